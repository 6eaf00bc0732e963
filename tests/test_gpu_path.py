"""runtime.device: what a CUDA recipe validates to, the Triton repository it emits (GPU instance groups), what
serving and generating it do on a machine without a GPU, and the kernels-only attention on CUDA. Nothing here
needs a GPU: emission and validation must work on the build box."""

from __future__ import annotations

import json
import shutil
from hashlib import sha256
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import write_engine_config

from bpcompile.cli import main
from bpcompile.compiler.recipe import load_recipe
from bpcompile.core.engine import EngineConfig
from bpcompile.core.errors import UserError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"
HAS_CUDA = torch.cuda.is_available()
no_gpu_only = pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour of a machine without CUDA")


@pytest.fixture(autouse=True)
def _default_switches(monkeypatch):
    """The defaults these tests are about, whatever an earlier test in this process left in the environment."""
    for var in ("BPCOMPILE_KERNELS", "BPCOMPILE_KV_MEMORY_LIMIT"):
        monkeypatch.delenv(var, raising=False)


def tiny_recipe(tmp: Path, runtime: str = "{device: cuda}", **replace) -> Path:
    """recipes/tiny.yaml with a runtime section and some lines replaced (key: new line)."""
    text = (REPO / "recipes" / "tiny.yaml").read_text().replace("../models/tiny", str(TINY))
    text = text.replace("store: ../engines", f"store: {tmp / 'engines'}")
    text = text.replace("triton_repo: ../triton_repo", f"triton_repo: {tmp / 'repo'}")
    lines = text.splitlines()
    for key, new in replace.items():  # a top-level key: its line and the indented block under it
        i = next(i for i, ln in enumerate(lines) if ln.startswith(f"{key}:"))
        j = i + 1
        while j < len(lines) and lines[j].startswith(" "):
            j += 1
        lines[i:j] = [new]
    f = tmp / "tiny.yaml"
    f.write_text("\n".join(lines) + f"\nruntime: {runtime}\n")
    return f


def engine_from(loaded, root: Path, version: int = 1) -> Path:
    """An engine version with the recipe's engine.json, as the build writes it (the checkpoints are stand-ins:
    emission copies them, nothing here loads them)."""
    d = root / str(version)
    for sub in ("verifier", "draft"):
        (d / sub).mkdir(parents=True)
        (d / sub / "config.json").write_text("{}")
    (d / "tokenizer").mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(TINY / "verifier" / f, d / "tokenizer" / f)
    EngineConfig.from_sections(loaded.resolved_dict()).save(d)
    (d / "manifest.json").write_text(json.dumps({"name": "tiny", "version": version, "build_id": f"b{version}"}))
    return d


def groups(cfg) -> list[tuple[str, int, list[int]]]:
    from bpcompile.serving.emit import mc

    return [(mc.ModelInstanceGroup.Kind.Name(g.kind), g.count, list(g.gpus)) for g in cfg.instance_group]


