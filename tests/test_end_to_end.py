"""`bpcompile build recipes/tiny.yaml` end to end, through the CLI as a user runs it: the shipped tiny pair
becomes a version with converted checkpoints, a calibrated KV plan and a Triton repository (no cubins: the
native runtime compiles its kernels where it runs); `eval` and `generate` work on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from bpcompile.cli import main
from bpcompile.runtime.kvcache import KVPlan

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not (TINY / "verifier" / "model.safetensors").is_file():
        pytest.skip("the shipped tiny pair is not present")
    d = tmp_path_factory.mktemp("e2e")
    text = (REPO / "recipes" / "tiny.yaml").read_text().replace("../models/tiny", str(TINY))
    text = text.replace("store: ../engines", f"store: {d / 'engines'}").replace(
        "triton_repo: ../triton_repo", f"triton_repo: {d / 'triton_repo'}"
    )
    (d / "tiny.yaml").write_text(text)
    res = CliRunner().invoke(main, ["build", str(d / "tiny.yaml"), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), d


def test_tiny_build_holds_every_artifact(engine):
    out, d = engine
    v = Path(out["path"])
    stages = {s["name"]: s for s in out["stages"]}
    assert stages["calibrate"]["status"] == "ran" and stages["compile kernels"]["status"] == "skipped"
    assert "target native" in stages["compile kernels"]["detail"] and "tensorrt plugin" not in stages
    plan = KVPlan.load(v / "kv_plan")
    assert plan.format == "int4-fp8-outlier" and plan.compression_vs_fp16() >= 3.5
    fp8 = [x for layer in plan.precision for t in ("k", "v") for x in layer[t] if x == "fp8"]
    assert len(fp8) == 1  # 8% of 16 units
    assert not (v / "kernels").exists()
    assert (d / "triton_repo" / "ensemble" / "config.pbtxt").is_file()
    assert (d / "triton_repo" / "tensorrt_llm" / "1").is_dir()


def test_eval_and_generate_on_the_built_engine(engine):
    out, _ = engine
    res = CliRunner().invoke(main, ["eval", out["path"], "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert "markdown" in rep and "int4-naive" in rep["markdown"] and "engine plan" in rep["markdown"]
    res = CliRunner().invoke(
        main, ["generate", out["path"], "--prompt", "The import statement", "--max-tokens", "8", "--json"]
    )
    assert res.exit_code == 0, res.output
    # the engine's directory (not a version) means its newest version: the same greedy tokens
    again = CliRunner().invoke(
        main,
        ["generate", str(Path(out["path"]).parent), "--prompt", "The import statement", "--max-tokens", "8", "--json"],
    )
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["tokens"] == json.loads(res.stdout)["tokens"]
