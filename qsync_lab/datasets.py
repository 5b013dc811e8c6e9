"""Small datasets that ship with the dependencies, as torch tensors ready to train on.

Example::

    >>> from qsync_lab.datasets import load_digits_split
    >>> x_train, y_train, x_test, y_test = load_digits_split()
    >>> tuple(x_train.shape), tuple(x_test.shape), y_train.dtype
    ((1347, 1, 8, 8), (450, 1, 8, 8), torch.int64)
"""

import torch

from qsync_lab.errors import QSyncError

DigitsSplit = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def load_digits_split(seed: int = 0, test_fraction: float = 0.25) -> DigitsSplit:
    """scikit-learn's 8x8 digits (1797 images, 10 classes), split and standardized.

    The split is stratified by class and fixed by ``seed``. Images are standardized with
    the training set's mean and standard deviation (one scalar each, over all pixels), so
    the test set sees no statistic of its own.

    Args:
        seed: seed of the shuffled split.
        test_fraction: share of the images held out for testing, in (0, 1).

    Returns:
        ``(x_train, y_train, x_test, y_test)``: float32 images (N, 1, 8, 8) and int64 labels (N,).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 0 < test_fraction < 1:
        raise QSyncError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )
    mean, std = x_train.mean(), x_train.std()

    def images_tensor(x):
        return torch.from_numpy((x - mean) / std).float().reshape(-1, 1, 8, 8)

    return (images_tensor(x_train), torch.from_numpy(y_train).long(),
            images_tensor(x_test), torch.from_numpy(y_test).long())
