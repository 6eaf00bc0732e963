"""KV fidelity eval: run the verifier *through* a quantized cache and compare with FP16 KV.

Every layer's K/V is written to a real `KVStore` (quantize-and-append) and read back dequantized;
each position attends to the dequantized cache of earlier positions and of itself (in decode a
token's own K/V is appended before it is attended to, so it is quantized too). Per-token
quantization makes this teacher-forced pass read exactly what sequential decode would read.

Metrics per plan: held-out perplexity, teacher-forced top-1 agreement with the FP16-KV verifier,
relative attention-output error per layer (same q/k/v, quantized vs FP16 cache), and compression
from the bytes the store allocates. `inject_key_outliers` builds the function-preserving
outlier-injected model the INT4+FP8 plan must clearly win on.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from bpcompile.compiler.calibrate import KVCalibConfig, measure_units, plan_from_measurement
from bpcompile.core.errors import UserError
from bpcompile.runtime.kvcache import KVPlan, make_kv_store
from bpcompile.runtime.model import Llama, causal_attend
from bpcompile.runtime.paged_kv import RecentKV, allocated_compression, cache_pages, dense_attention, exact_reads  # noqa: F401

PAGE = 16
STANDARD_FRACTIONS = (0.0, 0.04, 0.08, 0.16)
UNROTATED = "unrotated int4+fp8 8%"  # the plan without the Hadamard rotation (rotation: none)


def cached_forward(verifier: Llama, tokens: torch.Tensor, plan: KVPlan, layer_err: Optional[list] = None):
    """Teacher-forced logits [B,T,V] with every layer's K/V going through the plan's store.

    layer_err: if given, a list of [sum |o - o_fp16|^2, sum |o_fp16|^2] per layer is accumulated, where
    o_fp16 attends over the same k/v rounded to fp16 (the reference cache)."""
    B, T = tokens.shape
    c = verifier.cfg
    store = make_kv_store(plan, c, math.ceil(B * T / PAGE), PAGE, verifier.device)
    slots = torch.arange(B * T, device=tokens.device)

    t = torch.arange(T, device=tokens.device)

    def attend(layer, q, k, v):
        store.write(
            layer, slots, k.reshape(B * T, c.num_kv_heads, -1), v.reshape(B * T, c.num_kv_heads, -1), t.repeat(B)
        )
        kh, vh = (x.reshape(k.shape).to(q.dtype) for x in store.read(layer, slots))
        if plan.has_exact:
            o = attend_exact(q, kh, vh, k, v, plan, t, t, t[None, :] <= t[:, None])
        else:
            o = causal_attend(q, kh, vh)
        if layer_err is not None:
            ref = causal_attend(q, k.half().to(q.dtype), v.half().to(q.dtype))
            layer_err[layer][0] += (o - ref).double().pow(2).sum().item()
            layer_err[layer][1] += ref.double().pow(2).sum().item()
        return o

    return verifier.forward(tokens, attend=attend)


def attend_exact(q, kh, vh, k, v, plan: KVPlan, q_pos, k_pos, visible) -> torch.Tensor:
    """Attention of q [B, T, H, D] that reads the plan's exact entries as the runtime does (RecentKV): the FP16
    copy of k, v where exact_reads says so, the stored kh, vh elsewhere (all [B, N, KV, D]); visible [T, N]."""
    ex = exact_reads(q_pos, k_pos, plan.sink_tokens, plan.recent_window) & visible
    rep = q.shape[2] // k.shape[2]
    hide = lambda m: ~m.repeat_interleave(rep, dim=0)[None, None]  # noqa: E731  [1, 1, T * rep, N]
    ke, ve = (x.half().to(q.dtype).transpose(1, 2) for x in (k, v))
    return dense_attention(q, kh.transpose(1, 2), vh.transpose(1, 2), hide(visible & ~ex), exact=(ke, ve, hide(ex)))


def _fp16_plan(c) -> KVPlan:
    return KVPlan.uniform("fp16", c.num_layers, c.num_kv_heads, c.head_size)


def evaluate(
    verifier: Llama,
    plans: dict,
    heldout_token_ids: list[list[int]],
    batch: int = 8,
    seq_len: int = 2048,
    lookahead: int = 6,
    sequences: int = 1,
) -> dict:
    """plans: {name: KVPlan or format name ('fp16', 'fp8', 'int8', 'int4-naive')}. Returns a report dict
    with one row per plan and a markdown table under "markdown". seq_len, lookahead, sequences: the allocation
    compression is reported for (an engine's max_seq_len, largest tree and max_batch_size: the runtime's pool);
    "compression_one_sequence" is the same at one sequence (per-engine tables weigh most there)."""
    c = verifier.cfg
    plans = {
        n: (p if isinstance(p, KVPlan) else KVPlan.uniform(p, c.num_layers, c.num_kv_heads, c.head_size))
        for n, p in plans.items()
    }
    seqs = torch.tensor(heldout_token_ids, dtype=torch.long)
    ref_plan = _fp16_plan(c)
    ref_logp = []  # reference: FP16 KV cache
    for i in range(0, len(seqs), batch):
        ref_logp.append(
            F.log_softmax(cached_forward(verifier, seqs[i : i + batch].to(verifier.device), ref_plan).cpu().float(), -1)
        )
    rows = []
    for name, plan in plans.items():
        seq_nll, seq_kl, agree, errs = [], [], 0, [[0.0, 0.0] for _ in range(c.num_layers)]
        for b, i in enumerate(range(0, len(seqs), batch)):
            tok = seqs[i : i + batch].to(verifier.device)
            logits = cached_forward(verifier, tok, plan, errs).cpu().float()
            logp = F.log_softmax(logits, -1)
            seq_nll += (-logp[:, :-1].gather(-1, tok[:, 1:, None].cpu())).sum((1, 2)).tolist()
            agree += (logits.argmax(-1) == ref_logp[b].argmax(-1)).sum().item()
            # KL(FP16-KV || this cache) per position: the whole distribution's shift, which moves smoothly
            # with the quantization error where perplexity's sign at the +0.1% level is luck.
            seq_kl += F.kl_div(logp, ref_logp[b], log_target=True, reduction="none").sum((1, 2)).tolist()
        n = seqs[:, 1:].numel()
        nll, kl = sum(seq_nll), sum(seq_kl)
        rows.append(
            {
                "name": name,
                "format": plan.format,
                "outlier_fraction": plan.outlier_fraction,
                "fp8_units": sum(x == "fp8" for p in plan.precision for t in ("k", "v") for x in p[t]),
                "int8_units": sum(x == "int8" for p in plan.precision for t in ("k", "v") for x in p[t]),
                "int5_units": sum(x == "int5" for p in plan.precision for t in ("k", "v") for x in p[t]),
                "int6_units": sum(x == "int6" for p in plan.precision for t in ("k", "v") for x in p[t]),
                "int3_units": sum(x == "int3" for p in plan.precision for t in ("k", "v") for x in p[t]),
                "klt_units": sum(x.startswith("klt") for p in plan.precision for x in p["k"]),
                "compression_vs_fp16": round(
                    allocated_compression(plan, c, seq_len, lookahead, sequences=sequences), 4
                ),
                "compression_one_sequence": round(allocated_compression(plan, c, seq_len, lookahead), 4),
                "ppl": math.exp(nll / n),
                "top1_agreement": agree / seqs.numel(),
                "kl_vs_fp16": kl / seqs.numel(),
                # per-sequence sums (NLL over predicted tokens, KL over positions): for paired statistics
                "seq_nll": seq_nll,
                "seq_kl": seq_kl,
                "attn_rel_error": [math.sqrt(a / max(b, 1e-30)) for a, b in errs],
            }
        )
    base = next((r["ppl"] for r in rows if r["format"] == "fp16"), None)
    for r in rows:
        r["ppl_delta_pct"] = None if base is None else 100 * (r["ppl"] / base - 1)
    report = {
        "tokens": int(seqs.numel()),
        "sequences": len(seqs),
        "seq_len": int(seqs.shape[1]),
        "rows": rows,
        "compression_at": {"max_seq_len": seq_len, "lookahead": lookahead, "sequences": sequences},
    }
    report["markdown"] = markdown_table(report)
    return report


def markdown_table(report: dict) -> str:
    nl = len(report["rows"][0]["attn_rel_error"]) if report["rows"] else 0
    head = (
        "| KV cache | FP8 / INT8 / INT5 / INT6 / INT3 / KLT units | compression (allocated; one sequence) | held-out ppl | Δppl | top-1 agreement | "
        "KL vs FP16 KV (nats/token) | " + " | ".join(f"attn err L{i}" for i in range(nl)) + " |"
    )
    lines = [head, "|" + "---|" * (7 + nl)]
    for r in report["rows"]:
        d = "" if r["ppl_delta_pct"] is None else f"{r['ppl_delta_pct']:+.2f}%"
        units = " / ".join(str(r.get(f"{x}_units", 0)) for x in ("fp8", "int8", "int5", "int6", "int3", "klt"))
        lines.append(
            f"| {r['name']} | {units} | "
            f"{r['compression_vs_fp16']:.2f}x; {r.get('compression_one_sequence', r['compression_vs_fp16']):.2f}x | {r['ppl']:.4f} | {d} | "
            f"{100 * r['top1_agreement']:.2f}% | {r['kl_vs_fp16']:.5f} | "
            + " | ".join(f"{e:.4f}" for e in r["attn_rel_error"])
            + " |"
        )
    lines.append(
        f"\n{report['sequences']} sequences x {report['seq_len']} tokens ({report['tokens']} positions) of "
        f"{report.get('text', 'held-out text')}; agreement is against the same model with an FP16 KV cache. "
        + _allocation_note(report.get("compression_at"))
    )
    return "\n".join(lines)


def standard_plans(
    verifier: Llama,
    calib_samples: list[list[int]],
    group_size: int = 64,
    fractions=STANDARD_FRACTIONS,
    extra: Optional[dict] = None,
) -> dict:
    """FP16, FP8, naive INT4 and INT4 + FP8 outlier units at each fraction (one calibration pass)."""
    c = verifier.cfg
    plans = {"fp16": "fp16", "fp8": "fp8", "int4-naive": "int4-naive"}
    m = measure_units(verifier, calib_samples, KVCalibConfig(group_size=group_size, **(extra or {})))
    for f in fractions:
        plans[f"int4+fp8 {f:.0%}"] = plan_from_measurement(m, c, f)[0]
    return plans


def inject_key_outliers(verifier: Llama, factor: float = 20.0, heads=None, pairs=(0, 1)) -> Llama:
    """A function-preserving copy of `verifier` whose keys have outlier channels.

    In each chosen (layer, KV head) the key channels of rotary pairs (i, i + D/2), i in `pairs`
    counted from the lowest-frequency end, are multiplied by `factor` and the same query channels
    of every query head in that group divided by it: q·k is unchanged, and because both elements
    of a rotary pair get the same factor the transform commutes with RoPE. Default heads: KV head 0
    of every layer. Low-frequency pairs barely rotate, so the outlier stays in its channel post-RoPE,
    as real "massive" key channels do.
    """
    c = verifier.cfg
    D, rep, nq = c.head_size, c.num_heads // c.num_kv_heads, c.num_heads * c.head_size
    heads = heads if heads is not None else [(layer, 0) for layer in range(c.num_layers)]
    w = {k: v.clone() for k, v in verifier.w.items()}
    for layer, h in heads:
        for name in ("weight", "bias"):
            key = f"transformer.layers.{layer}.attention.qkv.{name}"
            if key not in w:
                continue
            t = w[key]
            for i in pairs:
                for ch in (D // 2 - 1 - i, D - 1 - i):
                    t[nq + h * D + ch] *= factor
                    for qh in range(h * rep, (h + 1) * rep):
                        t[qh * D + ch] /= factor
    out = Llama(c, w, verifier.dtype)
    return out.to(verifier.device)


# ---- passkey retrieval and greedy-continuation parity ---------------------------------------
# Both mirror what serving does with a cache: the prompt is prefilled attending to its own unquantized
# K/V (as the runtime's and TensorRT-LLM's context phase do) while its K/V is stored in the plan's
# format; every later token reads the stored (dequantized) cache, its own K/V included.

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_INTRO = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n"
)
PASSKEY_QUESTION = "\n\nWhat is the pass key?"
PASSKEY_ANSWER = "The pass key is"


def _chat(tok, user: str) -> str:
    """The user turn through the tokenizer's chat template; a model without one gets the bare text."""
    from bpcompile.runtime.text import chat_turn

    turn = chat_turn(tok, user)
    return turn if turn is not None else user + "\n"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def passkey_trials(tok, length: int, trials: int, seed: int = 0) -> list[dict]:
    """`trials` prompts of about `length` tokens: a random 5-digit key at a random depth of filler text,
    then "What is the pass key?". Each trial: ids (prompt + answer prefix + key), prompt_len (where decode
    starts) and key_start (first of the key's tokens, the ones scored)."""
    rng = random.Random(f"passkey:{seed}:{length}")
    enc = lambda text: tok(text).input_ids  # noqa: E731 (the tokenizer's own special tokens, as served)
    key_line = lambda key: f"The pass key is {key}. Remember it. {key} is the pass key. "  # noqa: E731
    overhead = len(enc(_chat(tok, PASSKEY_INTRO + key_line("00000") + PASSKEY_QUESTION))) + 8
    per = len(enc(PASSKEY_FILLER * 8)) / 8
    fill = max(1, round((length - overhead) / per))
    out = []
    for _ in range(trials):
        key, depth = str(rng.randint(10000, 99999)), rng.randint(0, fill)
        user = (
            PASSKEY_INTRO + PASSKEY_FILLER * depth + key_line(key) + PASSKEY_FILLER * (fill - depth) + PASSKEY_QUESTION
        )
        prompt = _chat(tok, user)
        ids = enc(prompt + PASSKEY_ANSWER + " " + key)
        prompt_len = _common_prefix(ids, enc(prompt))
        key_start = _common_prefix(ids, enc(prompt + PASSKEY_ANSWER))
        if not prompt_len < key_start < len(ids):
            raise UserError("passkey: the tokenizer does not split the answer from the key; cannot score it")
        out.append({"ids": ids, "prompt_len": prompt_len, "key_start": key_start, "depth": depth / fill, "key": key})
    return out


