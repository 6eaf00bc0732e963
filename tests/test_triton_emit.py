"""The emitted repository, without a server: configs parse with Triton's own schema, the ensemble is wired,
versions are added without touching what is served, and the streamed-text contract telescopes."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc")

from conftest import write_engine_config  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from bpcompile.core.errors import UserError  # noqa: E402
from bpcompile.serving import emit
from bpcompile.serving.emit import add_version, emit_repository, mc, publish_version, read_config, set_version_policy  # noqa: E402
from bpcompile.serving.protocol import context_window, delta_text, pack_words, unpack_words  # noqa: E402

TINY_TOK = Path(__file__).resolve().parents[1] / "models" / "tiny" / "verifier"
MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing")


def engine_dir(root: Path, version: int, target: str = "native", **recipe) -> Path:
    """An engine version's layout (what emit reads and copies); the checkpoints are stand-in files because
    nothing here loads them (tests/test_serving.py serves real ones)."""
    d = root / str(version)
    for sub in ("verifier", "draft"):
        (d / sub).mkdir(parents=True)
        (d / sub / "config.json").write_text("{}")
    (d / "tokenizer").mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(TINY_TOK / f, d / "tokenizer" / f)
    r = {
        "name": "tiny",
        "target": target,
        "limits": {"max_batch_size": 16, "max_input_len": 384, "max_seq_len": 512},
        "speculative": {"tree": "dynamic", "nodes": 5},
        "triton": {"version_policy": "latest", "generator_instances": 1},
    }
    r.update(recipe)
    write_engine_config(d, **r)
    (d / "manifest.json").write_text(json.dumps({"name": "tiny", "version": version, "build_id": f"b{version}"}))
    return d


@pytest.fixture
def repo(tmp_path):
    e = engine_dir(tmp_path / "engines", 1)
    emit_repository([(1, e)], tmp_path / "repo")
    return tmp_path / "repo"


def configs(repo: Path) -> dict[str, mc.ModelConfig]:
    return {m: read_config(repo / m / "config.pbtxt") for m in MODELS}


def check_wiring(cfgs: dict[str, mc.ModelConfig]) -> None:
    """What Triton's ensemble validator demands: each step's maps name real tensors of its model with matching
    types; every ensemble input is used; every tensor has one producer that runs before its consumers; every
    ensemble output is produced."""
    ens = cfgs["ensemble"]
    types = {i.name: i.data_type for i in ens.input}
    used = set()
    producers: dict[str, str] = {}
    for step in ens.ensemble_scheduling.step:
        m = cfgs[step.model_name]
        assert step.model_version == -1
        assert m.max_batch_size >= ens.max_batch_size
        m_in = {i.name: i for i in m.input}
        m_out = {o.name: o for o in m.output}
        for key, tensor in step.input_map.items():
            assert key in m_in, (step.model_name, key)
            assert tensor in types, f"{tensor} consumed by {step.model_name} before anything produced it"
            assert types[tensor] == m_in[key].data_type, (step.model_name, key)
            used.add(tensor)
        for name, i in m_in.items():
            assert i.optional or name in step.input_map, f"required {step.model_name}.{name} is not fed"
        for key, tensor in step.output_map.items():
            assert key in m_out, (step.model_name, key)
            assert tensor not in producers and tensor not in {i.name for i in ens.input}, tensor
            producers[tensor] = step.model_name
            types[tensor] = m_out[key].data_type
    assert {i.name for i in ens.input} <= used, {i.name for i in ens.input} - used
    for o in ens.output:
        assert o.name in producers and types[o.name] == o.data_type, o.name
    internal = set(producers) - {o.name for o in ens.output}
    assert internal <= used, f"produced but never consumed: {internal - used}"


def test_every_config_parses_and_round_trips(repo):
    from google.protobuf import text_format

    for m, cfg in configs(repo).items():
        assert cfg.name == m
        text = (repo / m / "config.pbtxt").read_text()
        assert text_format.MessageToString(cfg) == text  # written from the message, nothing else


def test_native_repository_layout_and_semantics(repo):
    cfgs = configs(repo)
    check_wiring(cfgs)
    g, post = cfgs["tensorrt_llm"], cfgs["postprocessing"]
    assert g.backend == "python" and g.model_transaction_policy.decoupled
    assert cfgs["ensemble"].platform == "ensemble" and not cfgs["ensemble"].instance_group
    assert [i.count for i in post.instance_group] == [1]  # response order (emit.py)
    assert g.version_policy.latest.num_versions == 1
    names = {i.name for i in cfgs["ensemble"].input}
    assert {
        "text_input",
        "max_tokens",
        "stream",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "end_id",
        "stop_words",
        "bad_words",
    } <= names
    outs = {o.name for o in cfgs["ensemble"].output}
    assert {
        "text_output",
        "acceptance_rate",
        "total_accepted_draft_tokens",
        "total_draft_tokens",
        "tokens_per_step",
    } <= outs
    for m in ("preprocessing", "tensorrt_llm", "postprocessing"):
        assert (repo / m / "1" / "model.py").is_file()
    assert (repo / "tensorrt_llm" / "1" / "engine" / "verifier" / "config.json").is_file()  # a copy
    assert not (repo / "tensorrt_llm" / "1" / "engine").is_symlink()
    assert (repo / "preprocessing" / "1" / "tokenizer" / "tokenizer.json").is_file()
    assert json.loads((repo / "tensorrt_llm" / "1" / "engine_source.json").read_text())["build_id"] == "b1"
    assert (repo / "ensemble" / "1").is_dir()


def test_ensemble_takes_every_input_of_the_backends_ensemble(repo):
    """tensorrtllm_backend's clients send its ensemble's inputs: every one (the checked-in table transcribed from
    the backend's config.pbtxt) is declared by the emitted ensemble with the same type and dims, and reaches the
    generator (check_wiring: every ensemble input is consumed)."""
    table = json.loads((Path(__file__).parent / "data" / "tensorrtllm_backend_ensemble.json").read_text())
    ens = configs(repo)["ensemble"]
    got = {i.name: (mc.DataType.Name(i.data_type), list(i.dims)) for i in ens.input}
    missing = [t["name"] for t in table["inputs"] if t["name"] not in got]
    assert not missing, missing
    for t in table["inputs"]:
        assert got[t["name"]] == (t["data_type"], t["dims"]), t["name"]
    check_wiring(configs(repo))


def test_ensemble_has_every_output_of_the_backends_ensemble(repo, tmp_path):
    """Its clients request the backend ensemble's outputs by name (end_to_end_grpc_client.py: sequence_index with
    -n, batch_index with --batch-inputs, the KV blocks and timestamps with --return-perf-metrics); tritonserver
    refuses a request for an output the ensemble does not declare. Every one of them (transcribed from its
    config.pbtxt) is declared with the same type and dims and produced by a step (check_wiring), for both targets;
    the ones tensorrt_llm makes come from the generator under the same name."""
    table = json.loads((Path(__file__).parent / "data" / "tensorrtllm_backend_ensemble.json").read_text())
    e = engine_dir(tmp_path / "trtllm-engines", 1, target="tensorrt-llm")
    emit_repository([(1, e)], tmp_path / "trtllm-repo")
    for r in (repo, tmp_path / "trtllm-repo"):
        cfgs = configs(r)
        got = {o.name: (mc.DataType.Name(o.data_type), list(o.dims)) for o in cfgs["ensemble"].output}
        missing = [t["name"] for t in table["outputs"] if t["name"] not in got]
        assert not missing, (r.name, missing)
        for t in table["outputs"]:
            assert got[t["name"]] == (t["data_type"], t["dims"]), (r.name, t["name"])
        check_wiring(cfgs)
        gen_step = next(s for s in cfgs["ensemble"].ensemble_scheduling.step if s.model_name == "tensorrt_llm")
        for name in ("batch_index", "sequence_index", "arrival_time_ns", "kv_cache_reused_blocks", "context_logits"):
            assert gen_step.output_map[name] == name, (r.name, name)


def test_decoupled_is_a_deployment_choice(tmp_path):
    """triton.decoupled (default true) sets the generator's transaction policy, and with it the ensemble's
    (tritonserver makes an ensemble decoupled when a step is); emit's decoupled overrides the recipe. The C++
    backend's config gets it as its decoupled_mode parameter too."""
    e = engine_dir(tmp_path / "e", 1)
    emit_repository([(1, e)], tmp_path / "default")
    assert configs(tmp_path / "default")["tensorrt_llm"].model_transaction_policy.decoupled
    emit_repository([(1, e)], tmp_path / "unary", decoupled=False)
    cfgs = configs(tmp_path / "unary")
    assert not cfgs["tensorrt_llm"].model_transaction_policy.decoupled
    assert not any(cfgs[m].model_transaction_policy.decoupled for m in MODELS)
    check_wiring(cfgs)
    assert json.loads((tmp_path / "unary" / emit.SUMMARY).read_text())["decoupled"] is False
    e2 = engine_dir(
        tmp_path / "e2", 1, triton={"version_policy": "latest", "generator_instances": 1, "decoupled": False}
    )
    emit_repository([(1, e2)], tmp_path / "recipe")
    assert not configs(tmp_path / "recipe")["tensorrt_llm"].model_transaction_policy.decoupled
    emit_repository([(1, e2)], tmp_path / "flag", decoupled=True)
    assert configs(tmp_path / "flag")["tensorrt_llm"].model_transaction_policy.decoupled
    e3 = engine_dir(tmp_path / "e3", 1, target="tensorrt-llm")
    emit_repository([(1, e3)], tmp_path / "trtllm", decoupled=False)
    g = read_config(tmp_path / "trtllm" / "tensorrt_llm" / "config.pbtxt")
    assert not g.model_transaction_policy.decoupled and g.parameters["decoupled_mode"].string_value == "false"


