"""Decode speed on the SmolLM2 pair: bpcompile's native runtime against transformers, side by side in one run.

    .venv/bin/python benchmarks/bench_smollm2.py                         # prints a markdown table
    .venv/bin/python benchmarks/bench_smollm2.py --json out.json --prompts 12 --repeats 3
    .venv/bin/python benchmarks/bench_smollm2.py --rows plan,plan_codes --kv key_transform=klt   # an opt-in plan's speed

Every row decodes the same chat prompts (held-out pydoc instruction prompts through SmolLM2's chat template)
greedily to exactly --max-tokens new tokens (no end token), batch 1, float32 weights (a feature draft packs its
own linears in bfloat16 where the CPU multiplies it natively, as engines run it; the header says so), --threads
intra-op threads. Rows: transformers `generate` (its dynamic cache, fp32) and `generate(assistant_model=draft)`;
bpcompile verifier-only with an FP16 cache, with the default KV plan (recipes/smollm2.yaml's kv_cache on the
native target, calibrated here as the build calibrates it: the same builtin pydoc train windows and retrieval
probes, so the same plan as the recipe's engine) and with that plan's codes alone (`plan_codes`:
its exact FP16 sink and window off); bpcompile speculation with the shipped draft (chain and dynamic trees, FP16 cache),
with the feature draft (`feat_*`: models/smollm2/feature_draft, one layer on the verifier's hidden states; transformers
has no assisted generation for such a draft, so its peer is assisted generation with the shipped standalone draft), and
with a draft of random weights (back-off on); speculative rows with and without back-off. Runs are interleaved: each repeat times every row
on every prompt, rows in a rotated order, so drift hits all rows alike. A ratio is the median over repeats of
(row's total time / the reference row's total time) inverted, with the min..max over repeats beside it.
Greedy identity: every speculative row's tokens must equal verifier-only's (same FP16 cache) on every prompt.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from bpcompile.compiler import corpus
from bpcompile.compiler.calibrate import calibrate  # noqa: E402
from bpcompile.compiler.convert import convert_checkpoint  # noqa: E402
from bpcompile.runtime.generator import Generator, SamplingParams, TreeSpec  # noqa: E402
from bpcompile.runtime.kvcache import kv_store_factory  # noqa: E402
from bpcompile.runtime.model import FeatureDraft, Llama  # noqa: E402
from bpcompile.runtime.paged_kv import float_store_factory  # noqa: E402


def _distill_module():
    spec = importlib.util.spec_from_file_location("distill", REPO / "tools" / "distill_smollm2_draft.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prompts(tok, n: int, max_prompt: int, seed: int) -> list[list[int]]:
    """Held-out instruction prompts (the draft was distilled on other documents' prompts), chat-templated."""
    d = _distill_module()
    pool = 4 * n
    while True:  # pools are prefixes of one shuffled list: a larger one only adds prompts after the first n
        texts = d.instruction_prompts(corpus.heldout_documents(), pool, seed)
        out = [ids for ids in (d.chat_ids(tok, p) for p in texts) if len(ids) <= max_prompt]
        if len(out) >= n or len(texts) < pool:
            return out[:n]
        pool *= 2


def ours(verifier, draft, tree, kv_factory, backoff=True):
    gen = Generator(
        verifier,
        draft if tree.kind != "none" else None,
        tree,
        max_batch_size=1,
        max_seq_len=1024,
        kv_store_factory=kv_factory,
        backoff=backoff,
    )

    def run(ids, n):
        ((toks, stats),) = gen.generate([ids], SamplingParams(max_tokens=n))
        return toks, stats.tau

    return run


def hf(model, assistant=None):
    def run(ids, n):
        x = torch.tensor([ids])
        kw = {"assistant_model": assistant} if assistant is not None else {}
        out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2, **kw)
        return out[0, len(ids) :].tolist(), None

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default=str(REPO / "models/smollm2/verifier"))
    ap.add_argument("--draft", default=str(REPO / "models/smollm2/draft"))
    ap.add_argument(
        "--feature-draft",
        default=str(REPO / "models/smollm2/feature_draft"),
        help="the FeatureDraft for the feat_* rows (tools/train_smollm2_feature_draft.py)",
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=256, help="longest prompt kept, in tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="all", help="comma-separated row keys to run (default: all)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the raw timings here")
    ap.add_argument(
        "--kv",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a kv_cache key of the recipe for the plan rows, as a recipe would (repeatable; e.g. "
        "key_transform=klt); the rows still say 'default KV plan'",
    )
    ap.add_argument(
        "--weights",
        choices=("both", "rows", "packed", "plain"),
        default="both",
        help="bpcompile's weight layout (runtime.cpu_weights; engines run both by default): both = plain "
        "for single rows and bpcompile's few-row kernel (else oneDNN-packed) for several, rows = "
        "the few-row kernel only, packed = oneDNN-packed only, plain = PyTorch's plain products",
    )
    ap.add_argument(
        "--plain-weights", dest="weights", action="store_const", const="plain", help="the same as --weights plain"
    )
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(a.verifier)
    ps = prompts(tok, a.prompts, a.max_prompt, a.seed)
    hv = AutoModelForCausalLM.from_pretrained(a.verifier, dtype=torch.float32).eval()
    hd = AutoModelForCausalLM.from_pretrained(a.draft, dtype=torch.float32).eval()
    tmp = Path(tempfile.mkdtemp())
    convert_checkpoint(a.verifier, tmp / "v")
    convert_checkpoint(a.draft, tmp / "d")
    v, d = Llama.from_checkpoint(tmp / "v"), Llama.from_checkpoint(tmp / "d")
    torch.manual_seed(0)
    rnd = Llama.from_checkpoint(tmp / "d")
    for name, b in rnd.named_buffers():  # same shape and cost as the shipped draft, useless proposals
        if b.is_floating_point() and "norm" not in name:
            torch.nn.init.normal_(b, std=0.02)
    t = time.perf_counter()
    import yaml
    from bench_overhead import (
        default_kv_cache,  # this directory: the recipe's kv_cache as the native target resolves it
    )

    if any("=" not in kv for kv in a.kv):
        ap.error(f"--kv takes KEY=VALUE, got {[kv for kv in a.kv if '=' not in kv]}")
    overrides = {k: yaml.safe_load(x) for k, x in (kv.split("=", 1) for kv in a.kv)}
    plan, _ = calibrate(
        v, corpus.calibration_samples(a.verifier, 16, 128), default_kv_cache(overrides), tokenizer=a.verifier
    )
    print(
        f"calibrated the default plan{' with ' + ', '.join(a.kv) if a.kv else ''} in {time.perf_counter() - t:.0f}s "
        f"({plan.compression_vs_fp16(2048, 6):.2f}x at 2048 tokens)",
        file=sys.stderr,
    )
    if a.weights != "plain":  # as `Generator.from_engine` runs them on CPU (after calibration: it backpropagates)
        for m in (v, d, rnd):
            m.pack_for_cpu(a.weights)
    fd = fd_rnd = None
    if Path(a.feature_draft, "config.json").is_file():
        fd = FeatureDraft.from_dir(a.feature_draft, v)  # shares v's (packed) head and embedding
        fd_rnd = FeatureDraft.from_dir(a.feature_draft, v)
        for name, b in fd_rnd.named_buffers():  # same shape and cost, useless proposals
            if b.is_floating_point() and "norm" not in name and "sub_head" not in name:
                torch.nn.init.normal_(b, std=0.02)
        if a.weights != "plain":
            fd.pack_for_cpu(a.weights)
            fd_rnd.pack_for_cpu(a.weights)
    fp16 = float_store_factory(torch.float16)
    rows = {
        "hf": ("transformers generate (fp32 cache)", hf(hv)),
        "hf_assisted": ("transformers assisted generation, shipped draft", hf(hv, hd)),
        "fp16": ("bpcompile verifier only, FP16 KV", ours(v, None, TreeSpec("none"), fp16)),
        "plan": ("bpcompile verifier only, default KV plan", ours(v, None, TreeSpec("none"), kv_store_factory(plan))),
        "plan_codes": (
            "bpcompile verifier only, default KV plan without its exact entries",
            ours(v, None, TreeSpec("none"), kv_store_factory(replace(plan, sink_tokens=0, recent_window=0))),
        ),
        "chain3": ("bpcompile chain 3, FP16 KV, back-off", ours(v, d, TreeSpec("chain", length=3), fp16)),
        "dyn5": ("bpcompile dynamic tree 5, FP16 KV, back-off", ours(v, d, TreeSpec("dynamic", nodes=5), fp16)),
        "chain3_raw": (
            "bpcompile chain 3, FP16 KV, no back-off",
            ours(v, d, TreeSpec("chain", length=3), fp16, backoff=False),
        ),
        "dyn5_raw": (
            "bpcompile dynamic tree 5, FP16 KV, no back-off",
            ours(v, d, TreeSpec("dynamic", nodes=5), fp16, backoff=False),
        ),
        "static2_raw": (
            "bpcompile static tree [[0], [1]] (the draft's top 2 at depth 1), FP16 KV, no back-off",
            ours(v, d, TreeSpec("static", choices=[[0], [1]]), fp16, backoff=False),
        ),
        "random": (
            "bpcompile dynamic tree 5, random-weight draft, back-off",
            ours(v, rnd, TreeSpec("dynamic", nodes=5), fp16),
        ),
    }
    if fd is not None:
        rows.update(
            {
                "feat_chain3": (
                    "bpcompile chain 3, feature draft, FP16 KV, back-off",
                    ours(v, fd, TreeSpec("chain", length=3), fp16),
                ),
                "feat_chain4_raw": (
                    "bpcompile chain 4, feature draft, FP16 KV, no back-off",
                    ours(v, fd, TreeSpec("chain", length=4), fp16, backoff=False),
                ),
                "feat_dyn6_raw": (
                    "bpcompile dynamic tree 6, feature draft, FP16 KV, no back-off",
                    ours(v, fd, TreeSpec("dynamic", nodes=6), fp16, backoff=False),
                ),
                "feat_chain3_raw": (
                    "bpcompile chain 3, feature draft, FP16 KV, no back-off",
                    ours(v, fd, TreeSpec("chain", length=3), fp16, backoff=False),
                ),
                "feat_dyn5_raw": (
                    "bpcompile dynamic tree 5, feature draft, FP16 KV, no back-off",
                    ours(v, fd, TreeSpec("dynamic", nodes=5), fp16, backoff=False),
                ),
                "feat_random": (
                    "bpcompile dynamic tree 5, random-weight feature draft, back-off",
                    ours(v, fd_rnd, TreeSpec("dynamic", nodes=5), fp16),
                ),
                "feat_dyn5": (
                    "bpcompile dynamic tree 5, feature draft, FP16 KV, back-off",
                    ours(v, fd, TreeSpec("dynamic", nodes=5), fp16),
                ),
                "feat_plan_dyn5": (
                    "bpcompile dynamic tree 5, feature draft, default KV plan, back-off",
                    ours(v, fd, TreeSpec("dynamic", nodes=5), kv_store_factory(plan)),
                ),
                "feat_plan_chain3_raw": (
                    "bpcompile chain 3, feature draft, default KV plan, no back-off",
                    ours(v, fd, TreeSpec("chain", length=3), kv_store_factory(plan), backoff=False),
                ),
            }
        )
    if a.rows != "all":
        keep = a.rows.split(",")
        rows = {k: r for k, r in rows.items() if k in keep or k in ("hf", "fp16")}
    keys = list(rows)
    for k in keys:  # warm-up (allocations, lazy init) outside the timings
        rows[k][1](ps[0], 4)
    times = {k: [[0.0] * len(ps) for _ in range(a.repeats)] for k in keys}
    toks, taus = {k: [None] * len(ps) for k in keys}, {k: [] for k in keys}
    for rep in range(a.repeats):
        for i, ids in enumerate(ps):
            shift = (rep * len(ps) + i) % len(keys)
            for k in keys[shift:] + keys[:shift]:
                t0 = time.perf_counter()
                out, tau = rows[k][1](ids, a.max_tokens)
                times[k][rep][i] = time.perf_counter() - t0
                assert len(out) == a.max_tokens, (k, len(out))
                toks[k][i] = out
                if tau is not None:
                    taus[k].append(tau)
        print(f"repeat {rep + 1}/{a.repeats} done", file=sys.stderr)
    total = {k: [sum(r) for r in times[k]] for k in keys}

    def ratio(k, ref):  # speed of k relative to ref: > 1 is faster
        rs = [total[ref][r] / total[k][r] for r in range(a.repeats)]
        return statistics.median(rs), min(rs), max(rs)

    spec_rows = (
        "chain3",
        "dyn5",
        "chain3_raw",
        "dyn5_raw",
        "static2_raw",
        "random",
        "feat_chain3",
        "feat_chain4_raw",
        "feat_dyn6_raw",
        "feat_chain3_raw",
        "feat_dyn5_raw",
        "feat_dyn5",
        "feat_random",
    )
    identical = {k: sum(toks[k][i] == toks["fp16"][i] for i in range(len(ps))) for k in keys if k in spec_rows}
    n_tok = a.max_tokens * len(ps)
    packed = getattr(fd.layers[0].qkv, "packed", None) if fd is not None else None
    draft_note = (
        "; the feature draft's linears in bfloat16" if packed is not None and packed.dtype == torch.bfloat16 else ""
    )
    few = "bpcompile's few-row kernel" if type(v.head).__name__ == "RowsLinear" else "oneDNN-packed"
    layout = {
        "plain": "plain layout",
        "packed": "oneDNN-packed",
        "rows": few,
        "both": f"{few} for several rows, plain for one",
    }[a.weights]
    lines = [
        f"{len(ps)} prompts x {a.max_tokens} new tokens, {a.repeats} interleaved repeats, batch 1, float32 "
        f"weights ({layout} for bpcompile{draft_note}), "
        f"{a.threads} threads, "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}",
        "",
        "| row | tokens/s (median) | vs transformers | vs verifier-only FP16 | tau |",
        "|---|---|---|---|---|",
    ]
    for k in keys:
        tps = n_tok / statistics.median(total[k])
        rh, rf = ratio(k, "hf"), ratio(k, "fp16")
        tau = f"{statistics.mean(taus[k]):.2f}" if taus[k] and (k in spec_rows or k.startswith("feat")) else ""
        lines.append(
            f"| {rows[k][0]} | {tps:.1f} | {rh[0]:.2f}x ({rh[1]:.2f}..{rh[2]:.2f}) | "
            f"{rf[0]:.2f}x ({rf[1]:.2f}..{rf[2]:.2f}) | {tau} |"
        )
    if "hf_assisted" in keys:
        for k in spec_rows:
            if k in keys and k not in ("random", "feat_random"):
                r = ratio(k, "hf_assisted")
                lines.append(
                    f"\n{rows[k][0]} vs transformers assisted generation: {r[0]:.2f}x ({r[1]:.2f}..{r[2]:.2f})"
                )
    if "plan" in keys:  # speculation over the default plan's cache against verifier-only on the same cache
        for k in ("feat_plan_dyn5", "feat_plan_chain3_raw"):
            if k in keys:
                r = ratio(k, "plan")
                lines.append(
                    f"\n{rows[k][0]} vs verifier-only with the default KV plan: {r[0]:.2f}x ({r[1]:.2f}..{r[2]:.2f})"
                )
    lines.append(
        "\nGreedy identity with verifier-only (FP16 KV): "
        + ", ".join(f"{k} {n}/{len(ps)}" for k, n in identical.items())
    )
    print("\n".join(lines))
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "args": vars(a),
                    "times": times,
                    "taus": taus,
                    "identical": identical,
                    "rows": {k: rows[k][0] for k in keys},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
