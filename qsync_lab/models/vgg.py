"""VGG-16 with BatchNorm: 13 conv+BN+ReLU layers in 5 pooled groups, then a 3-layer classifier.

Example::

    >>> import torch
    >>> from qsync_lab.models.vgg import VGG16BN
    >>> VGG16BN(num_classes=10).eval()(torch.zeros(1, 3, 32, 32)).shape
    torch.Size([1, 10])
"""

import torch
from torch import nn

from qsync_lab.models.checks import positive_int, probability
from qsync_lab.models.layers import init_conv_bn

#: Output channels of each 3x3 conv; "M" is a 2x2 max-pool.
VGG16_LAYOUT: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip


def _features(layout: tuple[int | str, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    in_channels = 3
    for item in layout:
        if item == "M":
            layers.append(nn.MaxPool2d(2, stride=2))
        else:
            layers += [
                nn.Conv2d(in_channels, int(item), 3, padding=1),
                nn.BatchNorm2d(int(item)),
                nn.ReLU(inplace=False),
            ]
            in_channels = int(item)
    return nn.Sequential(*layers)


class VGG16BN(nn.Module):
    """VGG-16-BN (138,365,992 parameters with 1000 classes).

    Args:
        num_classes: size of the output logits.
        dropout: dropout probability in the classifier.
    """

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        num_classes = positive_int("num_classes", num_classes)
        dropout = probability("dropout", dropout)
        self.features = _features(VGG16_LAYOUT)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(inplace=False),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=False),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )
        init_conv_bn(self)
        for module in self.classifier.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(self.avgpool(self.features(images))))


def vgg16_bn(*, num_classes: int = 1000, dropout: float = 0.5) -> VGG16BN:
    """VGG-16 with BatchNorm."""
    return VGG16BN(num_classes, dropout)