def test_generator_is_the_backends_tensorrt_llm_model(repo):
    """tensorrtllm_backend's repository has models ensemble, preprocessing, tensorrt_llm and postprocessing; its
    clients talk to tensorrt_llm directly with its inputs and read its outputs. Every one of them (the checked-in
    table transcribed from its config.pbtxt) is declared by the emitted tensorrt_llm model with the same type and
    dims."""
    table = json.loads((Path(__file__).parent / "data" / "tensorrtllm_backend_tensorrt_llm.json").read_text())
    assert set(table["repository_models"]) <= {p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file()}
    g = configs(repo)[table["model"]]
    assert g.name == table["model"] and g.model_transaction_policy.decoupled
    for kind, declared in (("inputs", g.input), ("outputs", g.output)):
        got = {i.name: (mc.DataType.Name(i.data_type), list(i.dims)) for i in declared}
        missing = [t["name"] for t in table[kind] if t["name"] not in got]
        assert not missing, (kind, missing)
        for t in table[kind]:
            assert got[t["name"]] == (t["data_type"], t["dims"]), (kind, t["name"])
    assert all(i.optional for i in g.input)  # each interface sends a subset


def test_a_repository_of_an_earlier_layout_is_refused(repo, tmp_path):
    """Repositories emitted before the generating model took the backend's name had it as `generator`."""
    shutil.move(repo / "tensorrt_llm", repo / "generator")
    with pytest.raises(UserError, match="earlier bpcompile"):
        emit_repository([(2, engine_dir(tmp_path / "engines", 2))], repo)


