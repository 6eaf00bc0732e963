"""Inputs that used to pass validation and fail later (or never): corrupt safetensors headers, absurd limits
and config values, non-tokenizers, malformed indexes, YAML alias bombs, device files posing as weights,
llama3 context arithmetic, unknown recipe keys, kernel-incompatible head sizes, over-long prompts.
Each is refused up front with exit code 2 and a message naming what and where."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import write_engine_config  # noqa: E402
from pairs import make_pair, write_recipe

from bpcompile.cli import main
from bpcompile.core.errors import UserError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


def run_subprocess(*args, timeout=120):
    """The CLI in a child process: the cases here used to hang, and a hang must fail the test, not stall it."""
    r = subprocess.run(
        [sys.executable, "-m", "bpcompile.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    return r.returncode, r.stdout + r.stderr


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


# ------------------------------------------------------------------------------ safetensors headers


def split_file(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_file(path: Path, header, data: bytes) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _layer(h, i, name):
    return h[f"model.layers.{i}.{name}"]


def overlapping(h, data):  # layer 1's q_proj reads layer 0's bytes: "a layer equal to another"
    _layer(h, 1, "self_attn.q_proj.weight")["data_offsets"] = list(
        _layer(h, 0, "self_attn.q_proj.weight")["data_offsets"]
    )
    return h, data


def reversed_(h, data):
    t = h["model.norm.weight"]
    t["data_offsets"] = t["data_offsets"][::-1]
    return h, data


def negative(h, data):
    t = h["model.norm.weight"]
    t["data_offsets"] = [-8, t["data_offsets"][1]]
    return h, data


def short(h, data):  # fewer bytes than dtype x shape needs
    t = h["model.norm.weight"]
    t["data_offsets"][1] -= 4
    return h, data


def gap(h, data):  # a tensor's bytes dropped from the header: the others no longer tile the data section
    first = min(h.items(), key=lambda kv: kv[1].get("data_offsets", [1 << 62])[0])[0]
    del h[first]
    return h, data


def shape_mismatch(h, data):  # offsets fine, shape says more elements than the bytes hold
    t = h["model.norm.weight"]
    t["shape"] = [t["shape"][0] + 1]
    return h, data


def truncated(h, data):
    return h, data[:-16]


def trailing(h, data):
    return h, data + b"\0" * 16


def not_an_object(h, data):
    return [], data


def float_shape(h, data):
    t = h["model.norm.weight"]
    t["shape"] = [float(t["shape"][0])]
    return h, data


CORRUPTIONS = [
    overlapping,
    reversed_,
    negative,
    short,
    gap,
    shape_mismatch,
    truncated,
    trailing,
    not_an_object,
    float_shape,
]


def corrupt(src: Path, dst: Path, how) -> Path:
    d = copy_model(src, dst)
    h, data = split_file(d / "model.safetensors")
    write_file(d / "model.safetensors", *how(h, data))
    return d


def test_patching_alone_keeps_a_valid_checkpoint(tmp_path, pair):
    """The control for the corruption cases: rewriting the header unchanged leaves a file both readers accept."""
    from safetensors import safe_open

    from bpcompile.compiler.hf import TensorReader

    v = corrupt(pair[0], tmp_path / "v", lambda h, data: (h, data))
    code, out = run("validate", write_recipe(tmp_path / "r.yaml", v, pair[1]))
    assert code == 0, out
    reader = TensorReader.for_dir(v)
    with safe_open(v / "model.safetensors", "pt") as f:
        for name in f.keys():
            assert reader.get(name).equal(f.get_tensor(name))


@pytest.mark.parametrize("how", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_safetensors_header_is_refused(tmp_path, pair, how):
    from safetensors import safe_open

    v = corrupt(pair[0], tmp_path / "v", how)
    # the safetensors library refuses the same file: we are at least as strict as the format's own reader
    with pytest.raises(Exception):  # noqa: B017 (whatever the format's own reader raises)
        with safe_open(v / "model.safetensors", "pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    code, out = run("validate", write_recipe(tmp_path / "r.yaml", v, pair[1]))
    assert code == 2, out
    assert "model.safetensors" in out and "models.verifier.path" in out and "Traceback" not in out
    code, out = run("inspect", v)
    assert code == 2 and "model.safetensors" in out, out
    from bpcompile.compiler.convert import convert_checkpoint

    with pytest.raises(UserError):
        convert_checkpoint(v, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_header_length_over_the_library_limit(tmp_path, pair):
    v = copy_model(pair[0], tmp_path / "v")
    f = v / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 100_000_001) + raw[8:])
    code, out = run("inspect", v)
    assert code == 2 and "100000000" in out, out


# ------------------------------------------------------------------------------ recipe limits and YAML


def recipe_with(tmp_path, pair, limits=None, extra="") -> Path:
    p = write_recipe(tmp_path / "r.yaml", *pair, extra=extra)
    if limits:
        p.write_text(p.read_text().replace("limits: {max_batch_size: 4, max_input_len: 64, max_seq_len: 128}", limits))
    return p


def test_absurd_batch_size_is_refused(tmp_path, pair):
    code, out = run(
        "validate",
        recipe_with(tmp_path, pair, "limits: {max_batch_size: 1000000, max_input_len: 64, max_seq_len: 128}"),
    )
    assert code == 2 and "limits.max_batch_size" in out and "4096" in out, out


def test_kv_pool_that_does_not_fit_in_memory_is_refused(tmp_path, pair):
    """4096 sequences of 2**20 tokens: terabytes of KV cache even for this 2-layer model."""
    code, out = run(
        "validate",
        recipe_with(tmp_path, pair, "limits: {max_batch_size: 4096, max_input_len: 64, max_seq_len: 1048576}"),
    )
    assert code == 2 and "limits.max_batch_size" in out and "would take" in out and "memory" in out, out


def test_kv_pool_estimate_matches_what_the_runtime_allocates(tmp_path, pair):
    import torch

    from bpcompile.compiler.calibrate import int5_key_layers, int6_key_layers
    from bpcompile.compiler.convert import convert_checkpoint
    from bpcompile.compiler.hf import read_hf_config
    from bpcompile.compiler.plan import kv_pool_bytes
    from bpcompile.compiler.recipe import load_recipe
    from bpcompile.runtime.generator import Generator
    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory
    from bpcompile.runtime.model import Llama
    from bpcompile.runtime.paged_kv import float_store_factory
    from bpcompile.runtime.speculative import TreeSpec

    models = {}
    for role, d in zip(("verifier", "draft"), pair):
        convert_checkpoint(d, tmp_path / role)
        models[role] = Llama.from_checkpoint(tmp_path / role)
    for fmt in ("fp16", "int4-fp8-outlier"):
        loaded = load_recipe(
            recipe_with(tmp_path, pair, extra="")
            if fmt == "fp16"
            else _with_kv(
                recipe_with(tmp_path, pair),
                "kv_cache: {format: int4-fp8-outlier, group_size: 16, "
                "outlier_fraction: 0.25, int6_keys: early, "
                "key_transform: none}",
            )
        )
        r = loaded.recipe
        vcfg = models["verifier"].cfg
        factory = float_store_factory(torch.float16)  # what Generator.from_engine gives format fp16
        if fmt != "fp16":
            plan = KVPlan.uniform(fmt, vcfg.num_layers, vcfg.num_kv_heads, vcfg.head_size, group_size=16)
            # the recipe's autos on the native target with INT6 keys asked for without KLT: an FP16 window, whose
            # copies the estimate counts, the middle third's keys in INT5 and two thirds of the values in INT3
            assert (
                r.kv_cache.sink_tokens,
                r.kv_cache.recent_window,
                r.kv_cache.int5_keys,
                r.kv_cache.int6_keys,
                r.kv_cache.int3_values,
            ) == (0, 11, "middle", "early", 0.6667)
            for layer in int5_key_layers("middle", vcfg.num_layers):
                plan.precision[layer]["k"] = ["int5"] * vcfg.num_kv_heads
            for layer in int6_key_layers("early", vcfg.num_layers):
                plan.precision[layer]["k"] = ["int6"] * vcfg.num_kv_heads
            values = [(layer, h) for layer in range(vcfg.num_layers) for h in range(vcfg.num_kv_heads)]
            for layer, h in values[: round(0.6667 * len(values))]:  # which ones does not change the bytes
                plan.precision[layer]["v"][h] = "int3"
            # then outlier_fraction 0.25 of the units in FP8, among the rest
            n = round(0.25 * 2 * vcfg.num_layers * vcfg.num_kv_heads)
            rest = [
                (layer, t, h)
                for layer in range(vcfg.num_layers)
                for t in "kv"
                for h in range(vcfg.num_kv_heads)
                if plan.precision[layer][t][h] == "int4"
            ]
            for layer, t, h in rest[:n]:
                plan.precision[layer][t][h] = "fp8"
            plan.sink_tokens, plan.recent_window = r.kv_cache.sink_tokens, r.kv_cache.recent_window
            factory = kv_store_factory(plan)
        gen = Generator(
            models["verifier"],
            models["draft"],
            TreeSpec(r.speculative.tree, nodes=r.speculative.nodes),
            max_batch_size=r.limits.max_batch_size,
            max_seq_len=r.limits.max_seq_len,
            page_size=r.kv_cache.page_size,
            kv_store_factory=factory,
        )
        allocated = gen.vkv.nbytes() + gen.dkv.nbytes()
        estimate = kv_pool_bytes(r, read_hf_config(pair[0]), read_hf_config(pair[1]))
        assert 0.95 * allocated <= estimate <= 1.05 * allocated + 4096, (fmt, estimate, allocated)


def _with_kv(p: Path, kv: str) -> Path:
    p.write_text(p.read_text().replace("kv_cache: {format: fp16}", kv))
    return p


def test_quantize_draft_is_an_unknown_key(tmp_path, pair):
    p = _with_kv(recipe_with(tmp_path, pair), "kv_cache: {format: fp16, quantize_draft: true}")
    code, out = run("validate", p)
    assert code == 2 and "kv_cache.quantize_draft: unknown key" in out, out


def test_yaml_alias_bomb_is_refused_quickly(tmp_path, pair):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join(['*a' + str(i - 1)] * 9)}]" for i in range(1, 10)]
    p = write_recipe(tmp_path / "r.yaml", *pair)
    p.write_text("\n".join(lines) + "\n" + p.read_text())
    t = time.perf_counter()
    code, out = run_subprocess("validate", p, timeout=60)
    assert code == 2 and "alias" in out and "r.yaml:2:" in out, out
    assert time.perf_counter() - t < 30


def test_oversized_and_non_utf8_recipes_are_refused(tmp_path, pair):
    p = write_recipe(tmp_path / "r.yaml", *pair)
    p.write_text(p.read_text() + "#" + "x" * (1 << 20) + "\n")
    code, out = run("validate", p)
    assert code == 2 and "larger than" in out, out
    p.write_bytes(b"name: \xff\xfe\n")
    code, out = run("validate", p)
    assert code == 2 and "UTF-8" in out, out


# ------------------------------------------------------------------------------ model config and files


def test_huge_layer_count_is_refused_against_the_tensors(tmp_path, pair):
    v = copy_model(pair[0], tmp_path / "v")
    edit_config(v, num_hidden_layers=10**8)
    t = time.perf_counter()
    code, out = run_subprocess("validate", write_recipe(tmp_path / "r.yaml", v, pair[1]), timeout=60)
    assert code == 2 and "num_hidden_layers" in out and "2 layers" in out, out
    assert time.perf_counter() - t < 30
    from bpcompile.compiler.convert import convert_checkpoint

    with pytest.raises(UserError, match="num_hidden_layers"):
        convert_checkpoint(v, tmp_path / "out")


@pytest.mark.parametrize(
    "key,value",
    [
        ("rope_theta", "ten thousand"),
        ("rms_norm_eps", "1e-5"),
        ("rms_norm_eps", [1e-5]),
        ("rope_theta", True),
        ("rms_norm_eps", -1.0),
        ("tie_word_embeddings", "false"),
        ("rope_scaling", {"rope_type": "linear", "factor": "2"}),
        ("rope_scaling", "linear"),
        ("dtype", ["float32"]),
        ("num_attention_heads", 2**40),
    ],
)
def test_bad_config_values_are_refused(tmp_path, pair, key, value):
    v = copy_model(pair[0], tmp_path / "v")
    edit_config(v, **{key: value})
    if key == "rope_theta":  # transformers 5 writes it inside rope_parameters, which wins over the top level
        edit_config(v, rope_parameters={"rope_theta": value, "rope_type": "default"})
    if key == "dtype":  # an unusable dtype is not an error (the tensors decide) but must not crash
        code, out = run("validate", write_recipe(tmp_path / "r.yaml", v, pair[1]))
        assert code == 0, out
        return
    code, out = run("validate", write_recipe(tmp_path / "r.yaml", v, pair[1]))
    assert code == 2 and "config.json" in out and key.split(".")[0] in out and "Traceback" not in out, out


@pytest.mark.parametrize("content", ['{"hello": 1}', "[1, 2, 3]", '{"model": []}', "not json"])
def test_tokenizer_json_that_is_not_a_tokenizer(tmp_path, pair, content):
    v = copy_model(pair[0], tmp_path / "v")
    (v / "tokenizer.json").write_text(content)
    code, out = run("validate", write_recipe(tmp_path / "r.yaml", v, pair[1]))
    assert code == 2 and "tokenizer.json" in out and "models.verifier.path" in out, out


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"x": "../other/model.safetensors"}, {}, {"x": 3}])
def test_bad_index_weight_map(tmp_path, pair, weight_map):
    v = copy_model(pair[0], tmp_path / "v")
    # a shard outside the checkpoint directory that really exists: refused for where it is, not for being absent
    shutil.copytree(pair[0], tmp_path / "other")
    (v / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    code, out = run("validate", write_recipe(tmp_path / "r.yaml", v, pair[1]))
    assert code == 2 and "model.safetensors.index.json" in out and "weight_map" in out, out


def test_weights_linked_to_dev_zero_are_refused_without_hanging(tmp_path, pair):
    v = copy_model(pair[0], tmp_path / "v")
    (v / "model.safetensors").unlink()
    (v / "model.safetensors").symlink_to("/dev/zero")
    p = write_recipe(tmp_path / "r.yaml", v, pair[1])
    for cmd in ("validate", "build"):
        code, out = run_subprocess(cmd, p, timeout=120)
        assert code == 2 and "model.safetensors" in out and "not a regular file" in out, out
    assert not (tmp_path / "engines").exists()


def test_fifo_among_hashed_inputs_is_refused_without_hanging(tmp_path, pair):
    v = copy_model(pair[0], tmp_path / "v")
    os.mkfifo(v / "special_tokens_map.json")
    code, out = run_subprocess("build", write_recipe(tmp_path / "r.yaml", v, pair[1]), timeout=120)
    assert code == 2 and "special_tokens_map.json: not a regular file" in out, out


# ------------------------------------------------------------------------------ rope context

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}


@pytest.mark.parametrize(
    "scaling,seq,ok",
    [
        (LLAMA3, 512, True),  # max_position_embeddings (512) already is the extended context ...
        (LLAMA3, 1024, False),  # ... so it is not multiplied by the factor again
        ({"rope_type": "linear", "factor": 4.0}, 2048, True),  # linear scaling stretches the trained 512 tokens
        ({"rope_type": "linear", "factor": 4.0}, 2049, False),
    ],
)
def test_rope_scaling_context(tmp_path, pair, scaling, seq, ok):
    v = copy_model(pair[0], tmp_path / "v")
    edit_config(v, rope_scaling=scaling)
    code, out = run(
        "validate",
        recipe_with(tmp_path, (v, pair[1]), f"limits: {{max_batch_size: 4, max_input_len: 64, max_seq_len: {seq}}}"),
    )
    if ok:
        assert code == 0, out
    else:
        assert code == 2 and "limits.max_seq_len" in out and "exceeds the verifier's context" in out, out


# ------------------------------------------------------------------------------ runtime

KERNEL_SCRIPT = r"""
import json, sys
sys.path.insert(0, "tests")
from conftest import noisy_copy, random_llama
from bpcompile.runtime.model import ModelConfig
from bpcompile.runtime.kvcache import KVPlan, kv_store_factory
from bpcompile.runtime.generator import Generator, SamplingParams
from bpcompile.runtime.speculative import TreeSpec

