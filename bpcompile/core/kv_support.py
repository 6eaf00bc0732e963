"""Which reader of a KV cache takes which part of the format: the one table.

A KV plan (bpcompile/runtime/kvcache.py, docs/KV_FORMAT.md) is made of *features*: the unit precisions it uses
(`int4`, `fp8`, ..., `klt6`; their codecs are the registry `PRECISIONS` in kvcache.py) and plan-wide ones (exact
FP16 sink / window entries, the Hadamard rotation, an unquantized FP16 cache). A *reader* is a path that attends
over the cache: the PyTorch executor, the Triton kernels, the onnxruntime executor's step graphs, the TensorRT
plugin, TensorRT-LLM. `SUPPORT` says, per feature, which readers take it; everything else asks it: the recipe's
validation (`engine_readers`, `unsupported`), the runtime's choice of attention path and its refusals
(`bpcompile.runtime.kvcache.plan_support`), the pools the kernels, graphs and plugin are passed, and the support
matrix in docs/KV_FORMAT.md (a test checks that page against this table).

Pure data and a few functions, no torch: the engine config (core) resolves its `auto` KV settings from it.
"""

from __future__ import annotations

READERS = ("torch", "triton", "onnxruntime", "tensorrt", "tensorrt-llm")
READER_NAMES = {
    "torch": "the torch executor",
    "triton": "the Triton kernels",
    "onnxruntime": "the onnxruntime executor's step graphs",
    "tensorrt": "the TensorRT plugin",
    "tensorrt-llm": "TensorRT-LLM",
}

_QUANT = frozenset({"torch", "triton", "onnxruntime", "tensorrt"})  # the four readers of bpcompile's own pools
_OURS = frozenset({"torch", "triton"})  # the PyTorch oracle and the kernels written against it

# feature -> (the readers that take it, what it is: used in reasons and in the docs' matrix)
SUPPORT: dict[str, tuple[frozenset, str]] = {
    "int4": (_QUANT, "INT4 units"),
    "fp8": (_QUANT, "FP8 (E4M3) units"),
    "int8": (_QUANT, "INT8 units"),
    "int5": (_QUANT, "INT5 units"),
    "int6": (_QUANT, "INT6 units"),
    "int3": (_QUANT, "INT3 units"),
    "klt4": (_OURS, "KLT4 key units (stored before RoPE in a calibrated basis)"),
    "klt5": (_OURS, "KLT5 key units (stored before RoPE in a calibrated basis)"),
    "klt6": (_OURS, "KLT6 key units (stored before RoPE in a calibrated basis)"),
    "exact": (_OURS, "exact FP16 (sink / recent-window) entries"),
    "rotation": (_QUANT, "the Hadamard rotation of K and V"),
    # on a GPU an FP16 cache is attended by PyTorch, not by the kernels (paged_kv.kernels_for)
    "fp16": (frozenset(READERS) - {"triton"}, "an unquantized FP16 cache"),
}


def takes(reader: str, feature: str) -> bool:
    """Whether `reader` reads `feature` (a unit precision's name or a plan feature of SUPPORT)."""
    if reader not in READER_NAMES:
        raise ValueError(f"unknown KV reader {reader!r}; expected one of {', '.join(READERS)}")
    return reader in SUPPORT[feature][0]


def unsupported(features, reader: str, where: dict | None = None) -> list[str]:
    """Why `reader` cannot run a cache made of `features` (empty: it can), one reason per feature it does not
    take, in SUPPORT's order. where: feature -> where in the plan it occurs (e.g. the first unit), appended."""
    where = where or {}
    return [
        f"{READER_NAMES[reader]} do not read {SUPPORT[f][1]}" + (f" ({where[f]})" if f in where else "")
        for f in SUPPORT
        if f in features and not takes(reader, f)
    ]


def engine_readers(target: str, onnx: bool, device: str) -> tuple[str, ...]:
    """The readers an engine's cache must suit: a native engine is read by the torch executor on the CPU and by
    the Triton kernels on CUDA (`auto`: either), plus the step graphs when it ships ONNX graphs; tensorrt and
    tensorrt-llm engines by their own."""
    if target == "tensorrt":
        return ("tensorrt",)
    if target == "tensorrt-llm":
        return ("tensorrt-llm",)
    readers = {"cpu": ("torch",), "cuda": ("triton",)}.get(device, ("torch", "triton"))
    return readers + (("onnxruntime",) if onnx else ())


def all_take(readers, feature: str) -> bool:
    """Whether every one of `readers` reads `feature`."""
    return all(takes(r, feature) for r in readers)


def support_matrix() -> str:
    """SUPPORT as the Markdown table docs/KV_FORMAT.md carries (a test checks the page against it)."""
    head = "| feature | " + " | ".join(READERS) + " |"
    rows = [head, "|" + "---|" * (len(READERS) + 1)]
    for f, (readers, what) in SUPPORT.items():
        rows.append(f"| `{f}`: {what} | " + " | ".join("yes" if r in readers else "no" for r in READERS) + " |")
    return "\n".join(rows)
