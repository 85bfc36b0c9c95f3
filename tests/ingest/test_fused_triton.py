"""The Triton kernel of the fused path (ingest/fused/triton_kernel.py) against the eager attention, on the CPU.

The kernel runs interpreted (``TRITON_INTERPRET=1``, set in a child process before triton is imported, so no
other test sees it) on small maps, several blocks of rows and keys each (``MAX_BLOCK`` 16) and one whole block:
its output equals the eager ``softmax(scale q k^T + mask) v`` and its statistics equal
:func:`ingest.kernels.reduce_maps` of the eager maps (the maps path's sums) within 1e-5, in the CPU kernel's
layout and dtypes. Its speed on a GPU is bench/gpu.sh's."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ingest import kernels
from tests.waiting import PATIENCE

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[2]
T, DIM = 40, 16
LOWEST = torch.finfo(torch.float32).min

# name: (heads, kv heads, real lengths, mask kind, softcap, a plan with special keys (None: no plan), largest block)
CASES: dict[str, tuple[int, int, list[int], str, float | None, bool | None, int]] = {
    "whole": (2, 2, [T, T], "none", None, True, 16),
    "whole-one-block": (2, 2, [T, T], "none", None, True, 64),
    "padded": (2, 2, [T, 23], "padding", None, True, 16),
    "causal": (2, 2, [T, T], "causal", None, True, 16),
    "causal-padded": (2, 2, [T, 29], "causal-padding", None, True, 16),
    "gqa": (4, 2, [T, 31], "causal-padding", None, True, 16),
    "sliding-window": (4, 2, [T, 35], "window", None, True, 16),
    "softcap": (2, 1, [T, 26], "causal-padding", 5.0, True, 16),
    "no-specials": (2, 2, [T, 23], "padding", None, False, 16),
    "output-only": (2, 2, [T, T], "shared", None, None, 16),
}
WINDOW = 9


def _mask(kind: str, lengths: list[int]) -> tuple[torch.Tensor | None, bool]:
    """The boolean mask ``(batch or 1, 1, T, T)`` as transformers builds it for SDPA (None: every key, or causal)."""
    keys = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (batch, T)
    lower = torch.ones(T, T, dtype=torch.bool).tril()
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    if kind == "padding":
        return keys[:, None, None, :].expand(-1, 1, T, -1).clone(), False
    if kind == "causal-padding":
        return keys[:, None, None, :] & lower, False
    if kind == "window":  # causal, padded, each query sees its last WINDOW keys
        return keys[:, None, None, :] & lower & ~torch.ones(T, T, dtype=torch.bool).tril(-WINDOW), False
    if kind == "shared":  # one causal mask for the whole batch
        return lower[None, None], False
    raise AssertionError(kind)


def _specials(lengths: list[int]) -> kernels.Specials:
    """Three special keys a sample (its first, middle and last real token; the last two [SEP]) and a fourth slot
    unused (a position out of range, never read); the middle and last queries are [SEP] rows."""
    batch = len(lengths)
    positions = torch.tensor([[0, length // 2, length - 1, T + 99] for length in lengths])
    slot_sep = torch.tensor([[False, True, True, False]] * batch)
    query_sep = torch.zeros(batch, T, dtype=torch.bool)
    for row, length in enumerate(lengths):
        query_sep[row, [length // 2, length - 1]] = True
    groups = torch.tensor([[0, 1, 1, 2]] * batch)  # the unused slot's is not read
    return kernels.Specials(positions, torch.full((batch,), 3), slot_sep, query_sep, groups)


def _inputs(name: str) -> dict[str, Any]:
    heads, kv_heads, lengths, kind, softcap, plan_kind, _ = CASES[name]
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    batch = len(lengths)
    query = 2 * torch.randn(batch, heads, T, DIM, generator=generator)
    key = torch.randn(batch, kv_heads, T, DIM, generator=generator)
    value = torch.randn(batch, kv_heads, T, DIM, generator=generator)
    mask, causal = _mask(kind, lengths)
    plan = None
    if plan_kind is not None:
        specials = _specials(lengths) if plan_kind else None
        plan = kernels.plan(torch.tensor(lengths), T, heads, specials, num_windows=4, group_count=3)
    return {"query": query, "key": key, "value": value, "mask": mask, "causal": causal,
            "scale": DIM**-0.5, "softcap": softcap, "plan": plan}  # fmt: skip


def _eager(arguments: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' eager attention: scores (capped, masked with finfo.min), their softmax and the output."""
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * arguments["scale"]
    if arguments["softcap"]:
        scores = torch.tanh(scores / arguments["softcap"]) * arguments["softcap"]
    if arguments["mask"] is not None:
        scores = scores + torch.where(arguments["mask"], 0.0, LOWEST)
    elif arguments["causal"]:
        scores = scores + torch.full((T, T), LOWEST).triu(1)
    probs = torch.softmax(scores, dim=-1)
    return scores, probs, torch.matmul(probs, value).transpose(1, 2)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case's (output, sums) from the interpreted Triton kernel, computed in one child process."""
    folder = tmp_path_factory.mktemp("triton")
    code = (
        "import sys, torch\n"
        "from ingest.fused import triton_kernel\n"
        "cases = torch.load(sys.argv[1], weights_only=False)\n"
        "results = {}\n"
        "for name, (arguments, block) in cases.items():\n"
        "    triton_kernel.MAX_BLOCK = block\n"
        "    output, sums = triton_kernel.attend(arguments.pop('query'), arguments.pop('key'),\n"
        "                                        arguments.pop('value'), arguments.pop('mask'), **arguments)\n"
        "    results[name] = (output, None if sums is None else tuple(sums))\n"
        "torch.save(results, sys.argv[2])\n"
    )
    torch.save({name: (_inputs(name), CASES[name][-1]) for name in CASES}, folder / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code, str(folder / "in.pt"), str(folder / "out.pt")], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE, check=False)  # fmt: skip
    if run.returncode != 0 and "No module named 'triton'" in run.stderr:
        pytest.skip("triton does not import in a child process")
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(folder / "out.pt", weights_only=False)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_equals_eager_attention(name: str, triton_results: dict[str, Any]) -> None:
    arguments = _inputs(name)
    scores, probs, expect = _eager(arguments)
    output, sums = triton_results[name]
    torch.testing.assert_close(output, expect, atol=1e-5, rtol=1e-5)  # every row, padding rows too
    plan: kernels.Plan | None = arguments["plan"]
    if plan is None:
        assert sums is None
        return
    batch, heads = probs.shape[:2]
    maps = batch * heads
    reference = kernels.reduce_maps(probs.reshape(maps, T, T), plan, scores.reshape(maps, T, T))
    assert sums is not None
    assert len(sums) == len(reference)
    for field, given, want in zip(kernels.MapSums._fields, sums, reference, strict=True):
        if want is None:  # no special keys: neither gives their sums
            assert given is None, field
            continue
        assert given is not None, field
        assert (given.shape, given.dtype) == (want.shape, want.dtype), field  # the CPU kernel's layout
        torch.testing.assert_close(given, want, atol=1e-5, rtol=1e-5, msg=f"{field} differs from the eager reference")
    if plan.with_specials:
        assert reference.special_columns is not None
        assert reference.sep_to_sep is not None
        assert float(reference.special_columns.abs().sum()) > 0  # the cases have special keys with mass
        assert float(reference.sep_to_sep.abs().sum()) > 0


