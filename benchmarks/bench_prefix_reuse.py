"""Multi-turn time to first token with KV prefix reuse on and off, interleaved in one process (SmolLM2 by default).

    .venv/bin/python benchmarks/bench_prefix_reuse.py                       # engines/smollm2/1, 4 conversations
    .venv/bin/python benchmarks/bench_prefix_reuse.py --conversations 2 --turns 2 --json out.json

Conversations in ChatML (SmolLM2's template), built token by token as an agent loop appends them: a system prompt
of about --system-tokens tokens (pydoc text) shared by every conversation, then user turns (short pydoc questions)
and the model's greedy answers (--max-tokens each). Each turn's prompt is the previous prompt + the answer + the
next user turn, so turn t > 1 starts with the previous turn's prompt, and every turn with the system prompt.

One engine, one process, batch 1: each conversation runs twice, reuse on and off in alternating order, on the same
prompts (the histories come from the reuse-off run, so both runs time the same tokens); a run starts on an empty
prefix cache except for what earlier conversations left (the shared system prompt), as a server's would. Time to
first token: from submitting the request to its first output token (prefill of verifier and draft), wall and
this process's CPU time. Reported per
turn: the median TTFT of each mode and the ratio off / on; the tokens taken from the cache; whether the greedy
answers agree (they should: a reused prefix is attended to as computed, for every KV plan); and the pages the
cache holds at the end (referenced and cached, with their bytes and those of their host-side copies).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def texts() -> list[str]:
    import pydoc_data.topics as t

    return [t.topics[k] for k in sorted(t.topics)]


def first_token_s(gen, prompt: list[int], max_tokens: int) -> tuple[tuple[float, float], list[int], object]:
    """((wall, CPU) seconds to the first output token, the answer, its stats): the request alone in the engine.
    CPU: this process's CPU time, which other processes on a loaded machine disturb less than the wall time."""
    from bpcompile.runtime.generator import SamplingParams

    t0, c0 = time.perf_counter(), time.process_time()
    rid = gen.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    ttft, toks, stats = None, [], None
    while gen.has_work():
        for o in gen.step():
            if o.request_id != rid:
                continue
            if o.new_tokens and ttft is None:
                ttft = (time.perf_counter() - t0, time.process_time() - c0)
            toks += o.new_tokens
            if o.finished:
                stats = o.stats
    return ttft, toks, stats


