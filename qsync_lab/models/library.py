"""Small configurations of six Hugging Face ``transformers`` architectures (the ``models``
extra), built offline with random weights, as :class:`~qsync_lab.models.families.Family`
entries: a ``model(**batch)`` dict batch and a loss on the output's ``logits``.

:func:`~qsync_lab.models.families.family_model` and
:func:`~qsync_lab.models.families.family_batch` build them by name.

Example::

    >>> from qsync_lab.models.families import family_batch
    >>> sorted(LIBRARY)[:3]
    ['bert_encoder', 'gpt2_decoder', 'resnet_classifier']
    >>> inputs, target = family_batch("gpt2_decoder", 2)  # building needs no transformers
    >>> sorted(inputs), tuple(target.shape)
    (['input_ids'], (2, 16))
"""

import torch
import torch.nn.functional as F
from torch import nn

from qsync_lab.models.family import Family

__all__ = ["LIBRARY", "LogitsLoss"]

_VOCAB, _TOKENS, _CLASSES = 96, 16, 10


class LogitsLoss(nn.Module):
    """Cross-entropy of a model output's ``logits`` (per token or per sequence/image)."""

    def forward(self, output, target: torch.Tensor) -> torch.Tensor:
        logits = output.logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _hf():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _gpt2():
    hf = _hf()
    return hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=_VOCAB,
                                            n_positions=_TOKENS, bos_token_id=0,
                                            eos_token_id=0))


def _bert():
    hf = _hf()
    return hf.BertForSequenceClassification(hf.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        vocab_size=_VOCAB, max_position_embeddings=_TOKENS, num_labels=3))


def _t5():
    hf = _hf()
    return hf.T5ForConditionalGeneration(hf.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16,
        vocab_size=_VOCAB, decoder_start_token_id=0, pad_token_id=0))


def _vit():
    hf = _hf()
    return hf.ViTForImageClassification(hf.ViTConfig(
        image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=64,
        num_attention_heads=4, intermediate_size=128, num_labels=_CLASSES))


def _swin():
    hf = _hf()
    return hf.SwinForImageClassification(hf.SwinConfig(
        image_size=32, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4],
        window_size=4, num_labels=_CLASSES))


def _resnet():
    hf = _hf()
    return hf.ResNetForImageClassification(hf.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=_CLASSES))


def _tokens(n: int, gen: torch.Generator, length: int = _TOKENS) -> torch.Tensor:
    return torch.randint(0, _VOCAB, (n, length), generator=gen)


def _next_tokens(n: int, gen: torch.Generator):
    ids = _tokens(n, gen, _TOKENS + 1)
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def _masked_sequences(n: int, gen: torch.Generator):
    inputs = {"input_ids": _tokens(n, gen),
              "attention_mask": torch.ones(n, _TOKENS, dtype=torch.long)}
    return inputs, torch.randint(0, 3, (n,), generator=gen)


def _translations(n: int, gen: torch.Generator):
    target = _tokens(n, gen, _TOKENS // 2)
    return {"input_ids": _tokens(n, gen), "decoder_input_ids": target}, target


def _images(n: int, gen: torch.Generator):
    return ({"pixel_values": torch.randn(n, 3, 32, 32, generator=gen)},
            torch.randint(0, _CLASSES, (n,), generator=gen))


#: library model name -> its family entry (building one needs ``transformers``)
LIBRARY = {
    # decoder-only; its projections are Conv1D (a transposed-weight addmm)
    "gpt2_decoder": Family(_gpt2, _next_tokens, LogitsLoss),
    # encoder-only, with an attention mask
    "bert_encoder": Family(_bert, _masked_sequences, LogitsLoss),
    # encoder-decoder; its layer norms are RMS norms of its own class
    "t5_encoder_decoder": Family(_t5, _translations, LogitsLoss),
    "vit_classifier": Family(_vit, _images, LogitsLoss),
    # windowed attention with learned relative-position bias tables
    "swin_classifier": Family(_swin, _images, LogitsLoss),
    "resnet_classifier": Family(_resnet, _images, LogitsLoss),
}
