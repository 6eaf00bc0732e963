#!/usr/bin/env python
"""The static-buffer step (bpcompile/runtime/static_step.py) against the executor's own step: greedy tokens with
speculation on, at batch 1 and batch 4, must be identical.

    python benchmarks/check_static_step.py --pair smollm2 --prompts 50 --tokens 32     # ~10 min on 2 cores
    python benchmarks/check_static_step.py --pair tiny --prompts 50 --tokens 32
    BPCOMPILE_KERNELS=triton python benchmarks/check_static_step.py --pair tiny --kv int4 --prompts 8 --tokens 16
    BPCOMPILE_KERNELS=triton python benchmarks/check_static_step.py --pair smollm2 --kv-plan engines/smollm2/1/kv_plan

The pairs: tiny (models/tiny, converted here; a Llama draft) and smollm2 (models/smollm2/verifier with the shipped
feature draft). --kv fp16: an FP16 cache; int4: a calibration-free INT4 plan (every unit INT4, no exact entries),
which BPCOMPILE_KERNELS=triton reads through the Triton kernels (Triton's interpreter on a CPU); int4-exact: the
same with exact entries (the verifier's: a sink of 4 and a recent window of 8; a Llama draft's: a window of 3).
--kv-plan DIR: the verifier's plan from a KV plan directory instead (an engine's kv_plan/, e.g. SmolLM2's default
plan, a recent window of 10), the draft's cache in FP16. With exact entries the report says whether the exact
copies (RecentKV) of both runs end bitwise equal ("exact_copies_equal"; only with --backoff off, the default: back-off
chooses each step's tree from timings, so two runs may write rejected branches' entries to other free columns, which
no later read sees but a bitwise comparison would). Prompts: the held-out
split's, --prompts x 32 tokens. Each batch size runs the engine's step (cuda_graphs off, the default dense view
on CPU) and the static step (cuda_graphs on: eager on CPU, captured CUDA graphs on --device cuda). Prints one JSON
object; exit 1 when tokens differ or the static step did not run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load(pair: str, tmp: Path):
    """(verifier, draft, tokenizer directory) of a pair, in float32."""
    from bpcompile.compiler.convert import convert_checkpoint
    from bpcompile.runtime.model import FeatureDraft, Llama

    if pair == "tiny":
        src = ROOT / "models" / "tiny"
        for n in ("verifier", "draft"):
            convert_checkpoint(src / n, tmp / n)
        return Llama.from_checkpoint(tmp / "verifier"), Llama.from_checkpoint(tmp / "draft"), src / "verifier"
    src = ROOT / "models" / "smollm2"
    convert_checkpoint(src / "verifier", tmp / "verifier")
    v = Llama.from_checkpoint(tmp / "verifier")
    return v, FeatureDraft.from_dir(src / "feature_draft", v), src / "verifier"


def factories(kind: str, v, d, plan_dir=None):
    """The verifier's and draft's KV store factories for --kv (--kv-plan: the verifier's plan from there)."""
    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory
    from bpcompile.runtime.paged_kv import float_store_factory

    if plan_dir is not None:
        return kv_store_factory(KVPlan.load(plan_dir)), float_store_factory(torch.float16)
    if kind == "fp16":
        return float_store_factory(torch.float16), float_store_factory(torch.float16)

    def plan(m, sink: int, window: int):
        c = m.cfg
        p = KVPlan.uniform("int4-naive", c.num_layers, c.num_kv_heads, c.head_size)
        if kind == "int4-exact":
            p.sink_tokens, p.recent_window = sink, window
        return p

    draft = kv_store_factory(plan(d, 0, 3)) if not getattr(d, "reads_features", False) else None
    return kv_store_factory(plan(v, 4, 8)), draft


def run(args) -> dict:
    from bpcompile.compiler.corpus import heldout_prompts
    from bpcompile.runtime.generator import Generator, SamplingParams, TreeSpec

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        v, d, tok_dir = load(args.pair, Path(tmp))
    prompts = heldout_prompts(tok_dir, args.prompts, 32)
    if torch.device(args.device).type == "cpu":  # the weights' layout an engine loads with (runtime.cpu_weights)
        for m in (v, d):
            m.pack_for_cpu("auto")
    vf, df = factories(args.kv, v, d, args.kv_plan)
    p = SamplingParams(max_tokens=args.tokens)
    kv = str(args.kv_plan) if args.kv_plan is not None else args.kv
    report = {"pair": args.pair, "kv": kv, "prompts": args.prompts, "tokens": args.tokens, "runs": []}
    ok = True
    for batch in args.batch:
        out, copies = {}, {}
        for mode in ("off", "on"):
            gen = Generator(
                v,
                d,
                TreeSpec("dynamic", nodes=5),
                max_batch_size=batch,
                max_seq_len=args.max_seq_len,
                page_size=16,
                kv_store_factory=vf,
                draft_kv_store_factory=df,
                device=args.device,
                cuda_graphs=mode,
                backoff=args.backoff == "on",
            )
            t0 = time.perf_counter()
            res = gen.generate(prompts, p)
            secs = time.perf_counter() - t0
            out[mode] = [t for t, _ in res]
            copies[mode] = [kv.recent for kv in (gen.vkv, gen.dkv) if kv is not None and kv.recent is not None]
            st = gen.v_exec.static
            report["runs"].append(
                {
                    "batch": batch,
                    "cuda_graphs": mode,
                    "static_step": st is not None,
                    "buckets": sorted(f"{k[0]}x{k[1]}" for k in st.buckets) if st is not None else [],
                    "kernels": gen.vkv.kern is not None,
                    "tau": round(sum(s.committed for _, s in res) / max(1, sum(s.verifier_steps for _, s in res)), 3),
                    "seconds": round(secs, 1),
                }
            )
            ok &= (mode == "off") or st is not None
            print(json.dumps(report["runs"][-1]), file=sys.stderr, flush=True)
        diff = [i for i, (a, b) in enumerate(zip(out["off"], out["on"])) if a != b]
        report["runs"][-1]["identical"] = not diff
        report["runs"][-1]["differing_prompts"] = diff
        if copies["on"] and args.backoff == "off":
            pairs = list(zip(copies["off"], copies["on"]))
            same = all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in pairs)
            report["runs"][-1]["exact_copies_equal"] = same
        ok &= not diff
    report["ok"] = ok
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--kv", choices=["fp16", "int4", "int4-exact"], default="fp16")
    ap.add_argument("--kv-plan", type=Path, help="the verifier's KV plan directory (an engine's kv_plan/)")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--backoff", choices=["on", "off"], default="off", help="speculation back-off (on: trees depend on timings)"
    )
    report = run(ap.parse_args())
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
