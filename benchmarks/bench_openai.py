"""What the OpenAI-compatible endpoint costs over tritonserver's own gRPC streaming, side by side in one run: one
tritonserver on an emitted repository, the endpoint in this process, `bench_remote` against both alternately
(repeats interleaved so drift hits both), closed-loop clients at each concurrency.

    .venv/bin/python benchmarks/bench_openai.py triton_repo/ --concurrency 1,4 --requests 16 --max-tokens 32 --repeats 3

Prints a markdown table: per protocol and concurrency, median [min, max] over repeats of TTFT p50, time per
output token p50 and output tokens/s."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bpcompile.serving.client import DEFAULT_PROMPTS, bench_remote  # noqa: E402
from bpcompile.serving.openai_frontend import OpenAIFrontend  # noqa: E402
from bpcompile.serving.serve import ServerProcess  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("repo", type=Path)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    levels = [int(c) for c in a.concurrency.split(",")]
    rows: dict = {}
    with ServerProcess(a.repo, log_file=Path("/tmp/bench_openai_server.log"), startup_timeout=300) as s:
        front = OpenAIFrontend(a.repo, s.grpc_url).start()
        try:
            targets = {
                "grpc (tritonclient, stream)": (s.grpc_url, "grpc"),
                "openai (/v1/completions, SSE)": (front.url, "openai"),
            }
            for _ in range(a.repeats):
                for c in levels:
                    for name, (url, proto) in targets.items():
                        r = bench_remote(
                            url, DEFAULT_PROMPTS, n=a.requests, concurrency=c, max_tokens=a.max_tokens, protocol=proto
                        )
                        assert r["errors"] == 0, r["error_samples"]
                        rows.setdefault((name, c), []).append(r)
        finally:
            front.stop()

    def fmt(xs, scale=1.0, digits=1):
        xs = [x * scale for x in xs]
        return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}, {max(xs):.{digits}f}]"

    print(f"{a.requests} requests per run, {a.max_tokens} max tokens, {a.repeats} repeats (median [min, max])\n")
    print("| client | concurrency | TTFT p50 (ms) | time per output token p50 (ms) | output tokens/s |")
    print("|---|---|---|---|---|")
    for (name, c), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(
            f"| {name} | {c} | {fmt([r['ttft_s']['p50'] for r in rs], 1e3)} | "
            f"{fmt([r['tpot_s']['p50'] for r in rs], 1e3, 2)} | {fmt([r['output_tokens_per_s'] for r in rs])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
