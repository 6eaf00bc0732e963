"""House rules a newcomer relies on: the scripts outside the package use only its public names, every environment
variable the package reads is documented, the docs stay readable (short README, short table cells), the packaging
list covers every package, and the README's test command is the one CI runs."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*(REPO / "benchmarks").glob("*.py"), *(REPO / "tools").glob("*.py")])


# ---- scripts under benchmarks/ and tools/ ----------------------------------------------------------------------


def script_problems(source: str) -> list[str]:
    """What a script does that it must not: reach into bpcompile's private names, rebind a bpcompile module's
    attributes, or put folders on sys.path (the package is installed)."""
    tree = ast.parse(source)
    problems = []
    modules = set()  # local names bound to bpcompile modules or objects imported from it
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "bpcompile":
                    modules.add(a.asname or a.name.split(".")[0])
                    if any(part.startswith("_") and not part.startswith("__") for part in a.name.split(".")):
                        problems.append(f"line {node.lineno}: imports private module {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bpcompile":
            for part in node.module.split("."):
                if part.startswith("_") and not part.startswith("__"):
                    problems.append(f"line {node.lineno}: imports from private module {node.module}")
            for a in node.names:
                modules.add(a.asname or a.name)
                if a.name.startswith("_"):
                    problems.append(f"line {node.lineno}: imports private name {node.module}.{a.name}")
    for node in ast.walk(tree):
        # private attributes of anything (bpcompile's objects are what a script has to reach into)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            problems.append(f"line {node.lineno}: private attribute {ast.unparse(node)}")
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            root = t
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if isinstance(t, ast.Attribute) and isinstance(root, ast.Name) and root.id in modules:
                problems.append(f"line {node.lineno}: assigns bpcompile attribute {ast.unparse(t)}")
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("setattr", "delattr") and node.args:
                root = node.args[0]
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in modules:
                    problems.append(f"line {node.lineno}: {name} on bpcompile's {ast.unparse(node.args[0])}")
            if name in ("sys.path.insert", "sys.path.append"):
                problems.append(f"line {node.lineno}: {name} (the package is installed)")
    return problems


def test_scripts_found():
    names = {p.name for p in SCRIPTS}
    assert {"bench_smollm2.py", "check_smollm2_speculation.py", "get_smollm2.py", "train_tiny.py"} <= names
    assert not list((REPO / "scripts").glob("check_*.py"))
    assert {p.name for p in (REPO / "scripts").glob("bench_*.py")} <= {"bench_gpu.py"}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_uses_public_names_only(path):
    assert script_problems(path.read_text()) == []


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_has_a_purpose(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.splitlines()[0].strip(), f"{path.name}: no docstring saying what it is for"


# One process runs every script's --help in turn (torch imported once: ~20 s instead of a minute): each as
# `python SCRIPT --help` would, its folder first on sys.path; the exit code and whether usage was printed come back.
HELP_DRIVER = """
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv, buf, code = [path, "--help"], io.StringIO(), None
    sys.path.insert(0, path.rsplit("/", 1)[0])
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
    except BaseException as e:
        code = repr(e)
    finally:
        sys.path.pop(0)
    out[path] = [code, "usage" in buf.getvalue()]
print(json.dumps(out))
"""


def test_scripts_answer_help():
    """Each script parses its arguments before doing any work: --help prints usage and exits 0."""
    import json

    r = subprocess.run(
        [sys.executable, "-c", HELP_DRIVER, *map(str, SCRIPTS)], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(r.stdout.splitlines()[-1])
    assert len(results) == len(SCRIPTS)
    bad = {Path(p).name: v for p, v in results.items() if v != [0, True]}
    assert not bad, f"--help did not print usage and exit 0: {bad}"


def test_script_checks_have_teeth():
    src = """
import sys
from bpcompile.compiler.calibrate import _LayerProbe
import bpcompile.compiler.calibrate as C
from bpcompile.eval import evaluate as E
sys.path.insert(0, "x")
C.PRECISIONS = {}
setattr(E, "attend_exact", None)
E._text("a")
"""
    found = "\n".join(script_problems(src))
    for what in ("_LayerProbe", "C.PRECISIONS", "setattr", "E._text", "sys.path.insert"):
        assert what in found, (what, found)
    assert script_problems("from bpcompile.runtime.model import Linear\nx = Linear\nx.y = 1\n") == []


# ---- environment variables -------------------------------------------------------------------------------------


def _constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
    return out


def env_reads(root: Path) -> dict[str, list[str]]:
    """Names of the environment variables the code under root reads -> where: literal names and module-level
    constants given to os.environ.get / os.getenv / os.environ[...] / `in os.environ`, plus every string constant
    that looks like one of bpcompile's own variables (BPCOMPILE_*, however it reaches the read)."""
    trees = {p: ast.parse(p.read_text()) for p in root.rglob("*.py")}
    consts = {}
    for tree in trees.values():
        consts.update(_constants(tree))
    found: dict[str, list[str]] = {}

    def name_of(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return consts.get(node.id)
        if isinstance(node, ast.Attribute):
            return consts.get(node.attr)
        return None

    for path, tree in trees.items():
        where = str(path.relative_to(root.parent))
        for node in ast.walk(tree):
            arg = None
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv", "getenv"):
                arg = node.args[0] if node.args else None
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                if isinstance(node.ctx, ast.Load):
                    arg = node.slice
            elif isinstance(node, ast.Compare) and any(ast.unparse(c) == "os.environ" for c in node.comparators):
                arg = node.left
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"BPCOMPILE_[A-Z0-9_]+", node.value):
                    found.setdefault(node.value, []).append(f"{where}:{node.lineno}")
                continue
            name = name_of(arg) if arg is not None else None
            if name:
                found.setdefault(name, []).append(f"{where}:{node.lineno}")
    return found


