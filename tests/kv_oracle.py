"""A reference decoder over a KV plan's store, built from positions alone (no pages, no runtime masks): the oracle
the runtime's executor is checked against. The prompt is prefilled attending to its own unquantized K/V; each later
step writes its tokens' K/V to a `KVStore` and attends to what the store returns (a plan's exact entries read from
an FP16 copy where `exact_reads` says so)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bpcompile.runtime.kvcache import KVPlan, make_kv_store
from bpcompile.runtime.model import Llama, causal_attend
from bpcompile.runtime.paged_kv import dense_attention, exact_reads

PAGE = 16


def attend_exact(q, kh, vh, k, v, plan: KVPlan, q_pos, k_pos, visible) -> torch.Tensor:
    """Attention of q [B, T, H, D] that reads the plan's exact entries as the runtime does (RecentKV): the FP16
    copy of k, v where exact_reads says so, the stored kh, vh elsewhere (all [B, N, KV, D]); visible [T, N]."""
    ex = exact_reads(q_pos, k_pos, plan.sink_tokens, plan.recent_window) & visible
    rep = q.shape[2] // k.shape[2]
    hide = lambda m: ~m.repeat_interleave(rep, dim=0)[None, None]  # noqa: E731  [1, 1, T * rep, N]
    ke, ve = (x.half().to(q.dtype).transpose(1, 2) for x in (k, v))
    return dense_attention(q, kh.transpose(1, 2), vh.transpose(1, 2), hide(visible & ~ex), exact=(ke, ve, hide(ex)))


def prefix_kv(verifier: Llama, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
