"""What bpcompile runs must be what was built: the CPU kernels' cache (a shared object planted by another user, or
changed after its build, is never loaded; no home directory or a relative cache path still leaves a working
kernel) and engine versions checked against their manifests before they are loaded (generate, eval, inspect,
serve refuse a tampered file with exit 2 naming it; --no-verify loads it). Also: one file mode for a whole
version, and small recipe checks (a symlinked tokenizer_config.json, `tp: true`, /dev/zero as calibration text).

Two users are played by this process (root) and uid 65534 / a uid without a passwd entry where the test needs
them; those tests are skipped when not run as root."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from pairs import make_pair, write_recipe

from bpcompile.cli import main
from bpcompile.core.errors import UserError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"
ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="plays another user: needs root")
# cbuild's real build-cache-load path on a one-function C file (the kernels' own sources take seconds to compile
# and bring torch in; test_another_uid_without_a_home_generates runs them in a real `generate`)
PROBE_C = "int bpc_probe(int x) { return x + 1; }\n"
PROBE = (
    "import os, sys; from pathlib import Path; from bpcompile.kernels import cbuild\n"
    "lib = cbuild.load(Path(os.environ['PROBE_SOURCE']), 'BPCOMPILE_PROBE', lambda lib: None)\n"
    "print(lib.bpc_probe(41) if lib is not None else None)"
)

# a shared object that, loaded, leaves a file behind (its constructor runs at dlopen): what another user plants
PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *m = getenv("PLANTED_MARKER");
    FILE *f = m ? fopen(m, "w") : NULL;
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("BPCOMPILE_CACHE", "XDG_CACHE_HOME", "BPCOMPILE_VERIFY")}
    env.update({k: v for k, v in kw.items() if v is not None})
    for k in [k for k, v in kw.items() if v is None]:
        env.pop(k, None)
    return env


def _python(code: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180, **kw)


@pytest.fixture(scope="module")
def planted_so(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("planted")
    (d / "p.c").write_text(PLANTED_C)
    subprocess.run([cc, "-shared", "-fPIC", str(d / "p.c"), "-o", str(d / "p.so")], check=True)
    return d / "p.so"


def _built_cache(tmp_path: Path) -> tuple[Path, Path]:
    """A cache directory with a real build of the probe in it (and its hash): (directory, the .so)."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    cache = tmp_path / "cache"
    r = _probe(cache=str(cache))
    assert r.returncode == 0 and r.stdout.strip() == "42", r.stderr
    (so,) = cache.glob("bpcompile-test-probe-*.so")
    return cache, so


def _probe(cache=None, cwd=None, **env) -> subprocess.CompletedProcess:
    src = Path(tempfile.gettempdir()) / "bpcompile-test-probe.c"  # readable by any uid, same key every time
    if not src.is_file() or src.read_text() != PROBE_C:
        src.write_text(PROBE_C)
    return _python(PROBE, _env(BPCOMPILE_CACHE=cache, PROBE_SOURCE=str(src), **env), cwd=cwd)


def _plant(so: Path, planted: Path, with_hash: bool) -> None:
    """Replace the build by the planted object (and, as its owner could, its recorded hash)."""
    import hashlib

    shutil.copyfile(planted, so)
    if with_hash:
        Path(f"{so}.sha256").write_text(hashlib.sha256(planted.read_bytes()).hexdigest() + "\n")


@ROOT_ONLY
@pytest.mark.parametrize("how", ["world-writable", "owned by another uid", "inside a world-writable directory"])
def test_planted_kernel_in_a_cache_others_control_is_not_loaded(tmp_path, planted_so, how):
    """Another user controls the cache directory (or the one above it) and plants cpu_decode-<key>.so with a
    matching hash: the victim does not load it (no constructor runs), warns once naming the directory, and still
    has a working kernel (built into a private directory)."""
    cache, so = _built_cache(tmp_path)
    _plant(so, planted_so, with_hash=True)
    if how == "world-writable":
        cache.chmod(0o777)
    elif how == "owned by another uid":
        for p in [cache, *cache.iterdir()]:
            os.chown(p, 65534, 65534)
    else:
        tmp_path.chmod(0o777)  # not sticky: another user can rename cache/ away and put their own in its place
    marker = tmp_path / "marker"
    r = _probe(cache=str(cache), PLANTED_MARKER=str(marker))
    assert not marker.exists(), "the planted shared object was loaded"
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "42"  # the kernel still works
    assert r.stderr.count("bpcompile: warning: kernel cache:") == 1 and str(cache) in r.stderr, r.stderr
    assert "building the CPU kernels into" in r.stderr and "bpcompile-kernels-" in r.stderr


