"""`bpcompile plan`: the per-GPU memory plan, checked against figures computed by hand (in the comments) for a
small GQA config and a Llama-3.1-70B-shaped one, and the command's exits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from bpcompile.cli import main
from bpcompile.compiler.plan import DEVICES, plan
from bpcompile.compiler.recipe import Recipe

REPO = Path(__file__).resolve().parent.parent

L70 = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
L1B = {
    **L70,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "head_dim": 64,
    "tie_word_embeddings": True,
}


def _spec(raw: dict) -> dict:
    """The normalized config read_hf_config gives, for the keys the plan reads."""
    return {
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["intermediate_size"],
        "num_hidden_layers": raw["num_hidden_layers"],
        "num_attention_heads": raw["num_attention_heads"],
        "num_key_value_heads": raw["num_key_value_heads"],
        "vocab_size": raw["vocab_size"],
        "head_dim": raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"]),
        "dtype": raw["torch_dtype"],
        "qkv_bias": False,
        "o_bias": False,
        "mlp_bias": False,
    }


def test_70b_recipe_at_tp8_on_h200():
    r = Recipe.model_validate(
        {
            **_recipe_70b(),
            "models": {"verifier": {"path": "v", "dtype": "bfloat16"}, "draft": {"path": "d", "dtype": "bfloat16"}},
        }
    )
    p = plan(r, _spec(L70), _spec(L1B), DEVICES["h200"])
    # verifier params on one of 8 ranks: embedding replicated 128256*8192 = 1,050,673,152; lm_head split
    # 16032*8192 = 131,334,144; ln_f 8192; per layer 2*8192 (norms) + (1024 + 2*128)*8192 (q, k, v: 8 query heads
    # and 1 KV head of 128) + 8192*1024 (o) + 3*8192*3584 (MLP) = 106,971,136, x 80 = 8,557,690,880
    verifier = 1_050_673_152 + 131_334_144 + 8192 + 8_557_690_880
    # draft (1B: 16 layers, hidden 2048, 32 heads / 8 KV heads of 64, MLP 8192, tied lm_head still written):
    # 128256*2048 + 16032*2048 + 2048 + 16 * (2*2048 + (256 + 128)*2048 + 2048*256 + 3*2048*1024)
    draft = 262_668_288 + 32_833_536 + 2048 + 16 * 7_606_272
    assert p["weights_bytes"] == 2 * (verifier + draft)
    # KV, the default plan (G = D = 128: one fp16 scale a token per unit; payload + 2 bytes): 2*80*8 = 1280 units.
    # Keys: layers 0-26 (the first third, round(80/3) = 27) KLT6, 27 x 8 units of 96 + 2; layers 27-52 (to
    # round(160/3) = 53) KLT5, 26 x 8 of 80 + 2; layers 53-79 INT4, 27 x 8 of 64 + 2. Values: round(0.6667 * 640)
    # = 427 INT3 (48 + 2), the other 213 INT4. 216*98 + 208*82 + 216*66 + 427*50 + 213*66 = 87,888 bytes a token for
    # the model, 1/8 of it per rank, + 4 for the slot's position that KLT keys are rebuilt with
    assert p["kv_bytes_per_token"] == 87_888 / 8 + 4 == 10_990
    assert p["draft_kv_bytes_per_token"] == 2 * 16 * 64 * 2 == 4096
    # 64 sequences x ceil((16384 + 6) / 64) = 257 pages, + 1, of 64 tokens
    assert p["cache_tokens"] == (64 * 257 + 1) * 64 == 1_052_736
    # exact copies: 10 window entries + a tree of 6, K and V of 80 layers x 1 KV head x 128 in fp16, per sequence
    exact = 80 * 2 * 128 * 2 * (10 + 6)
    # KLT tables of this rank's KV head: per KLT unit (53 layers) a 128 x 128 fp16 basis and fp32 weight and mean
    # (32,768 + 1,024 bytes); per layer bits (int8), steps and levels (fp32) of 128 coefficients (1,152 bytes); 64
    # fp32 frequencies; the kernels' fp32 copies: every layer's basis and bits, offsets, steps, levels, weights and
    # means (65,536 + 6 * 512 bytes), frequencies again
    tables = 53 * 33_792 + 80 * 1_152 + 256 + 80 * 68_608 + 256
    assert tables == 7_372_288
    assert p["kv_bytes"] == 1_052_736 * (10_990 + 4096) + 64 * exact + tables
    assert p["fits"] and p["tp"] == 8
    # no dense copy: on CUDA the verifier's quantized cache is read by the kernels, and the draft's float cache by
    # the static step (runtime.cuda_graphs auto, at tp 8 and with the plan's exact entries too); without it, the
    # draft's copy for 64 + 1 rows of 16384 + 6 + 1 entries, K and V of 16 layers x 1 KV head x 64 in bfloat16
    assert p["dense_kv_bytes"] == 0
    off = Recipe.model_validate({**r.model_dump(), "runtime": {**r.runtime.model_dump(), "cuda_graphs": "off"}})
    assert plan(off, _spec(L70), _spec(L1B), DEVICES["h200"])["dense_kv_bytes"] == 65 * 16_391 * 4096
    # batch 1 at 16384 tokens reads the verifier shard and one sequence's KV: 4.8e12 / (2*verifier + 16384*10990)
    assert p["projected_decode_tokens_per_s"]["batch_1_at_max_seq_len"] == pytest.approx(
        4.8e12 / (2 * verifier + 16384 * 10_990)
    )


def test_feature_draft_counts_only_its_own_weights():
    """A FeatureDraft reads the verifier's embedding (and head, without a vocab_subset): its weights are fc, its
    layers and its own head rows, nothing of a vocabulary-sized embedding."""
    r = Recipe.model_validate(
        {
            **_recipe_70b(),
            "models": {"verifier": {"path": "v", "dtype": "bfloat16"}, "draft": {"path": "d", "dtype": "bfloat16"}},
        }
    )
    v = _spec(L70)
    fd = dict(v, architecture="FeatureDraft", num_hidden_layers=1, intermediate_size=8192, head_rows=32000)
    alone = plan(r, v, None, DEVICES["h200"])["weights_bytes"]
    with_fd = plan(r, v, fd, DEVICES["h200"])["weights_bytes"]
    # on one of 8 ranks: fc 8192*16384 + 8192; one layer 2*8192 + (1024 + 2*128)*8192 + 8192*1024 + 3*8192*1024;
    # the head rows 32000*8192 (replicated: the draft's own head is not split)
    assert with_fd - alone == 2 * (134_225_920 + 44_056_576 + 262_144_000)


def test_exact_entries_add_their_copies_per_sequence():
    """With an FP16 sink and window each sequence holds sink + window + one tree of FP16 K/V per unit: on the 70B
    recipe at tp 8, 80 layers x 1 KV head x K|V x 128 x 2 bytes x (1 + 16 + 6) per sequence, 64 sequences."""
    # from INT4 units with 8% FP8 ones and no exact entries, each setting's bytes on their own
    fp8_units = {"format": "int4-fp8-outlier", "group_size": 128, "page_size": 64, "outlier_fraction": 0.08}
    base = {**_recipe_70b(), "kv_cache": {**fp8_units, "sink_tokens": 0, "recent_window": 0}}
    models = {"verifier": {"path": "v", "dtype": "bfloat16"}, "draft": {"path": "d", "dtype": "bfloat16"}}
    kv = {**base["kv_cache"], "sink_tokens": 1, "recent_window": 16, "int5_keys": "none"}
    exact = {**base, "models": models, "kv_cache": {**kv, "retrieval_fraction": 0.0}}
    p0 = plan(Recipe.model_validate({**base, "models": models}), _spec(L70), _spec(L1B), DEVICES["h200"])
    p1 = plan(Recipe.model_validate(exact), _spec(L70), _spec(L1B), DEVICES["h200"])
    assert p1["kv_bytes"] - p0["kv_bytes"] == 64 * 80 * 1 * 2 * 128 * 2 * (1 + 16 + 6)
    # with exact entries retrieval_fraction's auto is 0.015: round(19.2) = 19 of the 1280 units' keys in INT8
    # instead of INT4, 64 more payload bytes each per token, an eighth of them on this rank
    p2 = plan(
        Recipe.model_validate({**base, "models": models, "kv_cache": kv}), _spec(L70), _spec(L1B), DEVICES["h200"]
    )
    assert p2["kv_bytes_per_token"] - p1["kv_bytes_per_token"] == 19 * 64 / 8
    # int5_keys' auto with a window: the keys of the middle third of the 80 layers (27-52: 26 x 8 units) in INT5,
    # 16 more payload bytes each than INT4 (80 against 64 at head 128), and no INT8 retrieval units
    p3 = plan(
        Recipe.model_validate(
            {**exact, "kv_cache": {**kv, "int5_keys": "auto", "int6_keys": "none", "int3_values": 0}}
        ),
        _spec(L70),
        _spec(L1B),
        DEVICES["h200"],
    )
    # KLT keys (the first two thirds of the layers, 0-52) take the bytes of the INT4 / INT5 keys they replace (one
    # scale per token: the recipe's group is the head size); the store keeps a 4-byte position per slot; with
    # group 64 the other units keep two scales a token and the KLT ones one
    pk = plan(
        Recipe.model_validate(
            {
                **exact,
                "kv_cache": {**kv, "int5_keys": "auto", "int6_keys": "none", "int3_values": 0, "key_transform": "klt"},
            }
        ),
        _spec(L70),
        _spec(L1B),
        DEVICES["h200"],
    )
    assert p3["kv_bytes_per_token"] - p1["kv_bytes_per_token"] == 26 * 8 * 16 / 8
    assert pk["kv_bytes_per_token"] - p3["kv_bytes_per_token"] == 4
    g64 = {**exact["kv_cache"], "int5_keys": "auto", "int6_keys": "none", "int3_values": 0, "group_size": 64}
    p5, pk5 = (
        plan(
            Recipe.model_validate({**exact, "kv_cache": {**g64, "key_transform": t}}),
            _spec(L70),
            _spec(L1B),
            DEVICES["h200"],
        )
        for t in ("none", "klt")
    )
    assert pk5["kv_bytes_per_token"] - p5["kv_bytes_per_token"] == 4 - 53 * 8 * 2 / 8
    # and INT6 keys with int3_values' auto (no KLT keys): the keys of the first third (layers 0-26: 27 x 8 units) in
    # INT6, 32 more payload bytes each than INT4 (96 against 64), and round(0.6667 * 640) = 427 value units in INT3,
    # 16 fewer each (48 against 64)
    p4 = plan(
        Recipe.model_validate(
            {**exact, "kv_cache": {**kv, "int5_keys": "auto", "int6_keys": "early", "key_transform": "none"}}
        ),
        _spec(L70),
        _spec(L1B),
        DEVICES["h200"],
    )
    assert p4["kv_bytes_per_token"] - p3["kv_bytes_per_token"] == (27 * 8 * 32 - 427 * 16) / 8


def test_small_config_by_hand():
    small = {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "head_dim": 64,
        "dtype": "float32",
        "qkv_bias": True,
        "o_bias": False,
        "mlp_bias": False,
    }
    r = Recipe.model_validate(
        {
            "name": "s",
            "models": {"verifier": {"path": "v"}, "draft": {"path": "d"}},
            "limits": {"max_batch_size": 2, "max_input_len": 100, "max_seq_len": 128},
            "kv_cache": {"format": "fp8", "group_size": 64, "page_size": 16},
            "speculative": {"tree": "chain", "length": 3},
        }
    )
    p = plan(r, small, None, DEVICES["h100"], tp=2)
    # tp 2: 2 query heads and 1 KV head of 64 per rank; per layer 2*256 + (128 + 128)*256 + 256 (qkv bias) +
    # 256*128 + 3*256*256 = 295,680; embedding 4096*256; lm_head 2048*256; ln_f 256; fp32
    assert p["weights_bytes"] == 4 * (4096 * 256 + 4 * 295_680 + 256 + 2048 * 256)
    # fp8: 2*4*2 = 16 units, (64 + 2) bytes a token each, half of them on this rank
    assert p["kv_bytes_per_token"] == 8 * 66
    # 2 sequences x ceil((128 + 4) / 16) = 9 pages, + 1, of 16 tokens; no draft cache (draft=None)
    assert p["cache_tokens"] == 19 * 16 and p["kv_bytes"] == 19 * 16 * 8 * 66


def _recipe_70b() -> dict:
    import yaml

    return yaml.safe_load((REPO / "recipes" / "70b.yaml").read_text())


def _write(tmp_path: Path, text: str) -> Path:
    for d, cfg in (("v", L70), ("d", L1B)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text(json.dumps(cfg))
    f = tmp_path / "70b.yaml"
    f.write_text(
        text.replace("/models/Meta-Llama-3.1-70B-Instruct", str(tmp_path / "v")).replace(
            "/models/Llama-3.2-1B-Instruct", str(tmp_path / "d")
        )
    )
    return f


def test_plan_command(tmp_path):
    recipe = _write(tmp_path, (REPO / "recipes" / "70b.yaml").read_text())
    res = CliRunner().invoke(main, ["plan", str(recipe), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["at_recipe_tp"]["tp"] == 8 and out["at_recipe_tp"]["fits"]
    assert out["smallest_tp_that_fits"]["tp"] < 8
    # 40 GB cards: not at tp 8 with these limits (weights 20.3 GB + KV pools 15.9 + activations and a chunk's K/V
    # 0.7 = 36.9 GB, more than 90% of 40): exit 2
    res = CliRunner().invoke(main, ["plan", str(recipe), "--memory-gb", "40"])
    assert res.exit_code == 2 and "does not fit" in res.stderr and "| fits |" in res.stdout
    # a model path that does not exist is named
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.read_text().replace(str(tmp_path / "d"), str(tmp_path / "nowhere")))
    res = CliRunner().invoke(main, ["plan", str(bad)])
    assert res.exit_code == 2 and "nowhere" in res.stderr


def runtime_held(gen) -> dict:
    """What a loaded Generator holds (rank 0's share at tp > 1), by `runtime_bytes`'s parts: its models' tensors
    (distinct storages, so a shared embedding counts once; oneDNN-packed ones are opaque and left out: None), its
    KV pools and exact copies (`PagedKV.nbytes`), its dense copies grown to their full length, and the chunk copies
    of a max_input_len prompt (`Executor.chunk_begin`) where one prefills in chunks (longer than the budget)."""
    import itertools

    from bpcompile.runtime.generator import SamplingParams

    def held(model):
        seen = {}
        for t in itertools.chain(model.buffers(), model.parameters()):
            try:
                st = t.untyped_storage()
            except (NotImplementedError, RuntimeError):
                return None
            seen[st.data_ptr()] = st.nbytes()
        return seen

    models = [held(m) for m in (gen.verifier, gen.draft) if m is not None]
    weights = [sum(x.values()) if x is not None else None for x in models]
    if len(models) == 2 and None not in models:  # a feature draft reads the verifier's embedding
        weights[1] -= sum(n for p, n in models[1].items() if p in models[0])
    kvs = [k for k in (gen.vkv, gen.dkv) if k is not None]
    dense = 0
    for k in kvs:
        if k.dense is not None:
            k.dense.reserve(k.dense.length)
            dense += k.dense.k.nbytes + k.dense.v.nbytes
    chunk, chunked = 0, gen.chunks is not None and gen.max_input_len > gen.chunks.budget
    rid = gen.add_request([2] * gen.max_input_len, SamplingParams(max_tokens=1))
    (r,) = gen.scheduler.admit()
    for ex in (gen.v_exec, gen.d_exec) if chunked else ():
        if ex is not None:
            ex.chunk_begin(r, 0)
            chunk += sum(t.nbytes for t in ex.chunks[ex._chunk_keys[rid]][:2])
            ex.chunk_end(rid)
    gen.cancel(rid)
    return {"weights_by_model": weights, "kv_pools": sum(k.nbytes() for k in kvs), "dense": dense, "chunk": chunk}


def compare_with_runtime(engine: Path, tp: int = 1, cuda_graphs: str | None = None) -> tuple[dict, dict]:
    """(`runtime_bytes` of the engine's recipe on CPU at tp, what the engine loaded at tp holds); cuda_graphs: the
    runtime.cuda_graphs both take instead of the recipe's."""
    from bpcompile.compiler.hf import is_feature_draft, read_feature_draft, read_hf_config
    from bpcompile.compiler.plan import runtime_bytes
    from bpcompile.compiler.recipe import parse_recipe
    from bpcompile.runtime.generator import Generator

    r, _ = parse_recipe(engine / "recipe.yaml")
    v = read_hf_config(r.models.verifier.path)
    d = r.models.draft.path
    d = read_feature_draft(d, v) if is_feature_draft(d) else read_hf_config(d)
    if cuda_graphs is not None:
        r.runtime.cuda_graphs = cuda_graphs
    planned = runtime_bytes(r, v, d, "cpu", tp)
    gen = Generator.from_engine(engine, tp=tp, verify=False, cuda_graphs=cuda_graphs)
    try:
        return planned, runtime_held(gen)
    finally:
        gen.close()


def assert_plan_matches(planned: dict, held: dict, pools: float = 0.01) -> None:
    """Weights within 1% (the one-buffer layout's 4 KiB alignments), KV pools within `pools` (a plan's per-slot
    bookkeeping; at tp > 1 also how its outlier units fall on rank 0, against the plan's per-rank average), dense
    and chunk copies exactly."""
    for p, h in zip(planned["weights_by_model"], held["weights_by_model"]):
        assert h is None or abs(p - h) <= 0.01 * h, (p, h)
    assert abs(planned["kv_pools"] - held["kv_pools"]) <= pools * held["kv_pools"], (planned, held)
    assert planned["dense"] == held["dense"] and planned["chunk"] == held["chunk"], (planned, held)


SMOLLM2_ENGINE = REPO / "engines" / "smollm2" / "1"


@pytest.mark.skipif(
    not (SMOLLM2_ENGINE / "engine.json").is_file(), reason="no SmolLM2 engine (bpcompile build recipes/smollm2.yaml)"
)
def test_plan_counts_what_the_runtime_allocates_on_smollm2():
    """recipes/smollm2.yaml as built (the default KV plan with INT5/INT6/KLT keys, INT3 values and a recent window;
    the feature draft): `runtime_bytes` against what the loaded engine holds (see assert_plan_matches; the
    feature draft's linears, packed in bfloat16 where the CPU multiplies it natively, are opaque and not compared
    there)."""
    planned, held = compare_with_runtime(SMOLLM2_ENGINE)
    assert_plan_matches(planned, held)
    assert held["dense"] > 0 and held["chunk"] > 0  # CPU: dense copies; max_input_len 1536 > the 512 chunk
