"""The exported step graphs: built into a tiny engine version, checked by onnx (checker, strict shape inference),
holding the plugin nodes with the C++ creators' fields, and run by ONNX Runtime (the custom ops as
onnxruntime-extensions Python ops) to the same greedy tokens as the torch executor, speculation on, for the
engine's calibrated INT4/FP8 plan and for an FP16 cache. `target: tensorrt` without TensorRT refuses (exit 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime_extensions")

import torch  # noqa: E402

from bpcompile.cli import main  # noqa: E402
from bpcompile.compiler.onnx_export import export_generator  # noqa: E402
from bpcompile.runtime import plugin_ops as ops  # noqa: E402
from bpcompile.runtime.generator import Generator, SamplingParams  # noqa: E402
from bpcompile.runtime.kvcache import KVPlan, kv_store_factory  # noqa: E402
from bpcompile.runtime.model import Llama  # noqa: E402
from bpcompile.runtime.paged_kv import float_store_factory  # noqa: E402
from bpcompile.runtime.speculative import TreeSpec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"
CPP = REPO / "plugins" / "trt" / "src" / "bpcompile_plugins.cpp"


def tiny_recipe(d: Path, **extra: str) -> Path:
    text = (REPO / "recipes" / "tiny.yaml").read_text().replace("../models/tiny", str(TINY))
    text = text.replace("store: ../engines", f"store: {d / 'engines'}").replace(
        "triton_repo: ../triton_repo", f"triton_repo: {d / 'triton_repo'}"
    )
    text = text.replace("triton: {emit: true", "triton: {emit: false").replace("compile: true", "compile: false")
    for k, v in extra.items():
        text = (
            re.sub(rf"^{k}:.*$", f"{k}: {v}", text, flags=re.M)
            if re.search(rf"^{k}:", text, re.M)
            else text + f"{k}: {v}\n"
        )
    (d / "tiny.yaml").write_text(text)
    return d / "tiny.yaml"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    if not (TINY / "verifier" / "model.safetensors").is_file():
        pytest.skip("the shipped tiny pair is not present")
    d = tmp_path_factory.mktemp("onnx")
    res = CliRunner().invoke(main, ["build", str(tiny_recipe(d, runtime="{onnx: true}")), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    stage = {s["name"]: s for s in out["stages"]}["export onnx"]
    assert stage["status"] == "ran", stage
    return Path(out["path"])


def cpp_creators() -> dict[str, tuple[str, ...]]:
    """Plugin name -> its creator's fields, as the C++ declares them (field lists, plus sm_scale when the
    creator is made with scale = true)."""
    src = CPP.read_text()
    lists = {
        m[1]: tuple(re.findall(r'"(\w+)"', m[2]))
        for m in re.finditer(r"std::vector<std::string> const (\w+)\s*=\s*\{([^}]*)\}", src)
    }
    out = {}
    for name, fields, scale in re.findall(r'Creator<\w+> \w+\("(\w+)", (\w+), (true|false)\)', src):
        out[name] = lists[fields] + (("sm_scale",) if scale == "true" else ())
    return out


def test_graphs_pass_onnx_checks_and_hold_the_plugin_nodes(engine):
    L = {"verifier": 4, "draft": 1}
    creators = cpp_creators()
    assert set(creators) == {ops.QUANT_APPEND, ops.QUANT_ATTENTION}
    seen = set()
    for role in ("verifier", "draft"):
        for kind in ("prefill", "step"):
            path = engine / "onnx" / role / f"{kind}.onnx"
            onnx.checker.check_model(str(path), full_check=True)
            m = onnx.load(str(path))
            onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True, data_prop=True)
            assert (path.parent / f"{kind}.weights").stat().st_size > 1e6  # weights as external data
            custom = [n for n in m.graph.node if n.domain == ops.DOMAIN]
            counts = {}
            for n in custom:
                counts[n.op_type] = counts.get(n.op_type, 0) + 1
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
                assert attrs.pop("plugin_namespace") == b"bpcompile" and attrs.pop("plugin_version") == b"1"
                assert set(attrs) == set(ops.FIELDS[n.op_type])
                if n.op_type in creators:  # the attributes TensorRT hands the creator are exactly its fields
                    assert set(attrs) == set(creators[n.op_type]), (n.op_type, attrs, creators[n.op_type])
                seen.add(n.op_type)
            quant = role == "verifier"  # the engine's plan quantizes the verifier's cache; the draft's is float
            append = ops.QUANT_APPEND if quant else ops.FLOAT_APPEND
            attention = ops.QUANT_ATTENTION if quant else ops.FLOAT_ATTENTION
            assert counts.get(append) == L[role]
            if kind == "step":  # attention is the plugin node, not decomposed: no softmax anywhere in the graph
                assert counts.get(attention) == L[role]
                assert not [n for n in m.graph.node if n.op_type == "Softmax"]
    assert seen == set(ops.FIELDS)


def generators(engine: Path, executor_graphs: Path, fp16: bool):
    """A torch-executor Generator and an onnxruntime one over the same models and cache configuration (small
    limits: the Python-op bridge copies the pools on every call)."""
    v, d = Llama.from_checkpoint(engine / "verifier"), Llama.from_checkpoint(engine / "draft")
    factory = float_store_factory(torch.float16) if fp16 else kv_store_factory(KVPlan.load(engine / "kv_plan"))
    kw = dict(max_batch_size=4, max_seq_len=96, kv_store_factory=factory, backoff=False)
    tree = TreeSpec("dynamic", nodes=5)
    ref = Generator(v, d, tree, **kw)
    if fp16:
        export_generator(ref, executor_graphs)
    return ref, Generator(v, d, tree, executor="onnxruntime", graphs=executor_graphs, **kw)


PROMPTS = [
    "The import statement",
    "def fibonacci(n):",
    "Exceptions are raised when",
    "A class is",
    "for x in",
    "The with statement",
    "Lists are mutable",
    "print(",
    "Modules can be",
    "try:",
    "import os",
    "while True",
    "Dictionaries map",
    "The yield keyword",
    "Strings are",
    "return None",
    "lambda x:",
    "class Foo:",
    "Integers and floats",
    "The global statement",
]


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["plan", "fp16"])
def test_onnxruntime_executor_matches_torch(engine, tmp_path, cache):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine / "tokenizer" / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS]
    graphs = tmp_path / "graphs" if cache == "fp16" else engine / "onnx"
    ref, ort = generators(engine, graphs, fp16=cache == "fp16")
    params = SamplingParams(max_tokens=32)
    want, got = ref.generate(prompts, params), ort.generate(prompts, params)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(len(t) == 32 for t, _ in want)
    # the trees were drafted and verified through the graphs: draft tokens were accepted
    assert sum(sum(s.accepted_per_depth) for _, s in got) > 0 and ort.forwards["draft"] > 0


def test_generate_cli_runs_the_engine_graphs(engine):
    args = ["generate", str(engine), "--prompt", "The import statement", "--max-tokens", "8", "--raw", "--json"]
    a = CliRunner().invoke(main, args)
    b = CliRunner().invoke(main, args + ["--executor", "onnxruntime"])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert (ja["executor"], jb["executor"]) == ("torch", "onnxruntime")
    assert ja["tokens"] == jb["tokens"] and len(ja["tokens"]) == 8


def test_onnxruntime_executor_without_graphs_is_a_clear_error(tmp_path, engine):
    import shutil

    copy = tmp_path / "v"
    shutil.copytree(engine, copy, ignore=shutil.ignore_patterns("onnx"))
    # the manifest records the graphs: a version that lost them fails verification, naming the first missing one
    res = CliRunner().invoke(main, ["generate", str(copy), "--prompt", "x", "--executor", "onnxruntime"])
    assert res.exit_code == 2 and "prefill.onnx is missing" in res.output, res.output
    # past verification, the executor itself says which recipe key exports them
    cmd = ["generate", str(copy), "--prompt", "x", "--executor", "onnxruntime", "--no-verify"]
    res = CliRunner().invoke(main, cmd)
    assert res.exit_code == 2 and "runtime.onnx" in res.output, res.output


def test_target_tensorrt_without_tensorrt_exits_2_and_publishes_nothing(tmp_path):
    if not (TINY / "verifier" / "model.safetensors").is_file():
        pytest.skip("the shipped tiny pair is not present")
    res = CliRunner().invoke(main, ["build", str(tiny_recipe(tmp_path, target="tensorrt"))])
    assert res.exit_code == 2, res.output
    assert "trtexec --onnx=" in res.output and "--dynamicPlugins=" in res.output
    store = tmp_path / "engines"
    assert not store.exists() or not [p for p in store.rglob("*") if p.is_dir() and p.name != ".locks"]


@pytest.mark.server
def test_triton_generator_runs_the_graphs(engine, tmp_path):
    """A version whose engine.json says runtime.executor: onnxruntime is served by tritonserver's generator
    through the exported graphs: the same tokens as the torch executor in process."""
    import shutil

    pytest.importorskip("pytriton")
    from conftest import update_engine_config

    from bpcompile.serving.client import generate_remote
    from bpcompile.serving.emit import emit_repository
    from bpcompile.serving.serve import ServerProcess

    copy = tmp_path / "store" / "tiny" / "1"
    shutil.copytree(engine, copy)
    update_engine_config(copy, runtime={"executor": "onnxruntime", "onnx": True})
    emit_repository([(1, copy)], tmp_path / "repo")
    res = CliRunner().invoke(
        main,
        ["generate", str(copy), "--prompt", PROMPTS[0], "--max-tokens", "6", "--raw", "--executor", "torch", "--json"],
    )
    assert res.exit_code == 0, res.output
    with ServerProcess(tmp_path / "repo", log_file=tmp_path / "server.log", startup_timeout=240) as s:
        got = generate_remote(s.grpc_url, PROMPTS[0], 6)
        assert "executor onnxruntime" in s.log_tail(400)
    assert got["token_ids"] == json.loads(res.stdout)["tokens"] and got["verifier_steps"] >= 1
