"""Time one linear layer the ways the CPU runtime could run it, for the row counts a decode step multiplies.

    .venv/bin/python benchmarks/bench_linear.py --threads 2

Rows: 1 (verifier-only decode), 2-12 (a speculation tree's tokens, or a small batch). Shapes: SmolLM2-135M's fused
QKV, fused gate/up, down projection and tied 49152-row head, and the 2-layer draft's 256-wide head. Columns:
`x @ Wt` (the plain runtime's layout, W transposed to [in, out]), `F.linear` (W [out, in], what transformers
runs), `packed` (oneDNN's reordered weight and kernel: `bpcompile.runtime.model.PackedLinear`). Median of
`--repeats` timings of `--iters` calls each, microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bpcompile.runtime.model import Linear, PackedLinear

SHAPES = {
    "qkv 576->960": (576, 960),
    "gate_up 576->3072": (576, 3072),
    "down 1536->576": (1536, 576),
    "head 576->49152": (576, 49152),
    "draft head 256->49152": (256, 49152),
}


def timed(fn, iters: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t) / iters * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,6,8,12")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(
        f"{a.threads} threads, torch {torch.__version__}; microseconds per call (median of {a.repeats} x "
        f"{a.iters})\n\n| matrix | rows | x @ Wt | F.linear | packed | packed vs x @ Wt |\n|---|---|---|---|---|---|"
    )
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, generator=g) * k**-0.5
        plain, packed = Linear(w), PackedLinear(Linear(w))
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, generator=g)
            assert torch.allclose(plain(x), packed(x), rtol=1e-4, atol=1e-4)
            t_plain = timed(lambda: plain(x), a.iters, a.repeats)
            t_lin = timed(lambda: F.linear(x, w), a.iters, a.repeats)
            t_pack = timed(lambda: packed(x), a.iters, a.repeats)
            print(
                f"| {name} | {m} | {t_plain:.0f} | {t_lin:.0f} | {t_pack:.0f} | {t_plain / t_pack:.2f}x |", flush=True
            )


if __name__ == "__main__":
    main()
