"""Speculation on SmolLM2 against the fastest one-token step: per-step times (1 token vs the default tree), tau, and each draft's acceptance per depth on chat prompts neither draft was trained on.

    .venv/bin/python benchmarks/bench_speculation.py steps --repeats 3          # per-step times, tau, ms per token
    .venv/bin/python benchmarks/bench_speculation.py acceptance                 # both drafts, per depth (no timing)

Prompts: benchmarks/data/chat_prompts.json (36 hand-written chat requests: facts, instructions, code, lists,
multi-paragraph inputs), through SmolLM2's chat template, greedy, up to --max-tokens new tokens or the end token,
batch 1, FP16 KV cache, float32 models laid out as engines lay them out on CPU (`runtime.cpu_weights`).

steps: rows, run interleaved (each repeat runs every row on every prompt, rows in a rotated order, so drift hits all
rows alike): verifier-only with the one-row path of each --layouts (both: PyTorch's GEMV over a plain copy; rows:
bpcompile's few-row kernel for one row too; what auto picks here is printed), and speculation with the feature draft
at the recipe's tree (--tree) with back-off off (every step drafts: the per-step time of a drafting step) and on (as
engines run). Per row: the median step time (median over repeats of the median over that repeat's steps), tau, and
ms per generated token (decode steps only) with the speedup against the fastest verifier-only row.
acceptance: each draft (the feature draft and the standalone distilled one) as a chain of --chain tokens with
back-off off, all prompts in one batch: for depth d, the share of steps whose tree reached d where the accepted path did too (cumulative) and
the same given depth d - 1 was accepted (conditional), and tau; then tau at --tree. Not a timing: valid on a busy
machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "benchmarks" / "data" / "chat_prompts.json"

from bpcompile.compiler.convert import convert_checkpoint  # noqa: E402
from bpcompile.info import machine  # noqa: E402
from bpcompile.runtime.generator import Generator, SamplingParams  # noqa: E402
from bpcompile.runtime.model import FeatureDraft, Llama, cpu_layout  # noqa: E402
from bpcompile.runtime.paged_kv import float_store_factory  # noqa: E402
from bpcompile.runtime.speculative import TreeSpec, parse_tree_spec  # noqa: E402


def chat_prompts(tok, path: Path) -> list[list[int]]:
    items = json.loads(path.read_text())["prompts"]
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": p["text"]}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in items
    ]


def generator(v, d, tree: TreeSpec, backoff: bool, batch: int = 1) -> Generator:
    return Generator(
        v,
        d if tree.kind != "none" else None,
        tree,
        max_batch_size=batch,
        max_seq_len=1024,
        kv_store_factory=float_store_factory(torch.float16),
        backoff=backoff,
    )


def timed_run(gen: Generator, prompts, params) -> dict:
    """Every prompt through `gen`, one at a time; each decode step's wall time."""
    steps: list[float] = []
    run = gen.spec.run

    def step(reqs):
        t = time.perf_counter()
        out = run(reqs)
        steps.append(time.perf_counter() - t)
        return out

    gen.spec.run = step
    try:
        out = [gen.generate([p], params)[0] for p in prompts]
    finally:
        gen.spec.run = run
    committed = sum(s.committed for _, s in out)
    return {
        "step_ms": 1e3 * statistics.median(steps),
        "tau": committed / sum(s.verifier_steps for _, s in out),
        "ms_per_token": 1e3 * sum(steps) / committed,
        "tokens": [t for t, _ in out],
    }


def load(a, tmp: Path, standalone: bool = True):
    """The verifier and the standalone draft, converted into `tmp` (the verifier's checkpoint stays there)."""
    convert_checkpoint(a.verifier, tmp / "v")
    if not standalone:
        return Llama.from_checkpoint(tmp / "v"), None
    convert_checkpoint(a.draft, tmp / "d")
    return Llama.from_checkpoint(tmp / "v"), Llama.from_checkpoint(tmp / "d")


