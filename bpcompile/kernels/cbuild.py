"""Building bpcompile's CPU kernels (plain C files next to this one): compiled on first use with the system C
compiler for this machine's CPU, cached, loaded through ctypes. Plain C functions, no PyTorch headers, so a
build takes under a second; where a kernel cannot be built (no C compiler, not Linux x86-64, the compiler
refuses it, or its switch is 0) `load` returns None and callers keep PyTorch's own ops.

A cached shared object is code this process runs (its constructors run at dlopen), and its file name is
computed from public inputs, so the cache is trusted only where no other user can have put a file there:
* the cache directory ($BPCOMPILE_CACHE, else $XDG_CACHE_HOME/bpcompile, else ~/.cache/bpcompile; relative
  paths are ignored) must be owned by this uid and not writable by group or others, and every directory above
  it owned by root or this uid and not writable by group or others unless sticky (/tmp): otherwise a file could
  be swapped between the checks below and the dlopen;
* each .so must be a regular file owned by this uid, not writable by group or others, with a sidecar
  `<name>.so.sha256` written by the build that made it (next to it, atomically) whose hash its bytes match;
  anything else is rebuilt.
Where the directory fails (or there is no home directory) the kernels are built into a private directory
(mkdtemp: 0700, removed at exit) for this process, with one warning; where that fails too, no kernel."""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
SIDECAR = ".sha256"


@functools.cache
def _warn(msg: str) -> None:
    """Once per message and process: the kernels are loaded lazily, from several places."""
    print(f"bpcompile: warning: {msg}", file=sys.stderr, flush=True)


def configured_dir() -> Optional[Path]:
    """The cache the environment names: $BPCOMPILE_CACHE, else $XDG_CACHE_HOME/bpcompile, else
    ~/.cache/bpcompile. A relative path is ignored with a warning (it would change with the current directory);
    None where there is no home directory (a uid without a passwd entry and no $HOME)."""
    for var, sub in (("BPCOMPILE_CACHE", ""), ("XDG_CACHE_HOME", "bpcompile")):
        value = os.environ.get(var)
        if value:
            if os.path.isabs(value):
                return Path(value, sub)
            _warn(f"${var}={value!r} is not an absolute path: ignored for the kernel cache")
    try:
        home = Path.home()
    except (RuntimeError, KeyError):
        return None
    return home / ".cache" / "bpcompile" if home.is_absolute() else None


def _untrusted(d: Path) -> Optional[str]:
    """Why another user could put or swap files in directory d (which exists), or None."""
    uid = os.getuid()
    absolute = Path(os.path.abspath(d))
    # the directories as named (a symlink's own directory decides who can retarget it) and as resolved
    above = {*absolute.parents, *d.resolve().parents}
    for p in (absolute, d.resolve()):
        st = os.stat(p)
        if st.st_uid != uid:
            return f"owned by uid {st.st_uid}, not {uid}"
        if st.st_mode & 0o022:
            return f"writable by {'group' if st.st_mode & 0o020 else 'others'} (mode {stat.S_IMODE(st.st_mode):o})"
    for p in sorted(above):
        st = os.stat(p)
        if st.st_uid not in (0, uid):
            return f"inside {p}, owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"inside {p}, writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_private: list[Path] = []


def _private_dir() -> Optional[Path]:
    """This process's own build directory: mkdtemp (0700, an unpredictable name), removed at exit."""
    if not _private:
        try:
            d = Path(tempfile.mkdtemp(prefix="bpcompile-kernels-"))
        except OSError:
            return None
        atexit.register(shutil.rmtree, d, True)
        if _untrusted(d) is not None:  # e.g. $TMPDIR inside a directory others can write
            return None
        _private.append(d)
    return _private[0]


def cache_dir() -> Optional[Path]:
    """Where built kernels are kept and loaded from: the configured cache where it can be trusted (created 0700
    if absent), else a private temporary directory (one warning); None where neither is usable."""
    d = configured_dir()
    if d is None:
        why = "no home directory"
    else:
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            why = _untrusted(d)
        except OSError as e:
            why = f"not usable ({e.strerror})"
        if why is None:
            return d
        why = f"{d} is {why}"
    private = _private_dir()
    _warn(
        f"kernel cache: {why}; "
        + (f"building the CPU kernels into {private} for this process" if private else "CPU kernels off")
    )
    return private


def cache_subdir(name: str) -> Path:
    """A folder `name` of the kernel cache for other built code (the ahead-of-time GPU kernels), trusted as the
    cache is (created 0700 and checked the same way); else a folder of this process's private directory, else a
    fresh mkdtemp: code copied out of it into engines is run later, so it must come from a place only we write."""
    base = cache_dir()
    if base is not None:
        d = base / name
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            why = _untrusted(d)
        except OSError as e:
            why = f"not usable ({e.strerror})"
        if why is None:
            return d
        _warn(f"kernel cache: {d} is {why}; using a private directory for this process")
        private = _private_dir()
        if private is not None:
            d = private / name
            d.mkdir(mode=0o700, exist_ok=True)
            return d
    d = Path(tempfile.mkdtemp(prefix=f"bpcompile-{name}-"))
    atexit.register(shutil.rmtree, d, True)
    return d


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(so: Path) -> bool:
    """Whether `so` is a build this uid made: a regular file of ours, not writable by others, whose bytes
    match the hash its build recorded next to it."""
    uid = os.getuid()
    side = Path(f"{so}{SIDECAR}")
    try:
        for p in (so, side):
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
                return False
        return side.read_text().strip() == _sha256(so)
    except (OSError, UnicodeDecodeError):
        return False


def _cpu_id() -> str:
    """The CPU's model and flags: -march=native code is only reused on a CPU like the one it was built for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _temp(d: Path, name: str) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=d)
    os.close(fd)
    return tmp


def build(source: Path, cc: str) -> Optional[Path]:
    """Compile `source` into the cache unless an intact build of it is there; its path (None: no usable cache).
    Each file appears whole by a rename, the hash before the object, so a concurrent build of one key (the
    same bytes) is harmless."""
    d = cache_dir()
    if d is None:
        return None
    src = source.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), cc.encode(), _cpu_id().encode()])).hexdigest()
    out = d / f"{source.stem}-{key[:16]}.so"
    if _intact(out):
        return out
    tmp, side = _temp(d, out.name), _temp(d, out.name + SIDECAR)
    try:
        subprocess.run([cc, *FLAGS, str(source), "-o", tmp], check=True, capture_output=True, timeout=120)
        os.chmod(tmp, 0o755)
        Path(side).write_text(_sha256(Path(tmp)) + "\n")
        os.chmod(side, 0o644)
        os.replace(side, f"{out}{SIDECAR}")
        os.replace(tmp, out)
    finally:
        for t in (tmp, side):
            if os.path.exists(t):
                os.unlink(t)
    return out if _intact(out) else None


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
        so = build(source, cc)
        if so is None:
            return None
        lib = ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError):
        return None
    bind(lib)
    return lib
