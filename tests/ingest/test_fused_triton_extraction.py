"""The fused path on CUDA (the Triton kernel, ingest/fused/triton_kernel.py) through a whole feature extraction and
a whole detection run (SPEC 10's pattern masses, :func:`ingest.fused.triton_kernel.attend_cells`).

No GPU here: ``GPU_BRANCHES_ON_CPU`` and ``ingest.fused.TRITON_ON_CPU`` send CPU tensors down the CUDA branches,
with the kernel interpreted (``TRITON_INTERPRET=1``, set in a child process before triton is imported). A tiny
random BERT and a tiny Llama-shaped decoder with GQA, on a padded batch of unequal samples: every stored array
equals the maps path's (eager output_attentions maps, reduced) and the CPU fused kernel's within 1e-5. Detection on
the same two families: every score and the example maps equal the maps path's and the CPU kernel's within 1e-5."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ingest import features as features_module
from ingest import fused
from tests.waiting import PATIENCE

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["bert", "llama"]

CHILD = """
import dataclasses, pickle, sys
import numpy as np
from ingest import features as fm, fused
from ingest.features import FeatureConfig, extract_features
from ingest.fused import triton_kernel
from tests.ingest.test_features_contract import family, RUN_SAMPLES, N
calls = []
attend = triton_kernel.attend
triton_kernel.attend = lambda *a, **k: (calls.append(1), attend(*a, **k))[1]
out = {}
for name in sys.argv[2:]:
    model, tok = family(name)
    config = FeatureConfig(num_windows=N, max_length=32, batch_size=4)
    runs = {}
    for path, gpu in (("maps", False), ("fused", False), ("fused", True)):
        fm.REDUCTION, fm.GPU_BRANCHES_ON_CPU, fused.TRITON_ON_CPU = path, gpu, gpu
        before = len(calls)
        result = extract_features(model, tok, RUN_SAMPLES, config)
        arrays = {f.name: getattr(result.only, f.name) for f in dataclasses.fields(result.only)}
        runs["triton" if gpu else path] = ({k: v for k, v in arrays.items() if isinstance(v, np.ndarray)},
                                           result.config.reduction, len(calls) - before)
    out[name] = runs
pickle.dump(out, open(sys.argv[1], "wb"))
"""


DETECT_CHILD = """
import pickle, sys
from ingest import detectors, features as fm, fused
from ingest.detectors import DetectionConfig, detect_heads
from ingest.fused import triton_kernel
from tests.ingest.test_detectors import CASES
from tests.ingest.test_architectures import build, tokenizer
calls = []
attend_cells = triton_kernel.attend_cells
triton_kernel.attend_cells = lambda *a, **k: (calls.append(1), attend_cells(*a, **k))[1]
out = {}
for name in sys.argv[2:]:
    family, options = CASES[name]
    model, tok = build(family), tokenizer(options["template"], type_ids=options["type_ids"])
    runs = {}
    for path, gpu in (("maps", False), ("fused", False), ("fused", True)):
        fm.REDUCTION, fm.GPU_BRANCHES_ON_CPU, fused.TRITON_ON_CPU = path, gpu, gpu
        before = len(calls)
        result = detect_heads(model, tok, DetectionConfig(sequences=5, length=6, copies=3, seed=7, batch_size=2))
        runs["triton" if gpu else path] = (result.scores, result.example_maps, result.config.reduction,
                                           len(calls) - before)
    out[name] = runs
