"""bpcompile's CPU attention kernel (kernels/cpu_decode.c) on against off (the PyTorch path), side by side in one
run, on the SmolLM2 pair: verifier-only decoding and feature-draft speculation (dynamic tree 5, back-off), FP16 KV,
at batch 1 and a larger batch.

    .venv/bin/python benchmarks/bench_cpu_attention.py                    # batch 1 and 8, 8 prompts x 32 tokens, 3 repeats
    .venv/bin/python benchmarks/bench_cpu_attention.py --batches 8 --max-tokens 64 --repeats 5

Each configuration is one Generator (models as engines run them on CPU, `runtime.cpu_weights` both) with its
executors' `few_query_kernel` switched on or off; every repeat times all of them on the same held-out chat prompts
(benchmarks/bench_smollm2.py's), in an order reversed on odd repeats. Prints, per row, tokens/s with the kernel and
without, the median over repeats of the per-repeat speed-up with its min..max, and whether both produced the same
tokens. No assertion on speed: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from bench_smollm2 import prompts  # noqa: E402  (the benchmark's held-out chat prompts)

from bpcompile.compiler.convert import convert_checkpoint  # noqa: E402
from bpcompile.runtime.generator import Generator, SamplingParams, TreeSpec  # noqa: E402
from bpcompile.runtime.model import FeatureDraft, Llama  # noqa: E402
from bpcompile.runtime.paged_kv import float_store_factory  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verifier", default=str(REPO / "models" / "smollm2" / "verifier"))
    ap.add_argument("--feature-draft", default=str(REPO / "models" / "smollm2" / "feature_draft"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1, help="prompt selection (benchmarks/bench_smollm2.py's default)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    from bpcompile.kernels import cpu_decode

    if not cpu_decode.available():
        sys.exit("the CPU attention kernel cannot be built here (no C compiler, or BPCOMPILE_CPU_DECODE=0)")
    ps = prompts(AutoTokenizer.from_pretrained(a.verifier), a.prompts, 256, a.seed)
    tmp = Path(tempfile.mkdtemp())
    convert_checkpoint(a.verifier, tmp / "v")
    v = Llama.from_checkpoint(tmp / "v")
    v.pack_for_cpu("both")
    fd = FeatureDraft.from_dir(a.feature_draft, v)
    fd.pack_for_cpu("both")
    gens = {}
    for batch in (int(x) for x in a.batches.split(",")):
        for name, draft, tree in (
            ("verifier only", None, TreeSpec("none")),
            ("feature draft, dynamic tree 5", fd, TreeSpec("dynamic", nodes=5)),
        ):
            for kernel in (True, False):
                g = Generator(
                    v,
                    draft,
                    tree,
                    max_batch_size=batch,
                    max_seq_len=1024,
                    kv_store_factory=float_store_factory(torch.float16),
                )
                for ex in (g.v_exec, g.d_exec):
                    if ex is not None:
                        ex.few_query_kernel = kernel
                gens[(batch, name, kernel)] = g

    def run(key):
        batch, g = key[0], gens[key]
        out = []
        for i in range(0, len(ps), batch):  # the prompts in batches of `batch`
            out += [t for t, _ in g.generate(ps[i : i + batch], SamplingParams(max_tokens=a.max_tokens))]
        return out

    for key in gens:  # warm-up outside the timings
        gens[key].generate(ps[:1], SamplingParams(max_tokens=4))
    times, toks = {k: [] for k in gens}, {}
    for rep in range(a.repeats):
        for key in list(gens) if rep % 2 == 0 else list(gens)[::-1]:
            t = time.perf_counter()
            toks[key] = run(key)
            times[key].append(time.perf_counter() - t)
        print(f"repeat {rep + 1}/{a.repeats} done", file=sys.stderr)
    n = len(ps) * a.max_tokens
    print(
        f"{len(ps)} prompts x {a.max_tokens} new tokens, {a.repeats} interleaved repeats, FP16 KV, float32 weights, "
        f"{a.threads} threads, torch {torch.__version__}, {platform.machine()}\n"
    )
    print("| batch | row | kernel tok/s | PyTorch path tok/s | speed-up (median, min..max) | same tokens |")
    print("|---|---|---|---|---|---|")
    for batch, name, kernel in gens:
        if not kernel:
            continue
        on, off = times[(batch, name, True)], times[(batch, name, False)]
        r = sorted(b / a_ for a_, b in zip(on, off))
        print(
            f"| {batch} | {name} | {n / statistics.median(on):.1f} | {n / statistics.median(off):.1f} | "
            f"{statistics.median(r):.2f}x ({r[0]:.2f}..{r[-1]:.2f}) | "
            f"{toks[(batch, name, True)] == toks[(batch, name, False)]} |"
        )


if __name__ == "__main__":
    main()
