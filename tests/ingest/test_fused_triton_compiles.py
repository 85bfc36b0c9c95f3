"""The Triton kernel compiles for a GPU, on a machine without one.

The correctness tests run the kernel interpreted (``TRITON_INTERPRET=1``), and the interpreter runs Python that the
compiler refuses: a kernel reading a module global that is not a ``tl.constexpr`` passed every interpreted test and
failed its first compile on a GPU. Here triton's own compiler lowers the kernel to machine code for a Hopper GPU
(``sm_90``, the code the H200 runs) ahead of time, with every branch of its constant flags taken by one of the
variants."""

from __future__ import annotations

import importlib.util
import inspect

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

POINTERS = {
    "Q": "*fp32", "K": "*fp32", "V": "*fp32", "Mask": "*u8", "Out": "*fp32",
    "Lengths": "*i64", "Positions": "*i64", "Counts": "*i64", "SlotSep": "*u8", "QuerySep": "*u8",
    "Offsets": "*fp32", "Entropy": "*fp64", "SpecialOffsets": "*fp32", "Columns": "*fp64", "Seps": "*fp64",
    "Top": "*fp32", "Total": "*fp32",
}  # fmt: skip
# Every flag on in one variant or another (a mask and causal never come together: checked_inputs clears causal).
VARIANTS = {
    "masked-capped-statistics-specials-rows": {"HAS_MASK": True, "CAUSAL": False, "SOFTCAP": True, "STATS": True,
                                               "SPECIALS": True, "ROWS": True},
    "causal-statistics": {"HAS_MASK": False, "CAUSAL": True, "SOFTCAP": False, "STATS": True, "SPECIALS": False,
                          "ROWS": False},
    "output-only": {"HAS_MASK": False, "CAUSAL": False, "SOFTCAP": False, "STATS": False, "SPECIALS": False,
                    "ROWS": False},
}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_kernel_compiles_for_a_hopper_gpu(variant: str) -> None:
    import triton
    from triton.compiler import ASTSource

    try:
        from triton.backends.compiler import GPUTarget
    except ImportError as error:  # an older triton without ahead-of-time targets
        pytest.skip(f"triton cannot compile for a named target here: {error}")
    from ingest.fused import triton_kernel

    kernel = triton_kernel._attend_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    constants = {**VARIANTS[variant], "PRECISION": triton_kernel.PRECISION, "BLOCK_M": triton_kernel.BLOCK_ROWS,
                 "BLOCK_N": triton_kernel.BLOCK_KEYS, "BLOCK_D": 64}  # fmt: skip
    assert set(names) == set(POINTERS) | set(constants) | {n for n in names if n[0].islower()}  # every argument typed
    signature = {
        name: "constexpr" if name in constants else POINTERS.get(name) or ("fp32" if name in ("scale", "softcap")
                                                                             else "i32")
        for name in names
    }  # fmt: skip
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    options = {"enable_fp_fusion": triton_kernel.FP_FUSION, "num_warps": triton_kernel.NUM_WARPS}  # as launched
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert len(compiled.asm["cubin"]) > 0
    assert "ld.global" in compiled.asm["ptx"]  # real machine code that reads memory
