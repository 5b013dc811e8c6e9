"""Small hand-written models shared by the graph tests."""

import math

import torch
import torch.nn as nn


class Attention(nn.Module):
    """Multi-head self-attention written with functional ops (views, matmul, scalar div)."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.softmax = nn.Softmax(-1)
        self.drop = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(dim)
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        probs = self.drop(self.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)))
        context = (probs @ v).transpose(1, 2).reshape(b, s, d)
        return self.norm(x + context)


class TinyEncoder(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.a, self.b = Attention(dim), Attention(dim)
        self.out = nn.Linear(dim, classes)

    def forward(self, ids):
        return self.out(self.b(self.a(self.emb(ids)))[:, 0])


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))


class Residual(nn.Module):
    """x -> fc1 -> relu -> fc2 -> (+x) -> fc3: depth counts the longest path."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.relu, self.fc2, self.fc3 = (nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8),
                                                   nn.Linear(8, 2))

    def forward(self, x):
        h = self.fc2(self.relu(self.fc1(x))) + x
        return self.fc3(h.flatten(1))


class DataDependent(nn.Module):
    """Branches on a tensor value: torch.fx traces it only by running it on the example."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            h = h * 2
        return self.act(h)


class Box:
    """A Python object that carries a tensor: no torch.fx graph can hold one."""

    def __init__(self, tensor) -> None:
        self.tensor = tensor


class Opaque(nn.Module):
    """Hands a :class:`Box` to a module: torch.fx cannot trace it, however it tries. It
    keeps its batch size on itself, as some library models keep sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.carry = nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x):
        self.rows = x.shape[0]
        h = self.carry(Box(self.fc(x))).tensor
        return self.act(h * 2)
