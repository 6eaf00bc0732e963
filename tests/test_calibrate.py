"""KV calibration and the fidelity eval on small real checkpoints (random HF Llama -> converted)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_hf_llama

from bpcompile.compiler.calibrate import (
    KVCalibConfig,
    calibrate,
    calibrate_engine_stage,
    kv_loss_grad_sq,
    n_outlier_units,
)
from bpcompile.compiler.convert import convert_checkpoint
from bpcompile.core.errors import UserError
from bpcompile.eval.evaluate import (
    evaluate,
    evaluate_engine,
    evaluate_engine_report,
    inject_key_outliers,
    served,
    served_logits,
)
from bpcompile.runtime.kvcache import KVPlan, fake_quantize
from bpcompile.runtime.model import Llama, causal_attend

VOCAB = 300


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Converted 3-layer GQA Llama (4 heads / 2 KV heads, head 16, 12 units) + a matching tokenizer."""
    from pairs import make_tokenizer

    root = tmp_path_factory.mktemp("cal")
    hf = make_hf_llama(root / "hf", vocab_size=VOCAB)
    convert_checkpoint(hf, root / "ckpt")
    make_tokenizer(root / "tok", vocab=VOCAB)
    return root


@pytest.fixture(scope="module")
def model(ckpt):
    return Llama.from_checkpoint(ckpt / "ckpt")


def samples(n, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n, T), generator=g).tolist()


CFG = {"format": "int4-fp8-outlier", "outlier_fraction": 0.25, "group_size": 16, "page_size": 16}


def test_outlier_unit_count():
    assert n_outlier_units(0.08, 16) == 1 and n_outlier_units(0.08, 1280) == 102
    assert n_outlier_units(0.0, 16) == 0 and n_outlier_units(0.001, 16) == 1 and n_outlier_units(0.16, 16) == 3
    assert n_outlier_units(1.0, 12) == 12


