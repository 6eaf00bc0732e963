"""Serving benchmark: the same engine version through tritonserver (gRPC streaming, the emitted ensemble) and
in-process (bpcompile.runtime.Generator), at concurrency 1 and 8, with speculation on (the recipe's tree) and
off (verifier only).

    .venv/bin/python benchmarks/bench_serving.py --engine engines/tiny/1 --json out.json

--engine is a built engine version (`bpcompile build recipes/tiny.yaml` publishes engines/tiny/N). Greedy decoding,
fixed max_tokens, closed loop.
"""

from __future__ import annotations

import os

# Before torch is imported (here and, inherited, in the server): OpenMP threads that spin while waiting collapse
# throughput on a busy 2-core machine (in-process: 9 tok/s spinning vs 198 passive, same engine). Both sides of
# the comparison run with the same setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

from bpcompile.serving.client import DEFAULT_PROMPTS, bench_remote  # noqa: E402
from bpcompile.serving.emit import emit_repository  # noqa: E402
from bpcompile.serving.serve import ServerProcess  # noqa: E402


def in_process(engine: Path, tree, prompts, concurrency: int, n: int, max_tokens: int) -> dict:
    """The runtime without Triton: `concurrency` requests in the batch at a time (closed loop, like the client)."""
    from tokenizers import Tokenizer

    from bpcompile.runtime.generator import Generator, SamplingParams, TreeSpec

    tok = Tokenizer.from_file(str(engine / "tokenizer" / "tokenizer.json"))
    gen = Generator.from_engine(engine, tree=TreeSpec(**tree) if tree else None)
    params = SamplingParams(max_tokens=max_tokens, end_id=tok.token_to_id("</s>"))
    ids = [tok.encode(prompts[i % len(prompts)]).ids for i in range(n)]
    gen.generate(ids[:1], params)  # warm-up, as the remote bench does
    todo, start, lat, toks, steps, committed = list(range(n)), {}, [], 0, 0, 0.0
    t0 = time.perf_counter()
    while todo or gen.has_work():
        while todo and len(start) < concurrency:
            i = todo.pop(0)
            start[gen.add_request(ids[i], params)] = time.perf_counter()
        for o in gen.step():
            toks += len(o.new_tokens)
            if o.finished:
                lat.append(time.perf_counter() - start.pop(o.request_id))
                steps += o.stats.verifier_steps
                committed += o.stats.tau * o.stats.verifier_steps
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": n,
        "output_tokens": toks,
        "output_tokens_per_s": toks / wall,
        "latency_s": {"p50": statistics.median(lat), "mean": statistics.fmean(lat)},
        "tokens_per_step": committed / steps if steps else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True, help="engine version directory, e.g. engines/tiny/1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--json", type=Path, help="write all results here")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    engine = a.engine
    results = {
        "engine": str(engine),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), no GPU",
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "max_tokens": a.max_tokens,
        "runs": [],
    }
    for label, tree in (("speculation", None), ("verifier only", {"kind": "none"})):
        repo = tmp / f"repo-{'spec' if tree is None else 'nospec'}"
        emit_repository([(1, engine)], repo, tree=tree)
        with ServerProcess(repo, log_file=tmp / f"{repo.name}.log", startup_timeout=300) as s:
            for c in a.concurrency:
                n = c * a.requests_per_client
                remote = bench_remote(s.grpc_url, DEFAULT_PROMPTS, n=n, concurrency=c, max_tokens=a.max_tokens)
                local = in_process(engine, tree, DEFAULT_PROMPTS, c, n, a.max_tokens)
                row = {"mode": label, "concurrency": c, "triton": remote, "in_process": local}
                results["runs"].append(row)
                print(
                    f"{label:14s} c={c}: triton {remote['output_tokens_per_s']:.1f} tok/s "
                    f"(ttft p50 {remote['ttft_s']['p50'] * 1e3:.0f} ms, tpot p50 {remote['tpot_s']['p50'] * 1e3:.1f} ms, "
                    f"latency p50/p90/p99 {remote['latency_s']['p50']:.2f}/{remote['latency_s']['p90']:.2f}/"
                    f"{remote['latency_s']['p99']:.2f} s, tokens/step {remote['tokens_per_step'] or 0:.2f}, "
                    f"errors {remote['errors']}) | in-process {local['output_tokens_per_s']:.1f} tok/s "
                    f"(latency p50 {local['latency_s']['p50']:.2f} s)",
                    flush=True,
                )
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