def test_a_cuda_recipe_emits_gpu_instance_groups(tmp_path):
    pytest.importorskip("tritonclient.grpc")
    from bpcompile.serving.emit import emit_repository, publish_version, read_config

    gen = "tensorrt_llm/config.pbtxt"
    # tp 2: one instance on GPU 0 (its second rank takes GPU 1); Triton would start one per listed GPU
    loaded = load_recipe(tiny_recipe(tmp_path, parallel="parallel: {tp: 2, pp: 1}"))
    assert loaded.recipe.runtime.device == "cuda"
    e = engine_from(loaded, tmp_path / "e2")
    emit_repository([(1, e)], tmp_path / "r2")
    g = read_config(tmp_path / "r2" / gen)
    assert groups(g) == [("KIND_GPU", 1, [0])]
    assert g.parameters["device"].string_value == "cuda" and g.parameters["tp"].string_value == "2"
    # the tokenizing models stay on the CPU
    assert groups(read_config(tmp_path / "r2" / "preprocessing" / "config.pbtxt"))[0][0] == "KIND_CPU"

    # tp 1, two instances: a model copy per GPU; what `bpcompile build` publishes takes the engine's device too
    (tmp_path / "b").mkdir()
    loaded = load_recipe(
        tiny_recipe(tmp_path / "b", triton="triton: {emit: true, version_policy: latest, generator_instances: 2}")
    )
    e = engine_from(loaded, tmp_path / "e1")
    publish_version(tmp_path / "r1", e, 1)
    assert groups(read_config(tmp_path / "r1" / gen)) == [("KIND_GPU", 1, [0]), ("KIND_GPU", 1, [1])]

    # the same engine emitted for the CPU: one group of two CPU instances, as before
    emit_repository([(1, e)], tmp_path / "rc", device="cpu")
    g = read_config(tmp_path / "rc" / gen)
    assert groups(g) == [("KIND_CPU", 2, [])] and g.parameters["device"].string_value == "cpu"

    # two tensor-parallel copies: GPUs 0-1 and 2-3, each instance placed on its first
    (tmp_path / "c").mkdir()
    loaded = load_recipe(
        tiny_recipe(
            tmp_path / "c",
            parallel="parallel: {tp: 2, pp: 1}",
            triton="triton: {emit: true, version_policy: latest, generator_instances: 2}",
        )
    )
    emit_repository([(1, engine_from(loaded, tmp_path / "e3"))], tmp_path / "r3")
    assert groups(read_config(tmp_path / "r3" / gen)) == [("KIND_GPU", 1, [0]), ("KIND_GPU", 1, [2])]


@no_gpu_only
def test_serving_a_cuda_repository_without_a_gpu(tmp_path):
    pytest.importorskip("tritonclient.grpc")
    from bpcompile.serving.emit import emit_repository, read_config, set_device

    e = engine_from(load_recipe(tiny_recipe(tmp_path)), tmp_path / "e")
    repo = tmp_path / "repo"
    emit_repository([(1, e)], repo)
    gen = repo / "tensorrt_llm" / "config.pbtxt"
    before = gen.read_text()
    with pytest.raises(UserError, match="no CUDA device: this engine was built for runtime.device cuda.*--device cpu"):
        set_device(repo)
    assert gen.read_text() == before
    # the CLI says the same, exit 2, before any server starts
    r = CliRunner().invoke(main, ["serve", str(repo)])
    assert r.exit_code == 2 and "no CUDA device" in r.output, r.output
    # --device cpu re-places the generator on CPU instances; auto resolves to the CPU here
    assert set_device(repo, "cpu")["changed"]
    g = read_config(gen)
    assert groups(g) == [("KIND_CPU", 1, [])] and g.parameters["device"].string_value == "cpu"
    out = set_device(repo, "auto")
    assert out["device"] == "cpu" and groups(read_config(gen)) == [("KIND_CPU", 1, [])]
    assert not set_device(repo)["changed"]  # the repository's own setting (auto now) again: nothing to do


@no_gpu_only
def test_validate_and_generate_say_what_a_cuda_recipe_needs(tmp_path):
    f = tiny_recipe(tmp_path, parallel="parallel: {tp: 2, pp: 1}")
    r = CliRunner().invoke(main, ["validate", str(f)])
    assert r.exit_code == 0, r.output
    # what it would use, by bpcompile plan's figures, and that this machine cannot run it
    assert "runtime.device cuda: the engine runs at tp 2 on 2 GPUs, per GPU" in r.output
    assert "GB usable on an H200" in r.output and "no CUDA device on this machine" in r.output
    # a CPU recipe still validates silently
    (tmp_path / "cpu").mkdir()
    r = CliRunner().invoke(main, ["validate", str(tiny_recipe(tmp_path / "cpu", runtime="{device: cpu}"))])
    assert r.exit_code == 0 and "warning" not in r.output, r.output

    e = engine_from(load_recipe(f), tmp_path / "e")
    # what a build records, so the version passes its check before loading: each file's size and sha256
    files = [p for p in e.rglob("*") if p.is_file() and p.name != "manifest.json"]
    arts = {
        str(p.relative_to(e)): {"bytes": p.stat().st_size, "sha256": sha256(p.read_bytes()).hexdigest()} for p in files
    }
    m = json.loads((e / "manifest.json").read_text())
    (e / "manifest.json").write_text(json.dumps({**m, "artifacts": arts}))
    r = CliRunner().invoke(main, ["generate", str(e), "--prompt", "hello"])
    assert r.exit_code == 2 and "no CUDA device: this engine was built for runtime.device cuda" in r.output, r.output
    assert "--device cpu" in r.output


