"""Building bpcompile's CPU kernels (plain C files next to this one): compiled on first use with the system C
compiler for this machine's CPU, cached, loaded through ctypes. Plain C functions, no PyTorch headers, so a
build takes under a second; where a kernel cannot be built (no C compiler, not Linux x86-64, the compiler
refuses it, or its switch is 0) `load` returns None and callers keep PyTorch's own ops."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Optional

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


def build(source: Path, cc: str) -> Path:
    """Compile `source` into the cache (atomically: a concurrent build of the same key is harmless); its path."""
    src = source.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), cc.encode(), _cpu_id().encode()])).hexdigest()
    out = cache_dir() / f"{source.stem}-{key[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(source), "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(source: Path, switch: str, bind: Callable[[ctypes.CDLL], None]) -> Optional[ctypes.CDLL]:
    """The built kernel with its C signatures declared by bind(lib), or None where it cannot be built or the
    environment variable `switch` is 0."""
    if (
        os.environ.get(switch, "1") == "0"
        or platform.system() != "Linux"
        or platform.machine() not in ("x86_64", "AMD64")
    ):
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    try:
        lib = ctypes.CDLL(str(build(source, cc)))
    except (OSError, subprocess.SubprocessError):
        return None
    bind(lib)
    return lib