def test_kernel_changed_after_its_build_is_rebuilt_not_loaded(tmp_path, planted_so):
    """The cache is ours, but the .so's bytes are not what its build recorded: it is rebuilt, not loaded."""
    cache, so = _built_cache(tmp_path)
    _plant(so, planted_so, with_hash=False)
    marker = tmp_path / "marker"
    r = _probe(cache=str(cache), PLANTED_MARKER=str(marker))
    assert not marker.exists(), "the changed shared object was loaded"
    assert r.returncode == 0 and r.stdout.strip() == "42", r.stderr
    assert so.read_bytes() != planted_so.read_bytes()  # rebuilt in place
    # a build without its recorded hash (an older bpcompile's, or one copied in) is rebuilt too
    Path(f"{so}.sha256").unlink()
    _plant(so, planted_so, with_hash=False)
    r = _probe(cache=str(cache), PLANTED_MARKER=str(marker))
    assert r.stdout.strip() == "42" and not marker.exists() and Path(f"{so}.sha256").is_file(), r.stderr


def test_relative_cache_paths_are_ignored(tmp_path):
    """BPCOMPILE_CACHE and XDG_CACHE_HOME name the cache only as absolute paths: a relative one would put the
    kernels (code this process runs) wherever the command happens to start. Ignored with a warning."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = _probe(cache="rel", cwd=cwd, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert r.returncode == 0 and r.stdout.strip() == "42", r.stderr
    assert "$BPCOMPILE_CACHE='rel' is not an absolute path" in r.stderr
    assert list(cwd.iterdir()) == [] and list((tmp_path / "xdg" / "bpcompile").glob("bpcompile-test-probe-*.so"))
    r = _probe(cwd=cwd, XDG_CACHE_HOME="xdg", HOME=str(tmp_path / "home"))
    assert r.returncode == 0 and r.stdout.strip() == "42", r.stderr
    assert "$XDG_CACHE_HOME='xdg' is not an absolute path" in r.stderr
    assert list(cwd.iterdir()) == [] and list(
        (tmp_path / "home" / ".cache" / "bpcompile").glob("bpcompile-test-probe-*.so")
    )


# ------------------------------------------------------------------------------------------ engine versions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny recipe's engine, built by the real pipeline (no GPU kernels, no repository, a short calibration:
    faster)."""
    if not (TINY / "verifier" / "config.json").is_file():
        pytest.skip("the tiny pair is not in models/tiny")
    from bpcompile.compiler.pipeline import build

    root = tmp_path_factory.mktemp("tiny")
    text = (REPO / "recipes" / "tiny.yaml").read_text().replace("../models/tiny", str(TINY))
    text = text.replace("store: ../engines, triton_repo: ../triton_repo", f"store: {root / 'engines'}")
    text = text.replace("emit: true", "emit: false").replace("compile: true", "compile: false")
    text = text.replace("samples: 16, length: 128", "samples: 2, length: 64")  # a KV plan is all these tests need
    (root / "tiny.yaml").write_text(text)
    return build(root / "tiny.yaml").path


def _flip(f: Path) -> None:
    """Change bytes in the tensor data of a safetensors file (not its header): it still loads, differently."""
    b = bytearray(f.read_bytes())
    start = 8 + int.from_bytes(b[:8], "little")
    at = start + (len(b) - start) // 2
    b[at : at + 64] = bytes(x ^ 0x55 for x in b[at : at + 64])
    f.write_bytes(bytes(b))


@pytest.fixture
def tampered(tiny, tmp_path) -> Path:
    copy = Path(shutil.copytree(tiny, tmp_path / "store" / "tiny" / "1"))
    _flip(copy / "verifier" / "rank0.safetensors")
    return copy