def _prefix_kv(verifier: Llama, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill: each layer's (k, v) [P, KV, D] of the prompt, attending to its own unquantized K/V."""
    kv = []

    def capture(layer, q, k, v):
        kv.append((k[0], v[0]))
        return causal_attend(q, k, v)

    verifier.forward(torch.tensor([ids], device=verifier.device), attend=capture, last_only=True)
    return kv


class PlanDecoder:
    """Decode steps after a prefilled prompt through `plan`'s store: the prompt's K/V (from _prefix_kv) is
    stored in the plan's format once; each step appends its tokens' K/V, then they attend to the dequantized
    cache (the plan's exact entries read from an FP16 copy, as the runtime does). A step of T tokens reads
    exactly what T sequential decode steps would; capacity is the prompt plus `max_new` tokens.

    Every format's stored entry decodes on its own (its scales are per token and unit), so each entry is
    dequantized once, when written, and kept: a step costs its own tokens' reads, not the whole cache's."""

    def __init__(self, verifier: Llama, prefix_kv: list, plan: KVPlan, max_new: int):
        c, self.dev, self.verifier, self.plan = verifier.cfg, verifier.device, verifier, plan
        self.n = prefix_kv[0][0].shape[0]
        self.store = make_kv_store(plan, c, math.ceil((self.n + max_new) / PAGE), PAGE, self.dev)
        prompt = torch.arange(self.n, device=self.dev)
        self.read = []  # per layer: [k, v] [N, KV, D] as read back from the store, in the model's dtype
        for layer, (k, v) in enumerate(prefix_kv):
            self.store.write(layer, prompt, k, v, prompt)
            self.read.append([x.to(verifier.dtype) for x in self.store.read(layer, prompt)])
        self.exact = [list(kv) for kv in prefix_kv] if plan.has_exact else None
        self.capacity = self.n + max_new

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Logits [T, V] of `tokens` appended after everything stepped so far."""
        N = self.n + len(tokens)
        if N > self.capacity:
            raise ValueError(f"PlanDecoder: {N} positions exceed the capacity of {self.capacity}")
        slots, new = torch.arange(N, device=self.dev), torch.arange(self.n, N, device=self.dev)
        visible = slots[None, :] <= new[:, None]  # [T, N]: token i sees the prompt and tokens <= i
        plan = self.plan

        def attend(layer, q, k, v):
            self.store.write(layer, new, k[0], v[0], new)
            rd = self.read[layer]
            rd[0], rd[1] = (torch.cat([old, x.to(q.dtype)]) for old, x in zip(rd, self.store.read(layer, new)))
            if self.exact is not None:
                ex = self.exact[layer]
                ex[0], ex[1] = torch.cat([ex[0], k[0]]), torch.cat([ex[1], v[0]])
                return attend_exact(q, rd[0][None], rd[1][None], ex[0][None], ex[1][None], plan, new, slots, visible)
            kh, vh = (x.transpose(0, 1) for x in rd)  # [KV, N, D]
            rep = q.shape[2] // kh.shape[0]
            kh, vh = kh.repeat_interleave(rep, 0)[None], vh.repeat_interleave(rep, 0)[None]
            return F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, attn_mask=visible).transpose(1, 2)

        out = self.verifier.forward(torch.tensor([tokens], device=self.dev), new[None], attend=attend)[0]
        self.n = N
        return out


def decode_logits(verifier: Llama, prefix_kv: list, tail: list[int], plan: KVPlan) -> torch.Tensor:
    """Teacher-forced decode of `tail` after a prefilled prompt through `plan`'s store -> logits [T, V]."""
    return PlanDecoder(verifier, prefix_kv, plan, len(tail)).step(tail)


def greedy_answer(verifier: Llama, prefix_kv: list, answer_prefix: list[int], plan: KVPlan, tokens: int) -> list[int]:
    """The answer prefix teacher-forced after the prompt, then `tokens` greedy tokens through the plan."""
    dec = PlanDecoder(verifier, prefix_kv, plan, len(answer_prefix) + tokens)
    out = [int(dec.step(answer_prefix)[-1].argmax())]
    while len(out) < tokens:
        out.append(int(dec.step(out[-1:])[-1].argmax()))
    return out


def _progress(msg: str) -> None:
    """Long evaluation stages report on stderr (stdout carries the report)."""
    print(f"bpcompile eval: {msg}", file=sys.stderr, flush=True)


PASSKEY_ANSWER_TOKENS = 16  # the key and room for a few words before it


def key_in(text: str, key: str) -> bool:
    """The key as a number of its own in the answer (not part of a longer digit run)."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", text) is not None


def passkey_accuracy(verifier: Llama, plans: dict, tok, lengths, trials: int, seed: int = 0) -> dict:
    """Per plan and length: share of trials whose greedy answer (PASSKEY_ANSWER_TOKENS tokens after "The pass
    key is") contains the key ("accuracy", retrieval as passkey benchmarks score it), and share whose answer
    starts with the key verbatim ("verbatim": stricter, it also scores the wording). The prompt is prefilled
    once per trial; only the answer's decode steps run once per plan."""
    plans = _as_plans(verifier, plans)
    res = {
        "lengths": list(lengths),
        "trials": trials,
        "seed": seed,
        "answer_tokens": PASSKEY_ANSWER_TOKENS,
        "mean_prompt_tokens": {},
        "accuracy": {n: {} for n in plans},
        "verbatim": {n: {} for n in plans},
        "hits": {n: {} for n in plans},
    }
    for L in lengths:
        hits, verbatim = {n: [] for n in plans}, dict.fromkeys(plans, 0)
        ts = passkey_trials(tok, L, trials, seed)
        t0 = time.perf_counter()
        for i, t in enumerate(ts):
            if i and i % 10 == 0:
                _progress(f"passkey {L}: {i}/{len(ts)} trials ({time.perf_counter() - t0:.0f}s)")
            ids, P, ks = t["ids"], t["prompt_len"], t["key_start"]
            kv = _prefix_kv(verifier, ids[:P])
            for name, plan in plans.items():
                out = greedy_answer(verifier, kv, ids[P:ks], plan, PASSKEY_ANSWER_TOKENS)
                hits[name].append(int(key_in(tok.decode(out), t["key"])))
                verbatim[name] += out[: len(ids) - ks] == ids[ks:]
        res["mean_prompt_tokens"][str(L)] = round(sum(t["prompt_len"] for t in ts) / max(1, len(ts)), 1)
        for name in plans:
            res["accuracy"][name][str(L)] = sum(hits[name]) / max(1, trials)
            res["verbatim"][name][str(L)] = verbatim[name] / max(1, trials)
            res["hits"][name][str(L)] = hits[name]
    if "fp16" in plans:
        res["vs_fp16"] = {
            n: {L: paired_difference(res["hits"][n][L], res["hits"]["fp16"][L], seed) for L in res["hits"][n]}
            for n in plans
            if n != "fp16"
        }
    return res


def paired_difference(a: list[int], b: list[int], seed: int = 0, n_boot: int = 2000) -> dict:
    """a - b on the same trials (1 = retrieved): the difference in accuracy (points), the trials only a
    or only b got right, and a 95% paired-bootstrap interval of the difference. With a few hundred trials
    one trial is a point or less, so a gap is read against this interval, not against a sampling error of
    each accuracy on its own (the formats share their trials, and most of them agree)."""
    n = len(a)
    if n == 0 or n != len(b):
        raise ValueError("paired_difference: two equally long, non-empty outcome lists")
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    boot = d[torch.randint(0, n, (n_boot, n), generator=g)].mean(1)
    lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {
        "points": round(100 * d.mean().item(), 2),
        "only_this": int((d > 0).sum()),
        "only_fp16": int((d < 0).sum()),
        "interval_points": [round(100 * lo, 2), round(100 * hi, 2)],
    }


def greedy_parity(verifier: Llama, plans: dict, prompts: list[list[int]], tokens: int, batch: int = 16) -> dict:
    """Per plan: share of `tokens`-token greedy continuations identical to the FP16-KV one, and the mean
    length of the identical prefix. Runs the runtime's Generator (verifier-only, greedy) over each plan's
    real paged store, so it measures the cache serving uses."""
    from bpcompile.runtime.generator import Generator, SamplingParams
    from bpcompile.runtime.kvcache import kv_store_factory
    from bpcompile.runtime.speculative import TreeSpec

    plans = _as_plans(verifier, {"fp16": "fp16", **plans})
    outs = {}
    for name, plan in plans.items():
        _progress(f"parity: {name} ({len(prompts)} prompts x {tokens} tokens)")
        gen = Generator(
            verifier,
            None,
            TreeSpec("none"),
            max_batch_size=max(1, min(batch, len(prompts))),
            max_seq_len=max(map(len, prompts)) + tokens + 1,
            kv_store_factory=kv_store_factory(plan),
            device=str(verifier.device),
        )
        outs[name] = [toks for toks, _ in gen.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0))]
    ref = outs["fp16"]
    return {
        "prompts": len(prompts),
        "tokens": tokens,
        "prompt_tokens": len(prompts[0]) if prompts else 0,
        "how": "runtime Generator, verifier-only greedy, each plan's paged KV store",
        "identical": {n: sum(a == b for a, b in zip(o, ref)) / max(1, len(ref)) for n, o in outs.items()},
        "mean_identical_prefix": {
            n: sum(_common_prefix(a, b) for a, b in zip(o, ref)) / max(1, len(ref)) for n, o in outs.items()
        },
    }


