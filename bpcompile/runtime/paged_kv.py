"""Paged KV caches and the attention over them.

- `PagedKV` decides *which* slots a sequence uses: fixed-size pages, one block table per sequence, a free list.
  Page 0 is never handed out: padding tokens of a batch write their K/V there.
- A `KVStore` (bpcompile/runtime/kvcache.py, float or quantized) decides *how* K/V sit in those slots.
- `AttnBatch` is a batch's attention metadata (block tables, context and tree lengths, the packed tree mask);
  `paged_attention` is the one attention function over it (plain PyTorch here; the Triton kernels replace it
  where they run), `dense_attention` the same over a `DenseKV` copy.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from bpcompile.core.errors import UserError
from bpcompile.kernels.tree_mask import unpack_tree_mask
from bpcompile.runtime.kvcache import FloatKVStore, KVPlan, KVStore, make_kv_store
from bpcompile.runtime.model import ModelConfig

KVStoreFactory = Callable[[ModelConfig, int, int, str], KVStore]  # (model cfg, num_pages, page_size, device)


def pages_per_sequence(max_seq_len: int, lookahead: int, page_size: int) -> int:
    """Pages one sequence may hold: max_seq_len committed tokens plus one step's tree (lookahead entries)."""
    return -(-(max_seq_len + lookahead) // page_size)


def cache_pages(max_batch_size: int, max_seq_len: int, lookahead: int, page_size: int) -> int:
    """Pages a cache is allocated: every sequence of a full batch at its longest, plus page 0 (padding writes)."""
    return max_batch_size * pages_per_sequence(max_seq_len, lookahead, page_size) + 1


def float_store_factory(dtype: torch.dtype) -> KVStoreFactory:
    """Unquantized pages in `dtype` (the model's own, or FP16 for `kv_cache.format: fp16`)."""

    def make(cfg: ModelConfig, num_pages: int, page_size: int, device) -> KVStore:
        return FloatKVStore(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_size, num_pages, page_size, dtype=dtype, device=device
        )

    return make


class DenseKV:
    """What the store returns for each sequence's logical entries, kept contiguous per sequence in the compute
    dtype: k, v [L, rows + 1, KV, S, D]; the last row takes padding writes.

    The PyTorch attention path reads a sequence's keys as a slice of it instead of gathering (and dequantizing)
    every page at every layer of every step; a write dequantizes only the entries just written (`store.read` of
    their slots), so it holds exactly what the store holds. It is a host-side float copy of the cache: the
    store keeps the bytes of record (what kernels read, what `nbytes` counts)."""

    def __init__(self, store: KVStore, rows: int, length: int, dtype: torch.dtype, device):
        self.shape = [store.num_layers, rows + 1, store.num_kv_heads, 0, store.head_size]
        self.length, self.dtype, self.device = length, dtype, device
        self.k = self.v = torch.zeros(self.shape, dtype=dtype, device=device)
        self.null = rows
        self.free = list(range(rows - 1, -1, -1))
        # a FloatKVStore returns exactly what it was given, cast to its dtype: no need to read it back
        self.plain = type(store) is FloatKVStore

    def reserve(self, n: int) -> None:
        """Room for logical entries [0, n) in every row; grows by doubling (memory follows the longest sequence
        seen, not max_seq_len)."""
        if n > self.k.shape[3]:
            self.shape[3] = min(self.length, max(n, 2 * self.k.shape[3], 64))
            k, v = self.k, self.v
            self.k, self.v = (torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(2))
            self.k[:, :, :, : k.shape[3]] = k
            self.v[:, :, :, : v.shape[3]] = v

    def write(self, layer: int, rows: torch.Tensor, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, KV, D] at (row, logical index) pairs rows[N], idx[N]."""
        self.k[layer, rows, :, idx] = k.to(self.k.dtype)
        self.v[layer, rows, :, idx] = v.to(self.v.dtype)

    def write_layers(self, rows: torch.Tensor, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """write() of every layer: k, v [L, N, KV, D] (indexing [:, rows, :, idx] puts the N pairs first)."""
        self.k[:, rows, :, idx] = k.transpose(0, 1).to(self.k.dtype)
        self.v[:, rows, :, idx] = v.transpose(0, 1).to(self.v.dtype)

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.k[:, rows, :, dst] = self.k[:, rows, :, src].clone()
        self.v[:, rows, :, dst] = self.v[:, rows, :, src].clone()

    def read(self, layer: int, rows: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries [0, n) of each row -> k, v [B, KV, n, D] (a view for one row)."""
        if len(rows) == 1:
            return self.k[layer, rows[0] : rows[0] + 1, :, :n], self.v[layer, rows[0] : rows[0] + 1, :, :n]
        r = torch.tensor(rows, device=self.k.device)
        return self.k[layer, :, :, :n].index_select(0, r), self.v[layer, :, :, :n].index_select(0, r)


class RecentKV:
    """The exact copies of a plan with exact entries (KVPlan.sink_tokens / recent_window; docs/KV_FORMAT.md §4):
    k, v [L, rows, KV, sink + ring, D] in FP16, one row per sequence (the DenseKV row). Logical entry i sits in
    column i when i < sink, else in column sink + (i - sink) % ring. ring = window + lookahead: a step reads at
    most [ctx - window + 1, ctx + tree) and writes [ctx, ctx + tree), tree <= lookahead, so nothing it reads is
    overwritten. These are bytes of record: the cache's allocation counts them (`nbytes`)."""

    def __init__(self, store: KVStore, rows: int, sink: int, window: int, lookahead: int, device):
        self.sink, self.window, self.ring = sink, window, window + lookahead
        self.rows = rows
        shape = (store.num_layers, rows, store.num_kv_heads, sink + self.ring, store.head_size)
        self.k = torch.zeros(shape, dtype=torch.float16, device=device)
        self.v = torch.zeros(shape, dtype=torch.float16, device=device)
        self._memo: Optional[tuple] = None

    def column(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.where(idx < self.sink, idx, self.sink + (idx - self.sink) % self.ring)

    def write(self, layer: int, rows: torch.Tensor, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, KV, D] of logical entries idx[N] of rows[N]. Rows >= self.rows (padding) are dropped, and so is
        an entry a later one of the same call overwrites (a prompt longer than the ring): index_put with
        repeated indices would keep an arbitrary one."""
        rows, col, keep = self._targets(rows, idx)
        if keep is not None:
            k, v = k[keep], v[keep]
        self.k[layer, rows, :, col] = k.to(torch.float16)
        self.v[layer, rows, :, col] = v.to(torch.float16)

    def write_fixed(self, layer: int, rows: torch.Tensor, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`write` with fixed shapes and no host sync (a CUDA graph can hold it), for calls whose real entries
        have distinct columns in each row (at most `ring` consecutive entries: a step after prefill writes at most
        lookahead). Rows >= self.rows (padding) still change nothing: every padding entry writes what the call's
        first real entry writes, at its place (duplicate indices of index_put carrying one value), or, when no
        entry is real, puts back what row 0's column of entry 0 holds."""
        n = torch.arange(rows.shape[0], device=rows.device)
        real = rows < self.rows
        src = torch.where(real, n, real.int().argmax())  # argmax: the first real entry (0 when none)
        rows, col, real = rows[src].clamp(max=self.rows - 1), self.column(idx[src]), real[src, None, None]
        for store, x in ((self.k, k), (self.v, v)):
            old = store[layer, rows, :, col]
            store[layer, rows, :, col] = torch.where(real, x[src].to(torch.float16), old)

    def _targets(self, rows: torch.Tensor, idx: torch.Tensor) -> tuple:
        """(rows, columns, keep mask or None) of a write. Every layer of a forward writes the same (rows, idx)
        tensors, so the last answer is kept for them: one computation per forward, not per layer."""
        memo = self._memo
        if memo is not None and memo[0] is rows and memo[1] is idx:
            return memo[2]
        real = rows < self.rows
        last = torch.full((self.rows + 1,), -1, dtype=idx.dtype, device=idx.device)
        last = last.scatter_reduce(0, rows.clamp(max=self.rows), idx, "amax")
        keep = real & ((idx < self.sink) | (idx > last[rows.clamp(max=self.rows)] - self.ring))
        out = (rows, self.column(idx), None) if bool(keep.all()) else (rows[keep], self.column(idx[keep]), keep)
        self._memo = (rows, idx, out)
        return out

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        s, d = self.column(src), self.column(dst)
        self.k[:, rows, :, d] = self.k[:, rows, :, s].clone()
        self.v[:, rows, :, d] = self.v[:, rows, :, s].clone()

    def read(
        self, layer: int, rows: torch.Tensor, col: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Columns col [B, M] (`column` of the entries wanted, computed once per forward) of rows [B] -> k, v
        [B, KV, M, D] in dtype."""
        if rows.numel() == 1:  # decode of one sequence: a plain index, no gather of row ids
            r = int(rows[0])
            return self.k[layer, r, :, col[0]][None].to(dtype), self.v[layer, r, :, col[0]][None].to(dtype)
        r = rows[:, None].expand_as(col)
        return (self.k[layer, r, :, col].transpose(1, 2).to(dtype), self.v[layer, r, :, col].transpose(1, 2).to(dtype))

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def exact_reads(q_pos: torch.Tensor, k_pos: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """[..., T, N] bool: where a query at q_pos [..., T] reads the exact copy of the key at k_pos [..., N] (a sink
    position, or within `window` positions of its own, itself included). Position-relative, so a tree's query reads
    what sequential decode at its position reads."""
    d = q_pos[..., :, None] - k_pos[..., None, :]
    return (k_pos[..., None, :] < sink) | (d < window)


class PagedKV:
    """Pages of one KVStore handed out to sequences. Page 0 is the null page (padding writes).

    `kern`: the Triton kernels module when they run for this store (resolved once), else None. `dense`: a
    DenseKV the PyTorch path attends over (None: the reference `paged_attention` over `store.read`)."""

    def __init__(
        self, store: KVStore, device="cpu", dense: Optional[DenseKV] = None, recent: Optional[RecentKV] = None
    ):
        self.kern = kernels_for(store, torch.device(device))
        self.store, self.ps, self.recent = store, store.page_size, recent
        self.free = list(range(store.num_pages - 1, 0, -1))  # pop() hands out low page ids first
        self.tables: dict[str, list[int]] = {}
        self.dense = dense if self.kern is None else None
        self.rows: dict[str, int] = {}  # dense (or, under the kernels, RecentKV) row per sequence
        self._free_rows = list(range(recent.rows - 1, -1, -1)) if recent is not None else []
        self._pending: Optional[list] = None  # inside batched_writes: each layer's write, for the end of the forward
        # Prefix reuse (vLLM's automatic prefix caching, over these pages): a full page of a prompt is published
        # under its block hash (`block_hashes`); pages are shared by reference count; a published page nobody
        # references stays cached in `lru` (least recently used first) until a new page is needed.
        self.refs: dict[int, int] = {}  # page -> sequences whose table holds it (pages of a table only)
        self.cached: dict[bytes, int] = {}  # block hash -> page
        self.hash_of: dict[int, bytes] = {}  # page -> its block hash (published pages only)
        self.aux: dict[int, torch.Tensor] = {}  # page -> what a reader needs besides K/V (a verifier's feature)
        # page -> its entries as the dense view holds them (k, v [L, KV, page, D]): a sequence that adopts the
        # page copies them instead of dequantizing the page again (which costs a quantized plan's CPU path about
        # as much as computing the tokens); host-side copies like the dense view itself, not bytes of record
        self.dense_pages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # page -> its entries as the prefill that computed them attended to them (k, v [L, KV, page, D] in the
        # compute dtype), where the store keeps another form (a quantized plan, an FP16 cache of a float32
        # model): the rest of a prompt that reuses the page attends to these, as a full prefill attends to the
        # whole prompt's unquantized K/V, so its outputs equal reuse off; a plan's exact copies of the page's
        # entries (sink, recent window) come from them too. Copies on the model's device, not bytes of record.
        self.raw_pages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.shadow = not (self.dense is not None and self.dense.plain and self.dense.dtype == store.dtype)
        self.lru: OrderedDict[int, None] = OrderedDict()  # published pages with no reference, oldest first
        self.evicted = 0  # published pages dropped to make room

    @property
    def capacity(self) -> int:
        return self.store.num_pages - 1

    def available(self) -> int:
        """Pages a new allocation can take: free ones and cached ones nobody references."""
        return len(self.free) + len(self.lru)

    def _new_page(self) -> int:
        if self.free:
            page = self.free.pop()
        else:  # the least recently used cached page: its block is forgotten (a later prompt recomputes it)
            page, _ = self.lru.popitem(last=False)
            del self.cached[self.hash_of.pop(page)]
            self.aux.pop(page, None)
            self.dense_pages.pop(page, None)
            self.raw_pages.pop(page, None)
            self.evicted += 1
        self.refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        n = self.refs.pop(page) - 1
        if n > 0:
            self.refs[page] = n
        elif page in self.hash_of:
            self.lru[page] = None
        else:
            self.free.append(page)

    def ensure(self, rid: str, n_tokens: int) -> None:
        table = self.tables.setdefault(rid, [])
        need = -(-n_tokens // self.ps)
        if need - len(table) > self.available():
            raise RuntimeError(f"KV cache out of pages ({self.available()} free, {need - len(table)} needed)")
        while len(table) < need:
            table.append(self._new_page())
        if self.dense is not None:
            if rid not in self.rows:
                self.rows[rid] = self.dense.free.pop()
            self.dense.reserve(n_tokens)
        elif self.recent is not None and rid not in self.rows:  # the kernels read the exact copies of this row
            self.rows[rid] = self._free_rows.pop()

    def truncate(self, rid: str, n_tokens: int) -> None:
        table = self.tables.get(rid, [])
        keep = -(-n_tokens // self.ps)
        for page in reversed(table[keep:]):
            self._drop(page)
        del table[keep:]

    # --- prefix reuse --------------------------------------------------------------------------------------

    def block_hashes(self, tokens: list[int], salt: bytes) -> list[bytes]:
        """The hash of each full page of tokens: chained (a page's hash covers every token before it), salted
        with what else makes a page's bytes differ (engine, KV plan, model role)."""
        out, h = [], hashlib.sha256(salt).digest()
        for i in range(len(tokens) // self.ps):
            h = hashlib.sha256(h + array("q", tokens[i * self.ps : (i + 1) * self.ps]).tobytes()).digest()
            out.append(h)
        return out

    def match(self, hashes: list[bytes]) -> list[int]:
        """Pages cached for the leading hashes (stops at the first miss)."""
        pages = []
        for h in hashes:
            page = self.cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def adopt(self, rid: str, pages: list[int]) -> None:
        """A new sequence starts with these cached pages (its first len(pages) * page_size entries): referenced,
        not evictable while it holds them; its dense view row gets what the store holds for them, its exact
        copies what its prefill would have written (`fill`)."""
        self.adopt_pages(rid, pages)
        if pages and rid in self.rows:
            self.fill(self.rows[rid], pages)

    def adopt_pages(self, rid: str, pages: list[int]) -> None:
        """adopt's bookkeeping (rank 0's, with tensor parallelism: every rank runs `fill`)."""
        assert not self.tables.get(rid), "adopt() starts a sequence"
        for page in pages:
            self.lru.pop(page, None)
            self.refs[page] = self.refs.get(page, 0) + 1
        self.tables[rid] = list(pages)
        if pages and (self.dense is not None or self.recent is not None):
            self.ensure(rid, len(pages) * self.ps)

    def fill(self, row: int, pages: list[int]) -> None:
        """Row `row` of the dense view and of the exact copies gets what a prefill of the pages' tokens would
        have put there: the store's entries (dequantized) and, from the pages' raw copies, the exact ones."""
        n = len(pages) * self.ps
        if self.dense is not None:
            self.dense.reserve(n)
            if all(p in self.dense_pages for p in pages):
                self.dense.k[:, row, :, :n] = torch.cat([self.dense_pages[p][0] for p in pages], 2)
                self.dense.v[:, row, :, :n] = torch.cat([self.dense_pages[p][1] for p in pages], 2)
            else:
                slots = torch.tensor(pages, device=self.dense.device)[:, None] * self.ps + torch.arange(
                    self.ps, device=self.dense.device
                )
                for layer in range(self.store.num_layers):
                    k, v = self.store.read(layer, slots.reshape(-1))
                    self.dense.k[layer, row, :, :n] = k.transpose(0, 1).to(self.dense.dtype)
                    self.dense.v[layer, row, :, :n] = v.transpose(0, 1).to(self.dense.dtype)
        if self.recent is not None:
            k, v = self.raw_prefix(pages)
            dev = self.recent.k.device
            rows, idx = torch.full((n,), row, device=dev), torch.arange(n, device=dev)
            for layer in range(self.store.num_layers):
                self.recent.write(layer, rows, idx, k[layer].transpose(0, 1), v[layer].transpose(0, 1))

    def raw_prefix(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw copies of these pages end to end: k, v [L, KV, len(pages) * page_size, D]."""
        return tuple(torch.cat([self.raw_pages[p][i] for p in pages], 2) for i in (0, 1))

    def publish(
        self, rid: str, hashes: list[bytes], aux: Optional[Callable[[int], torch.Tensor]] = None
    ) -> list[tuple[int, int]]:
        """The sequence's first len(hashes) pages hold those blocks (written, never written again): cache them.
        A block already cached under another page stays private to this sequence. aux(i): what to keep with
        block i (see `aux`). -> the (block index, page) pairs now cached: their copies are taken by `keep`."""
        table, out = self.tables[rid], []
        for i, h in enumerate(hashes):
            page = table[i]
            if h in self.cached or page in self.hash_of:
                continue
            self.cached[h] = page
            self.hash_of[page] = h
            if aux is not None:
                self.aux[page] = aux(i)
            out.append((i, page))
        return out

    def keep(self, page: int, row: int, at: int, raw: Optional[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copies of a page just cached, its block at logical entries [at, at + page_size) of dense row `row`:
        the dense view's entries (`dense_pages`) and raw (k, v [L, KV, page, D]: `raw_pages`)."""
        if self.dense is not None:
            sl = slice(at, at + self.ps)
            self.dense_pages[page] = (self.dense.k[:, row, :, sl].clone(), self.dense.v[:, row, :, sl].clone())
        if raw is not None:
            self.raw_pages[page] = raw

    def held_pages(self) -> int:
        """Pages some sequence references (shared ones once)."""
        return len(self.refs)

    def dense_pages_nbytes(self) -> int:
        """Bytes of the cached pages' host-side copies (`dense_pages`, `raw_pages`)."""
        pages = list(self.dense_pages.values()) + list(self.raw_pages.values())
        return sum(k.numel() * k.element_size() * 2 for k, _ in pages)

    def release(self, rid: str) -> None:
        self.truncate(rid, 0)
        self.tables.pop(rid, None)
        row = self.rows.pop(rid, None)
        if row is not None:
            (self.dense.free if self.dense is not None else self._free_rows).append(row)

    def slot(self, rid: str, i: int) -> int:
        return self.tables[rid][i // self.ps] * self.ps + i % self.ps

    def block_tables(self, rids: list[str], device) -> torch.Tensor:
        width = max(1, max(len(self.tables[r]) for r in rids))
        return torch.tensor(
            [self.tables[r] + [0] * (width - len(self.tables[r])) for r in rids], dtype=torch.int32, device=device
        )

    @contextlib.contextmanager
    def batched_writes(self, own_exact: bool):
        """Within it (one forward), `write` keeps each layer's K/V, and the store gets every layer's at once when
        the forward ends (`KVStore.write_layers`: one quantize for the step, not one per layer; on CPU at decode
        the per-layer writes of a quantized store were a fifth of the step). Only with a dense view (the store is
        not read during the forward); a float store's dense view is still written layer by layer. A quantized
        store's dense view is filled at the end too, so only where the forward never reads its own entries from
        it (own_exact: a prompt attends to its raw K/V; a step's queries read their own entries' exact copies
        when the plan's recent window holds the whole step); else writes go through at once. An exception
        inside drops what was kept."""
        if self.dense is None or (not own_exact and not self.dense.plain):
            yield
            return
        self._pending = []
        try:
            yield
            pending, self._pending = self._pending, None
            self._write_pending(pending)
        finally:
            self._pending = None

    def _write_pending(self, pending: list) -> None:
        if not pending:
            return
        slots, dense_at, positions = pending[0][3:]
        if [p[0] for p in pending] != list(range(self.store.num_layers)):  # not one whole forward: layer by layer
            for layer, k, v, slots, dense_at, positions in pending:
                self._write_now(layer, slots, k, v, dense_at, positions, recent=False)
            return
        k, v = torch.stack([p[1] for p in pending]), torch.stack([p[2] for p in pending])
        if self.dense.plain:
            self.store.write_layers(slots, k, v, positions)
        else:
            self.dense.write_layers(*dense_at, *self.store.write_read_layers(slots, k, v, positions))

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dense_at: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        positions: Optional[torch.Tensor] = None,
        written: bool = False,
        fixed: bool = False,
    ) -> None:
        """Quantize-and-append k, v [N, KV, D] at flat slots [N] (the kernel or the store's oracle); with a dense
        view, also put what the store now returns for those slots at dense_at = (rows [N], logical index [N]).
        Inside `batched_writes` the store's part waits for the end of the forward. written: inside it, the caller
        has put the entries into a float store's dense view and the exact copies itself (the few-query kernel).
        fixed: the exact copies are written by `RecentKV.write_fixed` (the static step; no dense view)."""
        if self._pending is not None:
            self._pending.append((layer, k, v, slots, dense_at, positions))
            if written:
                return
            if self.dense.plain:  # what the store will hold, now: this forward's attention reads it
                self.dense.write(layer, *dense_at, k.to(self.store.dtype), v.to(self.store.dtype))
            if self.recent is not None:
                self.recent.write(layer, *dense_at, k, v)
            return
        assert not written, "written=True outside batched_writes"
        self._write_now(layer, slots, k, v, dense_at, positions, fixed=fixed)

    def _write_now(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dense_at: Optional[tuple[torch.Tensor, torch.Tensor]],
        positions: Optional[torch.Tensor],
        recent: bool = True,
        fixed: bool = False,
    ) -> None:
        if self.dense is None:
            write_kv(self.store, layer, slots, k, v, self.kern, positions)
        elif self.dense.plain:
            self.store.write(layer, slots, k, v, positions)
            self.dense.write(layer, *dense_at, k.to(self.store.dtype), v.to(self.store.dtype))
        else:  # the store decodes what it just wrote (what a read of those slots would return)
            self.dense.write(layer, *dense_at, *self.store.write_read(layer, slots, k, v, positions))
        if recent and self.recent is not None:
            (self.recent.write_fixed if fixed else self.recent.write)(layer, *dense_at, k, v)

    def move(self, src: torch.Tensor, dst: torch.Tensor, dense_at: Optional[tuple] = None) -> None:
        """Copy stored entries src -> dst (flat slots) in every layer; dense_at = (rows, src index, dst index)."""
        move_kv(self.store, src, dst, self.kern)
        if self.dense is not None:
            self.dense.move(*dense_at)
        if self.recent is not None:
            self.recent.move(*dense_at)

    def nbytes(self) -> int:
        """Bytes of record: the store's allocation and any exact copies (the DenseKV view is a host-side copy)."""
        return self.store.nbytes() + (self.recent.nbytes() if self.recent is not None else 0)


@dataclass
class AttnBatch:
    """What one forward's attention needs, shared by all layers (TensorRT-LLM's attention inputs, roughly).

    For sequence b, the keys are its logical cache entries [0, context_lens[b] + tree_lens[b]): the
    committed context (visible to every query) followed by a tree region of tree_lens[b] entries,
    which includes this forward's new tokens (already written). Query i sees tree entry j iff bit j of
    tree_mask[b, i] is set; tree_mask None means causal with the new tokens being the whole tree region.
    Rows i >= q_lens[b] are padding.
    """

    block_tables: torch.Tensor  # [B, P] int32 page ids
    context_lens: torch.Tensor  # [B] int64
    tree_lens: torch.Tensor  # [B] int64
    q_lens: torch.Tensor  # [B] int64
    tree_mask: Optional[torch.Tensor]  # [B, T, W] int32 packed, or None
    page_size: int
    _plan: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # a plan's exact entries where the kernels attend: (RecentKV, each sequence's row there [B], its query rows'
    # positions [B, T], its tree entries' positions [B, max tree]) (kernels.paged.paged_attention's `exact`)
    exact: Optional[tuple] = None

    def plan(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [B, N] int64, visible [B, T, N] bool), computed once per forward (few ops: tiny models are
        overhead-bound)."""
        if self._plan is None:
            B, ps = self.context_lens.shape[0], self.page_size
            N = int((self.context_lens + self.tree_lens).max())
            n = torch.arange(N, device=self.context_lens.device)
            slots = self.block_tables.gather(1, (n // ps).expand(B, N)).long() * ps + n % ps
            self._plan = (slots, self.visible(T, N))
        return self._plan

    def gather(self, store: KVStore, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every sequence's keys and values up to the longest (k, v [B, KV, N, D], read through the store, in q's
        dtype) and visible [B, T, N], for queries q [B, T, H, D]."""
        B, T, _, D = q.shape
        slots, visible = self.plan(T)
        N = slots.shape[1]
        k, v = store.read(layer, slots.reshape(-1))
        KV = k.shape[1]
        return (
            k.to(q.dtype).view(B, N, KV, D).transpose(1, 2),
            v.to(q.dtype).view(B, N, KV, D).transpose(1, 2),
            visible,
        )

    def visible(self, T: int, N: int) -> torch.Tensor:
        """[B, T, N] bool: query i of sequence b sees logical entry n."""
        B = self.context_lens.shape[0]
        n = torch.arange(N, device=self.context_lens.device)
        j = n - self.context_lens[:, None]  # [B, N] index into the tree region (< 0: context)
        if self.tree_mask is None:  # causal: the tree region is the new tokens themselves
            visible = j[:, None, :] <= torch.arange(T, device=n.device)[:, None]
        else:
            bits = unpack_tree_mask(self.tree_mask, self.tree_mask.shape[-1] * 32)  # [B, T, 32W]
            tree = bits.gather(2, j.clamp(0, bits.shape[-1] - 1)[:, None, :].expand(B, T, N))
            visible = (j < 0)[:, None, :] | (tree & (j < self.tree_lens[:, None])[:, None, :])
        # Key 0 (context, or the tree's root when there is no context) is visible to every real query;
        # making it visible to padding rows too keeps their softmax non-empty (no NaN).
        visible[:, :, 0] = True
        return visible


_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def kernels_for(store: KVStore, device: torch.device):
    """The Triton kernels module when they should run, else None (the PyTorch reference runs).

    BPCOMPILE_KERNELS=auto (default): kernels on CUDA for quantized caches; =triton: always (on CPU through
    Triton's interpreter, which is how tests check this path without a GPU); =torch: never.
    On CUDA (auto) the kernels are the attention: a quantized cache they cannot read is a UserError, not a
    quiet fallback (`bpcompile validate` refuses such a plan for runtime.device cuda; BPCOMPILE_KERNELS=torch
    asks for the PyTorch path by name, e.g. as a reference).
    """
    mode = os.environ.get("BPCOMPILE_KERNELS", "auto")
    if mode == "torch":
        return None
    from bpcompile.runtime.kvcache import QuantKVStore, plan_support

    if not isinstance(store, QuantKVStore) or not (mode == "triton" or device.type == "cuda"):
        return None
    from bpcompile.kernels.shapes import check_shape

    why = plan_support(store.plan, "triton") + [w for w in (check_shape(store.head_size, store.G),) if w]
    if why and mode != "triton" and device.type == "cuda":
        raise UserError(
            f"on CUDA the Triton kernels are the attention, and they cannot read this KV plan ({'; '.join(why)}); "
            "rebuild with runtime.device cuda (bpcompile validate names what to change), run with --device "
            "cpu, or set BPCOMPILE_KERNELS=torch for the PyTorch attention path",
            key="kv_cache",
        )
    if why:
        _warn_once(f"{'; '.join(why)}; using the PyTorch path")
        return None
    from bpcompile.kernels import paged as kernels

    return kernels


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    print(f"bpcompile: warning: {msg}", file=sys.stderr)


def write_kv(
    store: KVStore,
    layer: int,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kern=False,
    positions: Optional[torch.Tensor] = None,
) -> None:
    """Quantize-and-append k, v [N, KV, D] at flat slots [N]: the store's oracle, or the kernel (kern: the
    kernels module or None as resolved by kernels_for; False: resolve here). positions [N]: the tokens' RoPE
    positions, which a plan with KLT key units needs."""
    kern = kernels_for(store, k.device) if kern is False else kern
    if kern:
        kern.quantize_append(store, layer, slots, k, v, positions)
    else:
        store.write(layer, slots, k, v, positions)


def move_kv(store: KVStore, src: torch.Tensor, dst: torch.Tensor, kern=False) -> None:
    """Copy accepted tree entries' stored bytes src -> dst in every layer, on the device."""
    kern = kernels_for(store, src.device) if kern is False else kern
    (kern.move_slots if kern else type(store).move)(store, src, dst)


def paged_attention(q: torch.Tensor, store: KVStore, layer: int, batch: AttnBatch, kern=False) -> torch.Tensor:
    """q [B, T, H, D] (RoPE applied) over each sequence's paged K/V -> [B, T, H, D].

    The reference implementation: gather the visible pages (dequantized by the store) and run SDPA with
    a boolean mask built from context lengths and the packed tree mask. On CUDA with a quantized cache the
    Triton kernel (bpcompile/kernels/paged.py) runs instead, reading the packed pages directly.
    """
    H, D = q.shape[2:]
    kern = kernels_for(store, q.device) if kern is False else kern  # False: resolve here
    if kern is not None:
        return kern.paged_attention(
            q,
            store,
            layer,
            batch.block_tables,
            batch.context_lens,
            batch.tree_mask,
            batch.tree_lens,
            D**-0.5,
            q_lens=batch.q_lens,
            exact=batch.exact,
        )
    k, v, visible = batch.gather(store, layer, q)
    if batch.exact is not None:
        return _exact_reference(q, k, v, visible, layer, batch)
    kv = k.shape[1]
    if H != kv and not _HAS_GQA:
        k, v = k.repeat_interleave(H // kv, 1), v.repeat_interleave(H // kv, 1)
    extra = {"enable_gqa": True} if H != kv and _HAS_GQA else {}
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None], **extra)
    return out.transpose(1, 2)


def _exact_reference(q, k, v, visible, layer: int, batch: AttnBatch) -> torch.Tensor:
    """The reference attention over a plan's exact entries (batch.exact), as the kernel reads them: a visible
    (query, key) pair whose key is a sink position or within the window of the query's position reads the key's
    and value's FP16 copies, every other pair the stored entry. Fixed shapes and no host sync (the static step
    runs it over its full-width block tables)."""
    rec, rows, q_pos, tree_pos = batch.exact
    N = visible.shape[2]
    n = torch.arange(N, device=q.device)
    j = n - batch.context_lens[:, None]  # [B, N] index into the tree region (< 0: context)
    at = j.clamp(0, tree_pos.shape[1] - 1)
    kpos = torch.where(j >= 0, tree_pos.gather(1, at).to(n.dtype), n)  # past the tree region: never visible
    ex = exact_reads(q_pos, kpos, rec.sink, rec.window) & visible  # [B, T, N]
    col = rec.column(n)[None, :]
    ek = rec.k[layer, rows[:, None], :, col].transpose(1, 2).to(q.dtype)  # [B, KV, N, D]
    ev = rec.v[layer, rows[:, None], :, col].transpose(1, 2).to(q.dtype)
    rep = q.shape[2] // k.shape[1]
    exr = ex.repeat_interleave(rep, dim=1)[:, None]
    hidden = ~visible.repeat_interleave(rep, dim=1)[:, None]
    # the stored entries where a pair does not read exact, the copies where it does: one softmax over N keys
    return dense_attention(q, k, v, hidden | exr, exact=(ek, ev, hidden | ~exr))


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    hidden: Optional[torch.Tensor],
    scale: Optional[float] = None,
    exact: Optional[tuple] = None,
) -> torch.Tensor:
    """q [B, T, H, D] over k, v [B, KV, N, D] (GQA: query head h reads KV head h // (H/KV)) -> [B, T, H, D].

    hidden: [B, 1, T * H/KV, N] bool, True where a query must not see a key (rows t * H/KV + r), or None when
    every query sees every key; scale: of the scores (default D^-0.5). exact: (ek, ev [B, KV, M, D], hidden_e
    [B, 1, T * H/KV, M] or None), more keys in the same softmax (a plan's exact copies, which replace the stored
    entries they copy: `hidden` hides those). Plain matmul-softmax: at decode lengths (a few query rows, N in
    the hundreds) SDPA's setup costs more than the arithmetic."""
    B, T, H, D = q.shape
    KV = k.shape[1]
    rep = H // KV
    scale = D**-0.5 if scale is None else scale
    qh = (q * scale).view(B, T, KV, rep, D).transpose(1, 2).reshape(B, KV, T * rep, D)
    s = qh @ k.transpose(-1, -2)
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    if exact is not None:
        ek, ev, hidden_e = exact
        se = qh @ ek.transpose(-1, -2)
        if hidden_e is not None:
            se = se.masked_fill(hidden_e, float("-inf"))
        N = s.shape[-1]
        p = torch.softmax(torch.cat([s, se], -1), dim=-1, dtype=torch.float32).to(v.dtype)
        o = p[..., :N] @ v + p[..., N:] @ ev
    else:
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype)
        o = p @ v
    return o.view(B, KV, T, rep, D).transpose(1, 2).reshape(B, T, H, D)


def allocated_compression(
    plan: KVPlan, model_cfg, seq_len: int = 2048, lookahead: int = 6, page_size: int = 16, sequences: int = 1
) -> float:
    """FP16 cache bytes / this plan's, both as the runtime allocates them for `sequences` sequences of seq_len
    tokens with lookahead tree entries (its pages and the null page; nbytes(): payload, scales, tables and exact
    copies). The runtime allocates one pool for an engine's max_batch_size sequences; per-engine tables (the KLT
    bases) are counted once per pool, so the figure at one sequence is the most conservative."""
    # A store's bytes are affine in its pages (pools and positions per page, tables per engine), and the exact
    # copies are one row per sequence: one- and two-page stores give the pool's bytes without allocating it (an
    # engine's pool can be tens of GB).
    c = model_cfg
    pages = cache_pages(sequences, seq_len, lookahead, page_size)
    f1, f2 = (
        FloatKVStore(c.num_layers, c.num_kv_heads, c.head_size, n, page_size, dtype=torch.float16).nbytes()
        for n in (1, 2)
    )
    s1, s2 = (make_kv_store(plan, c, n, page_size) for n in (1, 2))
    ours = s1.nbytes() + (s2.nbytes() - s1.nbytes()) * (pages - 1)
    if plan.has_exact:
        ours += sequences * RecentKV(s1, 1, plan.sink_tokens, plan.recent_window, lookahead, "cpu").nbytes()
    return (f1 + (f2 - f1) * (pages - 1)) / ours
