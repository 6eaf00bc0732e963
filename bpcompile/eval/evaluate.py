"""KV fidelity eval: run the verifier *through* a KV plan's cache as the runtime serves it, and compare with FP16 KV.

Every figure comes from the runtime's own executor and paged store (`served`: the verifier-only Generator for the
plan, the Triton kernels where they run): a text window's first token is prefilled, the rest are fed as chains of
up to an engine's tree size per step through the tree-verify forward (`served_logits`), so each token reads the
cache as sequential decode reads it; passkey answers and greedy parity are the Generator's own greedy decodes.

Metrics per plan: perplexity on a text, teacher-forced top-1 agreement with the FP16-KV verifier, relative
attention-output error per layer (same queries over the stored vs the FP16-rounded K/V: `AttentionError`), and
compression from the bytes the store allocates. `inject_key_outliers` builds the function-preserving
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
from bpcompile.runtime.kvcache import KVPlan, kv_store_factory
from bpcompile.runtime.model import Llama
from bpcompile.runtime.paged_kv import allocated_compression, dense_attention
from bpcompile.runtime.request import Request, SamplingParams
from bpcompile.runtime.speculative import TreeSpec

STANDARD_FRACTIONS = (0.0, 0.04, 0.08, 0.16)
UNROTATED = "unrotated int4+fp8 8%"  # the plan without the Hadamard rotation (rotation: none)


def served(verifier: Llama, plan: KVPlan, batch: int, max_len: int, lookahead: int = 1):
    """The runtime's verifier-only Generator over `plan`'s store: its executor and paged cache (the dense view or the
    Triton kernels where `kernels_for` picks them, the exact copies of a plan with a sink or window) are what
    `generate` runs for this plan. lookahead: the most tokens one step feeds a sequence (an engine's tree). The
    executor runs eagerly: CUDA graphs replay the same kernels."""
    from bpcompile.runtime.generator import Generator

    return Generator(
        verifier,
        None,
        TreeSpec("none"),
        max_batch_size=batch,
        max_seq_len=max_len,
        kv_store_factory=kv_store_factory(plan),
        device=str(verifier.device),
        prefix_reuse=False,
        cuda_graphs="off",
        lookahead=lookahead,
    )


def served_logits(gen, seqs: list[list[int]], prefix: int = 1) -> torch.Tensor:
    """Teacher-forced logits [B, T, V] (float32, CPU) of equally long token sequences through `gen`'s verifier
    executor (`served`): the first `prefix` tokens prefilled (attending to their own unquantized K/V, as serving's
    prefill does; their K/V stored in the plan's form), the rest fed as chains of up to gen.g_max tokens per step
    through the speculative step's tree-verify forward, so every later token reads the cache as sequential decode
    reads it."""
    ex, T, G = gen.v_exec, len(seqs[0]), gen.g_max
    reqs = [Request(f"eval{b}", s[:prefix], SamplingParams(), None) for b, s in enumerate(seqs)]
    out = [ex.prefill(reqs, False, all_logits=True).float().cpu()]
    try:
        for s in range(prefix, T, G):
            g, at = min(G, T - s), list(range(s, min(s + G, T)))
            for r in reqs:
                ex.kv.ensure(r.id, s + g)
            chain = [[(2 << i) - 1 for i in range(g)]] * len(reqs) if g > 1 else None  # node i sees nodes <= i
            logits = ex.forward(
                reqs,
                [x[s : s + g] for x in seqs],
                [at] * len(reqs),
                [at] * len(reqs),
                [s] * len(reqs),
                [g] * len(reqs),
                chain,
            )
            out.append(logits.float().cpu())
    finally:
        for r in reqs:
            ex.kv.release(r.id)
    return torch.cat(out, 1)


class AttentionError:
    """Wraps an executor's model: each layer's attention output next to the same queries over the FP16-rounded K/V
    of every position so far (the reference cache), summed as [sum |o - o_ref|^2, sum |o_ref|^2] per layer. For
    sequences fed in order from position 0 (`served_logits`)."""

    def __init__(self, model: Llama, batch: int, length: int):
        c = model.cfg
        self.model, self.err = model, [[0.0, 0.0] for _ in range(c.num_layers)]
        shape = (c.num_layers, batch, c.num_kv_heads, length, c.head_size)
        self.k = torch.zeros(shape, dtype=torch.float16, device=model.device)
        self.v = torch.zeros_like(self.k)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tok, pos, attend, **kw):
        B, T = tok.shape
        s = 0 if pos is None else int(pos[0, 0])
        n = torch.arange(s + T, device=tok.device)
        seen = n[None, :] <= n[s:, None]  # [T, s + T]: a query sees every position up to its own

        def probe(layer, q, k, v):
            o = attend(layer, q, k, v)
            self.k[layer, :B, :, s : s + T], self.v[layer, :B, :, s : s + T] = k.transpose(1, 2), v.transpose(1, 2)
            kr, vr = (x[layer, :B, :, : s + T].to(q.dtype) for x in (self.k, self.v))
            hidden = ~seen.repeat_interleave(q.shape[2] // k.shape[2], 0)[None, None]
            ref = dense_attention(q, kr, vr, hidden)
            self.err[layer][0] += (o - ref).double().pow(2).sum().item()
            self.err[layer][1] += ref.double().pow(2).sum().item()
            return o

        return self.model(tok, pos, attend=probe, **kw)


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
    rows_of = [heldout_token_ids[i : i + batch] for i in range(0, len(seqs), batch)]
    B, T = min(batch, len(seqs)), seqs.shape[1]
    ref_logp = []  # reference: FP16 KV cache
    gen = served(verifier, _fp16_plan(c), B, T, lookahead)
    for part in rows_of:
        ref_logp.append(F.log_softmax(served_logits(gen, part), -1))
    rows = []
    for name, plan in plans.items():
        seq_nll, seq_kl, agree = [], [], 0
        gen = served(verifier, plan, B, T, lookahead)
        probe = gen.v_exec.model = AttentionError(verifier, B, T)
        for b, part in enumerate(rows_of):
            tok = torch.tensor(part, dtype=torch.long)
            logits = served_logits(gen, part)
            logp = F.log_softmax(logits, -1)
            seq_nll += (-logp[:, :-1].gather(-1, tok[:, 1:, None])).sum((1, 2)).tolist()
            agree += (logits.argmax(-1) == ref_logp[b].argmax(-1)).sum().item()
            # KL(FP16-KV || this cache) per position: the whole distribution's shift, which moves smoothly
            # with the quantization error where perplexity's sign at the +0.1% level is luck.
            seq_kl += F.kl_div(logp, ref_logp[b], log_target=True, reduction="none").sum((1, 2)).tolist()
        errs = probe.err
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
        f"{report.get('text', 'held-out text')}{_domain_note(report.get('calibration_domain'))}; agreement is "
        "against the same model with an FP16 KV cache. " + _allocation_note(report.get("compression_at"))
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
# Both run the runtime's Generator over the plan's cache: the prompt is prefilled attending to its own
# unquantized K/V (as the runtime's and TensorRT-LLM's context phase do) while its K/V is stored in the plan's
# format; every later token reads the stored cache, its own K/V included.

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


def _progress(msg: str) -> None:
    """Long evaluation stages report on stderr (stdout carries the report)."""
    print(f"bpcompile eval: {msg}", file=sys.stderr, flush=True)


PASSKEY_ANSWER_TOKENS = 16  # the key and room for a few words before it


def key_in(text: str, key: str) -> bool:
    """The key as a number of its own in the answer (not part of a longer digit run)."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", text) is not None


def passkey_accuracy(verifier: Llama, plans: dict, tok, lengths, trials: int, seed: int = 0, batch: int = 8) -> dict:
    """Per plan and length: share of trials whose greedy answer (PASSKEY_ANSWER_TOKENS tokens after "The pass
    key is") contains the key ("accuracy", retrieval as passkey benchmarks score it), and share whose answer
    starts with the key verbatim ("verbatim": stricter, it also scores the wording). The answer is what the
    runtime's `generate` decodes greedily over the plan's cache (`served`) for the prompt up to "The pass key
    is", `batch` trials at a time."""
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
        prompts = [t["ids"][: t["key_start"]] for t in ts]
        greedy = SamplingParams(max_tokens=PASSKEY_ANSWER_TOKENS, temperature=0.0)
        for name, plan in plans.items():
            t0 = time.perf_counter()
            gen = served(verifier, plan, min(batch, trials), max(map(len, prompts)) + PASSKEY_ANSWER_TOKENS)
            outs = [o for o, _ in gen.generate(prompts, greedy)]
            _progress(f"passkey {L}: {name}, {trials} trials ({time.perf_counter() - t0:.0f}s)")
            for t, out in zip(ts, outs):
                ids, ks = t["ids"], t["key_start"]
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
    plans = _as_plans(verifier, {"fp16": "fp16", **plans})
    outs = {}
    for name, plan in plans.items():
        _progress(f"parity: {name} ({len(prompts)} prompts x {tokens} tokens)")
        gen = served(verifier, plan, max(1, min(batch, len(prompts))), max(map(len, prompts)) + tokens + 1)
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

BUILTIN_SOURCE = "builtin:pydoc-topics"
BUILTIN_TEXT = f"{BUILTIN_SOURCE} held-out split"


def _text(text_file) -> tuple[list[str], str]:
    """(documents, what they are) for the evaluation text: a user's file, or the builtin held-out split."""
    from bpcompile.compiler import corpus

    if text_file is None:
        return corpus.heldout_documents(), f"{BUILTIN_TEXT} (fingerprint {corpus.fingerprint()})"
    docs = corpus.text_documents(text_file)
    import hashlib

    return docs, f"{text_file} (sha256 {hashlib.sha256(docs[0].encode()).hexdigest()[:16]})"


def calibration_domain(engine_dir: Path, text_file) -> bool:
    """Whether the evaluation text is the engine's calibration source's domain: the builtin held-out split for an
    engine calibrated on builtin:pydoc-topics (recipe.yaml as built; the default where it is missing), a file
    for an engine calibrated on a file with the same bytes."""
    import hashlib

    import yaml

    try:
        src = yaml.safe_load((engine_dir / "recipe.yaml").read_text())["calibration"]["source"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        src = BUILTIN_SOURCE
    if text_file is None or src == BUILTIN_SOURCE:
        return text_file is None and src == BUILTIN_SOURCE
    digest = lambda f: hashlib.sha256(Path(f).read_bytes()).hexdigest()  # noqa: E731
    try:
        return digest(src) == digest(text_file)
    except OSError:  # the calibration file is gone: nothing shows it is the same text
        return False


def _domain_note(domain: Optional[bool]) -> str:
    if domain is None:
        return ""
    return " (the calibration text's domain)" if domain else " (not the calibration text's domain)"


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
    report["calibration_domain"] = calibration_domain(engine_dir, text)
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