def _as_plans(verifier: Llama, plans: dict) -> dict:
    c = verifier.cfg
    return {
        n: (p if isinstance(p, KVPlan) else KVPlan.uniform(p, c.num_layers, c.num_kv_heads, c.head_size))
        for n, p in plans.items()
    }


def _long_markdown(report: dict) -> str:
    out = []
    pk = report.get("passkey")
    if pk:
        Ls = [str(L) for L in pk["lengths"]]
        out += [
            "",
            "| KV cache | " + " | ".join(f"passkey @{L} (~{pk['mean_prompt_tokens'][L]:.0f} tok)" for L in Ls) + " |",
            "|---|" + "---|" * len(Ls),
        ]
        out += [
            f"| {n} | " + " | ".join(f"{100 * a[L]:.1f}% ({100 * pk['verbatim'][n][L]:.0f}%)" for L in Ls) + " |"
            for n, a in pk["accuracy"].items()
        ]
        out.append(
            f"\nPasskey retrieval: {pk['trials']} trials per length (random 5-digit key at a random depth; "
            f'retrieved when the {pk["answer_tokens"]}-token greedy answer after "The pass key is" contains '
            "the key; in brackets, answers that start with the key verbatim)."
        )
        if pk.get("vs_fp16"):
            out += [
                "",
                "| KV cache vs FP16 KV, same trials | " + " | ".join(f"@{L}" for L in Ls) + " |",
                "|---|" + "---|" * len(Ls),
            ]
            out += [
                f"| {n} | "
                + " | ".join(
                    f"{d['points']:+.0f} pts ({d['interval_points'][0]:+.0f} … {d['interval_points'][1]:+.0f}); "
                    f"{d['only_this']} only here, {d['only_fp16']} only FP16"
                    for d in (v[L] for L in Ls)
                )
                + " |"
                for n, v in pk["vs_fp16"].items()
            ]
            out.append(
                "\nPaired difference in passkey accuracy, percentage points (95% paired-bootstrap interval), "
                "and the trials only one of the two retrieved."
            )
    gp = report.get("parity")
    if gp:
        out += ["", "| KV cache | identical greedy continuations | mean identical prefix (tokens) |", "|---|---|---|"]
        out += [f"| {n} | {100 * v:.1f}% | {gp['mean_identical_prefix'][n]:.1f} |" for n, v in gp["identical"].items()]
        out.append(
            f"\nGreedy-continuation parity: {gp['prompts']} prompts x {gp['tokens']} tokens against FP16 KV "
            f"({gp['how']})."
        )
    return "\n".join(out)


