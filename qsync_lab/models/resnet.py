"""ImageNet-style ResNet v1.5 (stride on the 3x3 conv of bottlenecks): ResNet-18 and ResNet-50.

Every ReLU call site is its own module, so each has a unique FQN such as
``layer1.0.relu2``. Any input of at least 32x32 works thanks to the adaptive pooling.

Example::

    >>> import torch
    >>> from qsync_lab.models.resnet import resnet18
    >>> resnet18(num_classes=10).eval()(torch.zeros(1, 3, 32, 32)).shape
    torch.Size([1, 10])
"""

from collections.abc import Sequence

import torch
from torch import nn

from qsync_lab.models.checks import positive_int
from qsync_lab.models.layers import init_conv_bn

STAGE_WIDTHS = (64, 128, 256, 512)


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Sequential | None:
    """1x1 conv + BN projection when the block changes shape, else None (identity)."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _shortcut(in_channels, width, stride)
        self.relu2 = nn.ReLU(inplace=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu2(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, v1.5), 1x1 expand by 4, with a residual connection."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = nn.ReLU(inplace=False)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample = _shortcut(in_channels, out_channels, stride)
        self.relu3 = nn.ReLU(inplace=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu3(out + identity)


class ResNet(nn.Module):
    """Stem (7x7 conv, BN, ReLU, max-pool), four stages of blocks, global pool, linear head.

    Args:
        block: ``BasicBlock`` or ``Bottleneck``.
        blocks_per_stage: number of blocks in each of the four stages.
        num_classes: size of the output logits.
    """

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck],
        blocks_per_stage: Sequence[int],
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        num_classes = positive_int("num_classes", num_classes)
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=False)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_channels = 64
        stages = []
        for stage_index, (width, num_blocks) in enumerate(zip(STAGE_WIDTHS, blocks_per_stage, strict=True)):
            blocks = []
            for block_index in range(num_blocks):
                stride = 2 if stage_index > 0 and block_index == 0 else 1
                blocks.append(block(in_channels, width, stride))
                in_channels = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(in_channels, num_classes)
        init_conv_bn(self)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.flatten(self.avgpool(x)))


def resnet18(*, num_classes: int = 1000) -> ResNet:
    """ResNet-18 (11,689,512 parameters with 1000 classes)."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes)


def resnet50(*, num_classes: int = 1000) -> ResNet:
    """ResNet-50 v1.5 (25,557,032 parameters with 1000 classes)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes)