cfg = ModelConfig(vocab_size=128, hidden_size=96, num_layers=2, num_heads=2, num_kv_heads=1, head_size=48,
                  intermediate_size=128)
v = random_llama(cfg, seed=0)
d = noisy_copy(v, 0.3, seed=1)
plan = KVPlan.uniform("int4-fp8-outlier", cfg.num_layers, cfg.num_kv_heads, cfg.head_size, group_size=16)
gen = Generator(v, d, TreeSpec("dynamic", nodes=4), max_batch_size=2, max_seq_len=64, page_size=8,
                kv_store_factory=kv_store_factory(plan))
out = gen.generate([[5, 17, 9, 100, 3], [7, 7, 7]], SamplingParams(max_tokens=8))
print(json.dumps([t for t, _ in out]))
"""


def test_kernel_path_falls_back_for_head_size_48():
    """The Triton kernels need a power-of-two head size; the runtime must not take them for head size 48."""
    outs = {}
    for mode in ("torch", "triton"):
        env = dict(os.environ, BPCOMPILE_KERNELS=mode, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        r = subprocess.run(
            [sys.executable, "-c", KERNEL_SCRIPT], capture_output=True, text=True, env=env, timeout=300, cwd=REPO
        )
        assert r.returncode == 0, r.stderr[-3000:]
        outs[mode] = (json.loads(r.stdout.strip().splitlines()[-1]), r.stderr)
    assert outs["triton"][0] == outs["torch"][0] and all(len(t) == 8 for t in outs["torch"][0])
    warnings = [l for l in outs["triton"][1].splitlines() if "head_size 48" in l]
    assert len(warnings) == 1 and "PyTorch path" in warnings[0], outs["triton"][1]
    assert "head_size 48" not in outs["torch"][1]


def test_native_runtime_enforces_max_input_len(tmp_path, pair):

    from bpcompile.compiler.convert import convert_checkpoint
    from bpcompile.runtime.generator import Generator, SamplingParams
    from bpcompile.runtime.speculative import TreeSpec

    eng = tmp_path / "eng"
    convert_checkpoint(pair[0], eng / "verifier")
    write_engine_config(eng, limits={"max_batch_size": 2, "max_input_len": 8, "max_seq_len": 64})
    gen = Generator.from_engine(eng, tree=TreeSpec("none"))
    p = SamplingParams(max_tokens=4)
    with pytest.raises(UserError, match=r"9 tokens, more than limits.max_input_len \(8\)"):
        gen.add_request(list(range(1, 10)), p)
    assert not gen.has_work()
    ((out, _),) = gen.generate([list(range(1, 9))], p)  # exactly max_input_len is fine
    assert len(out) == 4


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_native_runtime_refuses_non_finite_temperature(tmp_path, pair, temperature):
    from bpcompile.compiler.convert import convert_checkpoint
    from bpcompile.runtime.generator import Generator, SamplingParams
    from bpcompile.runtime.speculative import TreeSpec

    convert_checkpoint(pair[0], tmp_path / "eng" / "verifier")
    write_engine_config(tmp_path / "eng")
    gen = Generator.from_engine(tmp_path / "eng", tree=TreeSpec("none"))
    with pytest.raises(UserError, match="finite temperature"):
        gen.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=temperature))


def test_kv_memory_check_follows_the_serving_machine(tmp_path, pair, monkeypatch):
    """The build box is often not the server: BPCOMPILE_KV_MEMORY_LIMIT names the server's memory."""
    recipe = recipe_with(tmp_path, pair, "limits: {max_batch_size: 64, max_input_len: 64, max_seq_len: 256}")
    assert run("validate", recipe)[0] == 0
    monkeypatch.setenv("BPCOMPILE_KV_MEMORY_LIMIT", "1000")
    code, out = run("validate", recipe)
    assert code == 2 and "BPCOMPILE_KV_MEMORY_LIMIT" in out, out
    monkeypatch.setenv("BPCOMPILE_KV_MEMORY_LIMIT", "0")
    assert run("validate", recipe)[0] == 0
