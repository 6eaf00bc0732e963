"""The versioned engine store: engines/<name>/<N>/, integer versions (they become Triton model versions).

A version is built in a hidden staging directory on the same filesystem and published with one
`os.rename`, so an interrupted or failed build leaves no visible partial version. Version numbers
are taken under a file lock, so two builds into one store at once are safe. Every version holds a
`manifest.json` with the sha256 of every input and artifact; the build id (hash of inputs, recipe
and code version) makes a rebuild with the same inputs a no-op.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional

from filelock import FileLock

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


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

    def sha256(self, f: Path) -> str:
        st = f.stat()
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if key not in self.data:
            self.data[key] = sha256_file(f)
        return self.data[key]

    def save(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def artifact_hashes(root: Path) -> dict[str, dict]:
    out = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.name != MANIFEST:
            out[str(f.relative_to(root))] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    return out


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
        d = self.root / name
        out = []
        if d.is_dir():
            for p in d.iterdir():
                # numeric, no leading zero: the same rule Triton uses for version directories
                if p.is_dir() and p.name.isdigit() and not p.name.startswith("0") and (p / MANIFEST).is_file():
                    out.append(Version(name, int(p.name), p, json.loads((p / MANIFEST).read_text())))
        return sorted(out, key=lambda v: v.version)

    def find_build(self, name: str, build_id: str) -> Optional[Version]:
        for v in self.versions(name):
            if v.build_id == build_id:
                return v
        return None

    @contextlib.contextmanager
    def staging(self, name: str) -> Iterator[Path]:
        """A fresh hidden directory on the store's filesystem; removed if the block fails."""
        d = self.root / name / f".staging-{uuid.uuid4().hex[:12]}"
        d.mkdir(parents=True)
        try:
            yield d
        finally:
            if d.exists():
                shutil.rmtree(d, ignore_errors=True)

    def publish(self, name: str, staged: Path, manifest: dict, force: bool = False) -> tuple[Version, bool]:
        """Number, manifest and rename `staged` into place. Returns (version, created).

        Under the lock: if another build with the same build id finished first (and not --force),
        the existing version is returned and nothing is published.
        """
        with self._lock(name):
            existing = self.find_build(name, manifest["build_id"])
            if existing and not force:
                return existing, False
            n = max((v.version for v in self.versions(name)), default=0) + 1
            manifest = dict(manifest, name=name, version=n,
                            published=datetime.now(timezone.utc).isoformat(timespec="seconds"))
            manifest["artifacts"] = artifact_hashes(staged)
            manifest["bytes"] = sum(a["bytes"] for a in manifest["artifacts"].values())
            (staged / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            final = self.root / name / str(n)
            os.rename(staged, final)  # atomic on one filesystem: the version appears whole or not at all
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
