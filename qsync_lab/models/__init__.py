"""The model zoo: ResNet, VGG, BERT and small digit models, written to be fx-traceable.

Every module call site is its own module instance (one FQN per ReLU, Dropout, MatMul, ...),
so later code can change the precision of a single operator by swapping its module.

Example::

    >>> from qsync_lab.models import example_batch, get_model, list_models
    >>> "resnet18" in list_models()
    True
    >>> model = get_model("digits_cnn")
    >>> inputs, target = example_batch("digits_cnn", batch_size=4)
    >>> model(*inputs).shape
    torch.Size([4, 10])
"""

from qsync_lab.models.layers import MatMul
from qsync_lab.models.zoo import ModelSpec, example_batch, get_model, list_models, model_spec

__all__ = [
    "MatMul",
    "ModelSpec",
    "example_batch",
    "get_model",
    "list_models",
    "model_spec",
]