def test_broken_wiring_is_detected(repo):
    """The wiring check itself can fail: drop a mapping and it must say so."""
    cfgs = configs(repo)
    step = cfgs["ensemble"].ensemble_scheduling.step[2]
    del step.input_map["READ_OFFSET"]
    with pytest.raises(AssertionError):
        check_wiring(cfgs)


def test_tensorrt_llm_target(tmp_path):
    e = engine_dir(tmp_path / "engines", 3, target="tensorrt-llm")
    repo = tmp_path / "repo"
    emit_repository([(3, e)], repo)
    cfgs = configs(repo)
    check_wiring(cfgs)
    g = cfgs["tensorrt_llm"]
    p = {k: v.string_value for k, v in g.parameters.items()}
    assert g.backend == "tensorrtllm" and g.model_transaction_policy.decoupled
    assert p["gpt_model_type"] == "inflight_fused_batching"
    assert p["gpt_model_path"] == "tensorrt_llm/3/engine/trtllm/verifier"  # relative to the repository
    assert float(p["kv_cache_free_gpu_mem_fraction"]) == 0.9
    assert p["batch_scheduler_policy"] in ("guaranteed_no_evict", "max_utilization")
    assert p["decoupled_mode"] == "true" and p["max_beam_width"] == "1"
    ids = next(i for i in g.input if i.name == "input_ids")
    assert ids.allow_ragged_batch
    assert next(i for i in g.input if i.name == "request_output_len").HasField("reshape")
    assert {"output_ids", "sequence_length", "acceptance_rate"} <= {o.name for o in g.output}
    assert cfgs["postprocessing"].parameters["input_format"].string_value == "trtllm"
    # a new version re-points the engine path (the C++ backend ignores version directories)
    add_version(repo, 4, engine_dir(tmp_path / "engines", 4, target="tensorrt-llm"))
    g = read_config(repo / "tensorrt_llm" / "config.pbtxt")
    assert g.parameters["gpt_model_path"].string_value == "tensorrt_llm/4/engine/trtllm/verifier"


