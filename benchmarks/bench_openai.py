"""What the OpenAI-compatible endpoint costs over tritonserver's own gRPC streaming, side by side in one run: one
tritonserver on an emitted repository, the endpoint in this process, `bench_remote` against both alternately
(repeats interleaved so drift hits both), closed-loop clients at each concurrency.

    .venv/bin/python benchmarks/bench_openai.py triton_repo/ --concurrency 1,4 --requests 16 --max-tokens 32 --repeats 3

Prints a markdown table: per protocol and concurrency, median [min, max] over repeats of TTFT p50, time per
output token p50 and output tokens/s.

    .venv/bin/python benchmarks/bench_openai.py triton_repo/ --load --streams 128 --idle 1000 --max-tokens 32

--load instead holds `--idle` connections that sent a request head and one byte of a 100-byte body (slow
clients), runs `--streams` concurrent /v1/completions streams, and meanwhile times a new /v1/models request and a
new 1-token completion; it prints whether every stream completed and those times."""

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
    ap.add_argument("--load", action="store_true", help="the load check (streams + idle slow-body connections)")
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--idle", type=int, default=1000)
    a = ap.parse_args()
    if a.load:
        return load(a)
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


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load(a) -> int:
    import http.client
    import json
    import socket
    import time
    from concurrent.futures import ThreadPoolExecutor

    import openai

    with ServerProcess(a.repo, log_file=Path("/tmp/bench_openai_server.log"), startup_timeout=300) as s:
        front = OpenAIFrontend(a.repo, s.grpc_url).start()
        client = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=600)
        host, port = front.sock.getsockname()[:2]
        idle = []
        try:
            big = []  # a declared 50 MB body with 1 MB of it sent: seconds to the 413, and this process's RSS
            for _ in range(5):
                rss = _rss()
                with socket.create_connection((host, port)) as c:
                    t1 = time.perf_counter()
                    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 52428800\r\n\r\n")
                    c.sendall(b"a" * (1 << 20))
                    status = c.recv(64).split()[1]
                    big.append((int(status), time.perf_counter() - t1, _rss() - rss))
            for _ in range(a.idle):
                c = socket.create_connection((host, port))
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
                idle.append(c)

            def stream(i):
                t0 = time.perf_counter()
                chunks = list(
                    client.completions.create(
                        model=front.model_id,
                        prompt=DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)],
                        max_tokens=a.max_tokens,
                        temperature=0,
                        stream=True,
                    )
                )
                return chunks[-1].choices[0].finish_reason, time.perf_counter() - t0

            with ThreadPoolExecutor(a.streams) as pool:
                t0 = time.perf_counter()
                running = [pool.submit(stream, i) for i in range(a.streams)]
                time.sleep(1.0)  # the streams are in the batch
                t1 = time.perf_counter()
                client.models.list()
                models_s = time.perf_counter() - t1
                t1 = time.perf_counter()
                body = {"model": front.model_id, "prompt": "Hello", "max_tokens": 1, "temperature": 0, "stream": True}
                conn = http.client.HTTPConnection(host, port, timeout=600)
                conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
                # the server has answered (status and headers) while the request waits for a batch place
                stream_status = conn.getresponse().status
                stream_headers_s = time.perf_counter() - t1
                conn.close()
                t1 = time.perf_counter()
                client.completions.create(model=front.model_id, prompt="Hello", max_tokens=1, temperature=0)
                completion_s = time.perf_counter() - t1
                done = [f.result() for f in running]
                wall = time.perf_counter() - t0
        finally:
            for c in idle:
                c.close()
            front.stop()
    out = {
        "streams": a.streams,
        "idle_connections": a.idle,
        "max_tokens": a.max_tokens,
        "completed": sum(r == "length" or r == "stop" for r, _ in done),
        "new_models_request_s": round(models_s, 3),
        "new_stream_answered_s": round(stream_headers_s, 3),
        "new_stream_status": stream_status,
        "new_completion_s": round(completion_s, 3),
        "stream_latency_max_s": round(max(t for _, t in done), 2),
        "wall_s": round(wall, 2),
        "50mb_body": {
            "statuses": sorted({b[0] for b in big}),
            "seconds_to_413_max": round(max(b[1] for b in big), 4),
            "rss_growth_bytes_max": max(b[2] for b in big),
        },
    }
    print(json.dumps(out, indent=2))
    return 0 if out["completed"] == a.streams and models_s <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