# ---- engine report ----------------------------------------------------------------------------

BUILTIN_TEXT = "builtin:pydoc-topics held-out split"


def _text(text_file) -> tuple[list[str], str]:
    """(documents, what they are) for the evaluation text: a user's file, or the builtin held-out split."""
    from bpcompile.compiler import corpus

    if text_file is None:
        return corpus.heldout_documents(), f"{BUILTIN_TEXT} (fingerprint {corpus.fingerprint()})"
    docs = corpus.text_documents(text_file)
    import hashlib

    return docs, f"{text_file} (sha256 {hashlib.sha256(docs[0].encode()).hexdigest()[:16]})"


def _pick(plans: dict, only) -> dict:
    """Keep the plans named in `only` (and FP16, the reference); 'engine' names the engine's own plan."""
    if not only:
        return plans
    keep = {"fp16": plans["fp16"]}
    for want in only:
        hit = [n for n in plans if n == want or (want == "engine" and n.startswith("engine plan"))]
        if not hit:
            raise UserError(
                f"unknown KV plan {want!r}: expected some of {', '.join(['engine'] + list(plans))}", key="plans"
            )
        keep.update({n: plans[n] for n in hit})
    return keep


def _allocation_note(at: Optional[dict]) -> str:
    if not at:
        return ""
    n = at.get("sequences", 1)
    return (
        f"Compression: bytes the runtime allocates for {n} sequence{'s' if n != 1 else ''} of {at['max_seq_len']} "
        f"tokens + a {at['lookahead']}-token tree against FP16's, scales, tables and exact copies counted."
    )