def _trtllm_engine(root: Path, version: int) -> Path:
    """A target tensorrt-llm version with a chain draft, and stand-ins for its two trtllm-build outputs."""
    e = engine_dir(
        root, version, target="tensorrt-llm", speculative={"tree": "chain", "length": 4}, kv_cache={"format": "fp8"}
    )
    for role in ("verifier", "draft"):
        (e / "trtllm" / role).mkdir(parents=True)
        (e / "trtllm" / role / "config.json").write_text("{}")
    return e


def test_tensorrt_llm_draft_target_pair_is_wired_as_the_backend_wires_it(tmp_path, monkeypatch):
    """The draft-target pair as tensorrtllm_backend serves it: tensorrt_llm (verifier engine) and tensorrt_llm_draft
    (draft engine), non-decoupled with KV reuse, and its tensorrt_llm_bls model (decoupled; its own model.py and lib/
    copied from the backend's installation: a stand-in directory here, the backend's code is not in this
    repository). Every tensor the BLS sends to preprocessing, both engines and postprocessing, and every output it
    requests by name (a table transcribed from its triton_decoder.py) is declared by that model; the engine paths
    are relative to the repository and exist there; no config holds an absolute path; the copied repository is
    the same."""
    monkeypatch.delenv("BPCOMPILE_TRTLLM_BLS_DIR", raising=False)
    e = _trtllm_engine(tmp_path / "engines", 3)
    with pytest.raises(UserError, match="BPCOMPILE_TRTLLM_BLS_DIR"):
        emit_repository([(3, e)], tmp_path / "none")
    bls = tmp_path / "backend_bls"
    (bls / "lib").mkdir(parents=True)
    (bls / "model.py").write_text("# stand-in for tensorrtllm_backend's tensorrt_llm_bls/1/model.py\n")
    (bls / "lib" / "decode.py").write_text("# stand-in\n")
    repo = tmp_path / "repo"
    out = emit_repository([(3, e)], repo, bls_source=bls)
    assert set(out["models"]) == {
        "ensemble",
        "preprocessing",
        "tensorrt_llm",
        "tensorrt_llm_draft",
        "tensorrt_llm_bls",
        "postprocessing",
    }
    cfgs = {m: read_config(repo / m / "config.pbtxt") for m in out["models"]}
    check_wiring(cfgs)
    assert (repo / "tensorrt_llm_bls" / "3" / "model.py").is_file() and (
        repo / "tensorrt_llm_bls" / "3" / "lib"
    ).is_dir()
    assert (repo / "tensorrt_llm_draft" / "3").is_dir()
    table = json.loads((Path(__file__).parent / "data" / "tensorrtllm_backend_bls_calls.json").read_text())
    b = cfgs["tensorrt_llm_bls"]
    params = {k: v.string_value for k, v in b.parameters.items()}
    assert b.backend == "python" and b.model_transaction_policy.decoupled
    assert {i.name for i in b.input} >= {"text_input", "max_tokens", "num_draft_tokens", "use_draft_logits", "stream"}
    called = {params[k]: v for k, v in table["parameters"].items()}
    assert set(called) == {"tensorrt_llm", "tensorrt_llm_draft"} <= set(cfgs)
    for model in ("preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_draft"):
        spec = table["calls"][model if model in table["calls"] else "tensorrt_llm_model_name"]
        declared_in = {i.name for i in cfgs[model].input}
        declared_out = {o.name for o in cfgs[model].output}
        assert not set(spec["sends"]) - declared_in, (model, set(spec["sends"]) - declared_in)
        assert not set(spec["requests"]) - declared_out, (model, set(spec["requests"]) - declared_out)
    for model, role in (("tensorrt_llm", "verifier"), ("tensorrt_llm_draft", "draft")):
        g = cfgs[model]
        p = {k: v.string_value for k, v in g.parameters.items()}
        assert g.backend == "tensorrtllm" and not g.model_transaction_policy.decoupled
        assert p["enable_kv_cache_reuse"] == "true" and p["decoupled_mode"] == "false"
        assert p["gpt_model_path"] == f"tensorrt_llm/3/engine/trtllm/{role}"
        assert (repo / p["gpt_model_path"] / "config.json").is_file()
    for m, c in cfgs.items():
        for k, v in c.parameters.items():
            assert not v.string_value.startswith("/"), (m, k, v.string_value)
    # a new version re-points both engines; the copy of the repository elsewhere reads the same
    add_version(repo, 4, _trtllm_engine(tmp_path / "engines", 4), bls_source=bls)
    for model, role in (("tensorrt_llm", "verifier"), ("tensorrt_llm_draft", "draft")):
        path = read_config(repo / model / "config.pbtxt").parameters["gpt_model_path"].string_value
        assert path == f"tensorrt_llm/4/engine/trtllm/{role}" and (repo / path / "config.json").is_file()
    shutil.copytree(repo, tmp_path / "elsewhere", symlinks=True)
    path = read_config(tmp_path / "elsewhere" / "tensorrt_llm" / "config.pbtxt").parameters["gpt_model_path"]
    assert (tmp_path / "elsewhere" / path.string_value / "config.json").is_file()


