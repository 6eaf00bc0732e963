"""One decode step for a batch of running requests: grow each request's draft tree (batched draft forwards,
one per tree level), verify every tree in one batched verifier forward, accept a path per request, and
compact the accepted K/V in both caches (bytes moved, nothing recomputed).

Sequence state, per request (T = all committed tokens: prompt + generated):
- the verifier cache holds T[:-1] (`v_len = len(T) - 1`); the last token T[-1] is node 0 of the next tree
  and is written to the cache by that step's verifier forward (TensorRT-LLM's convention: the tree's
  G tokens are the true token plus G-1 drafts, position = v_len + depth).
- the draft cache holds T[:d_len]; at the start of a step the draft first runs T[d_len:] (one token,
  or two when the last accepted draft token was a leaf it never ran) and grows the tree from there.
Tree tokens are written to the logical slots right after the context (verifier: v_len + node;
draft: d_len + node - 1), so after acceptance the accepted path is moved to consecutive slots and the pages
past the new length are freed.

A FeatureDraft (model.py) also reads the verifier's final hidden states: the row of token T[i] gets the feature
at position i - 1. The verifier keeps its features of the accepted path in `Request.feats`, the draft's
catch-up consumes them, and tree nodes read their parent row's predicted feature. The draft's K/V of accepted
nodes came from predicted features, so none is kept: the catch-up reruns the accepted tokens on true ones.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from bpcompile.runtime.executor import Executor, Moves
from bpcompile.runtime.request import Request, apply_penalties, keep_logits, penalized
from bpcompile.runtime.speculative import (
    AcceptanceCalibration,
    AcceptRule,
    BackOff,
    Columns,
    DraftTree,
    TreeSpec,
    make_builder,
    residual_rule,
    verify_greedy,
    verify_sampling,
)


class SpeculativeStep:
    def __init__(self, verifier: Executor, draft: Optional[Executor], tree: TreeSpec, *, backoff: bool = True):
        self.verifier, self.draft, self.tree = verifier, draft, tree
        # greedy dynamic trees: acceptance rates seen so far (None: score by the raw draft probability)
        self.calib: Optional[AcceptanceCalibration] = AcceptanceCalibration()
        self.accept_rule: AcceptRule = residual_rule  # injectable (tests prove a wrong rule is caught)
        self.backoff: Optional[BackOff] = BackOff(tree) if backoff and draft is not None else None
        self.features = draft is not None and getattr(draft.model, "reads_features", False)
        verifier.features = self.features
        ids = getattr(draft.model, "proposable", None) if draft is not None else None
        self.columns = Columns(ids, draft.model.cfg.vocab_size) if ids is not None else None

    def run(self, reqs: list[Request]) -> list[list[int]]:
        """Tokens committed per request this step (the accepted drafts and the verifier's own token); both
        caches compacted and truncated to them, each request's statistics updated."""
        t0 = time.perf_counter()
        trees, builders = [], []
        spec = self.backoff.next_spec() if self.backoff is not None else self.tree
        for r in reqs:
            depth = r.params.max_tokens - len(r.out) - 1 if self.draft is not None else 0
            # a seeded sampled request draws its random numbers along its tree, so it gets the configured tree
            # every step: backoff's, chosen by timings, would make the same seed give other tokens another time
            seeded = r.params.seed is not None and not r.sampling.greedy
            tree, b = make_builder(
                self.tree if seeded else spec, r.tokens[-1], r.sampling, depth, self.calib, self.columns
            )
            trees.append(tree)
            builders.append(b)
        drafting = [k for k, b in enumerate(builders) if b is not None]
        if drafting:
            self._draft([reqs[k] for k in drafting], [trees[k] for k in drafting], [builders[k] for k in drafting])
        t1 = time.perf_counter()
        results = self._verify(reqs, trees)
        t2 = time.perf_counter()
        committed = self._commit(reqs, trees, results, builders)
        t3 = time.perf_counter()
        for r in reqs:
            r.stats.draft_s += t1 - t0
            r.stats.verify_s += t2 - t1
            r.stats.bookkeeping_s += t3 - t2
        if self.backoff is not None:
            acc = [len(path) - 1 for (path, _), b in zip(results, builders) if b is not None]
            self.backoff.update(bool(acc), sum(acc) / max(1, len(acc)), t3 - t0, t2 - t1)
        return committed

    def _draft(self, reqs: list[Request], trees: list[DraftTree], builders: list) -> None:
        """Grow each request's tree with batched draft forwards (one per round)."""
        draft = self.draft
        # Catch up: the tokens the draft has not run (the last committed token, maybe the last accepted draft).
        pend = [r.tokens[r.d_len :] for r in reqs]
        for r, p in zip(reqs, pend):
            draft.kv.ensure(r.id, r.d_len + len(p) + draft.lookahead)
        feats = None
        if self.features:
            feats = pad_rows([r.feats for r in reqs], max(map(len, pend)))
            for r in reqs:
                r.feats = None
        logits = draft.forward(
            reqs,
            pend,
            [list(range(r.d_len, r.d_len + len(p))) for r, p in zip(reqs, pend)],
            [list(range(r.d_len, r.d_len + len(p))) for r, p in zip(reqs, pend)],
            [r.d_len for r in reqs],
            [len(p) for p in pend],
            feats=feats,
            logit_rows=[len(p) - 1 for p in pend] if self.features else None,
        )
        todo, fe = {}, {}  # fe[b][node]: the draft's predicted feature at that node (its children's input)
        for b, (r, p) in enumerate(zip(reqs, pend)):
            r.d_len += len(p)
            todo[b] = builders[b].expand({0: logits[b, 0 if self.features else len(p) - 1]})
            if self.features:
                fe[b] = {0: draft.hidden[b, len(p) - 1]}
        # Rounds: draft tree node n (n >= 1) lives at draft logical slot d_len + n - 1; its mask row is the
        # verifier row shifted by one (node 0 is committed context for the draft).
        while any(todo.values()):
            bs = [b for b, nodes in todo.items() if nodes]
            sub = [reqs[b] for b in bs]
            nodes = [todo[b] for b in bs]
            feats = None
            if self.features:
                feats = pad_rows(
                    [torch.stack([fe[b][trees[b].parents[n]] for n in ns]) for b, ns in zip(bs, nodes)],
                    max(map(len, nodes)),
                )
            logits = draft.forward(
                sub,
                [[trees[b].tokens[n] for n in ns] for b, ns in zip(bs, nodes)],
                [[r.d_len - 1 + trees[b].depths[n] for n in ns] for b, r, ns in zip(bs, sub, nodes)],
                [[r.d_len + n - 1 for n in ns] for r, ns in zip(sub, nodes)],
                [r.d_len for r in sub],
                [len(trees[b]) - 1 for b in bs],
                [[trees[b].bits[n] >> 1 for n in ns] for b, ns in zip(bs, nodes)],
                feats=feats,
            )
            todo = {}
            for k, (b, ns) in enumerate(zip(bs, nodes)):
                trees[b].forwarded.update(ns)
                if self.features:
                    fe[b].update({n: draft.hidden[k, j] for j, n in enumerate(ns)})
                todo[b] = builders[b].expand({n: logits[k, j] for j, n in enumerate(ns)})

    def _verify(self, reqs: list[Request], trees: list[DraftTree]) -> list[tuple[list[int], int]]:
        """Every tree through the verifier in one forward; per request the accepted path and the bonus token."""
        for r, tree in zip(reqs, trees):
            self.verifier.kv.ensure(r.id, r.v_len + len(tree))
        logits = self.verifier.forward(
            reqs,
            [t.tokens for t in trees],
            [[r.v_len + d for d in t.depths] for r, t in zip(reqs, trees)],
            [list(range(r.v_len, r.v_len + len(t))) for r, t in zip(reqs, trees)],
            [r.v_len for r in reqs],
            [len(t) for t in trees],
            [t.bits for t in trees] if any(len(t) > 1 for t in trees) else None,
        )
        for b, (r, tree) in enumerate(zip(reqs, trees)):
            if penalized(r.params):  # each node's row sees the sequence up to that node: committed + its path
                done = r.tokens
                for i in range(len(tree)):
                    path, n = [], i
                    while n:
                        path.append(tree.tokens[n])
                        n = tree.parents[n]
                    logits[b, i] = apply_penalties(
                        logits[b, i], r.params, done + path[::-1], len(done) - len(r.prompt) + len(path)
                    )
        argmax = logits.argmax(-1).tolist() if any(r.sampling.greedy for r in reqs) else None
        results = []
        for b, (r, tree) in enumerate(zip(reqs, trees)):
            if r.sampling.greedy:
                results.append(verify_greedy(tree, argmax[b]))
                if tree.conf and self.calib is not None:
                    self.calib.update(tree, results[-1][0])
            else:
                results.append(
                    verify_sampling(
                        tree, lambda i, b=b, r=r: r.sampling.probs(logits[b, i]), r.sampling.rng, self.accept_rule
                    )
                )
            if self.features:  # the features of the accepted path: the draft's inputs for the tokens they predicted
                new = self.verifier.hidden[b, results[-1][0]]
                r.feats = new if r.feats is None else torch.cat((r.feats, new))
            if r.params.logprobs or r.params.generation_logits:  # node path[j] predicted the j-th committed
                path, bonus = results[-1]  # token (the last one: the bonus)
                keep_logits(r, logits[b, path], [tree.tokens[n] for n in path[1:]] + [bonus])
        return results

    def _commit(self, reqs: list[Request], trees: list[DraftTree], results, builders) -> list[list[int]]:
        """Accepted paths -> committed tokens; K/V of accepted nodes moved to consecutive slots, the rest freed."""
        vmove = Moves(self.verifier.kv)
        dmove = Moves(self.draft.kv) if self.draft is not None else None
        committed = []
        for r, tree, (path, bonus), bld in zip(reqs, trees, results, builders):
            for j, n in enumerate(path[1:], 1):
                if n != j:
                    vmove.add(r.id, r.v_len + n, r.v_len + j)
            r.v_len += len(path)
            if bld is not None and not self.features:
                m = 0  # accepted draft nodes the draft has run: their KV is kept, the rest is run next step
                for j, n in enumerate(path[1:], 1):
                    if n not in tree.forwarded:
                        break
                    if n != j:
                        dmove.add(r.id, r.d_len + n - 1, r.d_len + j - 1)
                    m += 1
                r.d_len += m
            new = [tree.tokens[n] for n in path[1:]] + [bonus]
            r.tokens += new
            committed.append(new)
            st = r.stats
            st.verifier_steps += 1
            st.committed += len(new)
            st.tau = st.committed / st.verifier_steps
            depth = max(tree.depths)
            for lst, upto in ((st.proposed_per_depth, depth), (st.accepted_per_depth, len(path) - 1)):
                lst.extend([0] * (depth - len(lst)))
                for d in range(upto):
                    lst[d] += 1
        self.verifier.move(vmove)
        if dmove is not None:
            self.draft.move(dmove)
        for r in reqs:
            self.verifier.kv.truncate(r.id, r.v_len)
            if self.draft is not None:
                self.draft.kv.truncate(r.id, r.d_len)
        return committed


def pad_rows(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    """Per-request feature rows [n_b, hidden] -> [B, T, hidden], zero-padded past each n_b."""
    out = rows[0].new_zeros(len(rows), T, rows[0].shape[-1])
    for b, x in enumerate(rows):
        out[b, : len(x)] = x
    return out
