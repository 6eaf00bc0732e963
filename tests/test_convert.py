"""Conversion HF -> TensorRT-LLM checkpoint: names, shapes and contents per rank, config, round trip, errors."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from conftest import SMALL, hf_to_trtllm, make_hf_llama, trtllm_to_hf
from safetensors import safe_open
from safetensors.torch import load_file

from bpcompile.compiler.convert import convert_checkpoint
from bpcompile.compiler.hf import TensorReader, list_weights, read_hf_config, tokenizers_equal, weight_files
from bpcompile.core.checkpoint import merge_ranks
from bpcompile.core.errors import UserError

H, KV, HID, INTER, V, LAYERS = (
    SMALL[k]
    for k in (
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_size",
        "intermediate_size",
        "vocab_size",
        "num_hidden_layers",
    )
)
D = HID // H


def expected_rank_shapes(tp, pp, tied=False):
    """What TRT-LLM's Llama converter puts in each rank file for the SMALL model, written out by hand."""
    stages = {1: [[0, 1, 2]], 2: [[0, 1], [2]]}[pp]  # tensor_split: the first stage takes the extra layer
    kv_rank = max(KV // tp, 1)
    vpad = -(-V // tp) * tp
    out = {}
    for s, layers in enumerate(stages):
        for r in range(tp):
            names = {}
            if s == 0:
                names["transformer.vocab_embedding.weight"] = (V, HID)
            for L in range(len(layers)):
                p = f"transformer.layers.{L}."
                names[p + "input_layernorm.weight"] = (HID,)
                names[p + "attention.qkv.weight"] = ((H // tp + 2 * kv_rank) * D, HID)
                names[p + "attention.dense.weight"] = (HID, H * D // tp)
                names[p + "post_layernorm.weight"] = (HID,)
                names[p + "mlp.fc.weight"] = (INTER // tp, HID)
                names[p + "mlp.gate.weight"] = (INTER // tp, HID)
                names[p + "mlp.proj.weight"] = (HID, INTER // tp)
            if s == pp - 1:
                names["transformer.ln_f.weight"] = (HID,)
                names["lm_head.weight"] = (vpad // tp, HID)  # written even when tied (see convert.py)
            out[s * tp + r] = names
    return out


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return make_hf_llama(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def hf_tied(tmp_path_factory):
    return make_hf_llama(tmp_path_factory.mktemp("hf_tied"), tie_word_embeddings=True, seed=1)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2])
def test_names_shapes_per_rank(hf_model, tmp_path, tp, pp):
    summary = convert_checkpoint(hf_model, tmp_path, tp=tp, pp=pp)
    assert summary["files"] == ["config.json"] + [f"rank{r}.safetensors" for r in range(tp * pp)]
    assert summary["bytes"] == sum((tmp_path / f).stat().st_size for f in summary["files"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(summary["files"])
    for rank, names in expected_rank_shapes(tp, pp).items():
        path = tmp_path / f"rank{rank}.safetensors"
        loaded = load_file(path)  # the real safetensors library accepts the hand-written files
        assert {k: tuple(v.shape) for k, v in loaded.items()} == names, f"rank {rank}"
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                sl = f.get_slice(k)
                assert sl.get_dtype() == "F32" and tuple(sl.get_shape()) == names[k]
                assert torch.equal(f.get_tensor(k), loaded[k])
        # the hand-written header is 8-byte aligned JSON
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        assert n % 8 == 0 and json.loads(raw[8 : 8 + n])


def test_split_contents_kv_duplication_and_vocab_padding(hf_model, tmp_path):
    """tp=4 over 2 KV heads: rank r holds q heads [r], k/v head r // 2; lm_head rows padded with zeros."""
    hf = load_file(hf_model / "model.safetensors")
    tp = 4
    convert_checkpoint(hf_model, tmp_path, tp=tp)
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(tp)]
    p = "model.layers.1."
    q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    for r, w in enumerate(ranks):
        qkv = w["transformer.layers.1.attention.qkv.weight"]
        kv = r // (tp // KV)
        assert torch.equal(qkv[:D], q[r * D : (r + 1) * D])
        assert torch.equal(qkv[D : 2 * D], k[kv * D : (kv + 1) * D])
        assert torch.equal(qkv[2 * D :], v[kv * D : (kv + 1) * D])
        assert torch.equal(
            w["transformer.layers.1.attention.dense.weight"], hf[p + "self_attn.o_proj.weight"][:, r * D : (r + 1) * D]
        )
        n = INTER // tp
        assert torch.equal(w["transformer.layers.1.mlp.fc.weight"], hf[p + "mlp.gate_proj.weight"][r * n : (r + 1) * n])
        assert torch.equal(w["transformer.layers.1.mlp.gate.weight"], hf[p + "mlp.up_proj.weight"][r * n : (r + 1) * n])
        assert torch.equal(
            w["transformer.layers.1.mlp.proj.weight"], hf[p + "mlp.down_proj.weight"][:, r * n : (r + 1) * n]
        )
        assert torch.equal(w["transformer.vocab_embedding.weight"], hf["model.embed_tokens.weight"])
    lm = torch.cat([w["lm_head.weight"] for w in ranks])
    assert lm.shape[0] == 100 and torch.equal(lm[:V], hf["lm_head.weight"]) and not lm[V:].any()


def test_tp2_qkv_layout(hf_model, tmp_path):
    """tp=2 over 2 KV heads: no duplication, rank r = [q heads 2r, 2r+1; k head r; v head r]."""
    hf = load_file(hf_model / "model.safetensors")
    convert_checkpoint(hf_model, tmp_path, tp=2)
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    for r in range(2):
        qkv = load_file(tmp_path / f"rank{r}.safetensors")["transformer.layers.0.attention.qkv.weight"]
        assert torch.equal(
            qkv, torch.cat([q[2 * r * D : (2 * r + 2) * D], k[r * D : (r + 1) * D], v[r * D : (r + 1) * D]])
        )


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("tied", [False, True])
def test_merge_back_to_hf_bit_exact(hf_model, hf_tied, tmp_path, tp, pp, tied):
    src = hf_tied if tied else hf_model
    convert_checkpoint(src, tmp_path, tp=tp, pp=pp)
    cfg = json.loads((tmp_path / "config.json").read_text())
    merged = merge_ranks(tmp_path)
    hf = load_file(src / "model.safetensors")
    assert ("lm_head.weight" in merged) == (not tied)
    assert merged.keys() == hf_to_trtllm(hf, cfg).keys()
    back = trtllm_to_hf(merged, cfg)
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        assert t.dtype == back[name].dtype and torch.equal(t, back[name]), name


def test_tied_lm_head_is_the_embedding(hf_tied, tmp_path):
    convert_checkpoint(hf_tied, tmp_path, tp=2, pp=2)
    emb = load_file(tmp_path / "rank0.safetensors")["transformer.vocab_embedding.weight"]
    lm = torch.cat([load_file(tmp_path / f"rank{r}.safetensors")["lm_head.weight"] for r in (2, 3)])
    assert "lm_head.weight" not in load_file(tmp_path / "rank0.safetensors")  # first stage: embedding only
    assert torch.equal(lm[:V], emb) and not lm[V:].any()


def test_config_json(hf_tied, tmp_path):
    convert_checkpoint(hf_tied, tmp_path, tp=2, pp=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    want = {
        "architecture": "LlamaForCausalLM",
        "dtype": "float32",
        "logits_dtype": "float32",
        "vocab_size": V,
        "hidden_size": HID,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": H,
        "num_key_value_heads": KV,
        "head_size": D,
        "intermediate_size": INTER,
        "hidden_act": "silu",
        "norm_epsilon": 1e-5,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": 256,
        "rotary_base": 10000.0,
        "rotary_scaling": None,
        "rotary_embedding_dim": D,
        "tie_word_embeddings": True,
        "attn_bias": False,
        "mlp_bias": False,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    assert {k: cfg[k] for k in want} == want
    m = cfg["mapping"]
    assert (m["world_size"], m["tp_size"], m["pp_size"], m["cp_size"]) == (4, 2, 2, 1)
    assert "rank" not in m  # TRT-LLM drops it when saving


def test_config_llama3_rope_and_head_dim(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    hf = make_hf_llama(tmp_path / "hf", rope_scaling=scaling, rope_theta=500000.0, head_dim=32)
    convert_checkpoint(hf, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["rotary_base"] == 500000.0 and cfg["head_size"] == 32
    assert cfg["rotary_scaling"] == {
        "type": "llama3",
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }


def test_transformers4_style_config(tmp_path):
    """Older checkpoints carry rope_theta + rope_scaling + torch_dtype instead of rope_parameters + dtype."""
    hf = make_hf_llama(tmp_path)
    raw = json.loads((hf / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.pop("dtype", None)
    raw.update(rope_theta=123.0, torch_dtype="bfloat16", rope_scaling={"type": "linear", "factor": 2.0})
    (hf / "config.json").write_text(json.dumps(raw))
    spec = read_hf_config(hf)
    assert spec["rope_theta"] == 123.0 and spec["dtype"] == "bfloat16"
    assert spec["rope_scaling"] == {"type": "linear", "rope_type": "linear", "factor": 2.0}


def test_dtype_cast(hf_model, tmp_path):
    s = convert_checkpoint(hf_model, tmp_path, dtype="bfloat16")
    assert s["dtype"] == "bfloat16" and json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    w = load_file(tmp_path / "rank0.safetensors")
    hf = load_file(hf_model / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert torch.equal(w["transformer.layers.2.mlp.proj.weight"], hf["model.layers.2.mlp.down_proj.weight"].bfloat16())


def test_sharded_source_gives_identical_files(tmp_path):
    single = make_hf_llama(tmp_path / "single")
    sharded = make_hf_llama(tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(weight_files(sharded)) > 2
    assert list_weights(single).keys() == list_weights(sharded).keys()
    convert_checkpoint(single, tmp_path / "a", tp=2, pp=2)
    convert_checkpoint(sharded, tmp_path / "b", tp=2, pp=2)
    for r in range(4):
        assert (tmp_path / "a" / f"rank{r}.safetensors").read_bytes() == (
            tmp_path / "b" / f"rank{r}.safetensors"
        ).read_bytes()


def test_copy_paths_give_identical_files(tmp_path, monkeypatch):
    """File-to-file byte copies (copy_file_range), their pread fallback and the through-memory path agree."""
    import dataclasses

    from bpcompile.compiler import convert

    hf = make_hf_llama(tmp_path / "hf", tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    convert_checkpoint(hf, tmp_path / "fast", tp=4, pp=2)
    monkeypatch.setattr(convert, "FILE_TO_FILE", False)
    convert_checkpoint(hf, tmp_path / "pread", tp=4, pp=2)
    plan = convert.plan
    monkeypatch.setattr(convert, "plan", lambda *a: [dataclasses.replace(j, segments=None) for j in plan(*a)])
    convert_checkpoint(hf, tmp_path / "memory", tp=4, pp=2)
    for r in range(8):
        name = f"rank{r}.safetensors"
        fast = (tmp_path / "fast" / name).read_bytes()
        assert fast == (tmp_path / "pread" / name).read_bytes() == (tmp_path / "memory" / name).read_bytes(), name


def test_reader_matches_safe_open(hf_model):
    reader = TensorReader.for_dir(hf_model)
    weights = list_weights(hf_model)
    with safe_open(hf_model / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(weights)
        for name in f.keys():
            t = reader.get(name)
            assert torch.equal(t, f.get_tensor(name)) and weights[name][1:] == (t.dtype, tuple(t.shape))


def test_progress_reports_all_bytes(hf_model, tmp_path):
    seen = []
    convert_checkpoint(hf_model, tmp_path, tp=2, progress=lambda done, total: seen.append((done, total)))
    data = sum(
        t.numel() * t.element_size() for r in range(2) for t in load_file(tmp_path / f"rank{r}.safetensors").values()
    )
    assert seen[-1][0] == data and all(a <= b for (a, _), (b, _) in zip(seen, seen[1:]))


# ------------------------------------------------------------------------------------------- errors


def test_refuses_pickle_checkpoint(hf_model, tmp_path):
    (tmp_path / "config.json").write_text((hf_model / "config.json").read_text())
    torch.save(load_file(hf_model / "model.safetensors"), tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"pytorch_model\.bin.*safe_serialization=True"):
        convert_checkpoint(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "tp,pp,match",
    [
        (3, 1, r"parallel\.tp = 3 does not divide num_attention_heads = 4"),
        (8, 1, r"parallel\.tp = 8 does not divide num_attention_heads"),
        (1, 4, r"parallel\.pp = 4 is more than the 3 layers"),
        (0, 1, r"parallel\.tp must be a positive integer"),
    ],
)
def test_parallel_errors(hf_model, tmp_path, tp, pp, match):
    with pytest.raises(UserError, match=match) as e:
        convert_checkpoint(hf_model, tmp_path / "out", tp=tp, pp=pp)
    assert e.value.key.startswith("parallel.")
    assert not (tmp_path / "out").exists()


def test_kv_heads_not_splittable(tmp_path):
    hf = make_hf_llama(tmp_path / "hf", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(UserError, match=r"parallel\.tp = 2 and num_key_value_heads = 3"):
        convert_checkpoint(hf, tmp_path / "out", tp=2)
    hf12 = make_hf_llama(tmp_path / "hf12", num_attention_heads=12, num_key_value_heads=4, hidden_size=48)
    with pytest.raises(UserError, match=r"parallel\.tp = 6 and num_key_value_heads = 4"):
        convert_checkpoint(hf12, tmp_path / "out", tp=6)
    assert not (tmp_path / "out").exists()
    # 3 KV heads over 6 ranks: each duplicated twice, and merged back exactly
    convert_checkpoint(hf, tmp_path / "ok", tp=6)
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    back = trtllm_to_hf(merge_ranks(tmp_path / "ok"), cfg)
    hfw = load_file(hf / "model.safetensors")
    assert back.keys() == hfw.keys() and all(torch.equal(hfw[k], back[k]) for k in hfw)


def test_input_errors(hf_model, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_hf_config(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        read_hf_config(tmp_path / "empty")
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UserError, match="architecture 'GPT2LMHeadModel' is not supported"):
        read_hf_config(bad)
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text((hf_model / "config.json").read_text())
    with pytest.raises(UserError, match="no weights found"):
        convert_checkpoint(noweights, tmp_path / "out")
    # a tensor missing from the file, and one with the wrong shape
    w = load_file(hf_model / "model.safetensors")
    from safetensors.torch import save_file

    save_file({k: v for k, v in w.items() if k != "model.layers.1.mlp.up_proj.weight"}, noweights / "model.safetensors")
    with pytest.raises(UserError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        convert_checkpoint(noweights, tmp_path / "out")
    w["model.norm.weight"] = torch.ones(HID + 1)
    save_file(w, noweights / "model.safetensors")
    with pytest.raises(UserError, match=r"'model\.norm\.weight' has shape \[65\]"):
        convert_checkpoint(noweights, tmp_path / "out")
    # a truncated file
    raw = (hf_model / "model.safetensors").read_bytes()
    (noweights / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(UserError, match="truncated"):
        list_weights(noweights)
    # unsupported rope scaling
    raw_cfg = json.loads((hf_model / "config.json").read_text())
    raw_cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    (noweights / "config.json").write_text(json.dumps(raw_cfg))
    with pytest.raises(UserError, match="rope scaling type 'yarn' is not supported"):
        read_hf_config(noweights)


# ------------------------------------------------------------------------------------------- tokenizers


def write_tokenizer(d, vocab, merges, added=()):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens([AddedToken(a, special=True) for a in added])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    return d


def test_tokenizers_equal(tmp_path):
    vocab = {c: i for i, c in enumerate("abcdefgh")} | {"ab": 8, "abc": 9}
    merges = [("a", "b"), ("ab", "c")]
    a = write_tokenizer(tmp_path / "a", vocab, merges, ["<s>"])
    same = write_tokenizer(tmp_path / "same", dict(vocab), list(merges), ["<s>"])
    assert tokenizers_equal(a, same)[0]
    swapped = dict(vocab, a=1, b=0)  # same size, same tokens, two ids swapped
    ok, why = tokenizers_equal(a, write_tokenizer(tmp_path / "swapped", swapped, merges, ["<s>"]))
    assert not ok and "vocabularies differ in 2 tokens" in why
    ok, why = tokenizers_equal(a, write_tokenizer(tmp_path / "merges", vocab, [("a", "b")], ["<s>"]))
    assert not ok and "merges" in why
    ok, why = tokenizers_equal(a, write_tokenizer(tmp_path / "special", vocab, merges, ["</s>"]))
    assert not ok and "added/special tokens differ" in why
    ok, why = tokenizers_equal(a, tmp_path / "none")
    assert not ok and "no tokenizer.json" in why
    norm = write_tokenizer(tmp_path / "norm", vocab, merges, ["<s>"])
    t = json.loads((norm / "tokenizer.json").read_text())
    t["normalizer"] = {"type": "Lowercase"}
    (norm / "tokenizer.json").write_text(json.dumps(t))
    ok, why = tokenizers_equal(a, norm)
    assert not ok and "normalizer" in why