def test_calibration_is_deterministic_and_picks_the_worst_units(model, tmp_path):
    s = samples(4, 32, 0)
    plan, report = calibrate(model, s, CFG)
    again, _ = calibrate(model, [list(x) for x in s], dict(CFG))
    plan.save(tmp_path / "a")
    again.save(tmp_path / "b")
    for f in ("plan.json", "scales.safetensors"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    units = [u for layer in report["layers"] for u in layer["units"]]
    assert len(units) == 12 and report["fp8_units"] == 3
    fp8 = [u for u in units if u["precision"] == "fp8"]
    worst_int4 = min(u["fisher_error"] for u in fp8)  # the units whose INT4 error moves the loss most
    assert len(fp8) == 3 and all(u["fisher_error"] <= worst_int4 for u in units if u["precision"] == "int4")
    assert report["outlier_selection"] == "fisher_error"
    assert report["rotation"] == "hadamard" and all(u["outlier_error"] < u["int4_error"] for u in units)
    assert [p[t][h] for p in plan.precision for t in "kv" for h in range(2)] == [u["precision"] for u in units]
    # another sample set is another measurement: the error table must change with the input
    other, _ = calibrate(model, samples(4, 32, 1), CFG)
    assert other.calibration["layers"] != plan.calibration["layers"]


def _loss(model, tok, attend) -> float:
    """Summed next-token NLL of tok [B, T] (inference forward, float64)."""
    logp = torch.log_softmax(model.forward(tok, attend=attend).double(), -1)
    return -logp[:, :-1].gather(-1, tok[:, 1:, None]).sum().item()


def test_loss_gradient_of_kv_matches_finite_differences(ckpt):
    """The Fisher pass's gradients (autograd through the layers walked by hand) against central differences
    of the plain inference forward with one K or V element moved."""
    m64 = Llama.from_checkpoint(ckpt / "ckpt", dtype=torch.float64)
    s = samples(2, 12, 5)
    g2 = kv_loss_grad_sq(m64, s, batch=2)
    tok = torch.tensor(s)
    for layer, kv in ((0, 1), (1, 0), (2, 0)):
        g = g2[layer][kv]
        b, t, h, d = (int(i) for i in torch.nonzero(g == g.max())[0])
        eps = 1e-2  # the forward returns float32 logits: a smaller step drowns in their rounding

        def moved(delta):
            def attend(i, q, k, v):
                if i == layer:
                    x = (k if kv == 0 else v).clone()
                    x[b, t, h, d] += delta
                    k, v = (x, v) if kv == 0 else (k, x)
                return causal_attend(q, k, v)

            return _loss(m64, tok, attend)

        fd = (moved(eps) - moved(-eps)) / (2 * eps)
        assert fd**2 == pytest.approx(g.max().item(), rel=1e-3)


def test_fisher_error_ranks_units_by_their_effect_on_the_loss(model):
    """The unit the plan ranks most loss-sensitive, quantized alone to INT4, raises the loss more than the unit it
    ranks least sensitive (measured with the plain forward and the oracle's fake quantization, not the estimate)."""
    s = samples(4, 32, 0)
    plan, report = calibrate(model, s, {**CFG, "outlier_fraction": 0.0})
    units = sorted((u for layer in report["layers"] for u in layer["units"]), key=lambda u: u["fisher_error"])
    tok = torch.tensor(s)
    base = _loss(model, tok, None)

    def quantized_alone(u):
        def attend(i, q, k, v):
            if i == u["layer"]:
                x = (k if u["kind"] == "k" else v).clone()
                h, kv = u["head"], int(u["kind"] == "v")  # the unit's own INT4 settings from the plan
                x[:, :, h] = fake_quantize(
                    x[:, :, h],
                    "int4",
                    plan.effective_group_size,
                    None if kv else plan.k_channel_scale[i, h],
                    float(plan.int4_clip[i, kv, h]),
                    None if kv else plan.k_mean[i, h],
                    plan.rotation == "hadamard",
                )
                k, v = (x, v) if u["kind"] == "k" else (k, x)
            return causal_attend(q, k, v)

        return abs(_loss(model, tok, attend) - base)

    assert quantized_alone(units[-1]) > 3 * quantized_alone(units[0])
    assert units[0]["fisher_error"] > 0


def test_quantized_cache_forward_and_eval(model):
    c = model.cfg
    tok = torch.tensor(samples(2, 24, 2))
    fp16 = KVPlan.uniform("fp16", c.num_layers, c.num_kv_heads, c.head_size)
    assert (served_logits(served(model, fp16, 2, 24), tok.tolist()) - model.forward(tok)).abs().max() < 1e-2
    plan, _ = calibrate(model, samples(4, 32, 0), CFG)
    rep = evaluate(model, {"fp16": "fp16", "int4-naive": "int4-naive", "ours": plan}, samples(4, 24, 3), batch=2)
    rows = {r["name"]: r for r in rep["rows"]}
    naive, ours = rows["int4-naive"], rows["ours"]
    assert naive["kl_vs_fp16"] > 1e-6 and ours["kl_vs_fp16"] > 1e-6
    assert 0 < sum(ours["attn_rel_error"]) < sum(naive["attn_rel_error"])
    # the compression reported is the format's arithmetic: per token and unit, INT4 D/2 bytes and FP8 D bytes,
    # each with an fp16 scale per group of G, against FP16's 2D (the static tables only nudge it at this size)
    D, G = c.head_size, CFG["group_size"]
    units = [p for layer in plan.precision for t in "kv" for p in layer[t]]
    per_unit = {"int4": D // 2 + 2 * D // G, "fp8": D + 2 * D // G}
    expected = 2 * D * len(units) / sum(per_unit[p] for p in units)
    assert ours["compression_vs_fp16"] == pytest.approx(expected, rel=0.03) and ours["compression_vs_fp16"] < expected
    assert "| ours |" in rep["markdown"]


def test_outlier_injection_preserves_function_and_hurts_naive_int4(model):
    inj = inject_key_outliers(model, factor=30.0)
    tok = torch.tensor(samples(2, 20, 4))
    assert (inj.forward(tok) - model.forward(tok)).abs().max() < 1e-4
    _, report = calibrate(inj, samples(4, 32, 0), {**CFG, "outlier_fraction": 0.0})
    for layer in report["layers"]:
        k0 = next(u for u in layer["units"] if u["kind"] == "k" and u["head"] == 0)  # the injected head
        assert k0["naive_int4_error"] > 3 * k0["int4_error"]
        assert k0["key_scale_alpha"] > 0  # channel scaling is what rescues it


def test_engine_stage_writes_plan(ckpt, tmp_path):
    out = tmp_path / "kv_plan"
    res = calibrate_engine_stage(ckpt / "ckpt", ckpt / "tok", CFG, {"samples": 2, "length": 24}, out)
    plan = KVPlan.load(out)
    assert plan.format == "int4-fp8-outlier" and res["compression_vs_fp16"] > 1
    meta = json.loads((out / "plan.json").read_text())
    assert meta["calibration"]["samples"]["n"] == 2 and len(meta["calibration"]["layers"]) == 3
    calibrate_engine_stage(ckpt / "ckpt", ckpt / "tok", {"format": "fp8"}, {}, tmp_path / "p8")
    assert KVPlan.load(tmp_path / "p8").precision[0]["v"] == ["fp8", "fp8"]
    with pytest.raises(UserError, match="format"):
        KVCalibConfig.from_dict({"format": "nf4"})


def test_speculative_greedy_equals_verifier_only_with_quantized_cache(ckpt, model, tmp_path):
    """Tree verification must read exactly the dequantized values sequential decode reads (per-token
    quantization + move() as a byte copy), so greedy speculation == verifier-only greedy, same cache."""
    from bpcompile.runtime.generator import Generator, SamplingParams
    from bpcompile.runtime.kvcache import kv_store_factory
    from bpcompile.runtime.speculative import TreeSpec

    draft_hf = make_hf_llama(
        tmp_path / "dhf",
        vocab_size=VOCAB,
        seed=1,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=48,
    )
    convert_checkpoint(draft_hf, tmp_path / "draft")
    draft = Llama.from_checkpoint(tmp_path / "draft")
    plan, _ = calibrate(model, samples(2, 24, 0), CFG)
    prompts = samples(2, 12, 7)
    params = SamplingParams(max_tokens=24)
    runs = []
    for d, tree in ((None, None), (draft, TreeSpec("dynamic", nodes=5)), (draft, TreeSpec("chain", length=3))):
        gen = Generator(model, d, tree, max_batch_size=2, max_seq_len=64, kv_store_factory=kv_store_factory(plan))
        runs.append([toks for toks, _ in gen.generate(prompts, params)])
    assert runs[0] == runs[1] == runs[2] and all(len(t) == 24 for t in runs[0])
    assert type(gen.vkv.store).__name__ == "QuantKVStore"  # the factory was used, not a float cache


def test_evaluate_engine(ckpt, tmp_path):
    import shutil

    eng = tmp_path / "engine"
    shutil.copytree(ckpt / "ckpt", eng / "verifier")
    shutil.copytree(ckpt / "tok", eng / "tokenizer")
    calibrate_engine_stage(eng / "verifier", eng / "tokenizer", CFG, {"samples": 2, "length": 24}, eng / "kv_plan")
    rep = evaluate_engine_report(eng, n=2, length=32, calib_n=2, calib_length=32)
    names = [r["name"] for r in rep["rows"]]
    assert names[:3] == ["fp16", "fp8", "int4-naive"] and names[-1] == "engine plan (int4-fp8-outlier)"
    assert rep["tokens"] == 64 and "| engine plan" in rep["markdown"]
    out = json.loads(evaluate_engine(eng, json_out=True, n=2, length=32, calib_n=2, calib_length=32))
    assert [r["name"] for r in out["rows"]] == names


def test_retrieval_probes_hold_the_key_where_they_say(ckpt):
    """Each probe's needle positions hold the key twice, the answer positions hold it once more, at the probe's
    depth, and the probe is about the asked length."""
    from bpcompile.compiler.corpus import retrieval_probes

    probes = retrieval_probes(ckpt / "tok", samples(4, 32, 3), n=3, length=96, seed=1)
    assert len(probes) == 3
    for i, p in enumerate(probes):
        ids, k = p["ids"], len(p["answer"])
        key = [ids[j] for j in p["answer"]]
        assert [ids[j] for j in p["needle"]] == key + key and p["answer"][-1] == len(ids) - 1
        assert abs(len(ids) - 96) <= 2 and p["needle"][0] < p["answer"][0] - k
        assert p["needle"][0] < len(ids) * (i + 1) / 3 + 12  # depth (i + 0.5) / n of the filler
    assert retrieval_probes(ckpt / "tok", samples(4, 32, 3), n=3, length=96, seed=1) == probes
    assert retrieval_probes(ckpt / "tok", samples(4, 32, 3), n=3, length=96, seed=2) != probes


def test_retrieval_scores_are_transformers_attention_on_the_needle(ckpt, model):
    """The score of a KV unit is, for its most needle-attending query head, the attention weight on the needle's
    tokens averaged over the positions that predict the answer's key: recomputed from transformers' own
    attention probabilities (eager attention, output_attentions) of the unconverted checkpoint."""
    from transformers import AutoModelForCausalLM

    from bpcompile.compiler.calibrate import retrieval_scores
    from bpcompile.compiler.corpus import retrieval_probes

    probes = retrieval_probes(ckpt / "tok", samples(4, 32, 4), n=2, length=80)
    hf = AutoModelForCausalLM.from_pretrained(ckpt / "hf", dtype=torch.float32, attn_implementation="eager").eval()
    want = torch.zeros(3, 4)
    for p in probes:
        with torch.no_grad():
            att = hf(torch.tensor([p["ids"]]), output_attentions=True).attentions  # L x [1, H, T, T]
        q = torch.tensor(p["answer"]) - 1
        for layer, a in enumerate(att):
            want[layer] += a[0][:, q][:, :, p["needle"]].sum(-1).mean(-1) / len(probes)
    got = retrieval_scores(model, probes)
    assert got.shape == (3, 2)
    torch.testing.assert_close(got, want.reshape(3, 2, 2).amax(-1), atol=1e-5, rtol=1e-4)


def test_retrieval_units_take_int8_before_the_outlier_units(model, ckpt, tmp_path):
    """The keys of the highest-scoring units are stored in INT8, the outlier units are then chosen among the
    others by their loss-based order, and the plan's bytes are what the memory plan counts for the recipe."""
    from bpcompile.compiler.calibrate import measure_units, plan_from_measurement

    m = measure_units(model, samples(4, 32, 0), KVCalibConfig.from_dict(CFG))
    score = torch.tensor([[0.1, 0.2], [0.9, 0.3], [0.0, 0.8]])  # (layer 1, head 0) then (2, 1) then (1, 1)
    plan, rep = plan_from_measurement(m, model.cfg, 0.25, retrieval=score, retrieval_fraction=2 / 12)
    assert plan.precision[1]["k"][0] == plan.precision[2]["k"][1] == "int8"
    assert rep["retrieval_units"] == 2 and rep["fp8_units"] == 3
    alone, _ = plan_from_measurement(m, model.cfg, 0.25)
    order = sorted(range(12), key=lambda u: (-m["units"][u]["fisher_error"], u))
    want = [
        u
        for u in order
        if (m["units"][u]["layer"], m["units"][u]["kind"], m["units"][u]["head"]) not in {(1, "k", 0), (2, "k", 1)}
    ][:3]
    fp8 = [i for i, u in enumerate(m["units"]) if plan.precision[u["layer"]][u["kind"]][u["head"]] == "fp8"]
    assert sorted(want) == fp8 and sum(x == "fp8" for p in alone.precision for x in p["k"] + p["v"]) == 3
    # bytes per token: 2 INT8 + 3 FP8 units of (16 + 2) bytes, 7 INT4 units of (8 + 2)
    assert plan.bytes_per_token() == 5 * 18 + 7 * 10
    # INT5 keys (the middle third of 3 layers: layer 1) come first; retrieval and FP8 units among the rest
    p5, rep5 = plan_from_measurement(m, model.cfg, 0.25, retrieval=score, retrieval_fraction=1 / 12, int5_keys="middle")
    assert p5.precision[1]["k"] == ["int5", "int5"] and rep5["int5_units"] == 2
    assert p5.precision[2]["k"][1] == "int8" and rep5["retrieval_units"] == 1  # (1, 0) scores higher but is INT5
    assert sum(x == "fp8" for p in p5.precision for x in p["k"] + p["v"]) == 3
    # 2 INT5 units of (10 + 2) bytes, 1 INT8 and 3 FP8 of (16 + 2), 6 INT4 of (8 + 2)
    assert p5.bytes_per_token() == 2 * 12 + 4 * 18 + 6 * 10
    # INT6 keys (the first third: layer 0) with them, and half the 6 value units in INT3: the 3 least sensitive,
    # those of the INT5 keys' layer (1) last; the 3 FP8 units are the most sensitive of what is left
    p6, rep6 = plan_from_measurement(m, model.cfg, 0.25, int5_keys="middle", int6_keys="early", int3_values=0.5)
    assert p6.precision[0]["k"] == ["int6", "int6"] and p6.precision[1]["k"] == ["int5", "int5"]
    values = sorted((u for u in m["units"] if u["kind"] == "v"), key=lambda u: (u["layer"] == 1, u["fisher_error"]))
    assert {(u["layer"], u["head"]) for u in values[:3]} == {
        (layer, h) for layer in range(3) for h in range(2) if p6.precision[layer]["v"][h] == "int3"
    }
    rest = sorted(
        (
            u
            for u in m["units"]
            if p6.precision[u["layer"]][u["kind"]][u["head"]] != "int3" and not (u["kind"] == "k" and u["layer"] < 2)
        ),
        key=lambda u: -u["fisher_error"],
    )
    assert [p6.precision[u["layer"]][u["kind"]][u["head"]] for u in rest] == ["fp8"] * 3 + ["int4"] * (len(rest) - 3)
    assert (rep6["int6_units"], rep6["int5_units"], rep6["int3_units"], rep6["fp8_units"]) == (2, 2, 3, 3)
    # 2 INT6 units of (12 + 2) bytes, 2 INT5 of (10 + 2), 3 INT3 of (6 + 2), 3 FP8 of (16 + 2), 2 INT4 of (8 + 2)
    assert p6.bytes_per_token() == 2 * 14 + 2 * 12 + 3 * 8 + 3 * 18 + 2 * 10
    # two thirds of them: every value outside the INT5 keys' layer, none of its own, whatever their sensitivity
    p7, _ = plan_from_measurement(m, model.cfg, 0.0, int5_keys="middle", int6_keys="early", int3_values=2 / 3)
    assert [p7.precision[layer]["v"] for layer in range(3)] == [["int3"] * 2, ["int4"] * 2, ["int3"] * 2]
    res = calibrate_engine_stage(
        ckpt / "ckpt",
        ckpt / "tok",
        {**CFG, "int6_keys": "early", "int3_values": 0.5},
        {"samples": 2, "length": 24},
        tmp_path / "kv6",
    )
    assert "keys of layers 0-0 INT6" in res["detail"] and "3 value units INT3" in res["detail"], res["detail"]
    assert KVPlan.load(tmp_path / "kv6").precision[0]["k"] == ["int6", "int6"]
    for bad in ({"int6_keys": "late"}, {"int3_values": 1.5}, {"int3_values": True}):
        with pytest.raises(UserError, match=next(iter(bad))):
            KVCalibConfig.from_dict({**CFG, **bad})
    res = calibrate_engine_stage(
        ckpt / "ckpt", ckpt / "tok", {**CFG, "int5_keys": "middle"}, {"samples": 2, "length": 24}, tmp_path / "kv5"
    )
    assert "keys of layers 1-1 INT5" in res["detail"] and not res["fp8_units"][0].startswith("L1.k")
    assert KVPlan.load(tmp_path / "kv5").precision[1]["k"] == ["int5", "int5"]
    res = calibrate_engine_stage(
        ckpt / "ckpt", ckpt / "tok", {**CFG, "retrieval_fraction": 0.1}, {"samples": 2, "length": 24}, tmp_path / "kv"
    )
    assert len(res["retrieval_units"]) == 1 and "retrieval keys INT8" in res["detail"]
    saved = KVPlan.load(tmp_path / "kv")
    assert sum(x == "int8" for p in saved.precision for x in p["k"]) == 1
    with pytest.raises(UserError, match="retrieval_fraction"):
        KVCalibConfig.from_dict({**CFG, "retrieval_fraction": 0.6})
    with pytest.raises(UserError, match="probes"):
        calibrate(model, samples(2, 16, 0), {**CFG, "retrieval_fraction": 0.1})


def test_klt_keys_are_fit_where_asked_and_speculation_stays_identical(ckpt, model, tmp_path):
    """key_transform: klt stores the INT4 keys of the first two thirds of the layers as KLT4 units: bits summing to
    4 x head size, an orthonormal basis (to float16 rounding), the same payload bytes; tree speculation over such a cache
    (tree entries written at their depth's position, then moved) gives verifier-only greedy output."""
    from bpcompile.compiler.calibrate import klt_key_layers
    from bpcompile.runtime.generator import Generator, SamplingParams
    from bpcompile.runtime.kvcache import kv_store_factory
    from bpcompile.runtime.speculative import TreeSpec

    plan, report = calibrate(model, samples(4, 24, 0), CFG | {"outlier_fraction": 0.0, "key_transform": "klt"})
    L, D = plan.num_layers, plan.head_size
    assert list(klt_key_layers(L)) == [0, 1] and report["klt_units"] == 4
    assert [p["k"] for p in plan.precision] == [["klt4"] * 2, ["klt4"] * 2, ["int4"] * 2]
    none, _ = calibrate(model, samples(4, 24, 0), CFG | {"outlier_fraction": 0.0})
    assert plan.bytes_per_token() == none.bytes_per_token()
    for layer in range(2):
        for h in range(2):
            assert int(plan.klt["bits"][layer, h].long().sum()) == 4 * D
            V = plan.klt["basis"][layer, h].float()
            assert V.dtype == torch.float32 and (V.T @ V - torch.eye(D)).abs().max() < 0.01
    draft_hf = make_hf_llama(
        tmp_path / "dhf",
        vocab_size=VOCAB,
        seed=1,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=48,
    )
    convert_checkpoint(draft_hf, tmp_path / "draft")
    draft = Llama.from_checkpoint(tmp_path / "draft")
    prompts, params, runs = samples(2, 12, 7), SamplingParams(max_tokens=24), []
    for d, tree in ((None, None), (draft, TreeSpec("dynamic", nodes=5))):
        for dense in (True, False):
            gen = Generator(
                model,
                d,
                tree,
                max_batch_size=2,
                max_seq_len=64,
                kv_store_factory=kv_store_factory(plan),
                dense_kv=dense,
                backoff=False,
            )
            runs.append([toks for toks, _ in gen.generate(prompts, params)])
    assert all(r == runs[0] for r in runs) and all(len(t) == 24 for t in runs[0])
    assert gen.vkv.store.positions is not None  # the KLT store, recording positions


def test_klt_keys_keep_the_bands_bits(ckpt, model, tmp_path):
    """With INT6 keys in the first third and INT5 in the middle, key_transform: klt stores them as KLT6 / KLT5 units
    (bits summing to 6 / 5 x head size, the same payload bytes), also with a group size below the head size; a KLT6
    unit reads back held-out keys closer to what was written than the same unit as KLT4."""
    from bpcompile.compiler.calibrate import capture_qkv
    from bpcompile.runtime.kvcache import QuantKVStore

    cfg = CFG | {
        "outlier_fraction": 0.0,
        "group_size": 64,
        "int6_keys": "early",
        "int5_keys": "middle",
        "int3_values": 0.5,
    }
    plan, _ = calibrate(model, samples(4, 24, 0), cfg | {"key_transform": "klt"})
    none, _ = calibrate(model, samples(4, 24, 0), cfg)
    D = plan.head_size
    assert [p["k"] for p in plan.precision] == [["klt6"] * 2, ["klt5"] * 2, ["int4"] * 2]
    assert [p["k"] for p in none.precision] == [["int6"] * 2, ["int5"] * 2, ["int4"] * 2]
    assert plan.bytes_per_token() == none.bytes_per_token()
    assert {int(plan.klt["bits"][0, h].long().sum()) for h in range(2)} == {6 * D}
    assert {int(plan.klt["bits"][1, h].long().sum()) for h in range(2)} == {5 * D}
    _, _, k, v = next(iter(capture_qkv(model, samples(1, 24, 3))))  # layer 0's keys (after RoPE), held out
    T = k.shape[1]
    errs = []
    klt4, _ = calibrate(
        model, samples(4, 24, 0), CFG | {"outlier_fraction": 0.0, "group_size": 64, "key_transform": "klt"}
    )
    assert klt4.precision[0]["k"] == ["klt4"] * 2
    # a group size below the head size: the other units get more scales, a KLT unit keeps one per token
    fine, _ = calibrate(model, samples(4, 24, 0), cfg | {"key_transform": "klt", "group_size": D // 2})
    assert [p["k"] for p in fine.precision] == [p["k"] for p in plan.precision] and fine.effective_group_size == D // 2
    assert fine.bytes_per_token() == plan.bytes_per_token() + (12 - 4) * 2  # as many INT3 values, other ones
    for p in (plan, klt4, fine):
        store = QuantKVStore(p, num_pages=4, page_size=16)
        slots, pos = torch.arange(16, 16 + T), torch.arange(T)
        store.write(0, slots, k[0], v[0], positions=pos)
        errs.append(float((store.read(0, slots)[0].float() - k[0]).pow(2).mean()))
    assert errs[0] < 0.5 * errs[1], errs  # two more bits a coefficient: a quarter of the squared error, roughly
    assert errs[2] == errs[0]  # the KLT units' codes do not depend on the other units' group size
    res = calibrate_engine_stage(
        ckpt / "ckpt", ckpt / "tok", cfg | {"key_transform": "klt"}, {"samples": 2, "length": 24}, tmp_path / "kv"
    )
    assert "keys of layers 0-1 KLT (before RoPE; layers 0-0 KLT6; layers 1-1 KLT5)" in res["detail"], res["detail"]


def test_klt_keys_lower_the_shipped_tiny_verifiers_held_out_kl(tmp_path):
    """On a trained model (the shipped tiny verifier) the same plan with its keys of the first two thirds of the
    layers as KLT4 units has a lower held-out KL vs FP16 KV than with them Hadamard-rotated INT4 (same bytes)."""
    from pathlib import Path

    from bpcompile.compiler.corpus import _windows, calibration_samples, heldout_documents

    tiny = Path(__file__).resolve().parents[1] / "models" / "tiny" / "verifier"
    convert_checkpoint(tiny, tmp_path / "ck")
    v = Llama.from_checkpoint(tmp_path / "ck")
    cal = calibration_samples(tiny / "tokenizer.json", 16, 128)
    held = _windows(tiny / "tokenizer.json", heldout_documents(), 128, 16, 0, "held-out")
    cfg = {"format": "int4-fp8-outlier", "outlier_fraction": 0.0, "group_size": 64}
    plans = {kt: calibrate(v, cal, cfg | {"key_transform": kt})[0] for kt in ("none", "klt")}
    rows = {r["name"]: r for r in evaluate(v, plans, held)["rows"]}
    assert rows["klt"]["kl_vs_fp16"] < 0.8 * rows["none"]["kl_vs_fp16"]
