"""Train the project's own series (docs/series.md): a small attention-only GPT-2 on repeated random sequences,
saving ``step-N/`` checkpoints (model and tokenizer) that ``headcat ingest DIR --series NAME`` reads.

    nice python bench/train_series.py OUT [--steps 4000] [--every 250] [--length 64] [--periods 4 28] [--seed 0]

The model: 2 layers, 2 heads per layer, width 64, 256 positions, a vocabulary of 256 (4 special
tokens); the MLPs are zeroed and frozen (attention only). Each training sequence is BOS, then a
random sequence of period p (p uniform in the periods, ids drawn from the 252 non-special ids)
repeated to fill the length; the loss is next-token cross entropy over every position. ``OUT/training.json``
holds the loss at every checkpoint and the later-copy accuracy on held-out sequences;
``OUT/corpus.txt`` 64 other held-out sequences as text, for the feature runs. Fixed seed:
the same command gives the same checkpoints on the same torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers

log = logging.getLogger("train_series")

VOCAB = 256
SPECIAL = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")


def tokenizer() -> Any:
    """A WordLevel tokenizer over ``t4`` .. ``t255`` and the four special tokens; it adds none itself
    (headcat's detection puts BOS first, as for GPT-2)."""
    vocab = {name: i for i, name in enumerate(SPECIAL)} | {f"t{i}": i for i in range(len(SPECIAL), VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]",
        model_input_names=["input_ids", "attention_mask"],
    )  # fmt: skip


def build_model() -> Any:
    config = tf.GPT2Config(
        vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=2, n_inner=4, bos_token_id=2,
        eos_token_id=3, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = tf.GPT2LMHeadModel(config)
    for block in model.transformer.h:  # attention only: the MLP adds nothing and learns nothing
        for parameter in block.mlp.parameters():
            parameter.data.zero_()
            parameter.requires_grad_(False)
    model.set_attn_implementation("eager")
    return model


def batch(
    generator: torch.Generator, size: int, length: int, shortest: int, longest: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` sequences of ``length`` (BOS + a random period repeated) and each one's period."""
    periods = torch.randint(shortest, longest + 1, (size,), generator=generator)
    rows = []
    for p in periods.tolist():
        ids = torch.randperm(VOCAB - len(SPECIAL), generator=generator)[:p] + len(SPECIAL)
        body = ids.repeat(length // p + 1)[: length - 1]
        rows.append(torch.cat([torch.tensor([2]), body]))
    return torch.stack(rows), periods


def write_corpus(path: Path, seed: int, shape: tuple[int, int, int], lines: int = 64) -> None:
    """Held-out sequences of the training distribution as text (``t17 t203 ...``, BOS left out), one per
    line: the feature runs' corpus (``headcat ingest ... --corpus OUT/corpus.txt``)."""
    inputs, _ = batch(torch.Generator().manual_seed(seed + 2), lines, *shape)
    path.write_text("".join(" ".join(f"t{i}" for i in row[1:].tolist()) + "\n" for row in inputs))


@torch.no_grad()
def evaluate(model: Any, inputs: torch.Tensor, periods: torch.Tensor) -> dict[str, float]:
    """Loss over every position, and the loss and accuracy on the first copy and on the later copies."""
    model.eval()
    logits = model(inputs).logits[:, :-1]
    targets = inputs[:, 1:]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    correct = (logits.argmax(-1) == targets).float()
    position = torch.arange(1, inputs.shape[1]).unsqueeze(0)  # the target's position in the sequence
    later = position > periods.unsqueeze(1)  # the target repeats an earlier token of the sequence
    model.train()
    return {
        "loss": float(losses.mean()),
        "loss_first": float(losses[~later].mean()),
        "loss_later": float(losses[later].mean()),
        "accuracy_later": float(correct[later].mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--length", type=int, default=64, help="tokens per training sequence, BOS included")
    parser.add_argument("--periods", type=int, nargs=2, default=(4, 28), help="shortest and longest period")
    parser.add_argument("--every", type=int, default=250, help="save a checkpoint every this many steps")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = build_model()
    vocabulary = tokenizer()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    data = torch.Generator().manual_seed(args.seed)
    shape = (args.length, *args.periods)
    held_out = batch(torch.Generator().manual_seed(args.seed + 1), 64, *shape)
    args.out.mkdir(parents=True, exist_ok=True)
    write_corpus(args.out / "corpus.txt", args.seed, shape)
    record: list[dict[str, Any]] = []
    started = time.monotonic()
    model.train()
    for step in range(args.steps + 1):
        if step % args.every == 0:
            model.save_pretrained(args.out / f"step-{step}")
            vocabulary.save_pretrained(args.out / f"step-{step}")
            record.append({"step": step, **evaluate(model, *held_out), "seconds": round(time.monotonic() - started, 1)})
            log.info("%s", record[-1])
        if step == args.steps:
            break
        inputs, _ = batch(data, args.batch, *shape)
        loss = model(inputs, labels=inputs).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__, "checkpoints": record}
    (args.out / "training.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
