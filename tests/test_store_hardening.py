"""The engine store and the Triton repository against unlucky operators and bad files: symlinked tokenizer side
files, emission into directories bpcompile does not own (or into the store), two engine names in one
repository, a half-published repository version, concurrent emission, stale staging, broken version
directories, and what the manifest says about a stage that did not run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from pairs import make_pair, write_recipe

from bpcompile.cli import main
from bpcompile.compiler.pipeline import build
from bpcompile.core.store import EngineStore

pytest.importorskip("tritonclient.grpc")

from conftest import write_engine_config  # noqa: E402

from bpcompile.serving.emit import JOURNAL, MARKER, SUMMARY, VERSIONED  # noqa: E402

EMIT = "triton: {emit: true}\n"


@pytest.fixture(scope="module")
def pair_src(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def pair(tmp_path, pair_src):
    """A private copy of the pair (tests change files in it)."""
    return tuple(Path(shutil.copytree(p, tmp_path / "models" / p.name)) for p in pair_src)


def recipe_with(tmp_path, pair, extra="", name="t", file="r.yaml", repo=None, store=None):
    r = write_recipe(tmp_path / file, *pair, extra=extra, name=name)
    text = r.read_text()
    if repo is not None:
        text = text.replace(f"triton_repo: {tmp_path / 'triton_repo'}", f"triton_repo: {repo}")
    if store is not None:
        text = text.replace(f"store: {tmp_path / 'engines'}", f"store: {store}")
    if "triton:" in extra:
        text = text.replace("triton: {emit: false}\n", "")
    r.write_text(text)
    return r


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def repo_versions(repo: Path) -> dict[str, list[int]]:
    return {m: sorted(int(p.name) for p in (repo / m).iterdir() if p.name.isdigit()) for m in VERSIONED}


# --- tokenizer side files --------------------------------------------------------------------------------


def test_symlinked_side_file_leading_out_of_the_checkpoint_is_refused(tmp_path, pair):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-TOKEN")
    (pair[0] / "special_tokens_map.json").symlink_to(secret)
    r = cli("build", recipe_with(tmp_path, pair, EMIT))
    assert r.exit_code == 2, r.output
    assert "special_tokens_map.json" in r.stderr and "symbolic link" in r.stderr
    assert EngineStore(tmp_path / "engines").versions("t") == []
    leaked = [
        f
        for f in tmp_path.rglob("*")
        if f.is_file() and not f.is_symlink() and f != secret and b"TOP-SECRET" in f.read_bytes()
    ]
    assert leaked == []


def test_links_inside_the_checkpoint_and_the_hf_cache_layout_build(tmp_path, pair):
    # a link within the checkpoint is fine
    (pair[0] / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    (pair[0] / "generation_config.json").unlink(missing_ok=True)
    (pair[0] / "generation_config.json").symlink_to("special_tokens_map.json")
    assert build(recipe_with(tmp_path, pair)).version == 1
    # the Hugging Face cache: snapshots/<rev>/file -> ../../blobs/<sha>
    hub = tmp_path / "hub" / "models--x--v"
    snap, blobs = hub / "snapshots" / "abc", hub / "blobs"
    blobs.mkdir(parents=True)
    shutil.copytree(pair[0], snap, symlinks=True)
    (snap / "generation_config.json").unlink()
    shutil.move(snap / "tokenizer_config.json", blobs / "sha1")
    (snap / "tokenizer_config.json").symlink_to("../../blobs/sha1")
    v = build(recipe_with(tmp_path, (snap, pair[1]), file="hub.yaml", name="h"))
    assert (v.path / "tokenizer" / "tokenizer_config.json").read_bytes() == (blobs / "sha1").read_bytes()


# --- where emission may write ------------------------------------------------------------------------------


def test_emission_refuses_a_directory_it_does_not_own(tmp_path, pair):
    repo = tmp_path / "shared"
    (repo / "preprocessing").mkdir(parents=True)
    (repo / "preprocessing" / "notes.txt").write_text("mine")
    (repo / "ensemble" / "3").mkdir(parents=True)
    r = cli("build", recipe_with(tmp_path, pair, EMIT, repo=repo))
    assert r.exit_code == 2 and MARKER in r.stderr and "not empty" in r.stderr, r.output
    assert (repo / "preprocessing" / "notes.txt").read_text() == "mine" and (repo / "ensemble" / "3").is_dir()
    assert sorted(p.name for p in repo.iterdir()) == ["ensemble", "preprocessing"]  # nothing written
    assert EngineStore(tmp_path / "engines").versions("t") == []  # refused before any work


def test_a_new_or_placeholder_only_directory_becomes_bpcompiles(tmp_path, pair):
    repo = tmp_path / "placeholder"
    repo.mkdir()
    (repo / "README.md").write_text("Build output\n")
    assert cli("build", recipe_with(tmp_path, pair, EMIT, repo=repo)).exit_code == 0
    assert json.loads((repo / MARKER).read_text()) == {"engine": "t"}
    assert (repo / "README.md").read_text() == "Build output\n" and repo_versions(repo)["tensorrt_llm"] == [1]


@pytest.mark.parametrize("where", ["same", "repo-in-store", "store-in-repo"])
def test_store_and_repository_must_not_overlap(tmp_path, pair, where):
    d = tmp_path / "out"
    store, repo = {"same": (d, d), "repo-in-store": (d, d / "repo"), "store-in-repo": (d / "engines", d)}[where]
    r = cli("build", recipe_with(tmp_path, pair, EMIT, repo=repo, store=store))
    assert r.exit_code == 2 and "overlap" in r.stderr and "output.triton_repo" in r.stderr, r.output
    assert not d.exists()


def test_one_engine_name_per_repository(tmp_path, pair):
    repo = tmp_path / "triton_repo"
    t = build(recipe_with(tmp_path, pair, EMIT))
    build(recipe_with(tmp_path, pair, name="u", file="u.yaml"))  # u/1, not emitted
    r = cli("build", recipe_with(tmp_path, pair, EMIT, name="u", file="u2.yaml"))  # would be u/2
    assert r.exit_code == 2 and "'t'" in r.stderr and "one engine name per repository" in r.stderr, r.output
    assert [v.version for v in EngineStore(tmp_path / "engines").versions("u")] == [1]
    assert repo_versions(repo) == {m: [1] for m in VERSIONED}
    src = json.loads((repo / "tensorrt_llm" / "1" / "engine_source.json").read_text())
    assert src["name"] == "t" and src["build_id"] == t.build_id


# --- a repository version is whole or absent ---------------------------------------------------------------


def test_half_published_version_is_repaired_not_reported_up_to_date(tmp_path, pair):
    """What emission used to leave when killed during the generator copy: preprocessing/2 and postprocessing/2
    without generator/2. The next build must not call that up to date."""
    recipe = recipe_with(tmp_path, pair, EMIT)
    repo = tmp_path / "triton_repo"
    build(recipe)
    v2 = build(recipe, force=True)
    shutil.rmtree(repo / "tensorrt_llm" / "2")
    lines = []
    from bpcompile.compiler.pipeline import Reporter

    out = build(recipe, reporter=Reporter(log=lines.append))
    assert not out.created and out.version == 2
    assert any("removed version 2" in x for x in lines), lines
    assert repo_versions(repo) == {m: [1, 2] for m in VERSIONED}
    assert json.loads((repo / "tensorrt_llm" / "2" / "engine_source.json").read_text())["build_id"] == v2.build_id


def _stand_in_engine(root: Path, v: int, tok: Path) -> Path:
    d = root / str(v)
    (d / "verifier").mkdir(parents=True)
    (d / "verifier" / "weights.bin").write_bytes(os.urandom(4 << 20))  # a copy that takes a moment
    (d / "tokenizer").mkdir()
    shutil.copy2(tok / "tokenizer.json", d / "tokenizer" / "tokenizer.json")
    write_engine_config(d)
    (d / "manifest.json").write_text(json.dumps({"name": "tiny", "version": v, "build_id": f"b{v}"}))
    return d


def test_concurrent_emission_into_one_repository(tmp_path, pair):
    from bpcompile.serving.emit import emit_repository

    engines = [_stand_in_engine(tmp_path / "engines", v, pair[0]) for v in range(1, 6)]
    repo = tmp_path / "repo"
    emit_repository([(1, engines[0])], repo)
    go = tmp_path / "go"
    code = (
        "import sys, time, pathlib\nfrom bpcompile.serving.emit import publish_version\n"
        "go = pathlib.Path(sys.argv[1])\nwhile not go.exists(): time.sleep(0.002)\n"
        "publish_version(sys.argv[2], sys.argv[3], int(sys.argv[4]))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(go), str(repo), str(e), str(v)], stderr=subprocess.PIPE, text=True
        )
        for v, e in enumerate(engines[1:], start=2)
    ]
    time.sleep(3)  # all four waiting at the start line (imports done)
    go.touch()
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errs
    assert repo_versions(repo) == {m: [1, 2, 3, 4, 5] for m in VERSIONED}
    summary = json.loads((repo / SUMMARY).read_text())
    assert sorted(v["version"] for v in summary["versions"]) == [1, 2, 3, 4, 5]
    assert not (repo / JOURNAL).exists()


# --- what killed builds leave in the store -------------------------------------------------------------


def test_stale_staging_is_removed_and_a_running_builds_is_kept(tmp_path, pair):
    d = tmp_path / "engines" / "t"
    (d / ".staging-dead00000000" / "verifier").mkdir(parents=True)  # its build is gone: nobody holds the lock
    (d / ".staging-dead00000000.lock").touch()
    live = d / ".staging-live00000000"
    (live / "verifier").mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from filelock import FileLock\n"
            "l = FileLock(sys.argv[1]); l.acquire(); print('held', flush=True); time.sleep(120)",
            f"{live}.lock",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert build(recipe_with(tmp_path, pair)).version == 1
        assert not (d / ".staging-dead00000000").exists() and not (d / ".staging-dead00000000.lock").exists()
        assert live.is_dir()
    finally:
        holder.kill()
        holder.wait()
    assert build(recipe_with(tmp_path, pair), force=True).version == 2  # and once its build is gone, it goes too
    assert not live.exists()


def test_version_directories_without_a_valid_manifest_are_skipped(tmp_path, pair):
    d = tmp_path / "engines" / "t"
    (d / "1").mkdir(parents=True)  # no manifest
    (d / "2").mkdir()
    (d / "2" / "manifest.json").write_text('{"name": "t", "vers')  # cut short
    r = cli("build", recipe_with(tmp_path, pair), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["version"] == 3
    assert f"{d / '1'} is not an engine version (no manifest.json)" in r.stderr
    assert f"{d / '2'} is not an engine version (unreadable manifest.json" in r.stderr
    rows = json.loads(cli("list", tmp_path / "engines", "--json").stdout)
    assert [(x["name"], x["version"]) for x in rows] == [("t", 3)]


# --- the manifest and the recipe ------------------------------------------------------------------------


def test_a_kernel_stage_that_did_not_apply_is_recorded_as_skipped(tmp_path, pair):
    r = recipe_with(tmp_path, pair)
    r.write_text(r.read_text().replace("kernels: {compile: false}", "kernels: {compile: true}"))
    v = build(r)  # target native: its runtime compiles the kernels on the GPU it runs on
    stages = {s["name"]: s for s in json.loads((v.path / "manifest.json").read_text())["stages"]}
    assert stages["compile kernels"]["status"] == "skipped", stages["compile kernels"]
    assert "target native" in stages["compile kernels"]["detail"] and not (v.path / "kernels").exists()


def test_version_policy_latest_zero_is_refused_at_validate(tmp_path, pair):
    r = cli("validate", recipe_with(tmp_path, pair, "triton: {emit: true, version_policy: {latest: 0}}\n"))
    assert r.exit_code == 2 and "triton.version_policy" in r.stderr, r.output
    r = cli("validate", recipe_with(tmp_path, pair, "triton: {emit: true, version_policy: {specific: [1, 2]}}\n"))
    assert r.exit_code == 0, r.output