def test_multi_rank_tensorrt_llm_engines_are_launched_one_server_per_rank(tmp_path, monkeypatch):
    """tp x pp > 1: tritonserver once per rank under mpirun, as tensorrtllm_backend's launch script does it (rank 0
    serves; the others load only the TensorRT-LLM models; a shared-memory prefix per rank). Where mpirun is missing,
    serve refuses before starting anything."""
    from bpcompile.core.errors import MissingDependency
    from bpcompile.serving.serve import mpi_command, server_command, trtllm_world

    e = _trtllm_engine(tmp_path / "engines", 1)
    write_engine_config(e, **{**json.loads((e / "engine.json").read_text()), "parallel": {"tp": 2, "pp": 1}})
    repo = tmp_path / "repo"
    emit_repository([(1, e)], repo, bls_source=_stand_in_bls(tmp_path))
    assert trtllm_world(repo) == (2, ["tensorrt_llm", "tensorrt_llm_draft"])
    cmd = ["tritonserver", f"--model-repository={repo}", "--http-port=1", "--model-control-mode=none"]
    m = mpi_command(cmd, 2, ["tensorrt_llm", "tensorrt_llm_draft"])
    assert m[:2] == ["mpirun", "--allow-run-as-root"] and m.count(":") == 1 and m.count("-n") == 2
    rank0, rank1 = " ".join(m).split(" : ")
    assert "--model-control-mode=none" in rank0 and "prefix0_" in rank0 and "--load-model" not in rank0
    assert "--model-control-mode=explicit" in rank1 and "--model-control-mode=none" not in rank1
    assert "--load-model=tensorrt_llm --load-model=tensorrt_llm_draft" in rank1 and "prefix1_" in rank1
    assert f"--model-repository={repo}" in rank1 and "--http-port=1" in rank1
    pytest.importorskip("pytriton")  # the bundled tritonserver; no mpirun on the emptied PATH
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(MissingDependency, match="mpirun is not on PATH"):
        server_command(repo, tmp_path / "run")


def _stand_in_bls(tmp_path: Path) -> Path:
    bls = tmp_path / "backend_bls"
    bls.mkdir(exist_ok=True)
    (bls / "model.py").write_text("# stand-in for tensorrtllm_backend's tensorrt_llm_bls/1/model.py\n")
    return bls


