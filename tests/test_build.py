"""Build + store: publish, idempotent rebuild, --force, atomic publish under injected failure, concurrent builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from pairs import make_pair, write_recipe

from bpcompile.cli import main
from bpcompile.compiler.pipeline import build
from bpcompile.core.store import EngineStore, sha256_file


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


def versions(root: Path) -> list[str]:
    d = root / "engines" / "t"
    # everything but the lock file: a leftover staging directory would show up here
    return sorted(p.name for p in d.iterdir() if p.name != ".lock") if d.exists() else []


def test_build_publishes_then_is_idempotent(tmp_path, pair):
    recipe = write_recipe(tmp_path / "r.yaml", *pair)
    res = CliRunner().invoke(main, ["build", str(recipe), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["version"] == 1 and out["created"]
    vdir = Path(out["path"])
    m = json.loads((vdir / "manifest.json").read_text())
    # every artifact's hash is right and every input is recorded
    for rel, a in m["artifacts"].items():
        assert sha256_file(vdir / rel) == a["sha256"]
    assert "verifier/model.safetensors" in m["inputs"] and "draft/tokenizer.json" in m["inputs"]
    assert (vdir / "verifier" / "config.json").is_file() and (vdir / "verifier" / "rank0.safetensors").is_file()
    assert (vdir / "tokenizer" / "tokenizer.json").is_file() and (vdir / "recipe.yaml").is_file()
    assert {s["name"] for s in m["stages"]} >= {"convert verifier", "convert draft", "tokenizer"}

    res2 = CliRunner().invoke(main, ["build", str(recipe), "--json"])
    assert res2.exit_code == 0
    out2 = json.loads(res2.stdout)
    assert out2["created"] is False and out2["version"] == 1
    assert "up to date" in res2.stderr and "version 1" in res2.stderr
    assert versions(tmp_path) == ["1"]

    res3 = CliRunner().invoke(main, ["build", str(recipe), "--force", "--json"])
    assert json.loads(res3.stdout)["version"] == 2
    # a recipe change that alters what is built gives a new build id
    recipe.write_text(recipe.read_text().replace("max_batch_size: 4", "max_batch_size: 2"))
    out4 = build(recipe)
    assert out4.created and out4.version == 3 and out4.build_id != out["build_id"]


def _fail_after(monkeypatch, stage: str) -> None:
    """The build raises right after `stage` really ran: the stage's own code first, then an error."""
    from bpcompile.compiler import convert, pipeline

    if stage.startswith("convert"):
        real, role = convert.convert_checkpoint, stage.split()[1]

        def conv(src, out, **kw):
            res = real(src, out, **kw)
            if Path(out).name == role:
                raise RuntimeError(f"injected failure after {stage}")
            return res

        monkeypatch.setattr(convert, "convert_checkpoint", conv)
    else:
        real_cal = pipeline._calibrate_stage

        def cal(*args):
            real_cal(*args)
            raise RuntimeError(f"injected failure after {stage}")

        monkeypatch.setattr(pipeline, "_calibrate_stage", cal)


@pytest.mark.parametrize("stage", ["convert verifier", "convert draft", "calibrate"])
def test_failed_build_publishes_nothing(tmp_path, pair, stage, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", *pair)
    with monkeypatch.context() as m:
        _fail_after(m, stage)
        with pytest.raises(RuntimeError, match="injected"):
            build(recipe)
    assert versions(tmp_path) == []
    # and the next build still starts at version 1
    assert build(recipe).version == 1


def test_concurrent_builds_publish_one_version(tmp_path, pair):
    recipe = write_recipe(tmp_path / "r.yaml", *pair)
    cmd = [sys.executable, "-m", "bpcompile.cli", "build", str(recipe), "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    results = [json.loads(o) for o, _ in outs]
    assert sorted(r["created"] for r in results) == [False, True]
    assert {r["version"] for r in results} == {1}
    assert [v.version for v in EngineStore(tmp_path / "engines").versions("t")] == [1]
    assert not any(p.name.startswith(".staging") for p in (tmp_path / "engines" / "t").iterdir())


def test_inspect_and_list(tmp_path, pair):
    recipe = write_recipe(tmp_path / "r.yaml", *pair)
    v = build(recipe)
    r = CliRunner().invoke(main, ["inspect", str(v.path), "--json"])
    info = json.loads(r.stdout)
    assert info["kind"] == "engine-version" and info["version"] == 1
    assert info["contents"]["verifier"]["kind"] == "trtllm-checkpoint"
    r = CliRunner().invoke(main, ["inspect", str(pair[0]), "--json"])
    hf = json.loads(r.stdout)
    assert hf["kind"] == "hf-checkpoint" and hf["parameters"] == info["contents"]["verifier"]["parameters"]
    r = CliRunner().invoke(main, ["list", str(tmp_path / "engines"), "--json"])
    rows = json.loads(r.stdout)
    assert [(x["name"], x["version"]) for x in rows] == [("t", 1)] and rows[0]["build_id"] == v.build_id
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "nothing")])
    assert r.exit_code == 2


