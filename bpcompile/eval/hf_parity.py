"""Greedy parity of the runtime with transformers in a low-precision dtype (bf16): the same prompts through
`transformers`' own generate and through the runtime's Generator (verifier only, and with a speculation tree),
and for every prompt where the two differ, transformers' own top-2 logit gap at the first differing position.

In bf16 two implementations that round differently can pick different tokens where the two best logits are
within rounding of each other; a divergence anywhere else is a bug. `bf16_ulp(x)` is the spacing of bf16 numbers
at |x| (8 significant bits)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


def transformers_greedy(hf_dir: Path, prompts: list[list[int]], n: int, dtype: torch.dtype):
    """Per prompt: (n greedy tokens, [(top-1 logit, top-1 minus top-2) at each position])."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            r = model.generate(
                torch.tensor([p]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
            top = [s[0].float().topk(2).values for s in r.scores]
            out.append((r.sequences[0, len(p) :].tolist(), [(float(t[0]), float(t[0] - t[1])) for t in top]))
    return out


def greedy_parity(
    hf_dir: Path,
    verifier,
    draft,
    prompts: list[list[int]],
    n: int,
    trees: dict,
    dtype: torch.dtype = torch.bfloat16,
    max_batch_size: int = 8,
) -> dict:
    """verifier/draft: runtime Llamas in `dtype`; trees: name -> TreeSpec. Returns per tree name
    {identical, prompts, divergences: [{prompt, position, top_logit, gap, ulps}]}."""
    from bpcompile.runtime.generator import Generator, SamplingParams

    ref = transformers_greedy(hf_dir, prompts, n, dtype)
    report = {}
    for name, tree in trees.items():
        gen = Generator(
            verifier,
            draft if tree.kind != "none" else None,
            tree,
            max_batch_size=max_batch_size,
            max_seq_len=max(len(p) for p in prompts) + n + 1,
            backoff=False,
        )
        got = [t for t, _ in gen.generate(prompts, SamplingParams(max_tokens=n))]
        div = []
        for i, (mine, (theirs, scores)) in enumerate(zip(got, ref)):
            if mine != theirs:
                k = next(j for j in range(n) if j >= len(mine) or mine[j] != theirs[j])
                top, gap = scores[k]
                div.append({"prompt": i, "position": k, "top_logit": top, "gap": gap, "ulps": gap / bf16_ulp(top)})
        report[name] = {"identical": len(prompts) - len(div), "prompts": len(prompts), "divergences": div}
    return report


def check_near_ties(report: dict, max_ulps: float = 1.0, max_share: Optional[float] = None) -> list[str]:
    """Problems: a divergence whose gap exceeds max_ulps bf16 ulps of the top logit, or (max_share) too many."""
    bad = []
    for name, r in report.items():
        for d in r["divergences"]:
            if d["ulps"] > max_ulps:
                bad.append(
                    f"{name}: prompt {d['prompt']} diverges at {d['position']} where transformers' top-2 gap "
                    f"is {d['gap']:.4g} ({d['ulps']:.2f} ulps): not a tie"
                )
        if max_share is not None and len(r["divergences"]) > max_share * r["prompts"]:
            bad.append(f"{name}: {len(r['divergences'])} of {r['prompts']} prompts diverge")
    return bad
