"""Small configurations of six Hugging Face ``transformers`` architectures, built offline
(no weights downloaded), each with a ``model(**batch)`` batch and a loss on its logits."""

import torch
import torch.nn.functional as F

VOCAB, TOKENS, CLASSES = 96, 16, 10


def logits_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a model output's ``logits`` (per token or per sequence/image)."""
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _tokens(batch: int, length: int = TOKENS) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length))


def _images(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32)


def gpt2_decoder(batch: int = 2):
    """Decoder-only: GPT-2, whose projections are ``Conv1D`` (a transposed-weight addmm)."""
    import transformers as hf

    config = hf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                           n_positions=TOKENS, bos_token_id=0, eos_token_id=0)
    return hf.GPT2LMHeadModel(config), {"input_ids": _tokens(batch)}, _tokens(batch)


def bert_encoder(batch: int = 2):
    """Encoder-only: BERT with a sequence-classification head and an attention mask."""
    import transformers as hf

    config = hf.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                           intermediate_size=128, vocab_size=VOCAB,
                           max_position_embeddings=TOKENS, num_labels=3)
    inputs = {"input_ids": _tokens(batch), "attention_mask": torch.ones(batch, TOKENS,
                                                                        dtype=torch.long)}
    return hf.BertForSequenceClassification(config), inputs, torch.randint(0, 3, (batch,))


def t5_encoder_decoder(batch: int = 2):
    """Encoder-decoder: T5, whose layer norms are RMS norms of its own class."""
    import transformers as hf

    config = hf.T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128,
                         num_heads=4, d_kv=16, vocab_size=VOCAB, decoder_start_token_id=0,
                         pad_token_id=0)
    inputs = {"input_ids": _tokens(batch), "decoder_input_ids": _tokens(batch, TOKENS // 2)}
    return hf.T5ForConditionalGeneration(config), inputs, _tokens(batch, TOKENS // 2)


def vit_classifier(batch: int = 2):
    """Vision transformer: ViT on 32x32 images in 8x8 patches."""
    import transformers as hf

    config = hf.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=64,
                          num_attention_heads=4, intermediate_size=128, num_labels=CLASSES)
    return (hf.ViTForImageClassification(config), {"pixel_values": _images(batch)},
            torch.randint(0, CLASSES, (batch,)))


def swin_classifier(batch: int = 2):
    """Windowed attention: Swin, with its learned relative-position bias tables."""
    import transformers as hf

    config = hf.SwinConfig(image_size=32, patch_size=4, embed_dim=32, depths=[2, 2],
                           num_heads=[2, 4], window_size=4, num_labels=CLASSES)
    return (hf.SwinForImageClassification(config), {"pixel_values": _images(batch)},
            torch.randint(0, CLASSES, (batch,)))


def resnet_classifier(batch: int = 2):
    """A CNN family: the library's ResNet."""
    import transformers as hf

    config = hf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                             num_labels=CLASSES)
    return (hf.ResNetForImageClassification(config), {"pixel_values": _images(batch)},
            torch.randint(0, CLASSES, (batch,)))


LIBRARY_MODELS = {f.__name__: f for f in (gpt2_decoder, bert_encoder, t5_encoder_decoder,
                                          vit_classifier, swin_classifier, resnet_classifier)}