def test_preprocessing_declares_the_backends_interface(repo):
    """Its BLS (and ensemble) address tensorrtllm_backend's preprocessing by tensor name: every input and output
    of the backend's preprocessing/config.pbtxt (transcribed below) is declared with the same type."""
    backend = {
        "inputs": {
            "QUERY": "TYPE_STRING",
            "DECODER_QUERY": "TYPE_STRING",
            "IMAGE_BYTES": "TYPE_UINT8",
            "IMAGE_URL": "TYPE_STRING",
            "IMAGES": "TYPE_STRING",
            "VIDEO_BYTES": "TYPE_UINT8",
            "REQUEST_OUTPUT_LEN": "TYPE_INT32",
            "BAD_WORDS_DICT": "TYPE_STRING",
            "STOP_WORDS_DICT": "TYPE_STRING",
            "EMBEDDING_BIAS_WORDS": "TYPE_STRING",
            "EMBEDDING_BIAS_WEIGHTS": "TYPE_FP32",
            "END_ID": "TYPE_INT32",
            "PAD_ID": "TYPE_INT32",
            "PROMPT_TABLE_EXTRA_ID": "TYPE_UINT64",
        },
        "outputs": {
            "INPUT_ID": "TYPE_INT32",
            "REQUEST_INPUT_LEN": "TYPE_INT32",
            "DECODER_INPUT_ID": "TYPE_INT32",
            "REQUEST_DECODER_INPUT_LEN": "TYPE_INT32",
            "BAD_WORDS_IDS": "TYPE_INT32",
            "STOP_WORDS_IDS": "TYPE_INT32",
            "EMBEDDING_BIAS": "TYPE_FP32",
            "REQUEST_OUTPUT_LEN": "TYPE_INT32",
            "OUT_END_ID": "TYPE_INT32",
            "OUT_PAD_ID": "TYPE_INT32",
            "OUT_PROMPT_TABLE_EXTRA_IDS": "TYPE_UINT64",
            "PIXEL_VALUES": "TYPE_FP16",
            "ASPECT_RATIO_IDS": "TYPE_INT64",
            "ASPECT_RATIO_MASK": "TYPE_INT64",
            "CROSS_ATTENTION_MASK": "TYPE_INT64",
            "IMAGE_SIZES": "TYPE_INT64",
            "IS_VIDEO_INPUT": "TYPE_BOOL",
            "ATTENTION_MASK": "TYPE_INT64",
            "IMAGE_GRID_THW": "TYPE_INT64",
            "VISION_INPUT_ID": "TYPE_INT32",
        },
    }
    pre = configs(repo)["preprocessing"]
    for kind, declared in (("inputs", pre.input), ("outputs", pre.output)):
        got = {i.name: mc.DataType.Name(i.data_type) for i in declared}
        assert {k: got.get(k) for k in backend[kind]} == backend[kind], kind


def test_add_version_leaves_served_configs_alone(repo, tmp_path):
    before = {m: (repo / m / "config.pbtxt").read_bytes() for m in MODELS}
    r = add_version(repo, 2, engine_dir(tmp_path / "engines", 2))
    assert r["versions"] == [1, 2] and r["note"] is None
    assert {m: (repo / m / "config.pbtxt").read_bytes() for m in MODELS} == before
    assert not [p for m in MODELS for p in (repo / m).iterdir() if p.name.startswith(".")]  # no staging left
    with pytest.raises(UserError, match="immutable"):
        add_version(repo, 2, engine_dir(tmp_path / "again", 2))
    with pytest.raises(UserError, match="target"):
        add_version(repo, 5, engine_dir(tmp_path / "engines", 5, target="tensorrt-llm"))


def test_version_policies_and_rollback(repo, tmp_path):
    add_version(repo, 2, engine_dir(tmp_path / "engines", 2))
    set_version_policy(repo, {"specific": [1]})
    for m in ("preprocessing", "tensorrt_llm", "postprocessing"):
        assert list(read_config(repo / m / "config.pbtxt").version_policy.specific.versions) == [1]
    set_version_policy(repo, "all")
    assert read_config(repo / "tensorrt_llm" / "config.pbtxt").version_policy.HasField("all")
    set_version_policy(repo, {"latest": 2})
    assert read_config(repo / "tensorrt_llm" / "config.pbtxt").version_policy.latest.num_versions == 2
    with pytest.raises(UserError, match="does not have"):
        set_version_policy(repo, {"specific": [7]})
    with pytest.raises(UserError, match="version_policy"):
        set_version_policy(repo, "newest")


