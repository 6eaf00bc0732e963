"""KV fidelity eval: run the verifier *through* a quantized cache and compare with FP16 KV.

Every layer's K/V is written to a real `KVStore` (quantize-and-append) and read back dequantized;
each position attends to the dequantized cache of earlier positions and of itself (in decode a
token's own K/V is appended before it is attended to, so it is quantized too). Per-token
quantization makes this teacher-forced pass read exactly what sequential decode would read.

Metrics per plan: held-out perplexity, teacher-forced top-1 agreement with the FP16-KV verifier,
relative attention-output error per layer (same q/k/v, quantized vs FP16 cache), and compression
from the bytes the store allocates. `inject_key_outliers` builds the function-preserving
outlier-injected model the INT4+FP8 plan must clearly win on.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from .errors import UserError
from .calibrate import KVCalibConfig, measure_units, plan_from_measurement
from .kvcache import FloatKVStore, KVPlan, make_kv_store
from .model import Llama, causal_attend

PAGE = 16
STANDARD_FRACTIONS = (0.0, 0.04, 0.08, 0.16)


def allocated_compression(plan: KVPlan, model_cfg, num_pages: int = 256, page_size: int = PAGE) -> float:
    """FP16 cache bytes / this plan's cache bytes, both from the stores' nbytes() (scales included)."""
    c = model_cfg
    fp16 = FloatKVStore(c.num_layers, c.num_kv_heads, c.head_size, num_pages, page_size, dtype=torch.float16)
    return fp16.nbytes() / make_kv_store(plan, c, num_pages, page_size).nbytes()


def cached_forward(verifier: Llama, tokens: torch.Tensor, plan: KVPlan, layer_err: Optional[list] = None):
    """Teacher-forced logits [B,T,V] with every layer's K/V going through the plan's store.

    layer_err: if given, a list of [sum |o - o_fp16|^2, sum |o_fp16|^2] per layer is accumulated, where
    o_fp16 attends over the same k/v rounded to fp16 (the reference cache)."""
    B, T = tokens.shape
    c = verifier.cfg
    store = make_kv_store(plan, c, math.ceil(B * T / PAGE), PAGE, verifier.device)
    slots = torch.arange(B * T, device=tokens.device)

    def attend(layer, q, k, v):
        store.write(layer, slots, k.reshape(B * T, c.num_kv_heads, -1), v.reshape(B * T, c.num_kv_heads, -1))
        kh, vh = (x.reshape(k.shape).to(q.dtype) for x in store.read(layer, slots))
        o = causal_attend(q, kh, vh)
        if layer_err is not None:
            ref = causal_attend(q, k.half().to(q.dtype), v.half().to(q.dtype))
            layer_err[layer][0] += (o - ref).double().pow(2).sum().item()
            layer_err[layer][1] += ref.double().pow(2).sum().item()
        return o

    return verifier.forward(tokens, attend=attend)


def _fp16_plan(c) -> KVPlan:
    return KVPlan.uniform("fp16", c.num_layers, c.num_kv_heads, c.head_size)


def evaluate(verifier: Llama, plans: dict, heldout_token_ids: list[list[int]], batch: int = 8) -> dict:
    """plans: {name: KVPlan or format name ('fp16', 'fp8', 'int8', 'int4-naive')}. Returns a report dict
    with one row per plan and a markdown table under "markdown"."""
    c = verifier.cfg
    plans = {n: (p if isinstance(p, KVPlan) else KVPlan.uniform(p, c.num_layers, c.num_kv_heads, c.head_size))
             for n, p in plans.items()}
    seqs = torch.tensor(heldout_token_ids, dtype=torch.long)
    ref_plan = _fp16_plan(c)
    ref_logp = []  # reference: FP16 KV cache
    for i in range(0, len(seqs), batch):
        ref_logp.append(F.log_softmax(cached_forward(verifier, seqs[i:i + batch].to(verifier.device), ref_plan).cpu().float(), -1))
    rows = []
    for name, plan in plans.items():
        seq_nll, seq_kl, agree, errs = [], [], 0, [[0.0, 0.0] for _ in range(c.num_layers)]
        for b, i in enumerate(range(0, len(seqs), batch)):
            tok = seqs[i:i + batch].to(verifier.device)
            logits = cached_forward(verifier, tok, plan, errs).cpu().float()
            logp = F.log_softmax(logits, -1)
            seq_nll += (-logp[:, :-1].gather(-1, tok[:, 1:, None].cpu())).sum((1, 2)).tolist()
            agree += (logits.argmax(-1) == ref_logp[b].argmax(-1)).sum().item()
            # KL(FP16-KV || this cache) per position: the whole distribution's shift, which moves smoothly
            # with the quantization error where perplexity's sign at the +0.1% level is luck.
            seq_kl += F.kl_div(logp, ref_logp[b], log_target=True, reduction="none").sum((1, 2)).tolist()
        n = seqs[:, 1:].numel()
        nll, kl = sum(seq_nll), sum(seq_kl)
        rows.append({"name": name, "format": plan.format, "outlier_fraction": plan.outlier_fraction,
                     "fp8_units": sum(x == "fp8" for p in plan.precision for t in ("k", "v") for x in p[t]),
                     "compression_vs_fp16": round(allocated_compression(plan, c), 4),
                     "ppl": math.exp(nll / n), "top1_agreement": agree / seqs.numel(),
                     "kl_vs_fp16": kl / seqs.numel(),
                     # per-sequence sums (NLL over predicted tokens, KL over positions): for paired statistics
                     "seq_nll": seq_nll, "seq_kl": seq_kl,
                     "attn_rel_error": [math.sqrt(a / max(b, 1e-30)) for a, b in errs]})
    base = next((r["ppl"] for r in rows if r["format"] == "fp16"), None)
    for r in rows:
        r["ppl_delta_pct"] = None if base is None else 100 * (r["ppl"] / base - 1)
    report = {"tokens": int(seqs.numel()), "sequences": len(seqs), "seq_len": int(seqs.shape[1]), "rows": rows}
    report["markdown"] = markdown_table(report)
    return report


def markdown_table(report: dict) -> str:
    nl = len(report["rows"][0]["attn_rel_error"]) if report["rows"] else 0
    head = ("| KV cache | FP8 units | compression (allocated) | held-out ppl | Δppl | top-1 agreement | "
            "KL vs FP16 KV (nats/token) | " + " | ".join(f"attn err L{i}" for i in range(nl)) + " |")
    lines = [head, "|" + "---|" * (7 + nl)]
    for r in report["rows"]:
        d = "" if r["ppl_delta_pct"] is None else f"{r['ppl_delta_pct']:+.2f}%"
        lines.append(f"| {r['name']} | {r['fp8_units']} | {r['compression_vs_fp16']:.2f}x | {r['ppl']:.4f} | {d} | "
                     f"{100 * r['top1_agreement']:.2f}% | {r['kl_vs_fp16']:.5f} | " + " | ".join(f"{e:.4f}" for e in r["attn_rel_error"]) + " |")
    lines.append(f"\n{report['sequences']} held-out sequences x {report['seq_len']} tokens "
                 f"({report['tokens']} positions); agreement is against the same model with an FP16 KV cache.")
    return "\n".join(lines)


def standard_plans(verifier: Llama, calib_samples: list[list[int]], group_size: int = 64,
                   fractions=STANDARD_FRACTIONS, extra: Optional[dict] = None) -> dict:
    """FP16, FP8, naive INT4 and INT4 + FP8 outlier units at each fraction (one calibration pass)."""
    c = verifier.cfg
    plans = {"fp16": "fp16", "fp8": "fp8", "int4-naive": "int4-naive"}
    m = measure_units(verifier, calib_samples, KVCalibConfig(group_size=group_size, **(extra or {})))
    for f in fractions:
        plans[f"int4+fp8 {f:.0%}"] = plan_from_measurement(m, c, f)[0]
    return plans


def inject_key_outliers(verifier: Llama, factor: float = 20.0, heads=None, pairs=(0, 1)) -> Llama:
    """A function-preserving copy of `verifier` whose keys have outlier channels.

    In each chosen (layer, KV head) the key channels of rotary pairs (i, i + D/2), i in `pairs`
    counted from the lowest-frequency end, are multiplied by `factor` and the same query channels
    of every query head in that group divided by it: q·k is unchanged, and because both elements
    of a rotary pair get the same factor the transform commutes with RoPE. Default heads: KV head 0
    of every layer. Low-frequency pairs barely rotate, so the outlier stays in its channel post-RoPE,
    as real "massive" key channels do.
    """
    c = verifier.cfg
    D, rep, nq = c.head_size, c.num_heads // c.num_kv_heads, c.num_heads * c.head_size
    heads = heads if heads is not None else [(layer, 0) for layer in range(c.num_layers)]
    w = {k: v.clone() for k, v in verifier.w.items()}
    for layer, h in heads:
        for name in ("weight", "bias"):
            key = f"transformer.layers.{layer}.attention.qkv.{name}"
            if key not in w:
                continue
            t = w[key]
            for i in pairs:
                for ch in (D // 2 - 1 - i, D - 1 - i):
                    t[nq + h * D + ch] *= factor
                    for qh in range(h * rep, (h + 1) * rep):
                        t[qh * D + ch] /= factor
    out = Llama(c, w, verifier.dtype)
    return out.to(verifier.device)


def _heldout(tokenizer_path, n: int, length: int) -> list[list[int]]:
    from .corpus import heldout_prompts

    return heldout_prompts(tokenizer_path, n, length)


def evaluate_engine_report(engine_dir, n: int = 16, length: int = 256, calib_n: int = 16,
                           calib_length: int = 128) -> dict:
    """Fidelity report of an engine version: its own KV plan next to FP16, FP8, naive INT4 and the
    INT4+FP8 sweep over outlier fractions (calibrated here with the engine's group size)."""
    from .corpus import calibration_samples

    engine_dir = Path(engine_dir)
    if not (engine_dir / "verifier" / "config.json").is_file():
        raise UserError("not an engine version: no converted verifier checkpoint",
                        file=str(engine_dir / "verifier" / "config.json"))
    verifier = Llama.from_checkpoint(engine_dir / "verifier")
    tok = engine_dir / "tokenizer" / "tokenizer.json"
    plan_dir = engine_dir / "kv_plan"
    own = KVPlan.load(plan_dir) if (plan_dir / "plan.json").exists() else None
    gs = own.group_size if own is not None else 64
    plans = standard_plans(verifier, calibration_samples(tok, calib_n, calib_length), gs)
    if own is not None:
        plans[f"engine plan ({own.format})"] = own
    report = evaluate(verifier, plans, _heldout(tok, n, length))
    report["engine"] = str(engine_dir)
    return report


def evaluate_engine(engine_dir, json_out: bool = False, **kw) -> str:
    """What `bpcompile eval ENGINE_DIR` prints: the markdown table, or the report as JSON.
    kw: sizes for evaluate_engine_report (n, length, calib_n, calib_length)."""
    report = evaluate_engine_report(engine_dir, **kw)
    return json.dumps(report, indent=1) if json_out else report["markdown"]
