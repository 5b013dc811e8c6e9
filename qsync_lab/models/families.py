"""Small models of six common families, written the way users write them (not for the zoo).

They use what the zoo avoids: ``F.scaled_dot_product_attention`` with a causal mask, tied
embeddings, ``nn.MultiheadAttention``, ``nn.TransformerEncoder``, grouped (depthwise)
convolutions, concatenated branches and ``nn.LSTM``. The coverage tests trace them and
``benchmarks/predictor_accuracy.py`` trains them, as a user's own model would be.

Example::

    >>> from qsync_lab.models.families import family_batch, family_model, FAMILIES
    >>> sorted(FAMILIES)[:3]
    ['depthwise_cnn', 'gpt_decoder', 'inception']
    >>> inputs, target = family_batch("gpt_decoder", 2)
    >>> family_model("gpt_decoder")(*inputs).shape
    torch.Size([2, 32, 256])
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from qsync_lab.errors import QSyncError
from qsync_lab.models.family import Family

__all__ = ["FAMILIES", "Family", "SequenceCrossEntropy", "family", "family_batch",
           "family_model"]

_VOCAB, _SEQ, _TAGS = 256, 32, 12


class SequenceCrossEntropy(nn.Module):
    """Cross-entropy over every position: logits ``(B, T, C)``, targets ``(B, T)``."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class DepthwiseSeparableCNN(nn.Module):
    """MobileNet-style: depthwise 3x3 then pointwise 1x1 convolutions, ReLU6, BatchNorm."""

    def __init__(self, width: int = 32, blocks: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU6())
        layers = []
        for i in range(blocks):
            out = width * 2 if i % 2 else width
            layers += [nn.Conv2d(width, width, 3, 1 + i % 2, 1, groups=width, bias=False),
                       nn.BatchNorm2d(width), nn.ReLU6(),
                       nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out), nn.ReLU6()]
            width = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPTDecoder(nn.Module):
    """GPT-style: causal SDPA blocks, the output head tied to the token embedding."""

    def __init__(self, vocab: int = _VOCAB, dim: int = 64, heads: int = 4, layers: int = 2,
                 max_len: int = _SEQ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[:, : ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class InceptionBlock(nn.Module):
    def __init__(self, cin: int, branch: int) -> None:
        super().__init__()
        def conv(ci, co, k):
            return nn.Sequential(nn.Conv2d(ci, co, k, padding=k // 2), nn.ReLU())
        self.b1 = conv(cin, branch, 1)
        self.b3 = nn.Sequential(conv(cin, branch, 1), conv(branch, branch, 3))
        self.b5 = nn.Sequential(conv(cin, branch // 2, 1), conv(branch // 2, branch, 5))
        self.pool = conv(cin, branch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(F.max_pool2d(x, 3, 1, 1))
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), pooled], dim=1)


class InceptionNet(nn.Module):
    """Inception-style: parallel 1x1/3x3/5x5/pool branches concatenated on channels."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.block1, self.block2 = InceptionBlock(32, 16), InceptionBlock(64, 24)
        self.fc = nn.Linear(96, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(F.max_pool2d(self.block1(self.stem(x)), 2))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class MHAEncoder(nn.Module):
    """A text classifier on ``nn.MultiheadAttention`` (post-norm blocks, mean pooling)."""

    def __init__(self, vocab: int = _VOCAB, dim: int = 64, heads: int = 4, layers: int = 2,
                 num_classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True)
                                  for _ in range(layers))
        self.norm1 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.ffn = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(),
                                               nn.Linear(2 * dim, dim)) for _ in range(layers))
        self.norm2 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for attn, n1, ffn, n2 in zip(self.attn, self.norm1, self.ffn, self.norm2):
            x = n1(x + attn(x, x, x, need_weights=False)[0])
            x = n2(x + ffn(x))
        return self.fc(x.mean(dim=1))


class ViT(nn.Module):
    """ViT-style: a strided-conv patch embedding, a class token, ``nn.TransformerEncoder``."""

    def __init__(self, image: int = 32, patch: int = 8, dim: int = 64, heads: int = 4,
                 layers: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.encoder(x)[:, 0])


class LSTMTagger(nn.Module):
    """A sequence tagger: embedding, a bidirectional 2-layer LSTM, a tag per token."""

    def __init__(self, vocab: int = _VOCAB, dim: int = 48, hidden: int = 64,
                 tags: int = _TAGS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.tag = nn.Linear(2 * hidden, tags)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tag(self.lstm(self.embed(ids))[0])


def _images(size: int, classes: int):
    def batch(n: int, gen: torch.Generator):
        return ((torch.randn(n, 3, size, size, generator=gen),),
                torch.randint(0, classes, (n,), generator=gen))
    return batch


def _tokens(classes: int | None):
    def batch(n: int, gen: torch.Generator):
        ids = torch.randint(0, _VOCAB, (n, _SEQ), generator=gen)
        shape = (n,) if classes else (n, _SEQ)
        return (ids,), torch.randint(0, classes or _TAGS, shape, generator=gen)
    return batch


def _next_tokens(n: int, gen: torch.Generator):
    ids = torch.randint(0, _VOCAB, (n, _SEQ + 1), generator=gen)
    return (ids[:, :-1],), ids[:, 1:]


FAMILIES: dict[str, Family] = {
    "depthwise_cnn": Family(DepthwiseSeparableCNN, _images(32, 10), nn.CrossEntropyLoss),
    "gpt_decoder": Family(GPTDecoder, _next_tokens, SequenceCrossEntropy),
    "inception": Family(InceptionNet, _images(32, 10), nn.CrossEntropyLoss),
    "mha_encoder": Family(MHAEncoder, _tokens(4), nn.CrossEntropyLoss),
    "vit": Family(ViT, _images(32, 10), nn.CrossEntropyLoss),
    "lstm_tagger": Family(LSTMTagger, _tokens(None), SequenceCrossEntropy),
}


def family(name: str) -> Family:
    """The :class:`Family` entry of ``name``: a family here, or a library model
    (:mod:`qsync_lab.models.library`)."""
    from qsync_lab.models.library import LIBRARY

    if name in FAMILIES or name in LIBRARY:
        return FAMILIES.get(name) or LIBRARY[name]
    raise QSyncError(f"unknown model family {name!r}; choose from: "
                     f"{', '.join([*FAMILIES, *LIBRARY])}")


def family_model(name: str) -> nn.Module:
    """A freshly initialised model of family ``name`` (seed with ``torch.manual_seed``)."""
    return family(name).build()


def family_batch(name: str, batch_size: int, *, seed: int = 0):
    """A random ``(inputs, target)`` batch for :func:`family_model`, the same for a seed."""
    return family(name).batch(batch_size, torch.Generator().manual_seed(seed))
