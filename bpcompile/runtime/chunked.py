"""Chunked prefill: prompts enter the caches a bounded number of tokens per step, so a long prompt that arrives
while other sequences decode delays their next token by one chunk's forward, not by the whole prompt's.

Each `Generator.step` spends at most `budget` prompt tokens (the engine's runtime.prefill_chunk), first come first
served: a prompt that fits what is left of the budget prefills whole, batched with the others that do (the
ordinary prefill, prefix reuse included); a longer one takes what is left this step and continues at the next,
interleaved with the decode / speculative steps of the running sequences (every prompt position's logits, where
a request asks for them, are gathered chunk by chunk).

Outputs equal unchunked ones for every KV plan: a chunk attends to the earlier chunks' K/V as they were computed
(`Executor.prefill_chunk` keeps them unquantized until the prompt is done), as an unchunked prefill attends to
the whole prompt's, never to their stored (quantized) form; the caches, the exact copies of a recent window and
the draft's cache receive the same entries at the same positions, a chunk at a time. What that costs is one
prompt's K/V per model in the compute dtype while it is prefilled (one prompt at a time: the budget goes to the
oldest first, and a prompt's copies are made at its first chunk, after the previous one's last); `bpcompile plan`
counts it. With tensor parallelism every rank keeps its heads' share (the calls go through runtime/tp.py)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from bpcompile.runtime.request import Request, StepOutput, apply_penalties, keep_logits, penalized


@dataclass
class _Prompt:
    """A prompt part-way through its prefill."""

    done: int  # prompt tokens in both caches (a reused prefix included)
    start: int  # the reused prefix (prefix reuse), in tokens
    hashes: Optional[tuple] = None  # (verifier, draft) block hashes, to publish its pages when done
    feat: Optional[torch.Tensor] = None  # a feature draft's input for the next chunk's first row
    hidden: list = field(default_factory=list)  # the verifier's features of the computed chunks (publishing)
    logits: list = field(default_factory=list)  # every position's logits, for a request that asks for them


class ChunkedPrefill:
    """The prefill work of a `Generator` (gen: its caches, executors and whole-prompt prefill) under a budget."""

    def __init__(self, gen, budget: int):
        self.gen, self.budget = gen, budget
        self.queue: deque[Request] = deque()  # admitted, prompt not (wholly) in the caches yet; oldest first
        self.state: dict[str, _Prompt] = {}

    def drop(self, rid: str) -> None:
        """Forget a request that ends (cancelled) while it waits or prefills; its K/V copies go."""
        self.queue = deque(r for r in self.queue if r.id != rid)
        if self.state.pop(rid, None) is not None:
            for ex in self._executors():
                ex.chunk_end(rid)

    def _executors(self):
        return [ex for ex in (self.gen.v_exec, self.gen.d_exec) if ex is not None]

    def run(self, new: list[Request]) -> list[StepOutput]:
        """This step's prefill work for the admitted requests (new ones join the queue) -> their first outputs."""
        self.queue.extend(new)
        budget, whole, chunks = self.budget, [], []
        while self.queue and budget > 0:
            r = self.queue[0]
            if r.id not in self.state:
                if len(r.prompt) <= budget:
                    whole.append(self.queue.popleft())
                    budget -= len(r.prompt)
                    continue
                if self._waits(r):  # (first come first served: the ones behind it wait too)
                    break
                self._start(r)
            st = self.state[r.id]
            n = min(len(r.prompt) - st.done, budget)
            budget -= n
            chunks.append((r, n))
            if st.done + n == len(r.prompt):
                self.queue.popleft()
        outs = self.gen._prefill(whole) if whole else []
        for r, n in chunks:
            outs += self._chunk(r, n)
        return outs

    def _waits(self, r: Request) -> bool:
        """With prefix reuse: r's next page that is not cached yet is one that a prompt part-way computes (prompts
        sharing a long system prompt, admitted together): r starts once that prompt is done and its pages cached,
        instead of computing them again."""
        g = self.gen
        if not g.prefix_reuse or not self.state:
            return False
        hv = g.vkv.block_hashes(r.prompt, g._salts["verifier"])
        limit = g._reuse_limit(r)
        n = min(len(g.vkv.match(hv)), limit)
        return n < limit and any(st.hashes is not None and hv[n] in st.hashes[0] for st in self.state.values())

    def _start(self, r: Request) -> None:
        """A prompt's first chunk: take its cached prefix (prefix reuse), make room for its K/V copies."""
        g, start, hashes, feat = self.gen, 0, None, None
        if g.prefix_reuse:
            hv = g.vkv.block_hashes(r.prompt, g._salts["verifier"])
            hd = g.dkv.block_hashes(r.prompt, g._salts["draft"]) if g.dkv is not None else hv
            pv = g.vkv.match(hv)
            pd = g.dkv.match(hd) if g.dkv is not None else pv
            n = min(len(pv), len(pd), g._reuse_limit(r))
            g.v_exec.adopt(r.id, pv[:n])
            if g.d_exec is not None:
                g.d_exec.adopt(r.id, pd[:n])
            start, hashes = n * g.page_size, (hv, hd)
        if g.spec.features and g.d_exec is not None:  # the row after a reused prefix reads the feature its last
            h = g.verifier.cfg.hidden_size  # page kept; the first row of a prompt reads zeros
            feat = g.vkv.aux[g.vkv.tables[r.id][start // g.page_size - 1]] if start else torch.zeros(h, device=g.device)
        self.state[r.id] = _Prompt(start, start, hashes, feat)

    def _chunk(self, r: Request, n: int) -> list[StepOutput]:
        """Prompt tokens [done, done + n) of r through both models; the last chunk picks the first token."""
        g, st = self.gen, self.state[r.id]
        m, last = st.done, st.done + n == len(r.prompt)
        if m == st.start:  # its K/V copies, made at its first chunk: the previous prompt's are gone by then
            for ex in self._executors():
                ex.chunk_begin(r, m)
        t0 = time.perf_counter()
        if r.params.context_logits:
            st.logits.append(g.v_exec.prefill_chunk(r, m, n, False, all_logits=True).float().cpu())
            logits = st.logits[-1][-1].to(g.device) if last else None
        else:
            logits = g.v_exec.prefill_chunk(r, m, n, last)
        t1 = time.perf_counter()
        if g.d_exec is not None:
            feats = None
            if g.spec.features:  # the row of prompt token i reads the verifier's feature at i - 1
                h = g.v_exec.hidden
                feats = torch.cat((st.feat[None, None].to(h.dtype), h[:, :-1]), 1)
                st.feat = h[0, -1].clone()
                if g.prefix_reuse:
                    st.hidden.append(h[0].clone())
                if last:
                    r.feats = h[0, n - 1 : n].clone()
            g.d_exec.prefill_chunk(r, m, n, False, feats=feats)
        t2 = time.perf_counter()
        st.done += n
        r.stats.verify_s += t1 - t0
        r.stats.draft_s += t2 - t1
        if not last:
            return []
        del self.state[r.id]
        for ex in self._executors():
            ex.chunk_end(r.id)
        if st.logits:
            r.context_logits = torch.cat(st.logits)
        if penalized(r.params):
            logits = apply_penalties(logits, r.params, r.prompt, 0)
        t = g._pick(r, logits)
        keep_logits(r, logits[None], [t])
        if st.hashes is not None:  # its full pages into the prefix cache, as an unchunked prefill's
            if st.hidden:
                g.v_exec.hidden = torch.cat(st.hidden)[None]
            g._publish([(r, st.start, *st.hashes)])
        r.v_len = r.d_len = len(r.prompt)
        r.tokens.append(t)
        return [g._emit(r, [t])]
