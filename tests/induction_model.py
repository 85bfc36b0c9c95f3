"""A 2-layer attention-only GPT-2 whose induction circuit is set by hand (Olsson et al. 2022), for tests.

Nothing is trained: every weight is written here, so the model is deterministic and what each head
does is known. The residual stream has four subspaces, each with a mirror half holding its negative
(so every residual vector has mean 0 and GPT-2's LayerNorms only rescale it):

- ``tok``: the current token, one-hot (the token embedding);
- ``pos``: the position, one-hot (the position embedding);
- ``prev``: the previous token, written by layer 0 head 0, a **previous-token head** (its query at
  position ``p`` matches the key of position ``p - 1``; its value is the token there);
- ``next``: the predicted next token, written by layer 1 head 0, an **induction head**: its query is
  the current token, its keys read ``prev`` (K-composition with layer 0 head 0), so it attends to
  the position just after an earlier copy of the current token, and copies that token into ``next``.

Head 1 of each layer has zero weights (uniform attention, no output); the MLPs are zero. The LM head
reads ``next``: after an earlier copy the model predicts the repeat almost surely; in a first copy
its induction head finds no match and averages, so its loss is high there. Pruning layer 1 head 0
removes in-context copying.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import transformers as tf

from tests.ingest.test_architectures import BOS, EOS, PAD, VOCAB, tokenizer

POSITIONS = 64
PREVIOUS_TOKEN_HEAD = (0, 0)  # (layer, head)
INDUCTION_HEAD = (1, 0)


def build_induction_model(*, gain: float = 6.0) -> Any:
    """The hand-set model (eager attention, eval mode) over the tests' WordLevel :data:`VOCAB`."""
    vocab = len(VOCAB)
    tok, prev, nxt, pos = 0, vocab, 2 * vocab, 3 * vocab  # offsets of the subspaces in one half
    half = 3 * vocab + POSITIONS
    width = 2 * half  # the mirror half: [half, 2 * half)
    heads = 2
    head_dim = width // heads
    config = tf.GPT2Config(
        vocab_size=vocab, n_positions=POSITIONS, n_embd=width, n_layer=2, n_head=heads, n_inner=4,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-6,
    )  # fmt: skip
    model: Any = tf.GPT2LMHeadModel(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for norm in (*(block.ln_1 for block in model.transformer.h), model.transformer.ln_f):
            norm.weight.fill_(1.0)
        for t in range(vocab):  # a mirrored one-hot: + in one half, - in the other
            model.transformer.wte.weight[t, tok + t] = 1.0
            model.transformer.wte.weight[t, half + tok + t] = -1.0
        for p in range(POSITIONS):
            model.transformer.wpe.weight[p, pos + p] = 1.0
            model.transformer.wpe.weight[p, half + pos + p] = -1.0
        # LayerNorm scales a residual of squared norm n to std 1: each one-hot entry reads sqrt(width / n).
        scale0 = math.sqrt(width / 4)  # tok + pos, mirrored
        scale1 = math.sqrt(width / 6)  # tok + pos + prev, mirrored
        logit = 24.0  # a matching key's score after GPT-2's 1 / sqrt(head_dim)
        q0 = k0 = math.sqrt(logit * math.sqrt(head_dim)) / scale0
        q1 = k1 = math.sqrt(logit * math.sqrt(head_dim)) / scale1
        layer0, layer1 = model.transformer.h
        w0, w1 = layer0.attn.c_attn.weight, layer1.attn.c_attn.weight  # (in, 3 * width): q | k | v
        # layer 0 head 0: the query of position p + 1 is the key of position p; the value is the token
        for p in range(POSITIONS - 1):
            w0[pos + p + 1, p] = q0
            w0[pos + p, width + p] = k0
        for t in range(vocab):
            w0[tok + t, 2 * width + t] = 1.0 / scale0
            layer0.attn.c_proj.weight[t, prev + t] = 1.0  # (in, out): head 0's value dims -> prev
            layer0.attn.c_proj.weight[t, half + prev + t] = -1.0
        # layer 1 head 0: the query is the current token, the key the previous token; the value the token
        for t in range(vocab):
            w1[tok + t, t] = q1
            w1[prev + t, width + t] = k1
            w1[tok + t, 2 * width + t] = 1.0 / scale1
            layer1.attn.c_proj.weight[t, nxt + t] = 1.0
            layer1.attn.c_proj.weight[t, half + nxt + t] = -1.0
            model.lm_head.weight[t, nxt + t] = gain
    model.set_attn_implementation("eager")
    return model.eval()


def induction_tokenizer() -> Any:
    """The tests' WordLevel tokenizer, GPT-2 style: no special tokens added (detection prepends BOS)."""
    return tokenizer(None, type_ids=False)


def save_induction_model(directory: Path) -> Path:
    """The hand-set model and its tokenizer as a ``transformers`` directory (what ``headcat ingest`` loads)."""
    build_induction_model().save_pretrained(directory)
    induction_tokenizer().save_pretrained(directory)
    return directory


def build_induction_checkpoint(previous: float, induction: float) -> Any:
    """The hand-set model with its two circuit heads' query weights scaled: ``previous`` for layer 0 head 0,
    ``induction`` for layer 1 head 0 (1: the full circuit; 0: uniform attention). A stand-in for a training
    run's checkpoints, where the previous-token head sharpens before the induction head does."""
    model = build_induction_model()
    width = model.config.n_embd
    head_dim = width // model.config.n_head
    with torch.no_grad():
        for block, scale in zip(model.transformer.h, (previous, induction), strict=True):
            block.attn.c_attn.weight[:, :head_dim] *= scale  # head 0's query columns
    return model


def save_induction_series(directory: Path, strengths: dict[int, tuple[float, float]]) -> Path:
    """``directory/step-N/`` for each step's ``(previous, induction)`` strengths
    (see :func:`build_induction_checkpoint`)."""
    for step, (previous, induction) in strengths.items():
        target = directory / f"step-{step}"
        build_induction_checkpoint(previous, induction).save_pretrained(target)
        induction_tokenizer().save_pretrained(target)
    return directory