def test_emit_reads_recipe_and_refuses_overwrite(tmp_path):
    e = engine_dir(
        tmp_path / "engines",
        1,
        triton={"version_policy": {"specific": [1]}, "generator_instances": 2},
        limits={"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128},
    )
    s = emit_repository([(1, e)], tmp_path / "repo", tree={"kind": "none"})
    g = read_config(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")
    assert s["max_batch_size"] == 4 and g.max_batch_size == 4 and g.instance_group[0].count == 2
    assert list(g.version_policy.specific.versions) == [1]
    assert json.loads(g.parameters["tree"].string_value) == {"kind": "none"}
    with pytest.raises(UserError, match="already holds"):
        emit_repository([(1, e)], tmp_path / "repo")
    with pytest.raises(UserError, match="engine.json is missing"):
        emit_repository([(1, tmp_path)], tmp_path / "other")


def test_publish_version_emits_then_adds_idempotently(tmp_path):
    repo = tmp_path / "repo"
    e1, e2 = engine_dir(tmp_path / "engines", 1), engine_dir(tmp_path / "engines", 2)
    publish_version(repo, e1, 1)
    assert publish_version(repo, e1, 1)["note"] == "already present"
    assert publish_version(repo, e2, 2)["versions"] == [1, 2]


def test_emit_writes_only_into_a_directory_it_owns(tmp_path):
    e = engine_dir(tmp_path / "engines", 1)
    theirs = tmp_path / "theirs"
    (theirs / "tensorrt_llm" / "7").mkdir(parents=True)
    (theirs / "tensorrt_llm" / "7" / "model.py").write_text("# someone else's")
    with pytest.raises(UserError, match="not created by bpcompile"):
        emit_repository([(1, e)], theirs, overwrite=True)
    assert (theirs / "tensorrt_llm" / "7" / "model.py").read_text() == "# someone else's"
    assert [p.name for p in theirs.iterdir()] == ["tensorrt_llm"]
    # inside the engine store (or the store inside the repository): refused, nothing written
    for bad in (tmp_path / "engines", tmp_path / "engines" / "repo", tmp_path):
        with pytest.raises(UserError, match="overlaps the engine store"):
            emit_repository([(1, e)], bad)
    assert sorted(p.name for p in (tmp_path / "engines").iterdir()) == ["1"]
    # a repository of another engine takes no version of this one
    mine = tmp_path / "mine"
    emit_repository([(1, e)], mine)
    other = engine_dir(tmp_path / "other", 2, name="other")
    with pytest.raises(UserError, match="one engine name per repository"):
        add_version(mine, 2, other)
    assert not (mine / "tensorrt_llm" / "2").exists()


def test_bad_version_policy_writes_nothing(tmp_path):
    e = engine_dir(tmp_path / "engines", 1)
    with pytest.raises(UserError, match="version_policy"):
        emit_repository([(1, e)], tmp_path / "repo", version_policy={"latest": 0})
    assert not (tmp_path / "repo").exists()


def test_engine_links_leading_out_are_not_copied(tmp_path):
    e = engine_dir(tmp_path / "engines", 1)
    (tmp_path / "secret").write_text("s3cret")
    (e / "tokenizer" / "special_tokens_map.json").symlink_to(tmp_path / "secret")
    with pytest.raises(UserError, match="symbolic link"):
        emit_repository([(1, e)], tmp_path / "repo")
    assert not [f for f in (tmp_path / "repo").rglob("*") if f.is_file() and f.read_bytes() == b"s3cret"]


def test_a_version_missing_from_one_model_is_not_already_present(tmp_path):
    """publish_version's no-op needs every model to hold the version: a half-published one is repaired."""
    repo = tmp_path / "repo"
    e1, e2 = engine_dir(tmp_path / "engines", 1), engine_dir(tmp_path / "engines", 2)
    publish_version(repo, e1, 1)
    publish_version(repo, e2, 2)
    shutil.rmtree(repo / "tensorrt_llm" / "2")
    out = publish_version(repo, e2, 2)
    assert out["note"] != "already present" and out["versions"] == [1, 2]
    assert any("removed version 2" in x for x in out["repaired"])
    assert not [p for m in MODELS for p in (repo / m).iterdir() if p.name.startswith(".")]


def test_a_switch_killed_halfway_is_finished_by_repair(tmp_path):
    import os
    import subprocess
    import sys

    repo = tmp_path / "repo"
    e1, e2 = engine_dir(tmp_path / "engines", 1), engine_dir(tmp_path / "engines", 2)
    emit_repository([(1, e1)], repo)
    code = "import sys; from bpcompile.serving.emit import add_version; add_version(sys.argv[1], 2, sys.argv[2])"
    r = subprocess.run(
        [sys.executable, "-c", code, str(repo), str(e2)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "BPCOMPILE_FAULT_AT": "switch"},
    )
    assert r.returncode == -9, r.stderr
    assert (repo / "preprocessing" / "2").is_dir() and not (repo / "tensorrt_llm" / "2").exists()
    assert any("finished an interrupted switch" in x for x in emit.repair_repository(repo))
    assert emit._versions(repo) == [1, 2]
    assert json.loads((repo / "tensorrt_llm" / "2" / "engine_source.json").read_text())["build_id"] == "b2"
    assert not [p for m in MODELS for p in (repo / m).iterdir() if p.name.startswith(".")]
    assert emit.repair_repository(repo) == []


# --- the streamed-text contract ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(TINY_TOK / "tokenizer.json"))


def stream_text(tok, ids, cuts, shuffle_seed=None):
    """Split ids at `cuts` into responses, decode each on its own (as postprocessing does), optionally in a
    shuffled order, then join by response index (as delivered in order)."""
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    bounds = [0, *cuts, len(ids)]
    msgs = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        ctx, read = context_window(ids, a, b)
        msgs.append((i, ctx, read, b == len(ids)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(msgs)
    pieces = {i: delta_text(decode, ctx, read, final) for i, ctx, read, final in msgs}
    return "".join(pieces[i] for i in sorted(pieces))


def test_streamed_pieces_join_to_the_full_decode(tok):
    rng = random.Random(0)
    texts = ["Hello wörld € 日本語 😀 ok", "naïve café — “quotes” 🎉🎉 end", "plain ascii text with spaces  "]
    cases = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    cases += [[rng.randrange(4, 4096) for _ in range(60)] for _ in range(20)]  # random ids: broken UTF-8 too
    for ids in cases:
        full = tok.decode(ids, skip_special_tokens=True)
        for trial in range(5):
            cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, rng.randrange(1, 12))))
            assert stream_text(tok, ids, cuts, shuffle_seed=trial) == full
        assert stream_text(tok, ids, list(range(1, len(ids)))) == full  # one token per response


def test_naive_per_response_decode_would_be_wrong(tok):
    """Why the context is needed: decoding each response's tokens alone breaks multi-byte characters."""
    ids = tok.encode("€ 日本語 😀", add_special_tokens=False).ids
    naive = "".join(tok.decode([i]) for i in ids)
    assert naive != tok.decode(ids) and stream_text(tok, ids, list(range(1, len(ids)))) == tok.decode(ids)


def test_word_lists_round_trip():
    words = [[5, 6], [7], [8, 9, 10]]
    arr = pack_words(words)
    assert arr.shape == (2, 6) and list(arr[1][:3]) == [2, 3, 6] and list(arr[1][3:]) == [-1, -1, -1]
    assert unpack_words(arr) == words
    assert unpack_words(pack_words([])) == [] and pack_words([]).tolist() == [[0], [-1]]


def test_models_dir_has_the_three_python_models():
    assert sorted(p.name for p in emit.MODELS_DIR.glob("*.py")) == [
        "generator.py",
        "postprocessing.py",
        "preprocessing.py",
    ]


def test_openai_port_refuses_a_non_decoupled_repository(tmp_path):
    """The OpenAI endpoint streams from the generator: serve refuses it on a repository emitted with decoupled
    false, naming the setting, before it starts tritonserver (the health port stays free)."""
    from bpcompile.serving.serve import free_port, serve

    e = engine_dir(tmp_path / "e", 1)
    emit_repository([(1, e)], tmp_path / "unary", decoupled=False)
    lines = []
    with pytest.raises(UserError, match=r"config.pbtxt: model_transaction_policy.decoupled is false") as err:
        serve(tmp_path / "unary", openai_port=free_port(), log=lines.append)
    assert err.value.exit_code == 2 and err.value.key == "triton.decoupled" and "--openai-port" in str(err.value)
    assert not any("starting tritonserver" in line for line in lines), lines


def test_exclude_input_in_output_defaults(repo):
    """The generator's exclude_input_in_output parameter is tensorrtllm_backend's template default (false: a token
    request that does not send it gets the prompt first); the ensemble sends the generator preprocessing's answer
    for it (true unless the client sent false), so its text stays the generated text."""
    cfgs = configs(repo)
    assert cfgs["tensorrt_llm"].parameters["exclude_input_in_output"].string_value == "false"
    pre, gen = cfgs["ensemble"].ensemble_scheduling.step[:2]
    assert pre.input_map["EXCLUDE_INPUT_IN_OUTPUT"] == "exclude_input_in_output"
    assert gen.input_map["exclude_input_in_output"] == pre.output_map["OUT_EXCLUDE_INPUT_IN_OUTPUT"]
    check_wiring(cfgs)
