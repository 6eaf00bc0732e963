"""Generate with an engine through the Triton kernels and through the torch executor, and compare the tokens.

    python benchmarks/check_kernel_path.py engines/smollm2/1 --prompts 8 --tokens 16

Greedy generation of --prompts prompts (the first eight are fixed English / code openings, the rest are built from
a fixed word list) with the engine's own KV plan, speculation as the engine says: once with BPCOMPILE_KERNELS=torch
(the PyTorch attention path) and once with BPCOMPILE_KERNELS=triton (the kernels of bpcompile/kernels/paged.py; on a
CPU in Triton's interpreter, slow: minutes for a few hundred tokens), each in its own process. Prints one JSON
object (the plan's unit kinds, each run's tokens and seconds, whether the kernels ran, whether the tokens are
identical) and exits 1 when they differ or the kernels did not run (a fallback to the PyTorch path).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was",
    "import numpy as np\n",
    "The three laws of thermodynamics are",
    "Water boils at",
    "class Stack:\n    def push(self, x):",
    "In 1969, the first humans",
]
WORDS = ["def", "class", "import", "the", "for", "return", "print", "with", "open", "list"]


def prompts(n: int) -> list[str]:
    """The first eight: TEXTS; then three words each from WORDS, in a fixed order."""
    extra = [f"{WORDS[i % 10]} {WORDS[(3 * i + 1) % 10]} {WORDS[(7 * i + 2) % 10]}" for i in range(max(0, n - 8))]
    return (TEXTS + extra)[:n]


def run_one(engine: str, n: int, tokens: int) -> dict:
    """In this process (its BPCOMPILE_KERNELS chosen by the caller): generate and describe."""
    import time

    from tokenizers import Tokenizer

    from bpcompile.runtime.generator import Generator, SamplingParams

    tok = Tokenizer.from_file(os.path.join(engine, "tokenizer", "tokenizer.json"))
    ids = [tok.encode(t).ids for t in prompts(n)]
    t0 = time.time()
    gen = Generator.from_engine(engine, device="cpu")
    out = gen.generate(ids, SamplingParams(max_tokens=tokens))
    plan = getattr(gen.vkv.store, "plan", None)
    return {
        "kernels": gen.vkv.kern is not None,
        "plan": sorted({x for p in plan.precision for t in "kv" for x in p[t]}) if plan is not None else ["fp16"],
        "recent_window": plan.recent_window if plan is not None else 0,
        "tokens": [t for t, _ in out],
        "seconds": round(time.time() - t0, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", help="an engine version directory (e.g. engines/smollm2/1)")
    ap.add_argument("--prompts", type=int, default=8, help="how many prompts (default 8)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per prompt (default 16)")
    ap.add_argument("--one", choices=["torch", "triton"], help=argparse.SUPPRESS)  # a child run
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.engine, a.prompts, a.tokens)))
        return 0
    runs = {}
    for mode in ("torch", "triton"):
        env = dict(os.environ, BPCOMPILE_KERNELS=mode)
        if mode == "triton":
            env.setdefault("TRITON_INTERPRET", "0" if _has_cuda() else "1")
        cmd = [
            sys.executable,
            __file__,
            a.engine,
            "--prompts",
            str(a.prompts),
            "--tokens",
            str(a.tokens),
            "--one",
            mode,
        ]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return 2
        runs[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    same = runs["torch"]["tokens"] == runs["triton"]["tokens"]
    report = {
        "engine": a.engine,
        "prompts": a.prompts,
        "tokens": a.tokens,
        "plan": runs["torch"]["plan"],
        "recent_window": runs["torch"]["recent_window"],
        "kernels_ran": runs["triton"]["kernels"],
        "identical": same,
        "seconds": {m: r["seconds"] for m, r in runs.items()},
        "runs": runs,
    }
    print(json.dumps(report))
    return 0 if same and runs["triton"]["kernels"] and not runs["torch"]["kernels"] else 1


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
