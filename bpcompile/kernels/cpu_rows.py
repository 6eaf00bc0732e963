"""The CPU kernel for products of a few rows (cpu_rows.c, which says why it exists): compiled on first use with
the system C compiler for this machine's CPU, cached, and called through ctypes (a plain C function: no
PyTorch headers, so it builds in under a second). `available()` is False where it cannot be built (no C
compiler, no AVX-512, not Linux x86-64); callers then keep PyTorch's own products."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("cpu_rows.c")
MAX_ROWS = 16
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def cache_dir() -> Path:
    """Where built kernels are kept: $BPCOMPILE_CACHE, else $XDG_CACHE_HOME/bpcompile, else ~/.cache/bpcompile."""
    if os.environ.get("BPCOMPILE_CACHE"):
        return Path(os.environ["BPCOMPILE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bpcompile"


def _cpu_id() -> str:
    """The CPU's model and flags: -march=native code is only reused on a CPU like the one it was built for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _build(cc: str) -> Path:
    """Compile SOURCE into the cache (atomically: a concurrent build of the same key is harmless) and return it."""
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), cc.encode(), _cpu_id().encode()])).hexdigest()
    out = cache_dir() / f"cpu_rows-{key[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cpu_rows-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _lib() -> Optional[ctypes.CDLL]:
    if os.environ.get("BPCOMPILE_CPU_ROWS", "1") == "0" or platform.system() != "Linux" \
            or platform.machine() not in ("x86_64", "AMD64"):
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError):
        return None
    fn = lib.bpc_rows_matmul
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


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
    if _lib().bpc_rows_matmul(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], y.data_ptr(),
                              torch.get_num_threads()):
        raise ValueError(f"cpu_rows: {x.shape[0]} rows (at most {MAX_ROWS})")
    return y
