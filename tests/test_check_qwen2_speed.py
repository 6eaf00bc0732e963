"""benchmarks/check_qwen2.py speed on a small random Qwen2 pair (an engine built from it and the same checkpoints
for transformers): each repeat runs our rows and transformers' rows in separate processes, the first side
alternating, with the threads asked for, every row decoding the same tokens; bad input exits 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bpcompile.compiler.pipeline import build
from tests.pairs import write_recipe
from tests.test_qwen2 import qwen2_pair

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "check_qwen2.py"


def _speed(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "speed", *args], capture_output=True, text=True, timeout=300)


def test_speed_runs_each_side_in_its_own_process(tmp_path):
    v, d = qwen2_pair(tmp_path, "d128")
    recipe = write_recipe(tmp_path / "r.yaml", v, d, extra="speculative: {tree: dynamic, nodes: 5, backoff: false}\n")
    engine = build(recipe).path
    run = _speed("--engine", str(engine), "--hf", str(tmp_path), "--repeats", "2", "--prompts", "1",
                 "--max-tokens", "8", "--pause", "0", "--threads", "1")  # fmt: skip
    assert run.returncode == 0, run.stderr
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert res["first_side_each_repeat"] == ["ours", "transformers"]
    assert res["threads"] == [1]  # set in every child process
    each = res["tokens_per_s_each_repeat"]
    assert set(each) == {"verifier only", "speculation", "transformers assisted", "transformers greedy"}
    assert all(len(v) == 2 and min(v) > 0 for v in each.values())
    for r in range(2):  # ratios pair the rows of the same repeat, not of the medians
        want = each["speculation"][r] / each["transformers assisted"][r]
        assert abs(res["ratios_each_repeat"]["speculation_vs_assisted"][r] - want) < 1e-3 * want
    for side in ("ours", "transformers"):
        mem = res["memory_mb"][side]
        assert all(0 < a <= p for a, p in zip(mem["after_load"], mem["peak"]))

    bad = _speed("--engine", str(tmp_path / "nowhere"), "--hf", str(tmp_path))
    assert bad.returncode == 2 and "--engine" in bad.stderr and "nowhere" in bad.stderr
