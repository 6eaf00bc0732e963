"""Fault injection: real `bpcompile build` processes killed with SIGKILL at five points (convert, calibrate, engine
publish, repository staging, repository switch), the AOT kernel compiler's caller killed while it runs (a
`target: tensorrt` build's stage, which cannot run here: it is called directly), and run out of disk at two
(writing the converted checkpoint, copying the engine into the repository). After each: `bpcompile list` shows
only complete versions, the repository holds one consistent set of versions, and the next build succeeds with
no manual cleanup.

The kill points are the build's test hook (store.fault_point, $BPCOMPILE_FAULT_AT). The full disk is real: a
small tmpfs mounted over the work directory when this runs as root (resized to leave a few MB free), else a
file-size limit (RLIMIT_FSIZE: writes past it fail with EFBIG) set in the build process.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bpcompile.core.store import sha256_file

pytest.importorskip("tritonclient.grpc")

from bpcompile.serving.emit import JOURNAL, VERSIONED, read_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20


def _recipe(root: Path) -> Path:
    text = (REPO / "recipes" / "tiny.yaml").read_text()
    text = (
        text.replace("../models/", f"{REPO}/models/")
        .replace("store: ../engines", f"store: {root / 'engines'}")
        .replace("triton_repo: ../triton_repo", f"triton_repo: {root / 'repo'}")
        .replace("samples: 16, length: 128", "samples: 2, length: 32")
    )
    f = root.parent / "tiny.yaml"
    f.write_text(text)
    return f


class Disk:
    """The work directory, on a tmpfs whose free space can be cut (as root), else under a file-size limit."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir()
        ok = (
            os.geteuid() == 0
            and subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(root)], capture_output=True
            ).returncode
            == 0
        )
        self.mode = "tmpfs" if ok else "rlimit-fsize"

    def close(self):
        if self.mode == "tmpfs":
            subprocess.run(["umount", "-l", str(self.root)], check=False)

    def limited(self, free: int, freed: int = 0):
        """(preexec_fn, undo) leaving about `free` bytes writable, after the build frees `freed` bytes."""
        if self.mode == "tmpfs":
            st = os.statvfs(self.root)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            subprocess.run(["mount", "-o", f"remount,size={used - freed + free}", str(self.root)], check=True)
            return None, lambda: subprocess.run(["mount", "-o", "remount,size=256m", str(self.root)], check=True)

        def preexec():
            resource.setrlimit(resource.RLIMIT_FSIZE, (free, free))
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not death by signal

        return preexec, lambda: None


def bp(*args, env=None, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bpcompile.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        preexec_fn=preexec,
        timeout=240,
        cwd=REPO,
    )


def listed(engines: Path) -> list[int]:
    """`bpcompile list`'s versions, each checked complete: every artifact of its manifest present and intact."""
    r = bp("list", engines, "--json")
    assert r.returncode == 0, r.stderr
    out = []
    for row in json.loads(r.stdout):
        vdir = Path(row["path"])
        m = json.loads((vdir / "manifest.json").read_text())
        assert m["artifacts"] and all(sha256_file(vdir / f) == a["sha256"] for f, a in m["artifacts"].items())
        out.append(row["version"])
    return out


def staged(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob(".*") if p.name.startswith((".staging-", ".tmp-")))


def served(root: Path) -> list[int]:
    """The repository's versions, checked consistent: all three versioned models have the same versions, each a
    full copy of the store's version of that number, every config parses, nothing half-switched or staged."""
    repo = root / "repo"
    assert not (repo / JOURNAL).exists() and staged(repo) == []
    per = {m: sorted(int(p.name) for p in (repo / m).iterdir() if p.name.isdigit()) for m in VERSIONED}
    assert per["preprocessing"] == per["postprocessing"] == per["tensorrt_llm"], per
    for m in VERSIONED + ("ensemble",):
        read_config(repo / m / "config.pbtxt")
    for v in per["tensorrt_llm"]:
        store_v = root / "engines" / "tiny" / str(v)
        manifest = json.loads((store_v / "manifest.json").read_text())
        src = json.loads((repo / "tensorrt_llm" / str(v) / "engine_source.json").read_text())
        assert src["build_id"] == manifest["build_id"]
        copy = repo / "tensorrt_llm" / str(v) / "engine"
        assert all(sha256_file(copy / f) == a["sha256"] for f, a in manifest["artifacts"].items())
        for m in ("preprocessing", "postprocessing"):
            assert (repo / m / str(v) / "tokenizer" / "tokenizer.json").read_bytes() == (
                store_v / "tokenizer" / "tokenizer.json"
            ).read_bytes()
    return per["tensorrt_llm"]


def build_cmd(recipe: Path, *args) -> list[str]:
    return [sys.executable, "-m", "bpcompile.cli", "build", str(recipe), *args]


def _compile_kernels_cmd(version: Path, out: Path) -> list[str]:
    """compile_engine_kernels (a target: tensorrt build's "compile kernels" stage) on a version's model."""
    code = (
        "import sys; from pathlib import Path; from bpcompile.compiler.aot import compile_engine_kernels; "
        "from bpcompile.compiler.recipe import Recipe; "
        "r = Recipe(name='k', models={'verifier': {'path': 'v'}, 'draft': {'path': 'd'}}, target='tensorrt'); "
        "compile_engine_kernels(Path(sys.argv[1]), r, Path(sys.argv[2]))"
    )
    return [sys.executable, "-c", code, str(version), str(out)]


