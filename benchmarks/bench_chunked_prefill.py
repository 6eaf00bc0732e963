"""How long a long prompt stalls the sequences already decoding, with chunked prefill and without (SmolLM2).

    .venv/bin/python benchmarks/bench_chunked_prefill.py                      # engines/smollm2/1, chunks 0,512,256
    .venv/bin/python benchmarks/bench_chunked_prefill.py --chunks 0,512 --json out.json

One engine per setting of runtime.prefill_chunk (0 = off), in one process, driven as the in-flight loop drives it
(`Generator.step`): --streams short chat prompts decode (speculation as the engine's recipe says); after --warmup
steps a --prompt-tokens prompt (pydoc text) arrives. For the running streams this reports the gap between
consecutive steps that gave them tokens: its median before the arrival, and the largest from the arrival until the
long prompt's first token; for the long prompt, the time of its largest prefill forward (a chunk, or the whole
prompt; verifier and draft, from its RequestStats) and its time to first token. The claim: the largest gap is the
median gap plus one chunk's forward (`excess_s`: what is left, the chunk's bookkeeping outside the forward). Also
reported: what the long prompt added to a gap, the gap less that step's own decode timed within the step (so that
a machine whose speed drifts between steps does not decide it). Greedy outputs of every setting are compared with the first's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bpcompile.info import machine

REPO = Path(__file__).resolve().parents[1]


def prompts(engine: Path, streams: int, long_tokens: int) -> tuple[list[list[int]], list[int]]:
    import pydoc_data.topics as t

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine / "tokenizer" / "tokenizer.json"))
    keys = sorted(t.topics)
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    short = [tok.encode(chat.format(f"Explain the Python topic '{k}' in detail.")).ids for k in keys[:streams]]
    text = " ".join(t.topics[k] for k in keys[-12:])
    long = tok.encode(chat.format(text)).ids[-long_tokens:]
    return short, long


def prefill_s(gen, rid) -> float:
    """Time a request has spent in forwards so far (RequestStats: verify_s + draft_s); 0 before it runs."""
    r = gen.running.get(rid)
    return r.stats.verify_s + r.stats.draft_s if r is not None else 0.0


def run(engine: Path, chunk: int, short, long, warmup: int, max_tokens: int) -> dict:
    from bpcompile.runtime.generator import Generator, SamplingParams

    gen = Generator.from_engine(engine, prefill_chunk=chunk)
    forwards: list[float] = []  # the long prompt's prefill forwards (verifier + draft), one a step
    spec_run = gen.spec.run

    def timed_spec(reqs, spec_run=spec_run):  # the running streams' own step (draft, verify, accept)
        t0 = time.perf_counter()
        out = spec_run(reqs)
        state["decode"] = time.perf_counter() - t0
        return out

    gen.spec.run = timed_spec
    state: dict = {}
    params = SamplingParams(max_tokens=max_tokens)
    ids = [gen.add_request(p, params) for p in short]
    last = dict.fromkeys(ids, None)
    gaps_before, gaps_during, extra, toks = [], [], [], {i: [] for i in ids}
    steps, arrived, first = 0, None, None
    while gen.has_work():
        if steps == warmup:
            state["long"] = gen.add_request(long, SamplingParams(max_tokens=4))
            toks[state["long"]] = []
            arrived = time.perf_counter()
        during = arrived is not None and first is None  # this step runs while the long prompt prefills
        state["decode"] = 0.0
        spent = prefill_s(gen, state.get("long"))
        outs = gen.step()
        now = time.perf_counter()
        steps += 1
        if during:  # its prefill's share of this step, from its own stats (chunks and a whole prefill alike)
            st = next((o.stats for o in outs if o.request_id == state["long"]), None)
            forwards.append((st.verify_s + st.draft_s if st is not None else prefill_s(gen, state["long"])) - spent)
        for o in outs:
            toks.setdefault(o.request_id, []).extend(o.new_tokens)
            if o.request_id == state.get("long") and o.new_tokens and first is None:
                first = now - arrived
            if o.request_id in last and o.new_tokens:
                if last[o.request_id] is not None:
                    (gaps_during if during else gaps_before).append(now - last[o.request_id])
                    if during:  # what the prompt added to this gap: the gap less this step's own decode
                        extra.append(now - last[o.request_id] - state["decode"])
                last[o.request_id] = now
    gen.close()
    median = statistics.median(gaps_before)
    return {
        "prefill_chunk": chunk,
        "median_gap_s": median,
        "max_gap_during_prefill_s": max(gaps_during),
        "largest_prefill_forward_s": max(forwards),
        "largest_added_delay_s": max(extra),
        "prefill_forwards": sum(f > 0 for f in forwards),
        "ttft_long_s": first,
        "excess_s": max(gaps_during) - median - max(forwards),
        "tokens": [toks[i] for i in ids],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default=str(REPO / "engines" / "smollm2" / "1"))
    ap.add_argument("--chunks", default="0,512,256", help="runtime.prefill_chunk settings, 0 = off [0,512,256]")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=8, help="steps of the streams before the long prompt arrives")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    engine = Path(a.engine)
    short, long = prompts(engine, a.streams, a.prompt_tokens)
    rows = [run(engine, int(c), short, long, a.warmup, a.max_tokens) for c in a.chunks.split(",")]
    for r in rows:
        r["same_tokens_as_first"] = r["tokens"] == rows[0]["tokens"]
    print(f"{machine()}; {a.streams} streams decoding, a {len(long)}-token prompt arrives after {a.warmup} steps")
    print(
        "| prefill_chunk | streams' median gap (s) | their largest gap while it prefills (s) | largest delay it "
        "added (s) | its largest prefill forward (s) | forwards | its TTFT (s) | largest gap - median - one forward (s) | "
        "same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['prefill_chunk'] or 'off'} | {r['median_gap_s']:.2f} | {r['max_gap_during_prefill_s']:.2f} | "
            f"{r['largest_added_delay_s']:.2f} | {r['largest_prefill_forward_s']:.2f} | {r['prefill_forwards']} | {r['ttft_long_s']:.2f} | "
            f"{r['excess_s']:.2f} | {'yes' if r['same_tokens_as_first'] else 'NO'} |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
