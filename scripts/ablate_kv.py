"""Where a KV plan's error comes from, on an engine's verifier (issue 10's question for SmolLM2): the plan applied
to K and V, to K only, to V only, with the first S positions of every window kept unquantized (attention
sinks, stored as FP16), and with a recent window: each query reads the K/V of the W newest positions up to and
including its own unquantized (position-relative, so tree verification would read what sequential decode reads),
on the same held-out windows as `bpcompile eval` (builtin pydoc held-out split, 16 x 256 tokens, teacher-forced;
each position attends to the decoded cache of the earlier positions and itself). Sinks and windows are applied
here on top of the engine's plan whatever it holds (its own exact entries are not used), FP16 copies as in the
format; the format's exact entries (KVPlan.sink_tokens / recent_window, docs/KV_FORMAT.md §4) are what
`bpcompile eval` measures, with their bytes counted.

    .venv/bin/python scripts/ablate_kv.py engines/smollm2/1 --sinks 0,1,4,16 --windows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bpcompile.compiler.corpus import text_windows  # noqa: E402
from bpcompile.core.store import engine_version_dir  # noqa: E402
from bpcompile.eval.evaluate import _text  # noqa: E402
from bpcompile.runtime.kvcache import KVPlan, make_kv_store  # noqa: E402
from bpcompile.runtime.model import Llama, causal_attend  # noqa: E402


def windowed_attend(q, k, v, kh, vh, window: int, sink: int) -> torch.Tensor:
    """Causal attention where query t reads key/value t' unquantized (k, v) when t - t' < window or t' < sink,
    and decoded (kh, vh) otherwise. All [B, T, heads, D]."""
    T, D, rep = q.shape[1], q.shape[-1], q.shape[2] // k.shape[2]
    qh, kf, vf, kq, vq = (x.transpose(1, 2) for x in (q, *(y.repeat_interleave(rep, 2) for y in (k, v, kh, vh))))
    t = torch.arange(T)
    exact = (t[:, None] - t[None, :] < window) | (t[None, :] < sink)
    s = torch.where(exact, qh @ kf.transpose(-1, -2), qh @ kq.transpose(-1, -2)) / math.sqrt(D)
    p = s.masked_fill(t[None, :] > t[:, None], float("-inf")).softmax(-1)
    return ((p * exact) @ vf + (p * ~exact) @ vq).transpose(1, 2)


def forward(
    verifier: Llama, tokens: torch.Tensor, plan: KVPlan, sink: int, parts: str, window: int = 0
) -> torch.Tensor:
    """Teacher-forced logits with K and/or V (`parts`) through the plan's store, the first `sink` positions kept,
    and (window > 0) each query's `window` newest positions read unquantized."""
    B, T = tokens.shape
    c = verifier.cfg
    store = make_kv_store(plan, c, math.ceil(B * T / 16), 16)
    slots = torch.arange(B * T)
    keep = (torch.arange(T) < sink).repeat(B)

    def attend(layer, q, k, v):
        kk, vv = (x.reshape(B * T, c.num_kv_heads, -1) for x in (k, v))
        store.write(layer, slots, kk, vv, torch.arange(T).repeat(B))
        kh, vh = (x.float().clone() for x in store.read(layer, slots))
        kh[keep], vh[keep] = kk[keep].half().float(), vv[keep].half().float()
        if "k" not in parts:
            kh = kk.half().float()
        if "v" not in parts:
            vh = vv.half().float()
        kh, vh = kh.reshape(k.shape).to(q.dtype), vh.reshape(v.shape).to(q.dtype)
        if window:
            return windowed_attend(q, k.half().to(q.dtype), v.half().to(q.dtype), kh, vh, window, sink)
        return causal_attend(q, kh, vh)

    return verifier.forward(tokens, attend=attend)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine")
    ap.add_argument("--sinks", default="0,1,4,16")
    ap.add_argument(
        "--windows", default="", help="recent-window sizes W, each measured without and with a 1-token sink"
    )
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    eng = engine_version_dir(a.engine)
    verifier = Llama.from_checkpoint(eng / "verifier", dtype=None)
    plan = KVPlan.load(eng / "kv_plan")
    docs, what = _text(None)
    seqs = torch.tensor(text_windows(eng / "tokenizer" / "tokenizer.json", docs, 256, 16, 0, "eval text"))
    c = verifier.cfg
    fp16 = KVPlan.uniform("fp16", c.num_layers, c.num_kv_heads, c.head_size)
    batches = [seqs[i : i + 8] for i in range(0, len(seqs), 8)]
    ref = [F.log_softmax(forward(verifier, b, fp16, 0, "kv").float(), -1) for b in batches]
    n = seqs[:, 1:].numel()
    ref_nll = sum(-r[:, :-1].gather(-1, b[:, 1:, None]).sum().item() for r, b in zip(ref, batches))
    rows = [("kv", s, 0) for s in map(int, a.sinks.split(","))] + [("k", 0, 0), ("v", 0, 0)]
    rows += [("kv", s, w) for w in map(int, filter(None, a.windows.split(","))) for s in (0, 1)]
    print(
        f"engine {eng}, plan {plan.format} ({sum(x == 'fp8' for p in plan.precision for t in 'kv' for x in p[t])} "
        f"FP8 units), text: {what}, FP16-KV ppl {math.exp(ref_nll / n):.3f}"
    )
    print(
        "| quantized | sink (FP16 positions) | recent window (FP16) | Δppl | top-1 agreement | KL vs FP16 KV |\n"
        "|---|---|---|---|---|---|"
    )
    for parts, sink, window in rows:
        t0 = time.time()
        nll = kl = agree = 0.0
        for r, b in zip(ref, batches):
            logp = F.log_softmax(forward(verifier, b, plan, sink, parts, window).float(), -1)
            nll += -logp[:, :-1].gather(-1, b[:, 1:, None]).sum().item()
            agree += (logp.argmax(-1) == r.argmax(-1)).sum().item()
            kl += F.kl_div(logp, r, log_target=True, reduction="sum").item()
        row = {
            "parts": parts,
            "sink": sink,
            "window": window,
            "dppl_pct": 100 * (math.exp((nll - ref_nll) / n) - 1),
            "top1": agree / seqs.numel(),
            "kl": kl / seqs.numel(),
            "seconds": round(time.time() - t0, 1),
        }
        print(
            f"| {'K and V' if parts == 'kv' else parts.upper() + ' only'} | {sink} | {window} | {row['dppl_pct']:+.2f}% | "
            f"{100 * row['top1']:.2f}% | {row['kl']:.4f} |",
            flush=True,
        )
        print(json.dumps(row), file=sys.stderr)


if __name__ == "__main__":
    main()
