"""BERT-style encoder with a sequence-classification head.

Module names follow the usual BERT layout, so FQNs read like
``bert.encoder.layer.0.attention.self.score_matmul``. Each attention matmul is its own
:class:`~qsync_lab.models.layers.MatMul`, and every activation, softmax and dropout call
site is its own module. There is no attention mask: inputs are unpadded token ids.

Example::

    >>> import torch
    >>> from qsync_lab.models.bert import BertClassifier
    >>> model = BertClassifier(num_layers=1, hidden=32, heads=4, intermediate=64, vocab_size=100)
    >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 2])
"""

import functools
import math

import torch
from torch import nn

from qsync_lab.errors import QSyncError
from qsync_lab.models.checks import positive_int, probability
from qsync_lab.models.layers import MatMul

LAYER_NORM_EPS = 1e-12
INIT_STD = 0.02


class BertEmbeddings(nn.Module):
    """Sum of word, position and token-type embeddings, then LayerNorm and dropout."""

    def __init__(
        self, vocab_size: int, hidden: int, max_positions: int, type_vocab_size: int, dropout: float
    ) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("position_ids", torch.arange(max_positions).unsqueeze(0), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # torch.narrow, unlike slicing, accepts the traced size, so fx records a get_attr.
        position_ids = torch.narrow(self.position_ids, 1, 0, input_ids.size(1))
        token_type_ids = torch.zeros_like(input_ids)
        embeddings = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(position_ids)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    """Multi-head scaled dot-product self-attention (q, k, v projections and two MatMuls)."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.scale = 1.0 / math.sqrt(hidden // heads)
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.score_matmul = MatMul()
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.context_matmul = MatMul()

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, hidden) -> (B, heads, S, head_dim)."""
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        query = self._split_heads(self.query(hidden_states))
        key = self._split_heads(self.key(hidden_states))
        value = self._split_heads(self.value(hidden_states))
        scores = self.score_matmul(query, key.transpose(-1, -2)) * self.scale
        probs = self.dropout(self.softmax(scores))
        context = self.context_matmul(probs, value)
        return context.transpose(1, 2).flatten(2)


class BertResidualOutput(nn.Module):
    """Dense projection, dropout, residual add and LayerNorm."""

    def __init__(self, in_features: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, hidden)
        self.dropout = nn.Dropout(dropout)
        self.LayerNorm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    """Self-attention followed by its residual output block."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.self = BertSelfAttention(hidden, heads, dropout)
        self.output = BertResidualOutput(hidden, hidden, dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states), hidden_states)


class BertIntermediate(nn.Module):
    """Dense expansion to the intermediate size followed by GELU."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)
        self.gelu = nn.GELU()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.gelu(self.dense(hidden_states))


class BertLayer(nn.Module):
    """One transformer encoder layer: attention, then the feed-forward block."""

    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float) -> None:
        super().__init__()
        self.attention = BertAttention(hidden, heads, dropout)
        self.intermediate = BertIntermediate(hidden, intermediate)
        self.output = BertResidualOutput(intermediate, hidden, dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden_states)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    """A stack of :class:`BertLayer`."""

    def __init__(self, num_layers: int, hidden: int, heads: int, intermediate: int, dropout: float) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hidden, heads, intermediate, dropout) for _ in range(num_layers))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states)
        return hidden_states


class BertPooler(nn.Module):
    """Dense + Tanh on the first token's hidden state."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))


class BertModel(nn.Module):
    """Embeddings, encoder and pooler (BERT-base: 109,482,240 parameters).

    ``forward(input_ids)`` returns ``(sequence_output, pooled_output)`` of shapes
    (B, S, hidden) and (B, hidden).
    """

    def __init__(
        self,
        num_layers: int,
        hidden: int,
        heads: int,
        intermediate: int,
        vocab_size: int,
        max_positions: int,
        type_vocab_size: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(vocab_size, hidden, max_positions, type_vocab_size, dropout)
        self.encoder = BertEncoder(num_layers, hidden, heads, intermediate, dropout)
        self.pooler = BertPooler(hidden)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sequence_output = self.encoder(self.embeddings(input_ids))
        return sequence_output, self.pooler(sequence_output)


class BertClassifier(nn.Module):
    """:class:`BertModel` (as ``self.bert``) plus dropout and a linear head on the pooled output.

    Args:
        num_layers: encoder layers.
        hidden: hidden size; must be divisible by ``heads``.
        heads: attention heads.
        intermediate: feed-forward inner size.
        vocab_size: word-piece vocabulary size.
        max_positions: longest supported sequence.
        type_vocab_size: number of token types (segments).
        num_labels: size of the output logits.
        dropout: dropout probability for hidden states and attention probabilities.
    """

    def __init__(
        self,
        *,
        num_layers: int = 12,
        hidden: int = 768,
        heads: int = 12,
        intermediate: int = 3072,
        vocab_size: int = 30522,
        max_positions: int = 512,
        type_vocab_size: int = 2,
        num_labels: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        sizes = dict(
            num_layers=num_layers,
            hidden=hidden,
            heads=heads,
            intermediate=intermediate,
            vocab_size=vocab_size,
            max_positions=max_positions,
            type_vocab_size=type_vocab_size,
            num_labels=num_labels,
        )
        for name, value in sizes.items():
            positive_int(name, value)
        dropout = probability("dropout", dropout)
        if hidden % heads:
            raise QSyncError(
                f"hidden ({hidden}) must be divisible by heads ({heads}); choose heads that divide hidden"
            )
        self.bert = BertModel(
            num_layers, hidden, heads, intermediate, vocab_size, max_positions, type_vocab_size, dropout
        )
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_labels)
        self.apply(_init_bert_weights)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        _, pooled_output = self.bert(input_ids)
        return self.classifier(self.dropout(pooled_output))


def _init_bert_weights(module: nn.Module) -> None:
    """Normal(0, 0.02) for Linear and Embedding weights, zero biases, LayerNorm 1/0."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, INIT_STD)
    if isinstance(module, nn.Linear):
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


#: BERT-base for sequence classification; keyword arguments override the dims.
bert_base = functools.partial(BertClassifier)

#: BERT-mini (4 layers, hidden 256, 4 heads) for sequence classification; keyword
#: arguments override the dims, as for :func:`bert_base`.
bert_mini = functools.partial(bert_base, num_layers=4, hidden=256, heads=4, intermediate=1024)