def steps_mode(a, tok, prompts, params) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        v, _ = load(a, Path(tmp), standalone=False)
        v.pack_for_cpu("auto")  # what engines do by default: print what it picks here
        auto = cpu_layout(v)
        rows = {}
        for layout in a.layouts.split(","):
            v = Llama.from_checkpoint(Path(tmp) / "v")
            v.pack_for_cpu(layout)
            fd = FeatureDraft.from_dir(a.feature_draft, v)
            fd.pack_for_cpu(layout)
            name = cpu_layout(v)
            rows[f"verifier-only [{name}]"] = (v, None, TreeSpec("none"), False)
            rows[f"speculation {a.tree} back-off off [{name}]"] = (v, fd, parse_tree_spec(a.tree), False)
            rows[f"speculation {a.tree} back-off on [{name}]"] = (v, fd, parse_tree_spec(a.tree), True)
    results: dict[str, list[dict]] = {k: [] for k in rows}
    names = list(rows)
    for rep in range(a.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            v, d, tree, backoff = rows[name]
            results[name].append(timed_run(generator(v, d, tree, backoff), prompts, params))
            print(f"  repeat {rep + 1}: {name}: {results[name][-1]['step_ms']:.1f} ms/step", file=sys.stderr)
    ref = results[names[0]][0]["tokens"]
    out = {"machine": machine(), "auto_picks": auto, "prompts": len(prompts), "rows": {}}
    for name, rs in results.items():
        out["rows"][name] = {
            "step_ms": statistics.median(r["step_ms"] for r in rs),
            "tau": statistics.median(r["tau"] for r in rs),
            "ms_per_token": statistics.median(r["ms_per_token"] for r in rs),
            "identical": all(r["tokens"] == ref for r in rs),
        }
    best = min(r["ms_per_token"] for n, r in out["rows"].items() if n.startswith("verifier-only"))
    for r in out["rows"].values():
        r["speedup"] = best / r["ms_per_token"]
    return out


def acceptance_mode(a, tok, prompts, params) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        v, d = load(a, Path(tmp))
    fd = FeatureDraft.from_dir(a.feature_draft, v)
    for m in (v, d, fd):
        m.pack_for_cpu()
    out = {"machine": machine(), "prompts": len(prompts), "drafts": {}}
    for name, draft in (("feature draft", fd), ("standalone draft", d)):
        res = {}
        for spec in (f"chain:{a.chain}", a.tree):
            # all prompts in one batch: acceptance per sequence does not depend on it, and it is far cheaper
            r = generator(v, draft, parse_tree_spec(spec), False, len(prompts)).generate(prompts, params)
            acc = [
                sum(s.accepted_per_depth[i] if i < len(s.accepted_per_depth) else 0 for _, s in r)
                for i in range(a.chain)
            ]
            prop = [
                sum(s.proposed_per_depth[i] if i < len(s.proposed_per_depth) else 0 for _, s in r)
                for i in range(a.chain)
            ]
            res[spec] = {"tau": sum(s.committed for _, s in r) / sum(s.verifier_steps for _, s in r)}
            if spec.startswith("chain"):
                res[spec]["depth"] = [
                    {
                        "depth": i + 1,
                        "accepted": acc[i],
                        "proposed": prop[i],
                        "cumulative": acc[i] / prop[i] if prop[i] else None,
                        "conditional": acc[i] / acc[i - 1]
                        if i and acc[i - 1]
                        else (acc[0] / prop[0] if not i and prop[0] else None),
                    }
                    for i in range(a.chain)
                ]
            print(f"  {name} {spec}: tau {res[spec]['tau']:.3f}", file=sys.stderr)
        out["drafts"][name] = res
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("steps", "acceptance"))
    ap.add_argument("--verifier", default=str(REPO / "models/smollm2/verifier"))
    ap.add_argument("--draft", default=str(REPO / "models/smollm2/draft"), help="the standalone draft")
    ap.add_argument("--feature-draft", default=str(REPO / "models/smollm2/feature_draft"))
    ap.add_argument("--prompts", default=str(PROMPTS), help="a JSON file like benchmarks/data/chat_prompts.json")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0: all)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tree", default="dynamic:5", help="the recipe's tree (recipes/smollm2.yaml) [dynamic:5]")
    ap.add_argument("--chain", type=int, default=5, help="acceptance: chain length (depths measured) [5]")
    ap.add_argument("--layouts", default="both,rows", help="steps: runtime.cpu_weights layouts to time [both,rows]")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", metavar="FILE", help="also write the results here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.verifier)
    prompts = chat_prompts(tok, Path(a.prompts))
    if a.limit:
        prompts = prompts[: a.limit]
    params = SamplingParams(max_tokens=a.max_tokens, end_id=tok.eos_token_id)
    with torch.inference_mode():
        out = (steps_mode if a.mode == "steps" else acceptance_mode)(a, tok, prompts, params)
    batch = "batch 1" if a.mode == "steps" else "one batch"
    print(f"{machine()}; {len(prompts)} prompts, up to {a.max_tokens} tokens, {batch}, FP16 KV")
    if a.mode == "steps":
        print(f"runtime.cpu_weights auto picks {out['auto_picks']} here")
        print("| row | median step (ms) | tau | ms / token | speedup vs fastest verifier-only | greedy identical |")
        print("|---|---|---|---|---|---|")
        for name, r in out["rows"].items():
            print(
                f"| {name} | {r['step_ms']:.1f} | {r['tau']:.2f} | {r['ms_per_token']:.1f} | {r['speedup']:.2f}x | "
                f"{'yes' if r['identical'] else 'NO'} |"
            )
    else:
        for name, res in out["drafts"].items():
            chain = res[f"chain:{a.chain}"]
            print(f"{name}: chain:{a.chain} tau {chain['tau']:.2f}, {a.tree} tau {res[a.tree]['tau']:.2f}")
            for dd in chain["depth"]:
                cum = "-" if dd["cumulative"] is None else f"{100 * dd['cumulative']:.1f}%"
                cond = "-" if dd["conditional"] is None else f"{100 * dd['conditional']:.1f}%"
                print(
                    f"  depth {dd['depth']}: {dd['accepted']}/{dd['proposed']} = {cum} (given depth {dd['depth'] - 1}: {cond})"
                )
    if a.json:
        for r in out.get("rows", {}).values():
            r.pop("tokens", None)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
