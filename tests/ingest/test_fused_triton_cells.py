"""The Triton path of the pattern accumulators (:func:`ingest.fused.triton_kernel.attend_cells`: the kernel's pass
stores each row's maximum and sum of exps, then each listed cell's probability is read from one score), against
dense float64 maps written here and against the CPU kernel's :func:`ingest.fused.attend_cells`.

The kernel runs interpreted (``TRITON_INTERPRET=1``, in a child process, ``MAX_BLOCK`` 16 so that the maps span
several blocks of rows and keys); the cell gathering runs in pieces of a few cells (``CELL_ELEMENTS`` lowered)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ingest import fused
from tests.ingest.test_fused_cells import dense, padded_mask
from tests.waiting import PATIENCE

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[2]
BATCH, HEADS, KV_HEADS, LENGTH, DIM = 3, 4, 2, 37, 8
SCALE, SOFTCAP = 0.5, 3.0
FORMS = ["causal", "masked", "padded", "plain", "softcap"]


def _inputs(form: str) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(sum(map(ord, form)))
    q = 2 * torch.randn(BATCH, HEADS, LENGTH, DIM, generator=generator)  # far from uniform: heads differ
    k, v = torch.randn(2, BATCH, KV_HEADS, LENGTH, DIM, generator=generator)
    mask = None
    if form == "masked":  # a random mask, each row allowing at least its own key
        mask = (torch.rand(BATCH, 1, LENGTH, LENGTH, generator=generator) < 0.7) | torch.eye(LENGTH, dtype=torch.bool)
    if form == "padded":  # sample 2 left-padded: its first rows allow no key
        mask = padded_mask(BATCH, LENGTH)
    masks = torch.rand(LENGTH, LENGTH, 3, generator=generator) < 0.25
    whole = torch.arange(LENGTH) % 3 != 0
    return {"query": q, "key": k, "value": v, "mask": mask, "scale": SCALE, "causal": form == "causal",
            "softcap": SOFTCAP if form == "softcap" else None,
            "cells": fused.Cells.from_masks(masks, whole=whole), "masks": masks, "whole": whole}  # fmt: skip


def _dense(arguments: dict[str, Any]) -> torch.Tensor:
    """Every map's probabilities ``(batch, head, Tq, Tk)`` in float64, as the eager attention makes them."""
    probs = dense(arguments["query"], arguments["key"], arguments["scale"], arguments["causal"], arguments["mask"],
                  arguments["softcap"])  # fmt: skip
    return probs.nan_to_num(1.0 / LENGTH)  # a row allowing no key: eager's uniform


@pytest.fixture(scope="module")
def triton_masses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each form's (output, masses) from the Triton path, interpreted, in one child process."""
    folder = tmp_path_factory.mktemp("triton-cells")
    code = (
        "import sys, torch\n"
        "from ingest import fused\n"
        "from ingest.fused import triton_kernel\n"
        "triton_kernel.MAX_BLOCK = 16\n"
        "triton_kernel.CELL_ELEMENTS = 3 * 4 * 8 * 5  # five cells a piece\n"
        "fused.TRITON_ON_CPU = True\n"
        "calls = []\n"
        "launch = triton_kernel._launch\n"
        "triton_kernel._launch = lambda *a, **k: (calls.append(1), launch(*a, **k))[1]\n"
        "cases = torch.load(sys.argv[1], weights_only=False)\n"
        "results = {}\n"
        "for name, a in cases.items():\n"
        "    results[name] = fused.attend_cells(a['query'], a['key'], a['value'], a['mask'], scale=a['scale'],\n"
        "                                       causal=a['causal'], softcap=a['softcap'], cells=a['cells'])\n"
        "results['calls'] = len(calls)\n"
        "torch.save(results, sys.argv[2])\n"
    )
    torch.save({form: _inputs(form) for form in FORMS}, folder / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code, str(folder / "in.pt"), str(folder / "out.pt")], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(folder / "out.pt", weights_only=False)


def test_every_call_ran_the_triton_kernel(triton_masses: dict[str, Any]) -> None:
    assert triton_masses["calls"] == len(FORMS)


@pytest.mark.parametrize("form", FORMS)
def test_triton_cell_masses_equal_the_dense_maps_sums(form: str, triton_masses: dict[str, Any]) -> None:
    arguments = _inputs(form)
    probs = _dense(arguments)
    masks, whole = arguments["masks"], arguments["whole"]
    want = torch.stack(
        [(probs * masks[..., c]).sum((-1, -2)) for c in range(3)] + [probs[:, :, whole].sum((-1, -2))], -1
    )
    output, masses = triton_masses[form]
    assert (masses.shape, masses.dtype) == ((BATCH, HEADS, 4), torch.float64)
    torch.testing.assert_close(masses, want, rtol=0, atol=1e-5)
    assert float((want[..., :3].amax(1) - want[..., :3].amin(1)).max()) > 0.05  # the heads' masses really differ
    values = arguments["value"].double().repeat_interleave(HEADS // KV_HEADS, 1)
    torch.testing.assert_close(output.double(), (probs @ values).transpose(1, 2), rtol=0, atol=1e-5)


@pytest.mark.skipif(fused.unavailable() is not None, reason="no compiler for the CPU kernel")
@pytest.mark.parametrize("form", FORMS)
def test_triton_cell_masses_equal_the_cpu_kernels(form: str, triton_masses: dict[str, Any]) -> None:
    arguments = _inputs(form)
    cpu_output, cpu_masses = fused.attend_cells(
        arguments["query"], arguments["key"], arguments["value"], arguments["mask"], scale=arguments["scale"],
        causal=arguments["causal"], softcap=arguments["softcap"], cells=arguments["cells"],
    )  # fmt: skip
    output, masses = triton_masses[form]
    torch.testing.assert_close(masses, cpu_masses, rtol=0, atol=1e-5)
    torch.testing.assert_close(output, cpu_output, rtol=1e-5, atol=1e-5)
