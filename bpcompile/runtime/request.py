"""A request as the runtime sees it: its sampling parameters, its state while it runs, what a step returns for
it, and the stop conditions applied to newly committed tokens (output processing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from bpcompile.runtime.speculative import Sampling


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: Optional[int] = None
    end_id: Optional[int] = None  # not included in the output
    end_ids: tuple[int, ...] = ()  # more ids that end it like end_id (a model whose generation config lists several)
    stop_words: list[list[int]] = field(default_factory=list)  # token sequences; included in the output
    # TensorRT-LLM's penalties, over every token of the sequence (prompt included): repetition divides a positive
    # logit and multiplies a negative one; presence subtracts once per token seen, frequency once per occurrence
    # (both after temperature); min_tokens holds end_id back until that many tokens are generated
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    # the OpenAI API's presence / frequency penalties instead: over the generated tokens only, subtracted from the
    # logits before temperature (repetition_penalty still covers the whole sequence)
    penalties_over_output: bool = False
    logprobs: bool = False  # return each generated token's log probability (see token_logprobs)
    context_logits: bool = False  # return the verifier's logits at every prompt position (first output)
    generation_logits: bool = False  # return the verifier's logits each generated token was chosen from


@dataclass
class RequestStats:
    tokens: int = 0  # tokens returned
    verifier_steps: int = 0  # verifier forwards after the prefill
    tau: float = 0.0  # tokens committed per verifier step (accepted drafts + the verifier's own token)
    accepted_per_depth: list[int] = field(default_factory=list)  # [d-1]: steps whose accepted path reached depth d
    proposed_per_depth: list[int] = field(default_factory=list)  # [d-1]: steps whose tree reached depth d
    draft_s: float = 0.0  # wall time of the batched steps this request took part in, by phase
    verify_s: float = 0.0
    bookkeeping_s: float = 0.0
    committed: int = 0  # tokens committed by verifier steps (tau's numerator; may exceed `tokens` at a stop)
    reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)
    reused_blocks: int = 0  # the KV pages (blocks) they fill


@dataclass
class StepOutput:
    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: Optional[str]  # "length" | "stop" | "cancelled"
    stats: RequestStats
    logprobs: Optional[list[float]] = None  # of new_tokens, when the request asked for them
    context_logits: Optional[torch.Tensor] = None  # [prompt tokens, vocab] float32, on the first output
    generation_logits: Optional[torch.Tensor] = None  # [new tokens, vocab] float32


@dataclass
class Request:
    """A request's state: committed tokens in both caches (v_len: verifier, d_len: draft), pages reserved."""

    id: str
    prompt: list[int]
    params: SamplingParams
    sampling: Sampling
    tokens: list[int] = field(default_factory=list)  # committed: prompt + generated (incl. past a stop)
    out: list[int] = field(default_factory=list)  # returned to the caller
    v_len: int = 0
    d_len: int = 0
    pages: int = 0  # worst-case pages reserved per cache
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[float] = field(default_factory=list)  # of the generated tokens (params.logprobs)
    context_logits: Optional[torch.Tensor] = None  # params.context_logits: until the first output takes them
    generation_logits: list[torch.Tensor] = field(default_factory=list)  # rows of the generated tokens (CPU)
    # a FeatureDraft's pending inputs: the verifier's features at positions [d_len - 1, v_len) [n, hidden]
    feats: Optional[torch.Tensor] = None


def apply_stops(r: Request, toks: list[int]) -> StepOutput:
    """Append newly committed tokens to r.out up to end_id (excluded), a stop word (included) or max_tokens."""
    p, new, reason, start = r.params, [], None, len(r.out)
    for t in toks:
        if (p.end_id is not None and t == p.end_id) or t in p.end_ids:
            reason = "stop"
            break
        r.out.append(t)
        new.append(t)
        if any(sw and r.out[-len(sw) :] == list(sw) for sw in p.stop_words):
            reason = "stop"
            break
        if len(r.out) >= p.max_tokens:
            reason = "length"
            break
    r.stats.tokens = len(r.out)
    # r.out is a prefix of the generated tokens, and r.logprobs follows the generated tokens
    lps = r.logprobs[start : len(r.out)] if p.logprobs else None
    gen = torch.stack(r.generation_logits[start : len(r.out)]) if p.generation_logits and new else None
    ctx, r.context_logits = r.context_logits, None
    return StepOutput(r.id, new, reason is not None, reason, r.stats, lps, ctx, gen)


def penalized(p: SamplingParams) -> bool:
    return (
        p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        or (p.min_tokens > 0 and (p.end_id is not None or bool(p.end_ids)))
    )


def apply_penalties(row: torch.Tensor, p: SamplingParams, seen: list[int], generated: int) -> torch.Tensor:
    """The logits row [V] of the next token after the sequence `seen` (prompt and generated tokens; `generated`
    of them generated), with the request's penalties applied (a new tensor)."""
    row = row.clone()
    if seen and (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(seen, device=row.device).unique(return_counts=True)
        x = row[ids]
        if p.repetition_penalty != 1.0:
            x = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        row[ids] = x
        if p.penalties_over_output:  # the counts of the generated tokens, on the logits as they are
            scale, gen = 1.0, seen[len(seen) - generated :] if generated > 0 else []
            ids, counts = torch.tensor(gen, device=row.device, dtype=torch.long).unique(return_counts=True)
        else:  # scaled by the temperature, so that they act on logits / temperature as TensorRT-LLM's do
            scale = p.temperature if p.temperature > 0 else 1.0
        row[ids] = row[ids] - scale * (p.presence_penalty + p.frequency_penalty * counts.to(row.dtype))
    if generated < p.min_tokens:
        for end in ([p.end_id] if p.end_id is not None else []) + list(p.end_ids):
            row[end] = float("-inf")
    return row


def keep_logits(r: Request, rows: torch.Tensor, tokens: list[int]) -> None:
    """What a request asked to get back about the tokens just chosen from these logits rows [N, V]."""
    if r.params.logprobs:
        r.logprobs += token_logprobs(r.sampling, rows, tokens)
    if r.params.generation_logits:
        r.generation_logits += list(rows.detach().float().cpu())


def token_logprobs(sampling: Sampling, rows: torch.Tensor, tokens: list[int]) -> list[float]:
    """log P(token) for each row of logits [N, V] and its chosen token: under the verifier's distribution as this
    request samples from it (temperature, top-k and top-p applied; greedy: the plain softmax), as TensorRT-LLM
    reports output_log_probs."""
    idx = torch.tensor(tokens, device=rows.device)[:, None]
    if sampling.greedy:
        return torch.log_softmax(rows.float(), -1).gather(1, idx)[:, 0].tolist()
    probs = torch.stack([sampling.probs(row) for row in rows])
    return probs.gather(1, idx.to(probs.device))[:, 0].clamp(min=torch.finfo(torch.float64).tiny).log().tolist()
