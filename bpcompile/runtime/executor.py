"""The model executor: one model over its paged KV cache. It turns a batch of requests' new tokens into
tensors and attention metadata, writes their K/V into the cache and returns logits; it knows nothing of
trees, sampling or stop conditions."""

from __future__ import annotations

import sys
import time
from typing import Optional

import torch

from bpcompile.kernels import cpu_decode
from bpcompile.kernels.tree_mask import pack_rows
from bpcompile.runtime.model import Llama, causal_attend
from bpcompile.runtime.paged_kv import AttnBatch, PagedKV, dense_attention, exact_reads, paged_attention
from bpcompile.runtime.request import Request


class Executor:
    """Host bookkeeping (pages, slots, padding) turns requests into tensors; `run_prefill`, `run_forward` and
    `run_move` compute on them. With tensor parallelism (runtime/tp.py) rank 0 does the bookkeeping and
    `peers` runs each call on every rank: the others get its tensors and run the same `run_*` on their shards."""

    def __init__(self, model: Llama, kv: PagedKV, device: torch.device, lookahead: int, role: str = "verifier"):
        """lookahead: cache entries reserved past a prompt at prefill (the largest tree a step writes)."""
        self.model, self.kv, self.device, self.lookahead, self.role = model, kv, device, lookahead, role
        self.forwards = 0  # batched forwards after prefill (benchmarks read these)
        self.peers = None  # runtime.tp.Peers on rank 0 of a tensor-parallel group
        self.static = None  # a StaticStep (static_step.py): forwards after prefill from its per-bucket buffers
        # features: the verifier of a FeatureDraft keeps each forward's final hidden states in `hidden`
        # [B, T, hidden] (a FeatureDraft's executor always does: they are its predicted features)
        self.features = False
        self.hidden: Optional[torch.Tensor] = None
        # prefix reuse (set by the generator on every rank): a prefill keeps its K/V as computed, [L, B, T, KV, D]
        # each, in `raw` for the pages it publishes where the store keeps another form (`PagedKV.raw_pages`);
        # raw_ids: the requests of that prefill (rank 0)
        self.reuse = False
        self.raw: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.raw_ids: list[str] = []
        self.chunks: dict[int, tuple] = {}  # a prompt prefilling in chunks: its K/V as computed (`chunk_begin`)
        self._chunk_keys: dict[str, int] = {}  # (rank 0) request id -> its chunk copy's number
        self._next_chunk_key = 0
        self.chunk_starts: dict[int, int] = {}  # chunk copy -> the reused prefix it starts after
        # a few queries a sequence on CPU (decode steps, tree verifies) over a float32 dense view: bpcompile's kernel
        # puts the new entries into the float cache (a float store) or the exact copies (a plan with a recent
        # window: decode steps of one sequence only) and attends, one call per sequence and layer
        self.few_query_kernel = (
            kv.dense is not None
            and kv.dense.dtype == torch.float32
            and torch.device(device).type == "cpu"
            and (
                (kv.dense.plain and kv.store.dtype in (torch.float16, torch.float32))
                or (kv.recent is not None and kv.recent.window >= 1)
            )
            and cpu_decode.available()
        )
        if kv.kern is not None and torch.device(device).type == "cuda":
            self.warm_kernels()

    def warm_kernels(self) -> float:
        """Compile (Triton's JIT, by launching each once) every kernel specialization this executor's cache can
        use, so that no request waits on a compile: called when the engine loads on CUDA, where nothing was
        compiled ahead of time (the kernels specialize on the GPU they run on). Returns the seconds it took."""
        t = time.perf_counter()
        self.kv.kern.warm_up(self.kv.store, self.model.cfg.num_heads, self.model.dtype, self.kv.recent)
        if self.kv.store.unit_precision.is_cuda:
            torch.cuda.synchronize(self.kv.store.unit_precision.device)
        took = time.perf_counter() - t
        print(f"bpcompile: {self.role} kernels compiled in {took:.1f}s", file=sys.stderr)
        return took

    def _call(self, name: str, *args):
        if self.peers is not None:
            return self.peers.run(self, name, args)
        return getattr(self, name)(*args)

    def _dense_width(self) -> int:
        return self.kv.dense.k.shape[3] if self.kv.dense is not None else 0

    def prefill(
        self, reqs: list[Request], last_logits: bool, all_logits: bool = False, feats: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """Prompts through the model (right-padded, causal over the prompt alone), K/V into the cache;
        the logits of each prompt's last token [B, V] when last_logits, of every position [B, T, V] when
        all_logits. feats [B, T, hidden]: a FeatureDraft's input features."""
        dev, kv = self.device, self.kv
        lens = [len(r.prompt) for r in reqs]
        B, T = len(reqs), max(lens)
        for r in reqs:
            kv.ensure(r.id, len(r.prompt) + self.lookahead)
        tok = torch.tensor([r.prompt + [0] * (T - len(r.prompt)) for r in reqs], device=dev)
        flat = torch.tensor(
            [[kv.slot(r.id, i) for i in range(len(r.prompt))] + [0] * (T - len(r.prompt)) for r in reqs], device=dev
        ).reshape(-1)
        at = None
        if kv.dense is not None or kv.recent is not None:  # under the kernels a plan's exact copies are by row too
            null = kv.dense.null if kv.dense is not None else kv.recent.rows
            at = (
                torch.tensor(
                    [[kv.rows[r.id]] * len(r.prompt) + [null] * (T - len(r.prompt)) for r in reqs], device=dev
                ).view(-1),
                torch.arange(T, device=dev).repeat(B),
            )
        same = len(set(lens)) == 1
        self.raw_ids = [r.id for r in reqs]
        logits = self._call(
            "run_prefill",
            tok,
            flat,
            at,
            not all_logits and (same or not last_logits),
            self._dense_width(),
            *(() if feats is None else (feats,)),
        )
        if all_logits:
            return logits
        if not last_logits:
            return None
        return logits[:, -1] if same else logits[torch.arange(B, device=dev), torch.tensor(lens, device=dev) - 1]

    def run_prefill(
        self,
        tok: torch.Tensor,
        flat: torch.Tensor,
        at: Optional[tuple],
        last_only: bool,
        dense_width: int,
        feats: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        kv, (B, T) = self.kv, tok.shape
        if kv.dense is not None:
            kv.dense.reserve(dense_width)
        prompt_pos = torch.arange(T, device=tok.device).repeat(B)  # the model's prefill positions
        cap = self._capture()

        def attend(layer, q, k, v):
            # Right padding: real tokens never see the padding under a causal mask. The prompt attends to
            # its unquantized K/V (as TensorRT-LLM's context phase does); the cache keeps the stored form.
            kv.write(layer, flat, k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]), at, prompt_pos)
            if cap is not None:
                cap.append((k, v))
            return causal_attend(q, k, v)

        with kv.batched_writes(own_exact=True):
            out = self._model(tok, None, attend, feats, last_only=last_only)
        self._captured(cap)
        return out

    def _capture(self) -> Optional[list]:
        self.raw = None
        return [] if self.reuse and self.kv.shadow else None

    def _captured(self, cap: Optional[list]) -> None:
        if cap:
            self.raw = (torch.stack([k for k, _ in cap]), torch.stack([v for _, v in cap]))

    def adopt(self, rid: str, pages: list[int]) -> None:
        """A new sequence starts from cached pages (prefix reuse): rank 0's bookkeeping, then every rank fills the
        sequence's dense view row and exact copies from its own copies of the pages (`PagedKV.fill`)."""
        self.kv.adopt_pages(rid, pages)
        if pages and rid in self.kv.rows:
            self._call("run_adopt", self.kv.rows[rid], torch.tensor(pages, dtype=torch.int64))

    def run_adopt(self, row: int, pages: torch.Tensor) -> None:
        self.kv.fill(row, pages.tolist())

    def publish(self, items: list[tuple[Request, int, list[bytes]]], aux=None) -> None:
        """Cache the full prompt pages of prefilled requests, items (request, entries it reused, its block
        hashes); aux(b): `PagedKV.publish`'s aux of item b. Every rank keeps its copies of the new pages
        (`run_publish`). A request the last prefill did not compute (no copy of what it attended to, where the
        store keeps another form) publishes nothing: its pages stay private."""
        kv, new = self.kv, []
        for j, (r, start, hashes) in enumerate(items):
            if kv.shadow and (self.raw is None or r.id not in self.raw_ids):
                continue
            b = self.raw_ids.index(r.id) if r.id in self.raw_ids else 0
            for i, page in kv.publish(r.id, hashes, aux(j) if aux is not None else None):
                new.append([page, kv.rows.get(r.id, -1), b, i * kv.ps, i * kv.ps - start])
        if new:
            self._call("run_publish", torch.tensor(new, dtype=torch.int64))

    def run_publish(self, new: torch.Tensor) -> None:
        """new [N, 5]: (page, dense row, batch index in the last prefill, first logical entry, its index there)."""
        kv, ps = self.kv, self.kv.ps
        for page, row, b, at, i in new.tolist():
            raw = None
            if kv.shadow:
                raw = tuple(x[:, b, i : i + ps].transpose(1, 2).clone() for x in self.raw)
            kv.keep(page, row, at, raw)

    def prefill_cached(
        self, reqs: list[Request], starts: list[int], last_logits: bool = True, feats: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """Prompts whose first starts[b] entries are already in the cache (a reused prefix, `PagedKV.adopt`):
        only the rest goes through the model, attending to the cached prefix in its stored form and to its own
        unquantized K/V (as `prefill` does). -> logits of each prompt's last token [B, V] when last_logits.
        feats: as prefill's, over the new tokens."""
        dev, kv = self.device, self.kv
        lens = [len(r.prompt) - m for r, m in zip(reqs, starts)]
        B, T = len(reqs), max(lens)
        for r in reqs:
            kv.ensure(r.id, len(r.prompt) + self.lookahead)
        tok = torch.tensor([r.prompt[m:] + [0] * (T - t) for r, m, t in zip(reqs, starts, lens)], device=dev)
        pos = torch.tensor([list(range(m, m + t)) + [0] * (T - t) for m, t in zip(starts, lens)], device=dev)
        flat = torch.tensor(
            [[kv.slot(r.id, i) for i in range(m, m + t)] + [0] * (T - t) for r, m, t in zip(reqs, starts, lens)],
            device=dev,
        ).reshape(-1)
        at = None
        if kv.dense is not None or kv.recent is not None:  # under the kernels a plan's exact copies are by row too
            null = kv.dense.null if kv.dense is not None else kv.recent.rows
            rows = [kv.rows[r.id] for r in reqs]
            at = (
                torch.tensor([[row] * t + [null] * (T - t) for row, t in zip(rows, lens)], device=dev).view(-1),
                pos.reshape(-1),
            )
        same = len(set(lens)) == 1
        self.raw_ids = [r.id for r in reqs]
        logits = self._call(
            "run_prefill_cached",
            same or not last_logits,
            tok,
            pos,
            flat,
            at,
            kv.block_tables([r.id for r in reqs], dev),
            torch.tensor(starts, device=dev),
            torch.tensor(lens, device=dev),
            self._dense_width(),
            *(() if feats is None else (feats,)),
        )
        if not last_logits:
            return None
        return logits[:, -1] if same else logits[torch.arange(B, device=dev), torch.tensor(lens, device=dev) - 1]

    def run_prefill_cached(
        self, last_only: bool, tok, pos, flat, at, tables, starts, lens, dense_width: int, feats=None
    ) -> torch.Tensor:
        kv, (B, T) = self.kv, tok.shape
        flat_pos = pos.reshape(-1)
        st, ln = starts.tolist(), lens.tolist()
        cap = self._capture()
        if kv.dense is not None:
            kv.dense.reserve(dense_width)
        # The prefix as a full prefill attends to it: as computed (the pages' raw copies) where the store keeps
        # another form, else the dense view (which holds exactly what was computed)
        raw = [kv.raw_prefix(tables[b, : st[b] // kv.ps].tolist()) for b in range(B)] if kv.shadow else None
        rows = at[0].view(B, T)[:, 0].tolist() if raw is None else None

        def attend(layer, q, k, v):
            kv.write(layer, flat, k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]), at, flat_pos)
            if cap is not None:
                cap.append((k, v))
            o = q.new_zeros(q.shape)  # padding rows: zeros (nothing reads them)
            rep = q.shape[2] // k.shape[2]
            for b in range(B):
                m, t = st[b], ln[b]
                if raw is not None:
                    kd, vd = raw[b][0][layer][None], raw[b][1][layer][None]
                else:
                    kd, vd = kv.dense.read(layer, [rows[b]], m)
                kk = torch.cat((kd.to(q.dtype), k[b : b + 1, :t].transpose(1, 2)), 2)
                vv = torch.cat((vd.to(q.dtype), v[b : b + 1, :t].transpose(1, 2)), 2)
                hidden = torch.ones(t, m + t, dtype=torch.bool, device=q.device).triu(m + 1)
                o[b, :t] = dense_attention(q[b : b + 1, :t], kk, vv, hidden.repeat_interleave(rep, 0)[None, None])[0]
            return o

        with kv.batched_writes(own_exact=True):
            out = self._model(tok, pos, attend, feats, last_only=last_only)
        self._captured(cap)
        return out

    def chunk_begin(self, r: Request, start: int) -> None:
        """Before r's prompt prefills in chunks (runtime/chunked.py) from entry `start` (a reused prefix before it):
        its pages, and a copy of its K/V [layers, KV, prompt, D] in the compute dtype that the chunks attend to, as
        computed (an unchunked prefill attends to the prompt's K/V before the store quantizes them); the reused
        prefix enters it in its stored form (as `prefill_cached` reads it). Every rank keeps its heads' copy, under
        a number rank 0 gives it."""
        self.kv.ensure(r.id, len(r.prompt) + self.lookahead)
        self._chunk_keys[r.id] = key = self._next_chunk_key
        self._next_chunk_key += 1
        slots = torch.tensor([self.kv.slot(r.id, i) for i in range(start)], dtype=torch.long, device=self.device)
        self._call("run_chunk_begin", key, len(r.prompt), slots)

    def run_chunk_begin(self, key: int, n: int, slots: torch.Tensor) -> None:
        s, m = self.kv.store, slots.numel()
        shape = (s.num_layers, s.num_kv_heads, n, s.head_size)
        k, v = (torch.empty(shape, dtype=self.model.dtype, device=self.device) for _ in range(2))
        if m and self.kv.shadow:  # the reused prefix as computed (`PagedKV.raw_pages`), as prefill_cached reads it
            k[:, :, :m], v[:, :, :m] = self.kv.raw_prefix((slots[:: self.kv.ps] // self.kv.ps).tolist())
            m = 0
        for layer in range(s.num_layers if m else 0):
            sk, sv = s.read(layer, slots)
            k[layer, :, :m], v[layer, :, :m] = sk.transpose(0, 1), sv.transpose(0, 1)
        self.chunks[key] = (k, v)
        self.chunk_starts[key] = slots.numel()

    def chunk_end(self, rid: str) -> None:
        key = self._chunk_keys.pop(rid, None)
        if key is not None:
            self.raw_ids = [rid]
            self._call("run_chunk_end", key)

    def run_chunk_end(self, key: int) -> None:
        """With prefix reuse where the store keeps another form, the copy becomes what `publish` keeps of the
        prompt's pages (its K/V past the reused prefix, laid out as a prefill's `raw`)."""
        kv_copy, start = self.chunks.pop(key, None), self.chunk_starts.pop(key, 0)
        if kv_copy is not None and self.reuse and self.kv.shadow:
            self.raw = tuple(x[:, None, :, start:].transpose(2, 3) for x in kv_copy)

    def prefill_chunk(
        self,
        r: Request,
        start: int,
        n: int,
        last_logits: bool,
        feats: Optional[torch.Tensor] = None,
        all_logits: bool = False,
    ) -> Optional[torch.Tensor]:
        """Prompt tokens [start, start + n) of r (after `chunk_begin`): K/V into the cache (and its dense view and
        exact copies, as `prefill` writes them) and into r's chunk copy; causal attention over the copy's [0, start)
        and the chunk. -> the logits of the chunk's last token [V] when last_logits, of its every token [n, V]
        when all_logits. feats [1, n, hidden]: a FeatureDraft's input features."""
        dev, kv = self.device, self.kv
        tok = torch.tensor([r.prompt[start : start + n]], device=dev)
        pos = torch.arange(start, start + n, device=dev)
        flat = torch.tensor([kv.slot(r.id, i) for i in range(start, start + n)], device=dev)
        at = None
        if kv.dense is not None or kv.recent is not None:
            at = (torch.full((n,), kv.rows[r.id], device=dev), pos)
        logits = self._call(
            "run_prefill_chunk",
            self._chunk_keys[r.id],
            start,
            tok,
            flat,
            at,
            all_logits,
            self._dense_width(),
            *(() if feats is None else (feats,)),
        )
        if all_logits:
            return logits[0]
        return logits[0, -1] if last_logits else None

    def run_prefill_chunk(
        self, key: int, start: int, tok, flat, at, all_logits: bool, dense_width: int, feats=None
    ) -> torch.Tensor:
        kv, n = self.kv, tok.shape[1]
        if kv.dense is not None:  # (rank 0's grows as its pages do; the others' to rank 0's width)
            kv.dense.reserve(dense_width)
        pos = torch.arange(start, start + n, device=tok.device)
        ck, cv = self.chunks[key]
        causal = torch.ones(n, start + n, dtype=torch.bool, device=tok.device).triu(start + 1)
        hidden = {}  # per query heads per KV head: rows t * rep + r (dense_attention's layout)

        def attend(layer, q, k, v):
            rep = q.shape[2] // k.shape[2]
            if rep not in hidden:
                hidden[rep] = causal.repeat_interleave(rep, 0)[None, None]
            kv.write(layer, flat, k[0], v[0], at, pos)
            ck[layer, :, start : start + n] = k[0].transpose(0, 1)
            cv[layer, :, start : start + n] = v[0].transpose(0, 1)
            return dense_attention(q, ck[layer, None, :, : start + n], cv[layer, None, :, : start + n], hidden[rep])

        with kv.batched_writes(own_exact=True):
            return self._model(tok, pos[None], attend, feats, last_only=not all_logits)

    def _model(self, tok, pos, attend, feats, last_only: bool = False, rows=None) -> torch.Tensor:
        """The model's logits; its final hidden states go to self.hidden where it reads or feeds features."""
        if feats is not None:
            logits, self.hidden = self.model(tok, pos, attend=attend, last_only=last_only, feats=feats, rows=rows)
        elif self.features:
            logits, self.hidden = self.model(tok, pos, attend=attend, last_only=last_only, return_hidden=True)
        else:
            return self.model(tok, pos, attend=attend, last_only=last_only)
        return logits

    def forward(
        self,
        reqs: list[Request],
        tokens: list[list[int]],
        positions: list[list[int]],
        writes: list[list[int]],
        ctx: list[int],
        tree_lens: list[int],
        mask_rows: Optional[list[list[int]]] = None,
        feats: Optional[torch.Tensor] = None,
        logit_rows: Optional[list[int]] = None,
    ) -> torch.Tensor:
        """One batched forward of new tokens over the paged cache -> logits [B, T, V].

        writes: logical cache index per new token; ctx/tree_lens/mask_rows: see AttnBatch (mask rows as
        Python-int bit rows over the tree region); feats [B, T, hidden]: a FeatureDraft's input features;
        logit_rows: with feats, only row logit_rows[b] of each sequence gets logits ([B, 1, V])."""
        if self.static is not None:
            self.forwards += 1
            return self.static.forward(reqs, tokens, positions, writes, ctx, tree_lens, mask_rows, feats, logit_rows)
        dev, kv, model = self.device, self.kv, self.model
        B, T = len(reqs), max(len(t) for t in tokens)
        pad = lambda xs, v=0: [x + [v] * (T - len(x)) for x in xs]  # noqa: E731
        tok = torch.tensor(pad(tokens), device=dev)
        pos = torch.tensor(pad(positions), device=dev)
        flat = torch.tensor(pad([[kv.slot(r.id, i) for i in w] for r, w in zip(reqs, writes)]), device=dev).view(-1)
        mask = None
        if mask_rows is not None:
            words = max(1, -(-max(tree_lens) // 32))
            mask = torch.stack([pack_rows(rows + [0] * (T - len(rows)), words) for rows in mask_rows]).to(dev)
        if kv.dense is not None:
            rows = [kv.rows[r.id] for r in reqs]
            at = (
                torch.tensor(
                    [[row] * len(w) + [kv.dense.null] * (T - len(w)) for row, w in zip(rows, writes)], device=dev
                ).view(-1),
                torch.tensor(pad(writes), device=dev).view(-1),
            )
            N = max(c + t for c, t in zip(ctx, tree_lens))
            hidden = exact = None
            rep = model.cfg.num_heads // model.cfg.num_kv_heads
            last = positions[0][0] == N - 1  # one new token at the end of its sequence (decode)
            few = self.few_query_kernel and T <= cpu_decode.MAX_QUERIES
            seqs = None  # for the kernel: per sequence (dense row, entries (a0, a1), queries, mask or None)
            if B > 1 or T > 1 or mask is not None or (kv.recent is not None and not last):
                batch = AttnBatch(
                    None, torch.tensor(ctx, device=dev), torch.tensor(tree_lens, device=dev), None, mask, kv.ps
                )
                visible = batch.visible(T, N)
                if kv.recent is not None:  # the kernel takes a plan's exact entries at decode steps only
                    visible, exact = self._exact_columns(visible, pos, writes, ctx, tree_lens, rows, rep)
                    few = False
                if few:
                    seqs = [
                        (row, (0, c + t), len(w), visible[b, : len(w), : c + t].contiguous())
                        for b, (row, w, c, t) in enumerate(zip(rows, writes, ctx, tree_lens))
                    ]
                else:
                    hidden = ~visible.repeat_interleave(rep, dim=1)[:, None]
            elif kv.recent is not None:
                exact = self._exact_last(rows[0], N)
                if few and writes[0] == [N - 1]:
                    seqs = [(rows[0], exact[3], 1, None)]
            elif few:
                seqs = [(rows[0], (0, N), 1, None)]
            attn = ("dense", at, rows, N, hidden, exact, seqs)
        else:
            attn = (
                "paged",
                AttnBatch(
                    kv.block_tables([r.id for r in reqs], dev),
                    torch.tensor(ctx, device=dev),
                    torch.tensor(tree_lens, device=dev),
                    torch.tensor([len(t) for t in tokens], device=dev),
                    mask,
                    kv.ps,
                ),
                *(self._kernel_exact(reqs, writes, positions, ctx, tree_lens, pos) if kv.recent is not None else ()),
            )
        self.forwards += 1
        lrows = None if logit_rows is None else torch.tensor(logit_rows, device=dev)
        return self._call(
            "run_forward", tok, pos, flat, attn, self._dense_width(), *(() if feats is None else (feats, lrows))
        )

    def run_static(self, *args) -> torch.Tensor:
        """A step from the static buffers (`StaticStep.run`); every rank of a tensor-parallel group runs it."""
        if self.static is None:
            raise RuntimeError(f"the {self.role} was sent a static step but runs the executor's own (cuda_graphs off)")
        return self.static.run(*args)

    def _kernel_exact(self, reqs, writes, positions, ctx, tree_lens, pos) -> tuple:
        """For the kernels over a plan with exact entries: (where this forward's entries go in the RecentKV: rows
        [B * T], logical index [B * T]; (each sequence's row [B], its query rows' positions [B, T], its tree
        entries' positions [B, max tree])). A tree entry sits at its token's position when this forward writes it,
        else at its logical index (as `_exact_columns` places keys for the PyTorch path)."""
        dev, rec = self.device, self.kv.recent
        T = pos.shape[1]
        rows = [self.kv.rows[r.id] for r in reqs]
        at = (
            torch.tensor([[row] * len(w) + [rec.rows] * (T - len(w)) for row, w in zip(rows, writes)], device=dev).view(
                -1
            ),
            torch.tensor([w + [0] * (T - len(w)) for w in writes], device=dev).view(-1),
        )
        tree_pos = [[c + j for j in range(max(1, *tree_lens))] for c in ctx]
        for b, (w, p, c, t) in enumerate(zip(writes, positions, ctx, tree_lens)):
            for i, x in zip(w, p):
                if c <= i < c + t:
                    tree_pos[b][i - c] = x
        meta = (torch.tensor(rows, device=dev), pos, torch.tensor(tree_pos, device=dev).view(len(reqs), -1))
        return at, meta

    def _exact_last(self, row: int, N: int) -> tuple:
        """Exact columns for one query at position N - 1 over entries [0, N) (the decode step): it reads the exact
        copies of the sink entries and of [N - window, N), the stored ones of the run between."""
        rec = self.kv.recent
        lo = max(rec.sink, N - rec.window)
        idx = list(range(min(rec.sink, N))) + list(range(lo, N))
        dev = self.device
        cols = rec.column(torch.tensor([idx], device=dev))
        return torch.tensor([row], device=dev), cols, None, (min(rec.sink, N), lo)

    def _exact_columns(
        self,
        visible: torch.Tensor,
        pos: torch.Tensor,
        writes: list[list[int]],
        ctx: list[int],
        tree_lens: list[int],
        rows: list[int],
        rep: int,
    ) -> tuple[torch.Tensor, tuple]:
        """For a batch with exact entries: (visible [B, T, N] of the stored entries, minus those read exact;
        (rows, RecentKV columns of the exact entries [B, M], hidden_e [B, 1, T * rep, M], None)). The M exact
        columns of sequence b are its sink entries and [ctx_b - window + 1, ctx_b + tree_b): every entry a query
        of this step may read exact.
        Tree entries' positions are their tokens' (this step's writes); context entries sit at their index."""
        rec, dev = self.kv.recent, self.device
        B, T, N = visible.shape
        S, W = rec.sink, rec.window
        n = torch.arange(N, device=dev)
        kpos = n.repeat(B, 1)
        for b, w in enumerate(writes):
            kpos[b, w] = pos[b, : len(w)]
        real = torch.tensor([[t < len(w) for t in range(T)] for w in writes], device=dev)
        ex = exact_reads(pos, kpos, S, W) & real[:, :, None]  # [B, T, N]
        win = W + max(tree_lens) - 1 if W > 0 else 0
        m = torch.arange(S + win, device=dev)
        c = torch.tensor(ctx, device=dev)[:, None]
        e = torch.where(m < S, m, c - (W - 1) + (m - S))  # [B, M]
        valid = (e >= 0) & (e < c + torch.tensor(tree_lens, device=dev)[:, None]) & ((m < S) | (e >= S))
        ec = e.clamp(0, N - 1)
        g = ec[:, None, :].expand(B, T, -1)
        show = valid[:, None, :] & visible.gather(2, g) & ex.gather(2, g)
        hidden_e = ~show.repeat_interleave(rep, dim=1)[:, None]
        return visible & ~ex, (torch.tensor(rows, device=dev), rec.column(ec), hidden_e, None)

    def run_forward(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        flat: torch.Tensor,
        attn: tuple,
        dense_width: int,
        feats: Optional[torch.Tensor] = None,
        logit_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        kv, (B, T) = self.kv, tok.shape
        flat_pos = pos.reshape(-1)
        if attn[0] == "dense":
            _, at, rows, N, hidden, exact, seqs = attn
            kv.dense.reserve(dense_width)
            if seqs is not None:  # bpcompile's kernel, a call per sequence (the store's part as below)
                round16 = kv.dense.plain and kv.store.dtype == torch.float16
                widx = at[1].view(B, T)
                if exact is not None:  # decode: the new entry goes to its exact copy, the stored run is read
                    rec, cols = kv.recent, exact[1][0].contiguous()
                    widx = rec.column(widx)
                ex = None if exact is None else (rec.k, rec.v, cols)
                one = B == 1 and seqs[0][2] == T  # one sequence without padding: no slicing (decode steps)
                w0 = widx[0]

                def attend(layer, q, k, v):
                    H, KV, D = q.shape[2], k.shape[2], q.shape[3]
                    # q, k, v are views of the qkv rows
                    k, v = k.reshape(B * T, KV, D).contiguous(), v.reshape(B * T, KV, D).contiguous()
                    kv.write(layer, flat, k, v, at, flat_pos, written=True)
                    if one:
                        row, run, _, m = seqs[0]
                        return cpu_decode.attend(
                            q.reshape(T, H, D).contiguous(),
                            kv.dense.k,
                            kv.dense.v,
                            (layer, row),
                            run,
                            exact=ex,
                            mask=m,
                            new=(k, v),
                            write=w0,
                            round16=round16,
                        ).view(1, T, H, D)
                    q, k, v = q.contiguous(), k.view(B, T, KV, D), v.view(B, T, KV, D)
                    o = q.new_zeros(B, T, H, D)  # padding rows: zeros (nothing reads them)
                    for b, (row, run, n, m) in enumerate(seqs):
                        o[b, :n] = cpu_decode.attend(
                            q[b, :n],
                            kv.dense.k,
                            kv.dense.v,
                            (layer, row),
                            run,
                            exact=ex,
                            mask=m,
                            new=(k[b, :n], v[b, :n]),
                            write=widx[b, :n],
                            round16=round16,
                        )
                    return o
            else:

                def attend(layer, q, k, v):
                    kv.write(layer, flat, k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]), at, flat_pos)
                    kd, vd = kv.dense.read(layer, rows, N)
                    if exact is None:
                        return dense_attention(q, kd, vd, hidden)
                    e_rows, e_cols, hidden_e, cut = exact
                    if cut is not None:  # one query: the stored entries it reads are a contiguous run
                        kd, vd = kd[:, :, cut[0] : cut[1]], vd[:, :, cut[0] : cut[1]]
                    ek, ev = kv.recent.read(layer, e_rows, e_cols, q.dtype)
                    return dense_attention(q, kd, vd, hidden, exact=(ek, ev, hidden_e))
        else:
            batch, at = attn[1], None
            if len(attn) > 2:  # the kernels read the plan's exact copies (and this forward writes them)
                at, meta = attn[2], attn[3]
                batch.exact = (kv.recent, *meta)

            def attend(layer, q, k, v):
                kv.write(
                    layer, flat, k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]), at, positions=flat_pos
                )
                return paged_attention(q, kv.store, layer, batch, kv.kern)

        # a step's queries read its own entries' exact copies when the plan's window holds the whole step
        with kv.batched_writes(own_exact=kv.recent is not None and kv.recent.window >= T):
            return self._model(tok, pos, attend, feats, rows=logit_rows)

    def move(self, moves: "Moves") -> None:
        """Apply the collected KV moves (accepted tree entries to their committed slots)."""
        if moves.src:
            self._call(
                "run_move",
                *(
                    torch.tensor(x, device=self.device)
                    for x in (moves.src, moves.dst, moves.rows, moves.src_index, moves.dst_index)
                ),
            )

    def run_move(self, src, dst, rows, src_i, dst_i) -> None:
        self.kv.move(src, dst, (rows, src_i, dst_i))


class Moves:
    """KV entries of accepted tree nodes to copy to consecutive committed positions, collected for one batch."""

    def __init__(self, kv: PagedKV):
        self.kv = kv
        self.src: list[int] = []
        self.dst: list[int] = []
        self.rows: list[int] = []
        self.src_index: list[int] = []
        self.dst_index: list[int] = []

    def add(self, rid: str, src: int, dst: int) -> None:
        """Logical index src -> dst of request rid."""
        self.src.append(self.kv.slot(rid, src))
        self.dst.append(self.kv.slot(rid, dst))
        self.rows.append(self.kv.rows.get(rid, 0))
        self.src_index.append(src)
        self.dst_index.append(dst)
