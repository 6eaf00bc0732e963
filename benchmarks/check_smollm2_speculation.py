"""Greedy speculation on the SmolLM2 pair is lossless: every tree's output equals verifier-only decoding's, token
for token, on held-out chat prompts (FP16 KV; models as engines run them on CPU, `runtime.cpu_weights` both:
bpcompile's few-row kernel, or oneDNN-packed where it cannot be built, for several rows, plain for one).

    .venv/bin/python benchmarks/check_smollm2_speculation.py --prompts 50 --max-tokens 64
    .venv/bin/python benchmarks/check_smollm2_speculation.py --feature-draft models/smollm2/feature_draft

Prompts: the benchmark's held-out chat prompts (48 fit 256 tokens), topped up with chat requests to continue
48-token held-out windows. Prints per tree the prompts whose continuation is identical, the first differing token of the others, and τ
(tokens per verifier step). Exit code 1 if any prompt differs. No timing: benchmarks/bench_smollm2.py times.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
from bench_smollm2 import prompts  # noqa: E402  (the benchmark's held-out chat prompts)

from bpcompile.compiler.convert import convert_checkpoint  # noqa: E402
from bpcompile.runtime.generator import Generator, SamplingParams  # noqa: E402
from bpcompile.runtime.model import FeatureDraft, Llama  # noqa: E402
from bpcompile.runtime.paged_kv import float_store_factory  # noqa: E402
from bpcompile.runtime.speculative import parse_tree_spec  # noqa: E402

TREES = "dynamic:5;chain:3;static:[[0],[1]]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default=str(ROOT / "models/smollm2/verifier"))
    ap.add_argument("--draft", default=str(ROOT / "models/smollm2/draft"))
    ap.add_argument(
        "--feature-draft",
        default=None,
        metavar="DIR",
        help="run the trees with this FeatureDraft (e.g. models/smollm2/feature_draft) instead of --draft",
    )
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--max-prompt",
        type=int,
        default=256,
        help="longest prompt kept, in tokens (the held-out pool has 48 chat prompts within 256)",
    )
    ap.add_argument("--trees", default=TREES, help=f"semicolon-separated tree specs [default: {TREES}]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.verifier)
    ps = prompts(tok, a.prompts, a.max_prompt, a.seed)
    if len(ps) < a.prompts:  # the held-out split yields 48 instruction prompts: top up with continuation requests
        from bpcompile.compiler import corpus

        need = a.prompts - len(ps)
        for w in corpus.heldout_prompts(tok, need, 48, a.seed):
            text = tok.decode(w, skip_special_tokens=True)
            ps.append(
                tok.apply_chat_template(
                    [{"role": "user", "content": f"Continue this text:\n\n{text}"}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
        print(
            f"{a.prompts - need} held-out instruction prompts within {a.max_prompt} tokens, {need} held-out "
            "continuation prompts",
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory() as tmp:
        convert_checkpoint(a.verifier, Path(tmp) / "v")
        convert_checkpoint(a.draft, Path(tmp) / "d")
        v, d = Llama.from_checkpoint(Path(tmp) / "v"), Llama.from_checkpoint(Path(tmp) / "d")
    if a.feature_draft:
        d = FeatureDraft.from_dir(a.feature_draft, v)
    for m in (v, d):
        m.pack_for_cpu()
    fp16, params = float_store_factory(torch.float16), SamplingParams(max_tokens=a.max_tokens)
    specs = [s.strip() for s in a.trees.split(";") if s.strip()]

    def run(spec):
        tree = parse_tree_spec(spec)
        gen = Generator(
            v,
            d if tree.kind != "none" else None,
            tree,
            max_batch_size=1,
            max_seq_len=1024,
            kv_store_factory=fp16,
            backoff=False,
        )
        return [gen.generate([p], params)[0] for p in ps]

    ref = [toks for toks, _ in run("none")]
    report = {"prompts": len(ps), "tokens": a.max_tokens, "trees": {}}
    for spec in specs:
        out = run(spec)
        diff = {
            i: next(j for j, (x, y) in enumerate(zip(toks + [-1], r + [-2])) if x != y)
            for i, ((toks, _), r) in enumerate(zip(out, ref))
            if toks != r
        }
        tau = sum(len(t) for t, _ in out) / sum(st.verifier_steps for _, st in out)
        report["trees"][spec] = {"identical": len(ps) - len(diff), "first_difference": diff, "tau": round(tau, 3)}
        if not a.json:
            print(
                f"{spec}: {len(ps) - len(diff)}/{len(ps)} identical over {a.max_tokens} tokens, tau {tau:.2f}"
                + (f"; first differing token per prompt: {diff}" if diff else ""),
                flush=True,
            )
    if a.json:
        print(json.dumps(report, indent=1))
    return 1 if any(t["first_difference"] for t in report["trees"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
