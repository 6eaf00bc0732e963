"""What cache shapes the Triton kernels (paged.py) take, importable without triton: `bpcompile validate` asks it
of a CUDA recipe before anything is built, and importing triton costs seconds."""

from __future__ import annotations


def check_shape(head_size: int, group_size: int) -> str | None:
    """Why the kernels can't serve this cache shape (None if they can): aranges need powers of two and
    tl.dot needs a reduction of at least 16 (the half-rows of D/2)."""
    if head_size < 32 or head_size & (head_size - 1):
        return f"head_size {head_size} is not a power of two >= 32"
    if group_size & (group_size - 1) or head_size % group_size:
        return f"group size {group_size} is not a power of two dividing head_size {head_size}"
    return None