def test_tensorrt_llm_target_fails_clearly_without_tensorrt(tmp_path, pair):
    recipe = write_recipe(
        tmp_path / "r.yaml", *pair, extra="target: tensorrt-llm\nspeculative: {tree: chain, length: 4}\n"
    )
    r = CliRunner().invoke(main, ["build", str(recipe)])
    assert r.exit_code == 2 and "TensorRT-LLM 1.2" in r.stderr and "target" in r.stderr
    assert versions(tmp_path) == []


@pytest.mark.parametrize(
    "extra, key, says",
    [
        (
            "kv_cache: {format: int4-fp8-outlier}\nspeculative: {tree: none}\n",
            "kv_cache.format",
            "one dtype per KV pool",
        ),
        ("kv_cache: {format: fp16}\nspeculative: {tree: dynamic, nodes: 5}\n", "speculative.tree", "chain"),
    ],
)
def test_tensorrt_llm_target_refuses_what_its_executor_cannot_hold(tmp_path, pair, extra, key, says):
    """Not a silent downgrade: the recipe is refused before any stage, naming the key and the alternative."""
    text = write_recipe(tmp_path / "r.yaml", *pair).read_text().replace("kv_cache: {format: fp16}\n", "")
    (tmp_path / "r.yaml").write_text(text + "target: tensorrt-llm\n" + extra)
    r = CliRunner().invoke(main, ["build", str(tmp_path / "r.yaml")])
    assert r.exit_code == 2 and key in r.stderr and says in r.stderr and "target: native" in r.stderr, r.stderr
    assert versions(tmp_path) == []