@pytest.mark.parametrize("name", [name for name in CASES if CASES[name][5] is not None])
def test_triton_kernel_equals_the_cpu_kernel(name: str, triton_results: dict[str, Any]) -> None:
    """The same output and sums as ingest.fused's C++ kernel on the same inputs, field by field: the Triton kernel's
    offset sums through the features' offset columns, as :func:`ingest.fused.attend` hands them on."""
    from ingest import fused

    problem = fused.unavailable()
    if problem is not None:
        pytest.skip(f"the CPU kernel cannot be built here: {problem}")
    arguments = _inputs(name)
    output, sums = fused.attend(arguments.pop("query"), arguments.pop("key"), arguments.pop("value"),
                                arguments.pop("mask"), **arguments)  # fmt: skip
    given_output, given_map_sums = triton_results[name]
    torch.testing.assert_close(given_output, output, atol=1e-5, rtol=1e-5)
    assert sums is not None
    given_sums = kernels.window_sums(kernels.MapSums(*given_map_sums), _inputs(name)["plan"])
    for field, given, want in zip(kernels.WindowSums._fields, given_sums, sums, strict=True):
        assert (given is None) == (want is None), field
        if want is not None:
            assert (given.shape, given.dtype) == (want.shape, want.dtype), field
            torch.testing.assert_close(given, want, atol=1e-5, rtol=1e-5, msg=f"{field} differs from the CPU kernel's")


def test_the_cuda_dispatch_names_why_triton_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors never go to the Triton kernel; where triton does not import, the reason is given."""
    from ingest import fused

    assert fused.triton_unavailable() is None
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton then raises ImportError
    assert fused.triton_unavailable() is not None
    assert "triton" in str(fused.triton_unavailable())