pickle.dump(out, open(sys.argv[1], "wb"))
"""


def _child(code: str, path: Path, names: list[str]) -> Any:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code, str(path), *names], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=PATIENCE, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    import pickle

    with open(path, "rb") as handle:
        return pickle.load(handle)


@pytest.fixture(scope="module")
def detections(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each family's scores, example maps, stored reduction and Triton calls from the maps, CPU fused and Triton
    detection runs."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    return _child(DETECT_CHILD, tmp_path_factory.mktemp("triton-detect") / "out.pkl", NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_triton_detection_equals_the_maps_and_cpu_fused_paths(name: str, detections: dict[str, Any]) -> None:
    maps_scores, maps_examples, maps_reduction, _ = detections[name]["maps"]
    cpu_scores, cpu_examples, cpu_reduction, cpu_calls = detections[name]["fused"]
    scores, examples, reduction, calls = detections[name]["triton"]
    assert (maps_reduction, cpu_reduction, reduction) == ("maps", "fused", "fused")
    assert cpu_calls == 0
    assert calls == 2 * 3  # one per layer and batch (5 sequences in batches of 2)
    assert set(scores) == set(maps_scores) == set(examples)
    for stack, expected in maps_scores.items():
        np.testing.assert_allclose(scores[stack], expected, rtol=0, atol=1e-5, err_msg=stack)
        np.testing.assert_allclose(scores[stack], cpu_scores[stack], rtol=0, atol=1e-5, err_msg=stack)
        finite = expected[np.isfinite(expected)]
        assert finite.max() - finite.min() > 0.05, stack  # heads and scores that really differ
        np.testing.assert_allclose(examples[stack], maps_examples[stack], rtol=0, atol=1e-5, err_msg=stack)
        np.testing.assert_allclose(examples[stack], cpu_examples[stack], rtol=0, atol=1e-5, err_msg=stack)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each family's arrays, stored reduction and Triton calls from the maps, CPU fused and Triton runs."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    return _child(CHILD, tmp_path_factory.mktemp("triton-run") / "out.pkl", NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_triton_extraction_equals_the_maps_and_cpu_fused_paths(name: str, runs: dict[str, Any]) -> None:
    maps, maps_reduction, _ = runs[name]["maps"]
    cpu, cpu_reduction, cpu_calls = runs[name]["fused"]
    triton, triton_reduction, triton_calls = runs[name]["triton"]
    assert (maps_reduction, cpu_reduction, triton_reduction) == ("maps", "fused", "fused")
    assert cpu_calls == 0
    assert triton_calls == 2  # one per layer: the Triton kernel did the work
    assert set(triton) == set(maps)
    assert "vectors" in triton
    for field, expected in maps.items():
        assert triton[field].shape == expected.shape, field
        if expected.dtype.kind == "f":
            np.testing.assert_allclose(triton[field], expected, rtol=0, atol=1e-5, err_msg=field)
            np.testing.assert_allclose(triton[field], cpu[field], rtol=0, atol=1e-5, err_msg=field)
        else:
            np.testing.assert_array_equal(triton[field], expected, err_msg=field)


class _Model(torch.nn.Module):
    def __init__(self, kind: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = type("Config", (), {"model_type": kind})()
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=dtype))


@pytest.mark.parametrize(
    ("kind", "dtype", "triton", "expected", "reason"),
    [
        ("bert", torch.float32, None, "fused", "Triton"),
        ("bert", torch.float16, None, "maps", "computes in float32"),
        ("t5", torch.float32, None, "maps", "does not cover 't5'"),
        ("llama", torch.float32, "ImportError: no triton", "maps", "not available here (ImportError: no triton)"),
    ],
)
def test_cuda_reduction_choice_names_why(
    kind: str, dtype: torch.dtype, triton: str | None, expected: str, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(features_module, "REDUCTION", "fused")
    monkeypatch.setattr(fused, "triton_unavailable", lambda: triton)
    chosen, why = features_module.choose_reduction(_Model(kind, dtype), torch.device("cuda"), {"encoder"}, 512)
    assert chosen == expected, why
    assert reason in why, why


def test_on_cuda_auto_runs_the_triton_kernel_from_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(features_module, "REDUCTION", "auto")
    monkeypatch.setattr(fused, "triton_unavailable", lambda: None)
    bound = features_module.TRITON_MIN_LENGTH
    model, cuda = _Model("bert", torch.float32), torch.device("cuda")
    assert features_module.choose_reduction(model, cuda, {"encoder"}, bound)[0] == "fused"
    assert features_module.choose_reduction(model, cuda, {"encoder"}, bound - 1) == (
        "maps", f"max_length {bound - 1} < {bound}: the Triton kernel runs from there on"
    )  # fmt: skip
    monkeypatch.setattr(features_module, "REDUCTION", "fused")
    assert features_module.choose_reduction(model, cuda, {"encoder"}, bound - 1)[0] == "fused"