def test_validate_refuses_for_cuda_what_the_kernels_cannot_read(tmp_path):
    """On CUDA the Triton kernels are the attention: validate names each KV setting whose feature the support table
    (bpcompile.core.kv_support) says they do not read, and a cache shape they cannot take; the CPU, whose PyTorch
    path reads every feature, keeps the same plan valid."""
    from bpcompile.core.kv_support import takes

    kv = (
        "kv_cache: {format: int4-fp8-outlier, recent_window: 8, int5_keys: middle, int6_keys: early, "
        "int3_values: 0.5, key_transform: klt, group_size: 64, page_size: 16}"
    )
    asked = {"exact": "recent_window", "klt5": "key_transform", "int6": "int6_keys", "int3": "int3_values"}
    refused = {key for feature, key in asked.items() if not takes("triton", feature)}
    if refused:
        with pytest.raises(UserError) as e:
            load_recipe(tiny_recipe(tmp_path, kv_cache=kv))
        for key in refused:
            assert f"kv_cache.{key}: runtime.device cuda" in str(e.value), (key, str(e.value))
    else:
        assert load_recipe(tiny_recipe(tmp_path, kv_cache=kv)).recipe.kv_cache.key_transform == "klt"
    (tmp_path / "cpu").mkdir()
    cpu = load_recipe(tiny_recipe(tmp_path / "cpu", runtime="{device: cpu}", kv_cache=kv)).recipe.kv_cache
    assert (cpu.recent_window, cpu.key_transform, cpu.int6_keys) == (8, "klt", "early")
    # a group of 48 in a head of 64: the kernels' tiles need a power of two dividing the head size
    shape = "kv_cache: {format: int4-fp8-outlier, recent_window: 0, group_size: 48, page_size: 16}"
    (tmp_path / "shape").mkdir()
    with pytest.raises(UserError, match="runtime.device cuda: the GPU's Triton kernels cannot take this cache: group"):
        load_recipe(tiny_recipe(tmp_path / "shape", kv_cache=shape))


def test_the_runtime_on_cuda_refuses_a_cache_the_kernels_cannot_take():
    """kernels_for decides per device type (a CPU store with a CUDA device object is enough to ask it): on CUDA a
    cache the kernels cannot take is an error naming why, never a quiet PyTorch fallback; on the CPU the PyTorch
    path reads it, as before."""
    from bpcompile.runtime.kvcache import KVPlan, QuantKVStore
    from bpcompile.runtime.paged_kv import kernels_for

    odd = KVPlan("int4-fp8-outlier", 1, 1, 48, 16, [{"k": ["int4"], "v": ["int4"]}])  # head size 48
    with pytest.raises(UserError, match="cannot read this KV plan \\(head_size 48 is not a power of two"):
        kernels_for(QuantKVStore(odd, 2, 16), torch.device("cuda"))
    assert kernels_for(QuantKVStore(odd, 2, 16), torch.device("cpu")) is None


