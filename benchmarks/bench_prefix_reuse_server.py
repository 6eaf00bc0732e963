"""Multi-turn time to first token through `bpcompile bench` against tritonserver, prefix reuse on and off.

    .venv/bin/python benchmarks/bench_prefix_reuse_server.py --conversations 2 --turns 2

Two servers of one repository (the engine emitted once), started with BPCOMPILE_PREFIX_REUSE=on and =off in their
environment (what `bpcompile serve --prefix-reuse on|off` sets), up together; each turn's request goes to both in
alternating order. A conversation is text as a client would send it to the ensemble: a system prompt of about
--system-tokens tokens (pydoc text) shared by every conversation, then user turns and the model's answers (from
the reuse-off server), each turn's prompt the previous one + its answer + the next user turn. Each timed request is
`bpcompile bench --prompts FILE -n 1 --warmup 0 --json` (one prompt, nothing sent before it): its time to first
token is the server's prefill of that turn (the turn before it left its pages in the reuse-on server's cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench_ttft(url: str, prompt: str, max_tokens: int, tmp: Path) -> float:
    f = tmp / "prompt.txt"
    f.write_text(prompt + "\n")
    cmd = [str(Path(sys.executable).with_name("bpcompile")), "bench", "--url", url, "--prompts", str(f)]
    cmd += ["-n", "1", "--warmup", "0", "--max-tokens", str(max_tokens), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = json.loads(r.stdout)
    assert out["errors"] == 0, out
    return out["time_to_first_token_s"]["avg"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default=str(REPO / "engines" / "smollm2" / "1"), help="engine version directory")
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()

    import pydoc_data.topics as topics

    from transformers import AutoTokenizer

    from bpcompile.core.switches import PREFIX_REUSE
    from bpcompile.serving.client import generate_remote
    from bpcompile.serving.emit import emit_repository
    from bpcompile.serving.serve import ServerProcess

    eng = Path(a.engine)
    tok = AutoTokenizer.from_pretrained(eng / "tokenizer")
    pieces = [" ".join(topics.topics[k].split()) for k in sorted(topics.topics)]
    words = " ".join(pieces[:3]).split()
    n = 0
    while len(tok.encode(" ".join(words[: n + 50]), add_special_tokens=False)) <= a.system_tokens:
        n += 50
    system = "System: " + " ".join(words[:n])
    tmp = Path(tempfile.mkdtemp(prefix="bench_reuse_"))
    repo = tmp / "repo"
    emit_repository([(1, eng)], repo)
    servers = {}
    try:
        for mode in ("on", "off"):
            os.environ[PREFIX_REUSE] = mode
            servers[mode] = ServerProcess(repo, log_file=tmp / f"server_{mode}.log", startup_timeout=900)
            servers[mode].__enter__()
        os.environ.pop(PREFIX_REUSE)
        rows = []
        for c in range(a.conversations):
            hist = system
            for t in range(a.turns):
                question = " ".join(pieces[10 + 7 * c + t].split()[:30])
                prompt = f"{hist} User: Explain this briefly: {question} Assistant:"
                ttft = {}
                for mode in ("on", "off") if (c + t) % 2 == 0 else ("off", "on"):
                    ttft[mode] = bench_ttft(servers[mode].grpc_url, prompt, a.max_tokens, tmp)
                answer = generate_remote(servers["off"].grpc_url, prompt, max_tokens=a.max_tokens)["text"]
                row = dict(
                    conversation=c + 1,
                    turn=t + 1,
                    prompt_tokens=len(tok.encode(prompt, add_special_tokens=False)),
                    ttft_on_s=ttft["on"],
                    ttft_off_s=ttft["off"],
                    ratio=ttft["off"] / ttft["on"],
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
                hist = prompt + " " + " ".join(answer.split())
    finally:
        for s in servers.values():
            s.__exit__(None, None, None)
    print("| conversation, turn | prompt tokens | TTFT off | TTFT on | off / on |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['conversation']}, {r['turn']} | {r['prompt_tokens']} | {r['ttft_off_s']:.2f} s | "
            f"{r['ttft_on_s']:.2f} s | {r['ratio']:.1f}x |"
        )
    later = [r["ratio"] for r in rows if r["turn"] > 1]
    if later:
        print(f"turns after the first: off / on median {statistics.median(later):.1f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(rows=rows), indent=1))


if __name__ == "__main__":
    main()
