"""Logits parity: bpcompile's Llama on a converted checkpoint vs transformers on the original HF one.

This is the executable proof that conversion (names, fused qkv, splits, KV duplication, vocab padding,
pp layer ranges, config fields) is right: any misplaced tensor moves the logits far beyond 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, make_hf_model

from bpcompile.compiler.convert import convert_checkpoint
from bpcompile.compiler.hf import tokenizers_equal
from bpcompile.runtime.model import Llama

TOL = 1e-4
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def hf_logits(hf_dir, tokens, positions):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(tokens, position_ids=positions).logits


def compare(hf_dir, out_dir, tp, pp, T=24, start=0, seed=0):
    convert_checkpoint(hf_dir, out_dir, tp=tp, pp=pp)
    model = Llama.from_checkpoint(out_dir)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, T), generator=g)
    positions = (torch.arange(T) + start).expand(2, T)
    ref = hf_logits(hf_dir, tokens, positions)
    got = model(tokens, positions)
    assert got.shape == ref.shape
    return (got - ref).abs().max().item(), ref, tokens, positions


CASES = {
    # name: (arch, config overrides, tp, pp, first position)
    "gqa-tp2-pp2": ("llama", {}, 2, 2, 0),  # 3 layers over 2 stages: 2 + 1
    "mha-tp4": ("llama", {"num_key_value_heads": 4}, 4, 1, 0),
    "tied-vocab-pad-tp2-pp2": ("llama", {"tie_word_embeddings": True}, 2, 2, 0),  # vocab 97 padded to 98
    "head-dim-32-tp2": ("llama", {"head_dim": 32}, 2, 1, 0),  # head_dim != hidden / heads (16)
    "llama3-rope-kvdup-tp4": ("llama", {"rope_scaling": LLAMA3}, 4, 1, 100),  # 2 KV heads over 4 ranks
    "bias-tp2-pp2": ("llama", {"attention_bias": True, "mlp_bias": True}, 2, 2, 0),
    "mistral-tp1": ("mistral", {}, 1, 1, 0),
    "qwen2-qkv-bias-tp2": ("qwen2", {"tie_word_embeddings": True}, 2, 1, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_parity(tmp_path, case):
    arch, overrides, tp, pp, start = CASES[case]
    hf = make_hf_model(tmp_path / "hf", arch, **overrides)
    diff, ref, _, _ = compare(hf, tmp_path / "trt", tp, pp, start=start)
    assert ref.abs().max() > 1.0  # logits are not trivially small
    assert diff <= TOL, f"{case}: max |logits diff| {diff:.2e}"


def test_parity_detects_a_wrong_config(tmp_path):
    """The comparison can fail: drop the llama3 rope scaling from the converted config and it does."""
    hf = make_hf_model(tmp_path / "hf", rope_scaling=LLAMA3)
    out = tmp_path / "trt"
    diff, ref, tokens, positions = compare(hf, out, 2, 1, start=100)
    assert diff <= TOL
    cfg = json.loads((out / "config.json").read_text())
    cfg["rotary_scaling"] = None
    (out / "config.json").write_text(json.dumps(cfg))
    bad = (Llama.from_checkpoint(out)(tokens, positions) - ref).abs().max().item()
    assert bad > 100 * TOL


@pytest.mark.parametrize("which", ["verifier", "draft"])
@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_pair_parity(tmp_path, which, tp):
    hf = TINY / which
    if not (hf / "config.json").is_file():
        pytest.skip(f"{hf} not present")
    diff, *_ = compare(hf, tmp_path / "trt", tp, 1, T=32)
    assert diff <= TOL, f"tiny {which} tp={tp}: max |logits diff| {diff:.2e}"


def test_tiny_pair_shares_tokenizer():
    if not (TINY / "verifier" / "tokenizer.json").is_file() or not (TINY / "draft" / "tokenizer.json").is_file():
        pytest.skip("tiny pair not present")
    ok, reason = tokenizers_equal(TINY / "verifier", TINY / "draft")
    assert ok, reason


@pytest.mark.slow
def test_bf16_greedy_matches_transformers_up_to_ties(tmp_path):
    """The runtime in bf16 (verifier only, and drafting a dynamic tree) against transformers' bf16 greedy on the
    tiny pair: where the two differ, transformers' own two best logits at the first differing token are within
    one bf16 ulp (a tie that rounding decides), and most prompts do not differ at all."""
    from tokenizers import Tokenizer

    from bpcompile.compiler.corpus import heldout_prompts
    from bpcompile.eval.hf_parity import check_near_ties, greedy_parity
    from bpcompile.runtime.speculative import TreeSpec

    if not (TINY / "verifier" / "config.json").is_file():
        pytest.skip("tiny pair not present")
    models = {}
    for which in ("verifier", "draft"):
        convert_checkpoint(TINY / which, tmp_path / which)
        models[which] = Llama.from_checkpoint(tmp_path / which, dtype=torch.bfloat16)
    prompts = heldout_prompts(Tokenizer.from_file(str(TINY / "verifier" / "tokenizer.json")), 16, 16)
    report = greedy_parity(
        TINY / "verifier",
        models["verifier"],
        models["draft"],
        prompts,
        32,
        {"verifier only": TreeSpec("none"), "dynamic tree": TreeSpec("dynamic", nodes=5)},
    )
    assert not check_near_ties(report, max_ulps=1.0, max_share=0.25), report
    assert report["dynamic tree"]["divergences"] == report["verifier only"]["divergences"]