def _allocation(engine_dir: Path) -> tuple[int, int, int]:
    """(max_seq_len, lookahead, max_batch_size) the engine's runtime allocates its cache pool for (engine.json's
    limits and tree); evaluate()'s defaults for a version without engine.json."""
    from bpcompile.compiler.plan import tree_tokens
    from bpcompile.core.engine import EngineConfig

    try:
        e = EngineConfig.load(engine_dir)
    except UserError:
        return 2048, 6, 1
    return e.limits.max_seq_len, tree_tokens(e), e.limits.max_batch_size


def evaluate_engine_report(
    engine_dir,
    n: int = 16,
    length: int = 256,
    calib_n: int = 16,
    calib_length: int = 128,
    text=None,
    plans=None,
    passkey_lengths=(),
    passkey_trials: int = 100,
    parity_prompts: int = 0,
    parity_tokens: int = 64,
    parity_prompt_tokens: int = 32,
    seed: int = 0,
    device: str = "cpu",
) -> dict:
    """Fidelity report of an engine version: its own KV plan next to FP16, FP8, naive INT4 and the
    INT4+FP8 sweep over outlier fractions (calibrated here with the engine's group size), on `text`
    (a file; default the builtin held-out split). `plans` restricts the rows (names or 'engine');
    passkey_lengths / parity_prompts > 0 add passkey retrieval and greedy-continuation parity."""
    from bpcompile.compiler.corpus import calibration_samples, text_windows

    engine_dir = Path(engine_dir)
    if not (engine_dir / "verifier" / "config.json").is_file():
        raise UserError(
            "not an engine version: no converted verifier checkpoint", file=str(engine_dir / "verifier" / "config.json")
        )
    docs, what = _text(text)
    tok = engine_dir / "tokenizer" / "tokenizer.json"
    windows = text_windows(tok, docs, length, n, seed, "eval text")  # a bad text fails before any model work
    verifier = Llama.from_checkpoint(engine_dir / "verifier", dtype=None).to(device)  # the recipe's dtype
    plan_dir = engine_dir / "kv_plan"
    own = KVPlan.load(plan_dir) if (plan_dir / "plan.json").exists() else None
    gs = own.group_size if own is not None else 64
    names = [f"int4+fp8 {f:.0%}" for f in STANDARD_FRACTIONS]
    if not plans or any(p in names for p in plans):
        all_plans = standard_plans(verifier, calibration_samples(tok, calib_n, calib_length), gs)
    else:  # no sweep row asked for: skip its calibration pass
        all_plans = {"fp16": "fp16", "fp8": "fp8", "int8": "int8", "int4-naive": "int4-naive"}
    if plans and UNROTATED in plans:  # the format before rotation, for comparison (its own calibration pass)
        m = measure_units(
            verifier, calibration_samples(tok, calib_n, calib_length), KVCalibConfig(group_size=gs, rotation="none")
        )
        all_plans[UNROTATED] = plan_from_measurement(m, verifier.cfg, 0.08)[0]
    if own is not None:
        all_plans[f"engine plan ({own.format})"] = own
        if own.has_exact:  # what the exact entries buy, measured on the same windows
            all_plans[f"engine plan ({own.format}), no exact entries"] = replace(own, sink_tokens=0, recent_window=0)
    chosen = _pick(all_plans, plans)
    seq_len, lookahead, sequences = _allocation(engine_dir)
    report = evaluate(verifier, chosen, windows, seq_len=seq_len, lookahead=lookahead, sequences=sequences)
    report["engine"] = str(engine_dir)
    report["text"] = what
    if passkey_lengths or parity_prompts:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_tok = AutoTokenizer.from_pretrained(engine_dir / "tokenizer")
    if passkey_lengths:
        report["passkey"] = passkey_accuracy(verifier, chosen, hf_tok, passkey_lengths, passkey_trials, seed)
    if parity_prompts:
        prompts = text_windows(tok, docs, parity_prompt_tokens, parity_prompts, seed + 1, "parity prompts")
        report["parity"] = greedy_parity(
            verifier, {k: v for k, v in chosen.items() if k != "fp16"}, prompts, parity_tokens
        )
    report["markdown"] = markdown_table(report) + _long_markdown(report)
    return report


def evaluate_engine(engine_dir, json_out: bool = False, **kw) -> str:
    """What `bpcompile eval ENGINE_DIR` prints: the markdown table, or the report as JSON.
    kw: see evaluate_engine_report."""
    report = evaluate_engine_report(engine_dir, **kw)
    return json.dumps(report, indent=1) if json_out else report["markdown"]