def killed_at(point: str, recipe: Path, *extra) -> None:
    r = bp("build", recipe, *extra, env={"BPCOMPILE_FAULT_AT": point})
    assert r.returncode == -signal.SIGKILL, f"not killed at {point}: rc {r.returncode}\n{r.stderr[-3000:]}"


def compilers(cache: Path) -> list[int]:
    """Processes whose command line names the kernel cache (the AOT compiler subprocess)."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and str(cache) in (p / "cmdline").read_bytes().decode(errors="replace"):
                out.append(int(p.name))
        except OSError:
            pass
    return out


@pytest.fixture
def disk(tmp_path):
    d = Disk(tmp_path / "w")
    yield d
    d.close()


def test_kill_and_full_disk_leave_only_complete_versions(tmp_path, disk):
    root = disk.root
    engines, repo = root / "engines" / "tiny", root / "repo"
    recipe = _recipe(root)
    print(f"full disk simulated with: {disk.mode}")

    r = bp("build", recipe)
    assert r.returncode == 0, r.stderr
    assert listed(root / "engines") == [1] and served(root) == [1]

    # --- killed while converting and calibrating, two builds at once (each one's staging is locked while it
    # runs, so none removes another's), and while compiling the cubins of version 1's model: nothing visible,
    # only staging directories left, and no compiler outlives its caller
    cache = tmp_path / "cache"  # empty: the kernel compiler must really run
    procs = [
        subprocess.Popen(
            _compile_kernels_cmd(engines / "1", tmp_path / "cubins")
            if point == "kernels"
            else build_cmd(_recipe(root), "--force"),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "BPCOMPILE_FAULT_AT": point, "BPCOMPILE_CACHE": str(cache)},
        )
        for point in ("convert", "calibrate", "kernels")
    ]
    for p in procs:
        err = p.communicate(timeout=240)[1]
        assert p.returncode == -signal.SIGKILL, err[-3000:]
    deadline = time.monotonic() + 10
    while compilers(cache) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert compilers(cache) == [], "the kernel compiler outlived the killed build"
    assert listed(root / "engines") == [1] and served(root) == [1]
    left = [p for p in engines.iterdir() if p.name.startswith(".staging-") and p.is_dir()]
    assert left

    # --- killed just after publishing version 2, before emission: the killed builds' staging is gone
    killed_at("publish", recipe, "--force")
    assert listed(root / "engines") == [1, 2] and served(root) == [1]
    assert not any(p.exists() for p in left) and not any(p.is_dir() for p in engines.glob(".staging-*"))

    # --- disk full while copying the engine into the repository (the build is up to date: emission only)
    preexec, undo = disk.limited(4 * MB)
    r = bp("build", recipe, preexec=preexec)
    undo()
    assert r.returncode == 1 and ("No space left" in r.stderr or "File too large" in r.stderr), r.stderr[-3000:]
    assert "[ok] triton repository" not in r.stderr
    assert listed(root / "engines") == [1, 2] and served(root) == [1]  # what it staged is gone

    # --- killed while staging the repository: the repository still serves version 1 alone
    killed_at("emit", recipe)
    assert listed(root / "engines") == [1, 2] and staged(repo)  # uncommitted
    assert sorted(int(p.name) for p in (repo / "preprocessing").iterdir() if p.name.isdigit()) == [1]

    r = bp("build", recipe)  # the next build: up to date, and the repository gets version 2
    assert r.returncode == 0 and "up to date" in r.stderr, r.stderr[-3000:]
    assert served(root) == [1, 2]

    # --- killed in the middle of the switch: some models have version 3, the journal says what remains
    killed_at("switch", recipe, "--force")
    assert listed(root / "engines") == [1, 2, 3]
    assert (repo / JOURNAL).is_file() and (repo / "preprocessing" / "3").is_dir()
    assert not (repo / "tensorrt_llm" / "3").exists()

    # --- disk full while converting: no version, no staging left
    preexec, undo = disk.limited(4 * MB)
    r = bp("build", recipe, "--force", preexec=preexec)
    undo()
    assert r.returncode == 1 and ("No space left" in r.stderr or "File too large" in r.stderr), r.stderr[-3000:]
    assert "[ok] convert verifier" not in r.stderr
    assert listed(root / "engines") == [1, 2, 3]
    assert not any(p.is_dir() for p in engines.glob(".staging-*"))

    r = bp("build", recipe)  # up to date: finishes the interrupted switch of version 3
    assert r.returncode == 0 and "finished an interrupted switch" in r.stderr, r.stderr[-3000:]
    assert served(root) == [1, 2, 3]

    r = bp("build", recipe, "--force")  # and a full build still works, with nothing left behind anywhere
    assert r.returncode == 0, r.stderr[-3000:]
    assert listed(root / "engines") == [1, 2, 3, 4] and served(root) == [1, 2, 3, 4]
    assert staged(root) == [] and [p.name for p in engines.iterdir() if not p.name.isdigit()] == [".lock"]
