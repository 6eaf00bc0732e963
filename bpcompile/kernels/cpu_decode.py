"""The CPU kernel for the attention of a few queries of one sequence (a decode step, a tree verify; cpu_decode.c,
which says why it exists), built and loaded by `cbuild`. `available()` is False where it cannot be built (no C
compiler, not Linux x86-64, or BPCOMPILE_CPU_DECODE=0); callers then keep the PyTorch path."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

from bpcompile.kernels import cbuild

SOURCE = Path(__file__).with_name("cpu_decode.c")


def bind(lib: ctypes.CDLL) -> None:
    """Declare the kernel's C signature on a loaded build of SOURCE."""
    p, i, f, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.bpc_attention.argtypes = [p, i, i, i, i, f, p, p, n, n, n, p, p, n, p, n, p, p, p, p, p, i, p, i]
    lib.bpc_attention.restype = ctypes.c_int


@functools.cache
def _lib() -> Optional[ctypes.CDLL]:
    return cbuild.load(SOURCE, "BPCOMPILE_CPU_DECODE", bind)


@functools.cache
def available() -> bool:
    """Whether the kernel is built, loads and agrees with a float64 attention here."""
    if _lib() is None:
        return False
    g = torch.Generator().manual_seed(0)
    H, KV, S, D = 6, 2, 40, 20  # D not a multiple of 16: the scalar tail
    q, kn, vn = torch.randn(H, D, generator=g), torch.randn(KV, D, generator=g), torch.randn(KV, D, generator=g)
    k, v = torch.randn(KV, S, D, generator=g), torch.randn(KV, S, D, generator=g)
    out = attend(q[None], k, v, (), (0, 37), new=(kn[None], vn[None]), write=torch.tensor([36]))[0]
    k[:, 36], v[:, 36] = kn, vn
    kd, vd = (t[:, :37].double().repeat_interleave(H // KV, 0) for t in (k, v))
    ref = torch.softmax(q.double()[:, None] @ kd.transpose(1, 2) * D**-0.5, -1) @ vd
    return torch.allclose(out.double(), ref[:, 0], rtol=1e-5, atol=1e-5)


def _at(t: torch.Tensor, at: tuple[int, ...]) -> int:
    """The address of t[at] (leading indices), without making a view."""
    return t.data_ptr() + t.element_size() * sum(i * t.stride(d) for d, i in enumerate(at))


MAX_QUERIES = 16  # a tree verify's tokens; more (a prompt) take the PyTorch path


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    at: tuple[int, ...],
    run: tuple[int, int],
    *,
    exact: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    mask: Optional[torch.Tensor] = None,
    new: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    write: Optional[torch.Tensor] = None,
    round16: bool = False,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """The T queries q [T, H, D] of one sequence over entries run = [a0, a1) of the float32 cache k[at], v[at]
    ([KV, S, D]; at: leading indices, a dense cache's layer and row) and, with exact = (kh, vh, cols), columns
    cols [M] (int64) of the FP16 cache kh[at], vh[at] ([KV, C, D]) -> [T, H, D]; query head h reads KV head
    h // (H / KV). mask [T, n] bool (n = a1 - a0 + M, the run first): what each query sees (None: everything; a
    query that sees nothing gets zeros). new = (knew, vnew) [T, KV, D]: first written at columns write [T]
    (int64) of the FP16 cache when exact is given, else at entries write of the float32 one (rounded through
    FP16 when round16). On CPU; q, knew, vnew, cols, mask, write contiguous, the caches contiguous in their last
    two dims (the caller checks these; `available()` first). scale: of the scores (default D^-0.5)."""
    T, H, D = q.shape
    KV = k.shape[len(at)]
    kh, vh, cols = exact if exact is not None else (None, None, None)
    knew, vnew = new if new is not None else (None, None)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    out = torch.empty(T, H, D)
    if _lib().bpc_attention(
        q.data_ptr(),
        T,
        H,
        KV,
        D,
        D**-0.5 if scale is None else scale,
        _at(k, at),
        _at(v, at),
        k.stride(len(at)),
        run[0],
        run[1],
        None if kh is None else _at(kh, at),
        None if vh is None else _at(vh, at),
        0 if kh is None else kh.stride(len(at)),
        ptr(cols),
        0 if cols is None else cols.numel(),
        ptr(mask),
        ptr(knew),
        ptr(vnew),
        None if exact is not None else ptr(write),
        ptr(write) if exact is not None else None,
        int(round16),
        out.data_ptr(),
        torch.get_num_threads(),
    ):
        raise ValueError(
            f"cpu_decode: bad shape (T {T}, H {H}, KV {KV}, D {D}, entries {run} and "
            f"{0 if cols is None else cols.numel()} exact) or out of memory"
        )
    return out