def documented_env() -> set[str]:
    names = set()
    for line in (REPO / "docs" / "ENVIRONMENT.md").read_text().splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return names


def test_every_environment_variable_is_documented():
    reads = env_reads(REPO / "bpcompile")
    assert {"BPCOMPILE_KERNELS", "BPCOMPILE_CPU_ROWS", "BPCOMPILE_REPOSITORY_TOKEN", "CC"} <= set(reads)
    missing = {k: v for k, v in reads.items() if k not in documented_env()}
    assert not missing, f"read by the package but not in docs/ENVIRONMENT.md's table: {missing}"


def test_env_scan_has_teeth(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import os\nNAME = 'XYZ_ONE'\nos.environ.get(NAME)\nos.getenv('XYZ_TWO')\n")
    (pkg / "b.py").write_text("import os\nif 'XYZ_THREE' in os.environ: os.environ['XYZ_FOUR']\nk = 'BPCOMPILE_ZZ'\n")
    assert set(env_reads(pkg)) == {"XYZ_ONE", "XYZ_TWO", "XYZ_THREE", "XYZ_FOUR", "BPCOMPILE_ZZ"}


@pytest.mark.parametrize(
    "argv,env",
    [
        (["generate", "no-such-engine", "--prompt", "x", "--cpu-kernels", "off"], {"BPCOMPILE_CPU_ROWS": "0"}),
        (["generate", "no-such-engine", "--prompt", "x", "--kernels", "torch"], {"BPCOMPILE_KERNELS": "torch"}),
        (["eval", "no-such-engine", "--cpu-kernels", "off"], {"BPCOMPILE_CPU_DECODE": "0"}),
        (["serve", "no-such-repo", "--kernels", "triton", "--cpu-kernels", "off"], {"BPCOMPILE_KERNELS": "triton"}),
        (["validate", "no-such-recipe.yaml", "--kv-memory-limit", "1000"], {"BPCOMPILE_KV_MEMORY_LIMIT": "1000"}),
    ],
)
def test_switch_flags_set_what_the_code_reads(argv, env, monkeypatch, tmp_path):
    """The flags reach the code (and the processes a command starts) through the documented variables."""
    from bpcompile.cli import main

    monkeypatch.chdir(tmp_path)
    for name in ("BPCOMPILE_KERNELS", "BPCOMPILE_CPU_ROWS", "BPCOMPILE_CPU_DECODE", "BPCOMPILE_KV_MEMORY_LIMIT"):
        monkeypatch.delenv(name, raising=False)
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2, r.output  # the missing input, after the flags were taken
    for name, value in env.items():
        assert os.environ.get(name) == value, (argv, name)
        assert name in documented_env()


def test_kv_memory_limit_flag_decides_validation(tmp_path, monkeypatch):
    """A build box smaller than the server: --kv-memory-limit names the server's memory."""
    from bpcompile.cli import main

    monkeypatch.delenv("BPCOMPILE_KV_MEMORY_LIMIT", raising=False)
    recipe = REPO / "recipes" / "tiny.yaml"
    r = CliRunner().invoke(main, ["validate", str(recipe), "--kv-memory-limit", "1000"])
    assert r.exit_code == 2 and "--kv-memory-limit" in r.output, r.output
    monkeypatch.delenv("BPCOMPILE_KV_MEMORY_LIMIT", raising=False)
    r = CliRunner().invoke(main, ["validate", str(recipe), "--kv-memory-limit", "0"])
    assert r.exit_code == 0, r.output


# ---- docs and packaging ----------------------------------------------------------------------------------------


def long_cells(text: str, limit: int = 300) -> list[str]:
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("|") and s.endswith("|"):
            cells = re.split(r"(?<!\\)\|", s[1:-1])
            out += [f"line {i}: {len(c.strip())} chars: {c.strip()[:60]}..." for c in cells if len(c.strip()) > limit]
    return out


def test_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; details belong in docs/"


def test_no_long_table_cells():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    bad = {str(p.relative_to(REPO)): c for p in pages if (c := long_cells(p.read_text()))}
    assert not bad, f"table cells over 300 characters (put the detail in prose under the table): {bad}"
    assert long_cells("| a | " + "x" * 301 + " |") and not long_cells("| a | b \\| c |")


def test_packaging_lists_every_package():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "bpcompile").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert present <= listed, f"packages missing from pyproject.toml's [tool.setuptools] packages: {present - listed}"


def test_readme_test_command_is_what_ci_runs():
    ci = [x for x in (REPO / ".ci" / "run").read_text().splitlines() if x and not x.startswith(("#", "set ", "cd "))]
    assert len(ci) == 1, ci
    readme = (REPO / "README.md").read_text()
    assert ci[0] in readme.splitlines(), f"README.md must show CI's command verbatim: {ci[0]}"


@pytest.mark.timeout(7)
def test_timeouts_scale_with_the_machine(request):
    """tests/conftest.py scales every per-test timeout by the machine's measured slowness (at least 2x)."""
    factor = request.config.timeout_factor
    assert 2.0 <= factor <= 20.0
    assert request.node.get_closest_marker("timeout").args[0] == pytest.approx(7 * factor)
