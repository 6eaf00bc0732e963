"""KV-cache fidelity benchmark on an HF verifier (default: the shipped tiny one).

    .venv/bin/python benchmarks/bench_kv.py                      # tables for docs/benchmarks/kv_cache.md
    .venv/bin/python benchmarks/bench_kv.py --ablations --json out.json

Converts the verifier (bpcompile.compiler.convert), calibrates on the corpus train split, evaluates on the
held-out split: FP16 / FP8 / INT8 / naive INT4 / INT4 + FP8 outlier units at 0, 4, 8, 16%, on the model
as shipped and on its outlier-injected (function-preserving) variant.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
from bpcompile.compiler import corpus
from bpcompile.compiler.calibrate import KVCalibConfig, measure_units, plan_from_measurement  # noqa: E402
from bpcompile.compiler.convert import convert_checkpoint  # noqa: E402
from bpcompile.eval.evaluate import evaluate, inject_key_outliers, standard_plans  # noqa: E402
from bpcompile.runtime.model import Llama  # noqa: E402


def calibration_table(report: dict) -> str:
    lines = [
        "| unit | INT4 error | naive INT4 error | FP8 error | key scale α | clip | precision |",
        "|---|---|---|---|---|---|---|",
    ]
    for layer in report["layers"]:
        for u in layer["units"]:
            lines.append(
                f"| L{u['layer']}.{u['kind']}{u['head']} | {u['int4_error']:.5f} | {u['naive_int4_error']:.5f} | "
                f"{u['outlier_error']:.5f} | {u['key_scale_alpha']:g} | {u['clip']:g} | {u['precision']} |"
            )
    return "\n".join(lines)


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def _half_grid(x, clip):
    """16-level symmetric grid without zero: levels ±0.5..±7.5 (s = absmax/7.5), no extra bytes."""
    s = (x.abs().amax(-1, keepdim=True) * clip / 7.5).half().float()
    return (torch.floor(x / s) + 0.5).clamp(-7.5, 7.5) * s


NF4 = torch.tensor(
    [
        -1.0,
        -0.6962,
        -0.5251,
        -0.3949,
        -0.2844,
        -0.1848,
        -0.0911,
        0.0,
        0.0796,
        0.1609,
        0.2461,
        0.3379,
        0.4407,
        0.5626,
        0.7230,
        1.0,
    ]
)  # QLoRA's NormalFloat4 levels


def _nf4(x, clip):
    s = (x.abs().amax(-1, keepdim=True) * clip).half().float()
    return NF4[(x[..., None] / s[..., None] - NF4).abs().argmin(-1)] * s


def study(model, calib, held, group_size):
    """Unit-level error of INT4 variants (same calibration search) and where top-1 disagreements happen."""
    from bpcompile.compiler.calibrate import LayerProbe, capture_qkv, key_channel_scale
    from bpcompile.eval.evaluate import served, served_logits
    from bpcompile.runtime.kvcache import KVPlan, fake_quantize

    c, H = model.cfg, _hadamard(model.cfg.head_size)
    clips = (1.0, 0.9, 0.8)
    variants = {
        f"INT4 G={group_size} (format)": lambda x, cs, r: fake_quantize(x, "int4", group_size, cs, r),
        "INT4 G=32 (+0.25 bit)": lambda x, cs, r: fake_quantize(x, "int4", 32, cs, r),
        "16-level half grid": lambda x, cs, r: (
            _half_grid(x / (cs if cs is not None else 1), r) * (cs if cs is not None else 1)
        ),
        "NF4 codebook": lambda x, cs, r: _nf4(x / (cs if cs is not None else 1), r) * (cs if cs is not None else 1),
        "Hadamard + INT4": lambda x, cs, r: fake_quantize(x @ H, "int4", group_size, None, r) @ H.T,
        "FP8": lambda x, cs, r: fake_quantize(x, "fp8", group_size),
    }
    errs = {n: [] for n in variants}
    for layer, q, k, v in capture_qkv(model, calib):
        probe = LayerProbe(model, layer, q, k, v)
        for kv in (0, 1):
            for h in range(c.num_kv_heads):
                x = (k if kv == 0 else v)[:, :, h]
                put = (lambda y: probe.error(h, k_new=y)) if kv == 0 else (lambda y: probe.error(h, v_new=y))
                scales = [None] + ([key_channel_scale(x, a) for a in (0.5, 1.0)] if kv == 0 else [])
                for n, f in variants.items():
                    errs[n].append(min(put(f(x, cs, r)) for cs in scales for r in clips))
    table = ["| INT4 variant (best key scale / clip per unit) | mean unit error | vs format |", "|---|---|---|"]
    base = sum(errs[next(iter(errs))]) / len(errs[next(iter(errs))])
    for n, e in errs.items():
        table.append(f"| {n} | {sum(e) / len(e):.5f} | {sum(e) / len(e) / base:.2f}x |")
    # where do disagreements with the FP16-KV model sit? (top-1 vs top-2 logit margin of the reference)
    seqs = torch.tensor(held)
    plans = standard_plans(model, calib, group_size, fractions=(0.08,))
    ref_plan = KVPlan.uniform("fp16", c.num_layers, c.num_kv_heads, c.head_size)
    T = seqs.shape[1]

    def teacher(p):  # the runtime's executor over p's cache, 8 windows at a time
        return [served_logits(served(model, p, 8, T), seqs[i : i + 8].tolist()) for i in range(0, len(seqs), 8)]

    ref = torch.cat(teacher(ref_plan))
    top2 = ref.topk(2, -1).values
    margin = (top2[..., 0] - top2[..., 1]).flatten()
    p1 = ref.softmax(-1).amax(-1).flatten()
    lines = [
        f"FP16-KV reference: median top-1 probability {p1.median():.3f}; {100 * (margin < 0.1).float().mean():.1f}% "
        f"of positions have a top-1/top-2 logit margin < 0.1",
        "",
        "| KV cache | top-1 agreement | median margin of disagreements | max margin | agreement where margin ≥ 0.5 |",
        "|---|---|---|---|---|",
    ]
    for name in ("fp8", "int4-naive", "int4+fp8 8%"):
        p = (
            plans[name]
            if isinstance(plans[name], KVPlan)
            else KVPlan.uniform(plans[name], c.num_layers, c.num_kv_heads, c.head_size)
        )
        top = torch.cat([x.argmax(-1) for x in teacher(p)]).flatten()
        dis = top != ref.argmax(-1).flatten()
        lines.append(
            f"| {name} | {100 * (1 - dis.float().mean()):.2f}% | {margin[dis].median():.3f} | {margin[dis].max():.3f} | "
            f"{100 * (1 - dis[margin >= 0.5].float().mean()):.2f}% ({100 * (margin >= 0.5).float().mean():.0f}% of positions) |"
        )
    text = "\n".join(table) + "\n\n" + "\n".join(lines)
    print("\n### study\n\n" + text, flush=True)
    return {"variants": {n: sum(e) / len(e) for n, e in errs.items()}, "markdown": text}


def paired_bootstrap(report: dict, a: str, b: str, n_boot: int = 2000, seed: int = 0) -> str:
    """Is plan `a` better than plan `b`? From the report's per-sequence NLL and KL (vs the FP16-KV cache):
    a paired bootstrap over sequences (both plans see the same resampled sequences) of the differences
    a - b in Δppl points and in KL. A 95% interval that straddles 0 means the data cannot tell them apart."""
    import math

    rows = {r["name"]: r for r in report["rows"]}
    ref = next(r for r in report["rows"] if r["format"] == "fp16")
    nll = {k: torch.tensor(r["seq_nll"], dtype=torch.float64) for k, r in (("fp16", ref), (a, rows[a]), (b, rows[b]))}
    kl = {k: torch.tensor(rows[k]["seq_kl"], dtype=torch.float64) for k in (a, b)}
    n_seq, per_seq = report["sequences"], report["seq_len"]

    def stats(idx):
        ppl = {k: math.exp(v[idx].sum().item() / (len(idx) * (per_seq - 1))) for k, v in nll.items()}
        d_ppl = 100 * (ppl[a] - ppl[b]) / ppl["fp16"]
        d_kl = (kl[a][idx].sum() - kl[b][idx].sum()).item() / (len(idx) * per_seq)
        return d_ppl, d_kl

    g = torch.Generator().manual_seed(seed)
    boots = [stats(torch.randint(0, n_seq, (n_seq,), generator=g)) for _ in range(n_boot)]
    point = stats(torch.arange(n_seq))
    lines = []
    for j, (what, unit) in enumerate((("Δppl", " points"), ("KL", " nats/token"))):
        v = sorted(x[j] for x in boots)
        lo, hi = v[int(0.025 * n_boot)], v[int(0.975 * n_boot) - 1]
        lines.append(
            f"- {a} minus {b}, {what}: {point[j]:+.5f}{unit} (95% interval {lo:+.5f} … {hi:+.5f}; "
            f"paired bootstrap over {n_seq} sequences, {n_boot} resamples)"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--verifier", default=str(ROOT / "models/tiny/verifier"))
    ap.add_argument("--n", type=int, default=23, help="held-out sequences (the tiny corpus split has 23 of 256 tokens)")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--calib-n", type=int, default=16)
    ap.add_argument("--calib-length", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--inject-factor", type=float, default=20.0)
    ap.add_argument("--ablations", action="store_true", help="also: no key scaling / no clip search at 8%%")
    ap.add_argument("--study", action="store_true", help="also: INT4 variants per unit, agreement vs logit margin")
    ap.add_argument("--json", help="write all reports here")
    ap.add_argument(
        "--bootstrap",
        nargs=3,
        metavar=("EVAL_JSON", "A", "B"),
        help="only: paired bootstrap of plan A minus plan B from a `bpcompile eval --json` report",
    )
    a = ap.parse_args()
    if a.bootstrap:
        report = json.loads(Path(a.bootstrap[0]).read_text())
        names = {r["name"] for r in report["rows"]}
        # an exact name first: "engine plan (...)" is also a prefix of "engine plan (...), no exact entries"
        pick = lambda want: want if want in names else next((n for n in sorted(names) if n.startswith(want)), want)  # noqa: E731
        print(paired_bootstrap(report, pick(a.bootstrap[1]), pick(a.bootstrap[2])))
        return
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        convert_checkpoint(a.verifier, Path(tmp) / "ckpt")
        model = Llama.from_checkpoint(Path(tmp) / "ckpt")
    tok = Path(a.verifier) / "tokenizer.json"
    calib = corpus.calibration_samples(tok, a.calib_n, a.calib_length)
    held = corpus.heldout_prompts(tok, a.n, a.length)
    out = {"corpus": corpus.fingerprint(), "args": vars(a)}
    for name, m in (
        ("as shipped", model),
        (f"outlier-injected x{a.inject_factor:g}", inject_key_outliers(model, a.inject_factor)),
    ):
        t = time.perf_counter()
        plans = standard_plans(m, calib, a.group_size)
        plans["int8"] = "int8"
        if a.ablations:
            for label, extra in (
                ("no key scaling", {"key_scale_alphas": (0.0,)}),
                ("no clip search", {"clip_ratios": (1.0,)}),
                ("neither", {"key_scale_alphas": (0.0,), "clip_ratios": (1.0,)}),
            ):
                meas = measure_units(m, calib, KVCalibConfig(group_size=a.group_size, **extra))
                plans[f"int4+fp8 8%, {label}"] = plan_from_measurement(meas, m.cfg, 0.08)[0]
        rep = evaluate(m, plans, held)
        meas = measure_units(m, calib, KVCalibConfig(group_size=a.group_size))
        _, cal = plan_from_measurement(meas, m.cfg, 0.08)
        rep["calibration_8pct"] = cal
        rep["paired_bootstrap"] = paired_bootstrap(rep, "int4+fp8 8%", "int4-naive")
        rep["seconds"] = time.perf_counter() - t
        out[name] = rep
        print(
            f"\n### {name} ({rep['seconds']:.0f}s)\n\n{rep['markdown']}\n\n{rep['paired_bootstrap']}\n\n"
            f"Calibration (8%):\n\n{calibration_table(cal)}",
            flush=True,
        )
    if a.study:
        out["study"] = study(model, calib, held, a.group_size)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
