"""Building the fused CPU kernel: kept in its cache and reused, and where it cannot be built, the reason named."""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import pytest
import torch

from ingest import fused


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No kernel loaded in this process (the module's state is put back afterwards) and an empty cache."""
    monkeypatch.setattr(fused, "_module", None)
    monkeypatch.setattr(fused, "_failed", None)
    monkeypatch.setenv("HEADCAT_KERNEL_CACHE", str(tmp_path))
    return tmp_path


def _again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "_module", None)
    monkeypatch.setattr(fused, "_failed", None)


def test_the_kernel_is_built_once_into_its_cache_and_then_loaded(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = fused.kernel()
    assert module is not None, fused._failed
    built = list(fresh.iterdir())
    assert [path.suffix for path in built] == [".so"]  # the library alone: no scratch left beside it
    assert module.headcat_call_size() == ctypes.sizeof(fused._Call)
    _again(monkeypatch)

    def no_compiling(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"compiled again: {args}")

    monkeypatch.setattr(subprocess, "run", no_compiling)  # the cached library is loaded, not rebuilt
    assert fused.kernel() is not None
    assert fused.unavailable() is None
    assert list(fresh.iterdir()) == built


def test_a_compiler_without_openmp_builds_the_kernel_whose_maps_then_go_to_a_pool_of_ours(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Apple's clang refuses ``-fopenmp``: the kernel is built without it, and on several threads its maps go to a
    pool of headcat's threads (one library call a range), with the same bits as torch's threads give them."""
    torch.manual_seed(2)
    q, k, v = torch.randn(3, 3, 2, 40, 8).unbind(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = fused.attend(q, k, v, None, scale=0.3, causal=True)[0]  # as this machine's compiler builds it
        _again(monkeypatch)
        monkeypatch.setenv("HEADCAT_KERNEL_CACHE", str(fresh / "without"))  # a machine that never built it with OpenMP
        compile_ = subprocess.run

        def without_openmp(command: list[str], *args: object, **kwargs: object) -> object:
            if "-fopenmp" in command:
                return subprocess.CompletedProcess(command, 1, "", "clang: error: unsupported option '-fopenmp'")
            return compile_(command, *args, **kwargs)

        monkeypatch.setattr(subprocess, "run", without_openmp)
        module = fused.kernel()
        assert module is not None, fused._failed
        assert module.headcat_parallel() == 0
        calls = []
        attend = module.headcat_attend
        monkeypatch.setattr(module, "headcat_attend", lambda *args: calls.append(args[2:]) or attend(*args))
        got = fused.attend(q, k, v, None, scale=0.3, causal=True)[0]
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got, want)
    assert sorted(calls) == [(start, start + 1) for start in range(6)]  # 3 x 2 maps, 4 ranges a worker: one each


def test_a_kernel_padding_its_rows_of_scores_otherwise_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller sizes the tile of scores the kernel writes: a library that pads its rows by more than the caller
    allows for would write past it, so it is not used."""
    _again(monkeypatch)
    monkeypatch.setattr(fused, "ROW_PAD", fused.ROW_PAD - 1)
    assert fused.kernel() is None
    assert (
        fused.unavailable()
        == f"RuntimeError: kernel.cpp pads rows of scores by {fused.ROW_PAD + 1} floats, ROW_PAD by {fused.ROW_PAD}"
    )


@pytest.mark.parametrize(
    ("compiler", "reason"),
    [
        ("false", "RuntimeError: false failed: 1"),
        ("/nonexistent/c++", "FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/c++'"),
    ],
)
def test_without_a_compiler_the_kernel_is_none_and_says_why(
    fresh: Path, compiler: str, reason: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", compiler)
    with caplog.at_level(logging.WARNING, logger="ingest.fused"):
        assert fused.kernel() is None
    assert fused.unavailable() == reason
    assert [record.getMessage() for record in caplog.records] == [
        f"headcat's fused CPU kernel could not be built ({reason}): the maps path runs"
    ]
    assert list(fresh.iterdir()) == []  # nothing half-built is kept


def test_a_compile_error_is_named_by_its_first_error_line(
    fresh: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path_factory.mktemp("source") / "kernel.cpp"
    broken.write_text("int headcat_attend( {\n")
    monkeypatch.setattr(fused, "SOURCE", broken)
    monkeypatch.delenv("CXX", raising=False)  # the default compiler, c++
    assert fused.kernel() is None
    assert fused._failed is not None
    assert fused._failed.startswith("RuntimeError: c++ failed: ")
    assert "kernel.cpp:1:" in fused._failed
    assert "error" in fused._failed
