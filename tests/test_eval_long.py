"""`bpcompile eval` beyond the next token, on the shipped tiny pair: the evaluation text (--text), passkey
retrieval, greedy-continuation parity, and FP16 KV meaning FP16 whatever the model's dtype."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import write_engine_config  # noqa: E402

from bpcompile.cli import main
from bpcompile.compiler.calibrate import calibrate_engine_stage
from bpcompile.compiler.convert import convert_checkpoint
from bpcompile.core.store import artifact_hashes
from bpcompile.eval.evaluate import passkey_trials, served, served_logits
from bpcompile.runtime.generator import Generator, SamplingParams
from bpcompile.runtime.kvcache import KVPlan, kv_store_factory
from bpcompile.runtime.model import Llama
from bpcompile.runtime.speculative import TreeSpec

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny" / "verifier"
KV = {"format": "int4-fp8-outlier", "outlier_fraction": 0.08, "group_size": 64, "page_size": 16}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """An engine version of the tiny verifier (converted checkpoint, tokenizer, calibrated KV plan)."""
    eng = tmp_path_factory.mktemp("eng")
    convert_checkpoint(TINY, eng / "verifier")
    (eng / "tokenizer").mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, eng / "tokenizer" / f)
    calibrate_engine_stage(eng / "verifier", eng / "tokenizer", KV, {"samples": 2, "length": 64}, eng / "kv_plan")
    (eng / "manifest.json").write_text(json.dumps({"artifacts": artifact_hashes(eng)}))  # eval verifies it
    return eng


@pytest.fixture(scope="module")
def verifier(engine):
    return Llama.from_checkpoint(engine / "verifier")


def run_eval(engine, *args):
    res = CliRunner().invoke(main, ["eval", str(engine), "--json", "--sequences", "2", "--length", "64", *args])
    return res


@pytest.mark.parametrize("window", [0, 4])
def test_teacher_forced_eval_reads_what_the_runtime_decode_reads(verifier, window):
    """served_logits (the prompt prefilled, the tail fed in chains of 6 through the runtime's tree-verify forward)
    must pick, at every step, the token the runtime's greedy decode (one token a step) picks over the same quantized
    cache, exact entries included, and give the logits of the reference decoder built from positions alone; with
    an FP16 cache it must match a plain full-precision forward."""
    from dataclasses import replace

    from kv_oracle import decode_logits, prefix_kv

    prompt = torch.randint(5, 4000, (40,), generator=torch.Generator().manual_seed(window)).tolist()
    c = verifier.cfg
    plan = replace(KVPlan.uniform("int4-naive", c.num_layers, c.num_kv_heads, c.head_size), recent_window=window)
    gen = Generator(
        verifier, None, TreeSpec("none"), max_batch_size=1, max_seq_len=64, kv_store_factory=kv_store_factory(plan)
    )
    out = gen.generate([prompt], SamplingParams(max_tokens=16))[0][0]
    got = served_logits(served(verifier, plan, 1, 56, 6), [prompt + out], len(prompt))[0, len(prompt) - 1 : -1]
    assert got.argmax(-1).tolist() == out  # the first token comes from the prefill, the rest from decode steps
    torch.testing.assert_close(
        got[1:], decode_logits(verifier, prefix_kv(verifier, prompt), out[:-1], plan), atol=1e-3, rtol=0
    )
    fp16 = KVPlan.uniform("fp16", c.num_layers, c.num_kv_heads, c.head_size)
    full = verifier.forward(torch.tensor([prompt + out]))[0, len(prompt) : -1]
    got16 = served_logits(served(verifier, fp16, 1, 56, 6), [prompt + out], len(prompt))[0, len(prompt) : -1]
    torch.testing.assert_close(got16, full, atol=2e-2, rtol=0)


def test_passkey_counts_the_key_as_a_number_of_its_own():
    from bpcompile.eval.evaluate import key_in

    assert key_in(" 41704. Remember", "41704") and key_in(" a41704", "41704") and key_in("is: 41704", "41704")
    assert not key_in(" 417041", "41704") and not key_in(" 4170", "41704") and not key_in("", "41704")


def test_passkey_trials_hide_the_key_at_the_asked_length():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    ts = passkey_trials(tok, 256, 6, seed=3)
    assert ts == passkey_trials(tok, 256, 6, seed=3)  # deterministic per seed
    for t in ts:
        key = tok.decode(t["ids"][t["key_start"] :]).strip()
        assert key.isdigit() and len(key) == 5
        haystack = tok.decode(t["ids"][: t["prompt_len"]])
        assert f"pass key is {key}." in haystack and haystack.rstrip().endswith("What is the pass key?")
        assert 0.8 * 256 <= t["prompt_len"] <= 1.2 * 256
    assert len({t["depth"] for t in ts}) > 1


def test_paired_difference_of_passkey_outcomes():
    from bpcompile.eval.evaluate import paired_difference

    d = paired_difference([1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 0, 1])
    assert d["points"] == pytest.approx(100 / 6, abs=0.01) and (d["only_this"], d["only_fp16"]) == (2, 1)
    lo, hi = d["interval_points"]
    assert -100 < lo < d["points"] < hi < 100  # quantiles of resamples, not their extremes
    same = paired_difference([1, 0, 1, 1] * 25, [1, 0, 1, 1] * 25)
    assert same == {"points": 0.0, "only_this": 0, "only_fp16": 0, "interval_points": [0.0, 0.0]}
    with pytest.raises(ValueError):
        paired_difference([1, 0], [1])


def test_eval_passkey_and_parity_on_tiny_sizes(engine):
    res = run_eval(
        engine,
        "--plans",
        "int4-naive,engine",
        "--passkey",
        "128,256",
        "--passkey-trials",
        "2",
        "--parity-prompts",
        "3",
        "--parity-tokens",
        "8",
    )
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    names = [r["name"] for r in rep["rows"]]
    assert names == ["fp16", "int4-naive", "engine plan (int4-fp8-outlier)"]
    assert rep["text"].startswith("builtin:pydoc-topics held-out split") and rep["calibration_domain"] is True
    assert "(the calibration text's domain)" in rep["markdown"]
    pk = rep["passkey"]
    assert pk["lengths"] == [128, 256] and pk["trials"] == 2 and set(pk["accuracy"]) == set(names)
    assert all(0 <= a <= 1 for acc in pk["accuracy"].values() for a in acc.values())
    for n in names:  # per-trial outcomes behind each accuracy, and the paired comparison drawn from them
        for L in ("128", "256"):
            h, f = pk["hits"][n][L], pk["hits"]["fp16"][L]
            assert len(h) == 2 and sum(h) / 2 == pk["accuracy"][n][L]
            if n != "fp16":
                d = pk["vs_fp16"][n][L]
                assert (d["only_this"], d["only_fp16"]) == (
                    sum(x > y for x, y in zip(h, f)),
                    sum(x < y for x, y in zip(h, f)),
                )
    assert "fp16" not in pk["vs_fp16"] and "vs FP16 KV, same trials" in rep["markdown"]
    gp = rep["parity"]
    assert gp["prompts"] == 3 and gp["tokens"] == 8 and set(gp["identical"]) == set(names)
    assert gp["identical"]["fp16"] == 1.0 and gp["mean_identical_prefix"]["fp16"] == 8
    assert "passkey @128" in rep["markdown"] and "identical greedy continuations" in rep["markdown"]


def test_eval_text_file_is_used_and_named(engine, tmp_path):
    from bpcompile.compiler import corpus

    f = tmp_path / "mine.txt"
    f.write_text(corpus.train_text()[:20000])
    a = json.loads(run_eval(engine, "--plans", "fp8", "--text", str(f)).stdout)
    b = json.loads(run_eval(engine, "--plans", "fp8").stdout)
    assert str(f) in a["text"] and "sha256" in a["text"] and str(f) in a["markdown"]
    assert a["rows"][0]["ppl"] != b["rows"][0]["ppl"]  # other text, other perplexity
    assert a["calibration_domain"] is False and "(not the calibration text's domain)" in a["markdown"]


def test_calibration_domain_follows_the_engines_calibration_source(tmp_path):
    from bpcompile.eval.evaluate import calibration_domain

    text, other = tmp_path / "t.txt", tmp_path / "o.txt"
    text.write_text("some text")
    other.write_text("other text")
    copy = tmp_path / "copy.txt"
    copy.write_text("some text")
    assert calibration_domain(tmp_path, None) and not calibration_domain(tmp_path, text)  # no recipe.yaml: builtin
    for source, on_file, on_builtin in (
        (text, True, False),
        (other, False, False),
        ("builtin:pydoc-topics", False, True),
    ):
        (tmp_path / "recipe.yaml").write_text(f"calibration: {{source: '{source}'}}\n")
        assert calibration_domain(tmp_path, copy) is on_file and calibration_domain(tmp_path, None) is on_builtin


@pytest.mark.parametrize(
    "content, why", [(None, "expected a UTF-8 text file"), (b"\xff\xfe\x00bad", "not UTF-8"), (b"too short", "windows")]
)
def test_eval_text_bad_input_is_a_clear_error(engine, tmp_path, content, why):
    f = tmp_path / "t.txt"
    if content is not None:
        f.write_bytes(content)
    res = run_eval(engine, "--text", str(f))
    assert res.exit_code == 2 and why in res.output and "Traceback" not in res.output


def test_eval_unknown_plan_and_bad_length_are_clear_errors(engine):
    res = run_eval(engine, "--plans", "int3")
    assert res.exit_code == 2 and "int3" in res.output and "engine" in res.output
    res = run_eval(engine, "--passkey", "5x")
    assert res.exit_code == 2 and "5x" in res.output


def test_fp16_kv_format_stores_fp16_for_an_fp32_model(engine, tmp_path):
    """recipe kv_cache.format fp16 (no KV plan) must give an FP16 cache, not one in the model's dtype."""
    eng = tmp_path / "e"
    shutil.copytree(engine / "verifier", eng / "verifier")
    write_engine_config(
        eng, kv_cache={"format": "fp16", "page_size": 16}, limits={"max_seq_len": 64, "max_input_len": 32}
    )
    gen = Generator.from_engine(eng)
    assert gen.verifier.dtype == torch.float32
    assert gen.vkv.store.dtype == torch.float16 and gen.vkv.store.k.dtype == torch.float16


def test_engine_tokenizer_keeps_the_chat_template(tmp_path):
    """Passkey prompts go through the chat template, which transformers 5 saves in its own file."""
    from bpcompile.compiler.pipeline import _copy_tokenizer

    src = tmp_path / "ckpt"
    src.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, src / f)
    (src / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    _copy_tokenizer(src, tmp_path / "tok")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"


def test_exact_entries_in_the_teacher_forced_eval(verifier):
    """served_logits with exact entries: a window (or a sink) covering every position reads FP16 K/V everywhere, so
    it equals the FP16 cache; a sink of 1 and a window of 8 lie in between, closer to FP16 than the plain plan."""
    from dataclasses import replace

    c = verifier.cfg
    tok = torch.randint(5, 4000, (2, 48), generator=torch.Generator().manual_seed(1)).tolist()
    run = lambda plan: served_logits(served(verifier, plan, 2, 48, 6), tok)  # noqa: E731
    base = KVPlan.uniform("int4-naive", c.num_layers, c.num_kv_heads, c.head_size)
    fp16 = run(KVPlan.uniform("fp16", c.num_layers, c.num_kv_heads, c.head_size))
    quant = run(base)
    torch.testing.assert_close(run(replace(base, recent_window=48)), fp16, atol=1e-4, rtol=0)
    torch.testing.assert_close(run(replace(base, sink_tokens=48)), fp16, atol=1e-4, rtol=0)
    mid = run(replace(base, sink_tokens=1, recent_window=8))
    assert (mid - fp16).abs().max() > 1e-2 and (mid - quant).abs().max() > 1e-2
    assert (mid - fp16).abs().mean() < (quant - fp16).abs().mean()