def test_a_recipe_without_runtime_device_keeps_the_cpu(tmp_path):
    d = tmp_path / "e"
    d.mkdir()
    write_engine_config(d)
    assert EngineConfig.load(d).runtime.device == "cpu"


def test_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    """benchmarks/gpu_check.py --device cpu --quick: the GPU check's code on the CPU (kernels in Triton's
    interpreter) over an engine of the tiny pair whose KV plan holds a unit of every precision the kernels read."""
    import subprocess
    import sys

    import yaml

    from bpcompile.compiler.convert import convert_checkpoint
    from bpcompile.runtime.kvcache import KVPlan

    e = tmp_path / "tiny" / "1"
    for role in ("verifier", "draft"):
        convert_checkpoint(TINY / role, e / role)
    (e / "tokenizer").mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(TINY / "verifier" / f, e / "tokenizer" / f)
    recipe = {
        "name": "tiny",
        "models": {
            "verifier": {"path": str(TINY / "verifier"), "dtype": "float32"},
            "draft": {"path": str(TINY / "draft"), "dtype": "float32"},
        },
        "limits": {"max_batch_size": 8, "max_input_len": 64, "max_seq_len": 128},
        "kv_cache": {"format": "int4-fp8-outlier", "sink_tokens": 0, "recent_window": 0, "group_size": 64},
        "speculative": {"tree": "dynamic", "nodes": 4, "backoff": False},
        "runtime": {"device": "cuda"},
    }
    write_engine_config(e, **{k: v for k, v in recipe.items() if k != "models"})
    (e / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    # the verifier's 4 layers x K|V x 2 KV heads: INT4, FP8, INT8 and INT5 units in every layer
    prec = [{"k": ["int4", "fp8"], "v": ["int8", "int5"]} for _ in range(4)]
    KVPlan("int4-fp8-outlier", 4, 2, 64, 64, prec).save(e / "kv_plan")

    out = tmp_path / "report.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick"]
    r = subprocess.run(cmd + ["--engine", str(e), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["ok"] and {"int4", "fp8", "int8", "int5"} <= set(rep["kernel_precisions"])
    names = [c["check"] for c in rep["kernels"]["checks"]]
    for what in ("quantize_append D=64", "quantize_append D=128", "attention D=128 KV=2 H=4 G=6", "move_slots"):
        assert any(n.startswith(what) for n in names), (what, names)
    pair = rep["pair"]
    assert pair["attention"] == "Triton kernels"  # the interpreter's, not the PyTorch path
    assert pair["vs_cpu_fp32_reference"]["prompts"] == 1
    assert pair["speculation_vs_verifier_only"]["identical"] == 1
    speed = pair["decode_tokens_per_s"]
    for k in ("runtime_verifier_only", "runtime_speculative", "transformers_generate"):
        assert speed[k]["batch_1"] > 0 and speed[k]["batch_8"] > 0, speed
    assert next(iter(pair["peak_memory_bytes"].values())) > pair["plan_predicts"]["weights_bytes"] > 0
    graphs = pair["cuda_graphs"]  # the static step (eager on CPU) from the plan's buffers, through the kernels
    assert graphs["static_step"] and graphs["attention"] == "Triton kernels" and graphs["captured_graphs"] == 0
    assert graphs["on_vs_off"]["identical"] == 1 and graphs["kv"] == "the engine's"
    assert all(graphs["decode_tokens_per_s"][m]["batch_8"] > 0 for m in ("on", "off"))


@no_gpu_only
def test_validate_of_the_70b_recipe_says_what_it_would_use():
    """recipes/70b.yaml as shipped (its checkpoint paths absent here): the missing paths, and what it would run on."""
    r = CliRunner().invoke(main, ["validate", str(REPO / "recipes" / "70b.yaml")])
    assert r.exit_code == 2 and "checkpoint directory does not exist" in r.output, r.output
    assert "runtime.device cuda: the engine would run at tp 8 on 8 GPUs; no CUDA device on this machine" in r.output