def shared(gen, system: list[int], users: list[list[int]], max_tokens: int) -> None:
    """Conversations sharing the system prompt, submitted together: the pages each one's table holds for the system
    prompt (its full pages), recorded while it runs; the system prompt is held once if they are the same pages."""
    from bpcompile.runtime.generator import SamplingParams

    n = len(system) // gen.page_size
    ids = [gen.add_request(system + u, SamplingParams(max_tokens=max_tokens)) for u in users]
    seen, reused = {}, {}
    while gen.has_work():
        for o in gen.step():
            if o.finished:
                reused[o.request_id] = o.stats.reused_tokens
        for rid in gen.running:
            if len(gen.vkv.tables.get(rid, [])) >= n:
                seen.setdefault(rid, tuple(gen.vkv.tables[rid][:n]))
    out = dict(
        conversations=len(ids),
        max_batch_size=gen.max_batch_size,
        system_tokens=len(system),
        system_pages=n,
        tables_seen=len(seen),
        distinct_pages_holding_the_system_prompt=len({p for t in seen.values() for p in t}),
        computed_in_full=sum(reused[i] == 0 for i in ids),
        reused_tokens=sorted(reused[i] for i in ids),
    )
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default=str(REPO / "engines" / "smollm2" / "1"), help="engine version directory")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1000, help="about this many system prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens each answer generates")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument(
        "--shared",
        type=int,
        default=0,
        help="instead: N conversations' first turns submitted at once (the engine's batch at a time); count the "
        "distinct pages that hold the system prompt across them",
    )
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from bpcompile.runtime.generator import Generator

    torch.set_num_threads(a.threads)
    eng = Path(a.engine)
    tok = AutoTokenizer.from_pretrained(eng / "tokenizer")
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    pieces = texts()
    words = " ".join(pieces[:3]).split()
    lo, hi = 0, len(words)
    while lo < hi:  # the longest prefix of the text within the token budget
        mid = (lo + hi + 1) // 2
        if len(enc(" ".join(words[:mid]))) <= a.system_tokens:
            lo = mid
        else:
            hi = mid - 1
    system = enc("<|im_start|>system\n" + " ".join(words[:lo]) + "<|im_end|>\n")
    end = enc("<|im_end|>\n")

    def user(c: int, t: int) -> list[int]:
        text = " ".join(pieces[(10 + 7 * c + t) % len(pieces)].split()[:30])
        return enc(f"<|im_start|>user\nExplain this briefly: {text}<|im_end|>\n<|im_start|>assistant\n")

    gen = Generator.from_engine(eng)
    print(
        f"engine {eng}: KV {type(gen.vkv.store).__name__}, page {gen.page_size} tokens, tree {gen.tree.kind}; "
        f"reuse by default: {gen.prefix_reuse}; system prompt {len(system)} tokens; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    if a.shared:
        shared(gen, system, [user(c, 0) for c in range(a.shared)], a.max_tokens)
        return
    rows = []  # (conversation, turn, mode, ttft, reused tokens, prompt tokens, agree)
    for c in range(a.conversations):
        hist = list(system)
        for t in range(a.turns):
            prompt = hist + user(c, t)
            res = {}
            for mode in ("on", "off") if (c + t) % 2 == 0 else ("off", "on"):
                gen.prefix_reuse = mode == "on"
                res[mode] = first_token_s(gen, prompt, a.max_tokens)
            rows.append(
                dict(
                    conversation=c,
                    turn=t + 1,
                    prompt_tokens=len(prompt),
                    ttft_on_s=res["on"][0][0],
                    ttft_off_s=res["off"][0][0],
                    cpu_on_s=res["on"][0][1],
                    cpu_off_s=res["off"][0][1],
                    reused_tokens=res["on"][2].reused_tokens,
                    answers_agree=res["on"][1] == res["off"][1],
                )
            )
            print(json.dumps(rows[-1]), flush=True)
            hist = prompt + res["off"][1] + end
    kv = gen.vkv
    page_bytes = kv.store.nbytes() / kv.store.num_pages
    memory = dict(
        referenced_pages=kv.held_pages(),
        cached_pages=len(kv.lru),
        cached_mib=len(kv.lru) * page_bytes / 2**20,
        dense_copies_mib=kv.dense_pages_nbytes() / 2**20,
        pool_pages=kv.capacity,
        pool_mib=kv.nbytes() / 2**20,
        evicted_pages=kv.evicted,
    )
    print("| turn | prompt tokens | reused tokens | TTFT off | TTFT on | off / on | CPU time to 1st token, off / on |")
    print("|---|---|---|---|---|---|---|")
    summary = []
    for t in range(1, a.turns + 1):
        r = [x for x in rows if x["turn"] == t]
        med = lambda k: statistics.median(x[k] for x in r)  # noqa: E731
        ratio = statistics.median(x["ttft_off_s"] / x["ttft_on_s"] for x in r)
        cpu = statistics.median(x["cpu_off_s"] / x["cpu_on_s"] for x in r)
        summary.append(
            dict(turn=t, ttft_off_s=med("ttft_off_s"), ttft_on_s=med("ttft_on_s"), ratio=ratio, cpu_ratio=cpu)
        )
        print(
            f"| {t} | {med('prompt_tokens'):.0f} | {med('reused_tokens'):.0f} | {med('ttft_off_s'):.1f} s | "
            f"{med('ttft_on_s'):.1f} s | {ratio:.1f}x | {cpu:.1f}x |"
        )
    agree = sum(x["answers_agree"] for x in rows)
    print(f"greedy answers equal with reuse on and off: {agree}/{len(rows)} turns")
    print(
        f"cache at the end: {memory['cached_pages']} cached pages ({memory['cached_mib']:.1f} MiB of the store, "
        f"{memory['dense_copies_mib']:.1f} MiB of host-side float copies) of {memory['pool_pages']} "
        f"({memory['pool_mib']:.0f} MiB pool), {memory['referenced_pages']} referenced, "
        f"{memory['evicted_pages']} evicted"
    )
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                dict(machine=platform.processor() or platform.machine(), rows=rows, summary=summary, memory=memory),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