def test_gpu_kernel_cache_others_can_write_is_not_used(tmp_path):
    """The ahead-of-time cubins are cached by a key of public inputs and copied into engines: a cache folder other
    users can write (planted or swappable files) is passed over for a private one, as the CPU kernels' is."""
    code = "import os; from pathlib import Path; from bpcompile.compiler.aot import _cache_root\nprint(_cache_root())"
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    r = _python(code, _env(BPCOMPILE_CACHE=str(cache)))
    assert r.returncode == 0 and r.stdout.strip() == str(cache / "kernels"), r.stderr
    assert (cache / "kernels").stat().st_mode & 0o077 == 0
    os.chmod(cache / "kernels", 0o777)
    r = _python(code, _env(BPCOMPILE_CACHE=str(cache)))
    used = Path(r.stdout.strip())
    assert r.returncode == 0 and used != cache / "kernels" and cache not in used.parents, r.stderr
    assert "kernels is writable by group (mode 777); using a private directory" in r.stderr


def test_every_file_of_a_built_version_has_one_mode(tiny):
    """safetensors writes 0600 through its temporary file; a version is read by other users: 0644 / 0755 (with
    this umask) for everything, the KV plan's scales included."""
    mask = os.umask(0)
    os.umask(mask)
    modes = {str(p.relative_to(tiny)): p.stat().st_mode & 0o777 for p in tiny.rglob("*")}
    assert modes["kv_plan/scales.safetensors"] == 0o666 & ~mask
    assert {m for p, m in modes.items() if (tiny / p).is_dir()} == {0o777 & ~mask}
    assert {m for p, m in modes.items() if (tiny / p).is_file()} == {0o666 & ~mask}
    if os.getuid() == 0 and shutil.which("setpriv"):  # and another uid reads every file of it
        shared = Path(tempfile.mkdtemp(prefix="bpcompile-test-"))  # tmp_path's parents are root's own (0700)
        try:
            shared.chmod(0o755)
            copy = Path(shutil.copytree(tiny, shared / "1"))
            files = sorted(str(p) for p in copy.rglob("*") if p.is_file())
            nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            r = subprocess.run([*nobody, "cat", *files], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            assert r.returncode == 0, r.stderr
        finally:
            shutil.rmtree(shared, ignore_errors=True)


def test_tampered_rank_file_is_refused_by_generate_inspect_and_eval(tampered, monkeypatch):
    """Bytes of the verifier's rank file flipped after the build (the manifest still records the old sha256):
    generate, inspect and eval exit 2 naming the file and the sha256; --no-verify loads it."""
    monkeypatch.setenv("BPCOMPILE_VERIFY", "1")  # --no-verify sets it to 0 in this process: restored after
    args = ("--prompt", "def", "--max-tokens", "2", "--raw", "--json")
    for cmd in (["generate", tampered, *args], ["inspect", tampered], ["eval", tampered, "--sequences", "1"]):
        r = CliRunner().invoke(main, list(map(str, cmd)))
        assert r.exit_code == 2, (cmd[0], r.output)
        assert "verifier/rank0.safetensors has sha256" in r.output and "the manifest records" in r.output, r.output
    r = CliRunner().invoke(main, ["generate", str(tampered), *args, "--no-verify"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["tokens"]) == 2


def test_verification_names_what_differs(tiny, tmp_path):
    """Size (checked before any hashing), a missing file, a file the manifest does not list: each named; from
    Python, Generator.from_engine refuses it unless verify=False."""
    from bpcompile.runtime.generator import Generator
    from bpcompile.runtime.speculative import TreeSpec

    def copy(name):
        return Path(shutil.copytree(tiny, tmp_path / name))

    c = copy("short")
    f = c / "kv_plan" / "scales.safetensors"
    f.write_bytes(f.read_bytes()[:-4])
    with pytest.raises(UserError, match=r"kv_plan/scales.safetensors has size \d+ bytes, the manifest records"):
        Generator.from_engine(c)
    c = copy("missing")
    (c / "tokenizer" / "tokenizer_config.json").unlink()
    with pytest.raises(UserError, match="tokenizer/tokenizer_config.json is missing"):
        Generator.from_engine(c)
    c = copy("extra")
    shutil.copy(c / "verifier" / "rank0.safetensors", c / "verifier" / "rank1.safetensors")
    with pytest.raises(UserError, match="verifier/rank1.safetensors is not in the manifest"):
        Generator.from_engine(c)
    c = copy("flipped")
    _flip(c / "verifier" / "rank0.safetensors")
    with pytest.raises(UserError, match="verifier/rank0.safetensors has sha256"):
        Generator.from_engine(c, tree=TreeSpec("none"))
    assert Generator.from_engine(c, tree=TreeSpec("none"), verify=False).verifier is not None
    r = CliRunner().invoke(main, ["inspect", str(tiny)])
    assert r.exit_code == 0 and "files: match the manifest" in r.output, r.output


def test_serve_refuses_a_repository_with_a_tampered_engine_before_starting_tritonserver(tiny, tmp_path):
    """The repository holds a copy of the version: a rank file changed there makes `serve` exit 2 naming it,
    and tritonserver is never started (the check comes first)."""
    pytest.importorskip("tritonclient.grpc")
    from bpcompile.serving.emit import emit_repository

    emit_repository([(1, tiny)], tmp_path / "repo")
    _flip(tmp_path / "repo" / "tensorrt_llm" / "1" / "engine" / "verifier" / "rank0.safetensors")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bpcompile.cli",
            "serve",
            str(tmp_path / "repo"),
            "--http-port",
            "1",
            "--grpc-port",
            "2",
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("serve did not refuse the tampered repository (it went on to start tritonserver)")
    assert p.returncode == 2, err
    assert "tensorrt_llm/1/engine" in err and "verifier/rank0.safetensors has sha256" in err, err
    assert "starting tritonserver" not in err
    # a tokenizer copy changed in preprocessing/ is refused too
    emit_repository([(1, tiny)], tmp_path / "repo2")
    tok = tmp_path / "repo2" / "preprocessing" / "1" / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<s>"', '"<x>"', 1))
    from bpcompile.serving.integrity import verify_repository

    with pytest.raises(UserError, match="preprocessing/1/tokenizer/tokenizer.json: its sha256 differs"):
        verify_repository(tmp_path / "repo2")


def test_generate_without_a_home_directory(tiny, tmp_path):
    """A uid with no passwd entry and no $HOME (a container's arbitrary uid; played in a user namespace) runs
    `generate`: the CPU kernels build into a private directory instead of failing on the home directory."""
    unshare = shutil.which("unshare")
    userns = [unshare, "--user", "--map-user=54321", "--map-group=54321"] if unshare else []
    if not unshare or subprocess.run([*userns, "true"], capture_output=True).returncode != 0:
        pytest.skip("no user namespaces here")
    argv = ["generate", str(tiny), "--prompt", "def", "--max-tokens", "3", "--raw", "--json"]
    r = subprocess.run(
        [*userns, sys.executable, "-m", "bpcompile.cli", *argv],
        env=_env(HOME=None, BPCOMPILE_CPU_DECODE="1"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 3
    from bpcompile.kernels import cpu_decode

    if cpu_decode.available():  # built here, so it builds there: into a private directory
        assert "kernel cache: no home directory; building the CPU kernels into" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------ recipe checks


@pytest.fixture
def pair(tmp_path):
    return make_pair(tmp_path / "pair")


def _validate(recipe: Path):
    r = CliRunner().invoke(main, ["validate", str(recipe)])
    return r.exit_code, r.output


def test_validate_refuses_a_tokenizer_config_linked_from_outside_the_checkpoint(tmp_path, pair):
    """What `build` refuses, `validate` refuses: a side file that is a link leading out of the checkpoint."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(pair[0] / "tokenizer_config.json", outside / "tokenizer_config.json")
    (pair[0] / "tokenizer_config.json").symlink_to(outside / "tokenizer_config.json")
    code, out = _validate(write_recipe(tmp_path / "r.yaml", *pair))
    assert code == 2 and "tokenizer_config.json is a symbolic link" in out and "models.verifier.path" in out, out


def test_validate_refuses_tp_true(tmp_path, pair):
    r = write_recipe(tmp_path / "r.yaml", *pair)
    r.write_text(r.read_text().replace("parallel: {tp: 1, pp: 1}", "parallel: {tp: true, pp: 1}"))
    code, out = _validate(r)
    assert code == 2 and "parallel.tp" in out and "valid integer" in out, out


@pytest.mark.parametrize("source", ["/dev/zero", "binary"])
def test_validate_says_a_calibration_source_is_not_a_text_file(tmp_path, pair, source):
    if source == "binary":
        source = tmp_path / "weights.bin"
        source.write_bytes(bytes(range(256)) * 8)
    r = write_recipe(tmp_path / "r.yaml", *pair, extra=f"calibration: {{source: {source}}}\n")
    code, out = _validate(r)
    want = "is not a regular file" if source == "/dev/zero" else "is not UTF-8 text"
    assert code == 2 and f"calibration.source: calibration text {source} {want}" in out, out
