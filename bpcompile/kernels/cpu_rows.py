"""The CPU kernel for products of a few rows (cpu_rows.c, which says why it exists), built and loaded by
`cbuild`. `available()` is False where it cannot be built (no C compiler, no AVX-512, not Linux x86-64, or
BPCOMPILE_CPU_ROWS=0); callers then keep PyTorch's own products."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

from bpcompile.kernels import cbuild

SOURCE = Path(__file__).with_name("cpu_rows.c")
MAX_ROWS = 16


def _bind(lib: ctypes.CDLL) -> None:
    c = ctypes
    lib.bpc_rows_matmul.argtypes = [c.c_void_p, c.c_long, c.c_long, c.c_void_p, c.c_long, c.c_void_p, c.c_int]
    lib.bpc_rows_matmul.restype = c.c_int


@functools.cache
def _lib() -> Optional[ctypes.CDLL]:
    return cbuild.load(SOURCE, "BPCOMPILE_CPU_ROWS", _bind)


@functools.cache
def available() -> bool:
    """Whether the kernel is built, loads and agrees with a float64 product here."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(37, 70, generator=g), torch.randn(5, 70, generator=g)  # odd sizes: masked tail, 1-row tail
    return torch.allclose(rows_matmul(x, w).double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)


def rows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [R, K] @ w [N, K]^T for 1 <= R <= MAX_ROWS, both float32, contiguous, on CPU (the caller checks these;
    `available()` first): y [R, N] float32."""
    y = torch.empty(x.shape[0], w.shape[0])
    if _lib().bpc_rows_matmul(
        x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], y.data_ptr(), torch.get_num_threads()
    ):
        raise ValueError(f"cpu_rows: {x.shape[0]} rows (at most {MAX_ROWS})")
    return y
