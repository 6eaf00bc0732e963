"""The versioned engine store: engines/<name>/<N>/, integer versions (they become Triton model versions).

A version is built in a hidden staging directory on the same filesystem and published with one
`os.rename`, so an interrupted or failed build leaves no visible partial version. Version numbers
are taken under a file lock, so two builds into one store at once are safe. Every version holds a
`manifest.json` with the sha256 of every input and artifact; the build id (hash of inputs, recipe
and code version) makes a rebuild with the same inputs a no-op.

What a killed build (SIGKILL, power aside) or a full disk leaves behind, and who removes it:
* a staging directory `.staging-<id>`: each is held by a lock on `.staging-<id>.lock` for as long as its
  build runs; the kernel drops that lock when the process dies, and the next build removes every
  staging directory whose lock it can take (`clean_stale`).
* nothing visible: a numbered directory appears only by the rename of a complete staging directory
  whose manifest is already written. A numbered directory without a readable manifest (copied in by
  hand, say) is not a version: it is skipped, reported by `incomplete`, and its number is not reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional

from filelock import FileLock, Timeout

from bpcompile.core.errors import UserError

MANIFEST = "manifest.json"
STAGING = ".staging-"
FAULT_ENV = "BPCOMPILE_FAULT_AT"
# 0: engine versions are loaded without checking them against their manifest (`--no-verify` sets it, so that
# the processes a command starts, tensor-parallel workers and tritonserver's models, skip the check too)
VERIFY_ENV = "BPCOMPILE_VERIFY"
_CHUNK = 8 << 20


def fault_point(name: str) -> None:
    """Test hook: SIGKILL this process when $BPCOMPILE_FAULT_AT equals `name`; does nothing otherwise.

    tests/test_faults.py kills real `bpcompile build` processes here (points: convert, calibrate, kernels,
    publish, emit, switch) to check what a kill -9 at each point leaves behind."""
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` whole or not at all: written under a hidden temporary name next to it, then
    renamed over it; a failure (a full disk) leaves neither a half-written file nor the temporary."""
    tmp = path.with_name(f".tmp-{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class HashCache:
    """sha256 of input files keyed by (path, size, mtime_ns): a 140 GB verifier is hashed once, not per build."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.data = json.loads(path.read_text())
        except (OSError, ValueError):
            self.data = {}
        if not isinstance(self.data, dict):
            self.data = {}

    def sha256(self, f: Path) -> str:
        st = f.stat()
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if key not in self.data:
            self.data[key] = sha256_file(f)
        return self.data[key]

    def save(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(self.data))


def _umask() -> int:
    try:  # Linux reports it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normalize_modes(root: Path) -> None:
    """One mode for everything a build writes: files 0644, directories 0755 (less what the umask takes). Writers
    differ (safetensors writes 0600 through a temporary file; mkdtemp is 0700): an engine built by one user must
    load for another."""
    mask = _umask()
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def artifact_hashes(root: Path) -> dict[str, dict]:
    out = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.name != MANIFEST:
            out[str(f.relative_to(root))] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    return out


def _numbered(p: Path) -> bool:
    # numeric, no leading zero: the same rule Triton uses for version directories
    return p.name.isdigit() and not p.name.startswith("0") and p.is_dir()


def _read_manifest(p: Path) -> tuple[Optional[dict], str]:
    """(manifest, "") or (None, why it is not a version)."""
    try:
        m = json.loads((p / MANIFEST).read_text())
    except FileNotFoundError:
        return None, f"no {MANIFEST}"
    except (OSError, ValueError) as e:
        return None, f"unreadable {MANIFEST} ({e})"
    if not isinstance(m, dict):
        return None, f"{MANIFEST} is not a JSON object"
    return m, ""


@dataclass
class Version:
    name: str
    version: int
    path: Path
    manifest: dict

    @property
    def build_id(self) -> str:
        return self.manifest.get("build_id", "")


class EngineStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _lock(self, name: str) -> FileLock:
        (self.root / name).mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / name / ".lock"))

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def versions(self, name: str) -> list[Version]:
        """Complete versions only (see `incomplete` for numbered directories that are not)."""
        d = self.root / name
        out = []
        if d.is_dir():
            for p in filter(_numbered, d.iterdir()):
                m, _ = _read_manifest(p)
                if m is not None:
                    out.append(Version(name, int(p.name), p, m))
        return sorted(out, key=lambda v: v.version)

    def incomplete(self, name: str) -> list[tuple[Path, str]]:
        """Numbered directories that are not versions, with the reason (bpcompile never publishes one)."""
        d = self.root / name
        out = []
        if d.is_dir():
            for p in sorted(filter(_numbered, d.iterdir()), key=lambda p: int(p.name)):
                m, why = _read_manifest(p)
                if m is None:
                    out.append((p, why))
        return out

    def find_build(self, name: str, build_id: str) -> Optional[Version]:
        """The newest version built from `build_id` (--force rebuilds give one build id several versions)."""
        for v in reversed(self.versions(name)):
            if v.build_id == build_id:
                return v
        return None

    def clean_stale(self, name: str) -> list[Path]:
        """Remove staging directories (and lock files) of builds that are no longer running: their lock is free."""
        d = self.root / name
        removed = []
        if not d.is_dir():
            return removed
        for p in sorted(d.glob(STAGING + "*")):
            lock_file = p if p.suffix == ".lock" else Path(f"{p}.lock")
            staged = lock_file.with_suffix("")
            lock = FileLock(str(lock_file), timeout=0)
            try:
                lock.acquire()
            except Timeout:
                continue  # a running build holds it
            try:
                if staged.exists():
                    shutil.rmtree(staged, ignore_errors=True)
                    removed.append(staged)
                lock_file.unlink(missing_ok=True)
            finally:
                lock.release()
        return removed

    @contextlib.contextmanager
    def staging(self, name: str) -> Iterator[Path]:
        """A fresh hidden directory on the store's filesystem, locked while this process uses it; removed if the
        block fails (and by `clean_stale` of a later build if this process is killed)."""
        d = self.root / name / f"{STAGING}{uuid.uuid4().hex[:12]}"
        d.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(f"{d}.lock")
        with lock:
            d.mkdir()
            try:
                yield d
            finally:
                if d.exists():
                    shutil.rmtree(d, ignore_errors=True)
                Path(lock.lock_file).unlink(missing_ok=True)

    def publish(self, name: str, staged: Path, manifest: dict, force: bool = False) -> tuple[Version, bool]:
        """Number, manifest and rename `staged` into place. Returns (version, created).

        Under the lock: if another build with the same build id finished first (and not --force),
        the existing version is returned and nothing is published.
        """
        with self._lock(name):
            existing = self.find_build(name, manifest["build_id"])
            if existing and not force:
                return existing, False
            # every numbered directory counts, complete or not: a number is never given out twice
            taken = [int(p.name) for p in filter(_numbered, (self.root / name).iterdir())]
            n = max(taken, default=0) + 1
            manifest = dict(
                manifest, name=name, version=n, published=datetime.now(timezone.utc).isoformat(timespec="seconds")
            )
            normalize_modes(staged)
            manifest["artifacts"] = artifact_hashes(staged)
            manifest["bytes"] = sum(a["bytes"] for a in manifest["artifacts"].values())
            (staged / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            final = self.root / name / str(n)
            os.rename(staged, final)  # atomic on one filesystem: the version appears whole or not at all
            fault_point("publish")
            return Version(name, n, final, manifest), True

    def resolve(self, ref: str) -> Version:
        """'name' (latest), 'name/N', or a path to a version directory."""
        p = Path(ref)
        if (p / MANIFEST).is_file():
            m = json.loads((p / MANIFEST).read_text())
            return Version(m.get("name", p.parent.name), int(m.get("version", 0) or 0), p, m)
        name, _, num = ref.partition("/")
        vs = self.versions(name)
        if not vs:
            raise FileNotFoundError(ref)
        if num:
            for v in vs:
                if v.version == int(num):
                    return v
            raise FileNotFoundError(ref)
        return vs[-1]


def verify_enabled(verify: Optional[bool] = None) -> bool:
    """verify as given, else what $BPCOMPILE_VERIFY says (on unless 0)."""
    return os.environ.get(VERIFY_ENV, "1") != "0" if verify is None else verify


def no_verify_option(command):
    """Add --no-verify to a click command (generate, eval, serve): it sets $BPCOMPILE_VERIFY to 0, which the
    processes the command starts inherit (no new parameter reaches the command's function)."""
    import click

    return click.option(
        "--no-verify",
        is_flag=True,
        expose_value=False,
        callback=lambda ctx, p, v: os.environ.__setitem__(VERIFY_ENV, "0") if v else None,
        help="Load the engine version without checking its files against the sizes and sha256 its manifest "
        "records (the check reads every byte: ~1-2 s per GB; for very large engines).",
    )(command)


def verify_version(version_dir: str | Path) -> dict:
    """Check an engine version's files against its manifest before anything is loaded from it: every artifact
    present with the recorded size and sha256, and no file the manifest does not list (a loader may pick up an
    extra shard). UserError naming the file (its path inside the version) and what differs. Reads every byte:
    about 1 s per GB here (sha256 in 8 MB chunks); the manifest's sizes are checked first, so a truncated or
    grown file is refused without hashing. Returns the manifest."""
    d = Path(version_dir)
    hint = "rebuild the version or restore the file; --no-verify (verify=False) loads it anyway"
    m, why = _read_manifest(d)
    if m is None:
        raise UserError(f"engine version {d} cannot be verified: {why}; {hint}", file=str(d / MANIFEST))
    arts = m.get("artifacts")
    if not isinstance(arts, dict) or not arts:
        raise UserError(
            f"engine version {d} cannot be verified: {MANIFEST} records no artifacts (the size and sha256 of "
            f"each file, written by `bpcompile build`); {hint}",
            file=str(d / MANIFEST),
        )
    root = d.resolve()
    for rel, a in arts.items():
        p = Path(rel)
        if p.is_absolute() or ".." in p.parts or not isinstance(a, dict) or not {"bytes", "sha256"} <= a.keys():
            raise UserError(f"engine version {d}: {MANIFEST} has an invalid artifact entry {rel!r}", file=str(d))
    present = {str(f.relative_to(root)) for f in root.rglob("*") if f.is_file() or f.is_symlink()} - {MANIFEST}
    extra, missing = sorted(present - arts.keys()), sorted(arts.keys() - present)
    if extra:
        raise UserError(f"engine version {d}: {extra[0]} is not in the manifest (added after the build); {hint}")
    if missing:
        raise UserError(f"engine version {d}: {missing[0]} is missing (the manifest records it); {hint}")
    for rel, a in sorted(arts.items()):
        try:
            st = os.stat(d / rel)
        except OSError as e:
            raise UserError(f"engine version {d}: {rel} cannot be read ({e.strerror}); {hint}") from None
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"engine version {d}: {rel} is not a regular file; {hint}")
        if st.st_size != a["bytes"]:
            raise UserError(
                f"engine version {d}: {rel} has size {st.st_size} bytes, the manifest records {a['bytes']}; {hint}"
            )
    names = sorted(arts)
    # hashlib releases the GIL: the files of a sharded or tensor-parallel engine are hashed side by side
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        sums = dict(zip(names, pool.map(lambda rel: sha256_file(d / rel), names)))
    for rel, a in sorted(arts.items()):
        got = sums[rel]
        if got != a["sha256"]:
            raise UserError(
                f"engine version {d}: {rel} has sha256 {got}, the manifest records {a['sha256']} "
                f"(its contents changed after the build); {hint}"
            )
    return m


def engine_version_dir(ref: str, default_store: str | Path = "engines") -> Path:
    """ENGINE as the CLI takes it: a version directory, an engine's directory in any store (its newest
    version), or `name[/N]` of the default store."""
    p = Path(ref)
    if (p / MANIFEST).is_file():
        return p
    try:
        if p.is_dir() and p.parent != Path("."):
            return EngineStore(p.parent).resolve(p.name).path
        return EngineStore(default_store).resolve(ref).path
    except (FileNotFoundError, ValueError):
        raise UserError(
            f"no engine version at {ref!r} (give a version directory such as engines/tiny/1, "
            f"or NAME[/N] of ./{default_store})"
        ) from None
