"""Small datasets that ship with the dependencies, as torch tensors ready to train on.

Example::

    >>> from qsync_lab.datasets import load_digits_split
    >>> x_train, y_train, x_test, y_test = load_digits_split()
    >>> tuple(x_train.shape), tuple(x_test.shape), y_train.dtype
    ((1347, 1, 8, 8), (450, 1, 8, 8), torch.int64)
"""

import importlib.metadata
import io
import zipfile

import numpy as np
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.io import atomic_write_bytes
from qsync_lab.resources import cache_dir

DigitsSplit = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_SPLIT_ARRAYS = ("x_train", "x_test", "y_train", "y_test")


def load_digits_split(seed: int = 0, test_fraction: float = 0.25) -> DigitsSplit:
    """scikit-learn's 8x8 digits (1797 images, 10 classes), split and standardized.

    The split is stratified by class and fixed by ``seed``. Images are standardized with
    the training set's mean and standard deviation (one scalar each, over all pixels), so
    the test set sees no statistic of its own. The split is cached (:func:`digits_split_arrays`),
    so a training rank reads it without importing scikit-learn.

    Args:
        seed: seed of the shuffled split.
        test_fraction: share of the images held out for testing, in (0, 1).

    Returns:
        ``(x_train, y_train, x_test, y_test)``: float32 images (N, 1, 8, 8) and int64 labels (N,).
    """
    if not 0 < test_fraction < 1:
        raise QSyncError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    x_train, x_test, y_train, y_test = digits_split_arrays(seed, test_fraction)
    mean, std = x_train.mean(), x_train.std()

    def images_tensor(x):
        return torch.from_numpy((x - mean) / std).float().reshape(-1, 1, 8, 8)

    return (images_tensor(x_train), torch.from_numpy(y_train).long(),
            images_tensor(x_test), torch.from_numpy(y_test).long())


def digits_split_arrays(seed: int, test_fraction: float) -> tuple[np.ndarray, ...]:
    """``(x_train, x_test, y_train, y_test)`` as scikit-learn's stratified
    ``train_test_split`` makes them, kept in ``<cache>/datasets/``
    (:func:`~qsync_lab.resources.cache_dir`) per scikit-learn version, seed and fraction:
    importing scikit-learn takes about 2 s, a cached split a few milliseconds.

    Example::

        >>> x_train, x_test, y_train, y_test = digits_split_arrays(0, 0.25)
        >>> x_train.shape, y_test.shape
        ((1347, 64), (450,))
    """
    name = f"digits-sklearn{importlib.metadata.version('scikit-learn')}-seed{seed}"
    path = cache_dir() / "datasets" / f"{name}-test{test_fraction!r}.npz"
    try:
        with np.load(path) as cached:
            return tuple(cached[key] for key in _SPLIT_ARRAYS)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):  # missing or unreadable
        pass
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    arrays = train_test_split(images, labels, test_size=test_fraction, random_state=seed,
                              stratify=labels)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **dict(zip(_SPLIT_ARRAYS, arrays)))
    atomic_write_bytes(path, buffer.getvalue())
    return tuple(arrays)
