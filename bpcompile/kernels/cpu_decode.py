"""The CPU kernel for one decode query's attention (cpu_decode.c, which says why it exists), built and loaded
by `cbuild`. `available()` is False where it cannot be built (no C compiler, not Linux x86-64, or
BPCOMPILE_CPU_DECODE=0); callers then keep the PyTorch path."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

from bpcompile.kernels import cbuild

SOURCE = Path(__file__).with_name("cpu_decode.c")


@functools.cache
def _lib() -> Optional[ctypes.CDLL]:
    lib = cbuild.load(SOURCE, "BPCOMPILE_CPU_DECODE")
    if lib is None:
        return None
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.bpc_decode_attention.argtypes = [p, p, p, p, p, ctypes.c_long, ctypes.c_long, i, i, i, f, i, p, i]
    lib.bpc_decode_attention.restype = ctypes.c_int
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel is built, loads and agrees with a float64 attention here."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    H, KV, S, D, n = 6, 2, 40, 20, 37  # D not a multiple of 16: the scalar tail
    q, kn, vn = torch.randn(H, D, generator=g), torch.randn(KV, D, generator=g), torch.randn(KV, D, generator=g)
    k, v = torch.randn(KV, S, D, generator=g), torch.randn(KV, S, D, generator=g)
    out = attend_one(q, kn, vn, k, v, n, round16=False)
    k[:, n - 1], v[:, n - 1] = kn, vn
    kd, vd = (t[:, :n].double().repeat_interleave(H // KV, 0) for t in (k, v))
    ref = torch.softmax(q.double()[:, None] @ kd.transpose(1, 2) * D ** -0.5, -1) @ vd
    return torch.allclose(out.double(), ref[:, 0], rtol=1e-5, atol=1e-5)


def attend_one(q: torch.Tensor, knew: Optional[torch.Tensor], vnew: Optional[torch.Tensor], k: torch.Tensor,
               v: torch.Tensor, n: int, round16: bool, at: tuple[int, ...] = (),
               scale: Optional[float] = None) -> torch.Tensor:
    """Write knew, vnew [KV, D] (None: nothing) at entry n - 1 of the cache k[at], v[at] ([KV, S, D]; rounded
    through FP16 when round16), then attend the query heads q [H, D] over entries [0, n) -> [H, D] (query head h
    reads KV head h // (H / KV)). at: leading indices into k and v (a dense cache's layer and row), so no view is
    made. All float32 on CPU; q, knew, vnew contiguous, k and v contiguous in their last two dims (the caller
    checks these; `available()` first). scale: of the scores (default D^-0.5)."""
    H, D = q.shape
    KV = k.shape[len(at)]
    off = 4 * sum(i * k.stride(d) for d, i in enumerate(at))
    out = torch.empty(H, D)
    if _lib().bpc_decode_attention(q.data_ptr(), None if knew is None else knew.data_ptr(),
                                   None if vnew is None else vnew.data_ptr(), k.data_ptr() + off, v.data_ptr() + off,
                                   k.stride(len(at)), n, H, KV, D, D ** -0.5 if scale is None else scale,
                                   int(round16), out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"cpu_decode: bad shape (H {H}, KV {KV}, D {D}, n {n}) or out of memory")
    return out
