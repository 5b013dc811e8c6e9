"""Small, fast models for 8x8 digits (CNN) and flat feature vectors such as MNIST-1D (MLP).

Example::

    >>> import torch
    >>> from qsync_lab.models.small import DigitsCNN, DigitsMLP
    >>> DigitsCNN()(torch.zeros(4, 1, 8, 8)).shape, DigitsMLP(in_features=40)(torch.zeros(4, 40)).shape
    (torch.Size([4, 10]), torch.Size([4, 10]))
"""

import torch
from torch import nn

from qsync_lab.models.checks import positive_int
from qsync_lab.models.layers import init_conv_bn

DIGITS_IMAGE_SIZE = 8


class DigitsCNN(nn.Module):
    """Two conv+BN+ReLU layers, a 2x2 max-pool and a two-layer classifier for (B, 1, 8, 8) input."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        num_classes = positive_int("num_classes", num_classes)
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU(inplace=False)
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(32 * (DIGITS_IMAGE_SIZE // 2) ** 2, 64)
        self.relu3 = nn.ReLU(inplace=False)
        self.fc2 = nn.Linear(64, num_classes)
        init_conv_bn(self)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(images)))
        x = self.relu2(self.bn2(self.conv2(x)))
        x = self.flatten(self.pool(x))
        return self.fc2(self.relu3(self.fc1(x)))


class DigitsMLP(nn.Module):
    """``in_features -> hidden -> hidden -> num_classes`` with a ReLU after each hidden layer."""

    def __init__(self, in_features: int = 40, hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        in_features = positive_int("in_features", in_features)
        hidden = positive_int("hidden", hidden)
        num_classes = positive_int("num_classes", num_classes)
        self.fc1 = nn.Linear(in_features, hidden)
        self.relu1 = nn.ReLU(inplace=False)
        self.fc2 = nn.Linear(hidden, hidden)
        self.relu2 = nn.ReLU(inplace=False)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.relu2(self.fc2(self.relu1(self.fc1(features)))))


def digits_cnn(*, num_classes: int = 10) -> DigitsCNN:
    """Small CNN for sklearn's 8x8 digits."""
    return DigitsCNN(num_classes)


def digits_mlp(*, in_features: int = 40, hidden: int = 128, num_classes: int = 10) -> DigitsMLP:
    """MLP for flat features: 40 for MNIST-1D (its bundled task), 64 for flattened 8x8 digits."""
    return DigitsMLP(in_features, hidden, num_classes)