@pytest.mark.parametrize("fmt, qmax", [("fp8", 448.0), ("int8", 127.0)])
def test_tensorrt_llm_kv_cache_scales_in_every_rank_file(tmp_path, pair, fmt, qmax):
    """FP8 / INT8 KV for TensorRT-LLM: one kv_cache_scaling_factor per layer, = the largest |K| or |V| (keys after
    RoPE) over the calibration samples / the format's largest value, replicated into every tp rank file of the pp
    stage that owns the layer under its local index; config.json says the algorithm. The reference amax comes from
    transformers' own KV cache of the HF checkpoint on the same samples."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from bpcompile.compiler.convert import convert_checkpoint
    from bpcompile.compiler.corpus import calibration_samples
    from bpcompile.compiler.trtllm import kv_scales_stage

    v = pair[0]
    ckpt = tmp_path / "verifier"
    convert_checkpoint(v, ckpt, tp=2, pp=2)
    out = kv_scales_stage(ckpt, v, fmt, {"samples": 4, "length": 32})
    assert ("FP8" if fmt == "fp8" else "INT8") in out["detail"]
    samples = calibration_samples(v, 4, 32)
    hf = AutoModelForCausalLM.from_pretrained(v, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor(samples), use_cache=True)
    layers = getattr(out, "cache", None) or out.past_key_values
    layers = [(x.keys, x.values) for x in layers.layers]
    want = [max(float(key.abs().max()), float(val.abs().max())) / qmax for key, val in layers]
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization"]["kv_cache_quant_algo"] == fmt.upper()
    seen = set()
    for rank in range(4):  # tp 2 x pp 2: ranks 0, 1 hold layer 0 (local 0); ranks 2, 3 hold layer 1 (local 0)
        with safe_open(ckpt / f"rank{rank}.safetensors", "pt") as f:
            names = [k for k in f.keys() if k.endswith("kv_cache_scaling_factor")]
            assert names == ["transformer.layers.0.attention.kv_cache_scaling_factor"]
            s = f.get_tensor(names[0])
            assert s.dtype == torch.float32 and s.shape == (1,)
            layer = rank // 2
            assert abs(float(s) - want[layer]) <= 1e-5 * want[layer], (rank, float(s), want[layer])
            seen.add(layer)
    assert seen == {0, 1}


def _feature_draft(d: Path, verifier: Path, fc_cols: int = 2) -> Path:
    """A one-layer FeatureDraft (random weights) for `verifier`'s shape; fc_cols != 2 makes fc.weight malformed."""
    import torch
    from safetensors.torch import save_file

    from bpcompile.compiler.hf import read_hf_config

    c = read_hf_config(verifier)
    H, D, inter = c["hidden_size"], c["head_dim"], 48
    nq, nkv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g) / s[-1] ** 0.5  # noqa: E731
    p = "transformer.layers.0."
    w = {
        "fc.weight": r(H, fc_cols * H),
        "fc.bias": torch.zeros(H),
        p + "input_layernorm.weight": torch.ones(H),
        p + "post_layernorm.weight": torch.ones(H),
        p + "attention.qkv.weight": r(nq + 2 * nkv, H),
        p + "attention.dense.weight": r(H, nq),
        p + "mlp.fc.weight": r(inter, H),
        p + "mlp.gate.weight": r(inter, H),
        p + "mlp.proj.weight": r(H, inter),
    }
    d.mkdir(parents=True)
    save_file(w, str(d / "model.safetensors"))
    (d / "config.json").write_text(
        json.dumps({"architecture": "FeatureDraft", "num_layers": 1, "intermediate_size": inter})
    )
    return d


def test_feature_draft_builds_serves_and_is_refused_where_it_cannot_run(tmp_path, pair):
    """A FeatureDraft as the recipe's draft: validated against the verifier (shapes from the safetensors headers),
    copied into the version, loaded by Generator.from_engine, greedy output the verifier's own; a target that
    cannot run it, or a malformed tensor, is a clear exit-2 error naming what."""
    from bpcompile.runtime.generator import Generator, SamplingParams, TreeSpec
    from bpcompile.runtime.model import FeatureDraft

    fd = _feature_draft(tmp_path / "fd", pair[0])
    recipe = write_recipe(tmp_path / "r.yaml", pair[0], fd, "speculative: {tree: chain, length: 3}\n")
    res = CliRunner().invoke(main, ["build", str(recipe), "--json"])
    assert res.exit_code == 0, res.output
    vdir = Path(json.loads(res.stdout)["path"])
    m = json.loads((vdir / "manifest.json").read_text())
    assert "copy feature draft" in {s["name"] for s in m["stages"]} and "draft/model.safetensors" in m["inputs"]
    gen = Generator.from_engine(vdir)
    assert isinstance(gen.draft, FeatureDraft) and gen.tree.kind == "chain"
    prompts = [[5, 17, 9, 200, 3], list(range(30, 41))]
    got = [t for t, _ in gen.generate(prompts, SamplingParams(max_tokens=16))]
    plain = Generator.from_engine(vdir, tree=TreeSpec("none"))
    assert got == [t for t, _ in plain.generate(prompts, SamplingParams(max_tokens=16))]
    res = CliRunner().invoke(main, ["inspect", str(vdir), "--json"])
    assert res.exit_code == 0 and "feature-draft" in res.output

    bad = write_recipe(tmp_path / "onnx.yaml", pair[0], fd, "runtime: {onnx: true}\n")
    res = CliRunner().invoke(main, ["validate", str(bad)])
    assert res.exit_code == 2 and "feature draft" in res.output and "models.draft.path" in res.output
    wrong = write_recipe(tmp_path / "w.yaml", pair[0], _feature_draft(tmp_path / "fd3", pair[0], fc_cols=3))
    res = CliRunner().invoke(main, ["build", str(wrong)])
    assert res.exit_code == 2 and "'fc.weight'" in res.output and "[64, 192]" in res.output
