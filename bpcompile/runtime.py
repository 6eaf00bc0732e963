"""The native runtime: paged KV cache, in-flight batching, tree speculative decoding.

Who owns what
- `PagedKV` decides *which* slots a sequence uses: fixed-size pages, one block table per sequence, a
  free list. Page 0 is never handed out: padding tokens of a batch write their K/V there.
- A `KVStore` (bpcompile/kvcache.py, float or quantized) decides *how* K/V sit in those slots.
- `paged_attention` is the one attention function (plain PyTorch here; custom kernels replace it).
- `Generator` runs requests: prefill, then per step draft tree -> one verifier forward over the tree
  -> acceptance (bpcompile/speculative.py) -> compaction of the accepted path in both caches.

Sequence state, per request (T = all committed tokens: prompt + generated):
- verifier cache holds T[:-1] (`v_len = len(T) - 1`); the last token T[-1] is node 0 of the next tree
  and is written to the cache by that step's verifier forward (TensorRT-LLM's convention: the tree's
  G tokens are the true token plus G-1 drafts, position = v_len + depth).
- draft cache holds T[:d_len]; at the start of a step the draft first runs T[d_len:] (one token,
  or two when the last accepted draft token was a leaf it never ran) and grows the tree from there.
Tree tokens are written to the logical slots right after the context (verifier: v_len + node;
draft: d_len + node - 1), so after acceptance the accepted path is moved to consecutive slots with
`KVStore.move` (bytes copied, nothing recomputed) and the pages past the new length are freed.
"""
from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .errors import UserError
from .kvcache import FloatKVStore, KVStore
from .model import Llama, ModelConfig, causal_attend
from .speculative import (AcceptanceCalibration, AcceptRule, BackOff, DraftTree, Sampling, TreeSpec, make_builder,
                          pack_rows, parse_tree_spec, residual_rule, sample, unpack_tree_mask, verify_greedy,
                          verify_sampling)

__all__ = ["SamplingParams", "TreeSpec", "RequestStats", "StepOutput", "Generator", "PagedKV", "AttnBatch",
           "paged_attention", "generate_cli", "IncrementalDetokenizer"]

KVStoreFactory = Callable[[ModelConfig, int, int, str], KVStore]  # (model cfg, num_pages, page_size, device)


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: Optional[int] = None
    end_id: Optional[int] = None  # not included in the output
    stop_words: list[list[int]] = field(default_factory=list)  # token sequences; included in the output


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


@dataclass
class StepOutput:
    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: Optional[str]  # "length" | "stop" | "cancelled"
    stats: RequestStats


# ------------------------------------------------------------------------------------------ paging

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
            self.k[:, :, :, :k.shape[3]] = k
            self.v[:, :, :, :v.shape[3]] = v

    def write(self, layer: int, rows: torch.Tensor, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, KV, D] at (row, logical index) pairs rows[N], idx[N]."""
        self.k[layer, rows, :, idx] = k.to(self.k.dtype)
        self.v[layer, rows, :, idx] = v.to(self.v.dtype)

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.k[:, rows, :, dst] = self.k[:, rows, :, src].clone()
        self.v[:, rows, :, dst] = self.v[:, rows, :, src].clone()

    def read(self, layer: int, rows: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries [0, n) of each row -> k, v [B, KV, n, D] (a view for one row)."""
        if len(rows) == 1:
            return self.k[layer, rows[0]:rows[0] + 1, :, :n], self.v[layer, rows[0]:rows[0] + 1, :, :n]
        r = torch.tensor(rows, device=self.k.device)
        return self.k[layer, :, :, :n].index_select(0, r), self.v[layer, :, :, :n].index_select(0, r)


class PagedKV:
    """Pages of one KVStore handed out to sequences. Page 0 is the null page (padding writes).

    `kern`: the Triton kernels module when they run for this store (resolved once), else None. `dense`: a
    DenseKV the PyTorch path attends over (None: the reference `paged_attention` over `store.read`)."""

    def __init__(self, store: KVStore, device="cpu", dense: Optional[DenseKV] = None):
        self.store, self.ps = store, store.page_size
        self.free = list(range(store.num_pages - 1, 0, -1))  # pop() hands out low page ids first
        self.tables: dict[str, list[int]] = {}
        self.kern = kernels_for(store, torch.device(device))
        self.dense = dense if self.kern is None else None
        self.rows: dict[str, int] = {}  # dense row per sequence

    @property
    def capacity(self) -> int:
        return self.store.num_pages - 1

    def ensure(self, rid: str, n_tokens: int) -> None:
        table = self.tables.setdefault(rid, [])
        need = -(-n_tokens // self.ps)
        if need - len(table) > len(self.free):
            raise RuntimeError(f"KV cache out of pages ({len(self.free)} free, {need - len(table)} needed)")
        while len(table) < need:
            table.append(self.free.pop())
        if self.dense is not None:
            if rid not in self.rows:
                self.rows[rid] = self.dense.free.pop()
            self.dense.reserve(n_tokens)

    def truncate(self, rid: str, n_tokens: int) -> None:
        table = self.tables.get(rid, [])
        keep = -(-n_tokens // self.ps)
        self.free.extend(reversed(table[keep:]))
        del table[keep:]

    def release(self, rid: str) -> None:
        self.truncate(rid, 0)
        self.tables.pop(rid, None)
        row = self.rows.pop(rid, None)
        if row is not None:
            self.dense.free.append(row)

    def slot(self, rid: str, i: int) -> int:
        return self.tables[rid][i // self.ps] * self.ps + i % self.ps

    def block_tables(self, rids: list[str], device) -> torch.Tensor:
        width = max(1, max(len(self.tables[r]) for r in rids))
        return torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in rids],
                            dtype=torch.int32, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              dense_at: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """Quantize-and-append k, v [N, KV, D] at flat slots [N] (the kernel or the store's oracle); with a dense
        view, also put what the store now returns for those slots at dense_at = (rows [N], logical index [N])."""
        if self.dense is None:
            write_kv(self.store, layer, slots, k, v, self.kern)
        elif self.dense.plain:
            self.store.write(layer, slots, k, v)
            self.dense.write(layer, *dense_at, k.to(self.store.dtype), v.to(self.store.dtype))
        else:  # the store decodes what it just wrote (what a read of those slots would return)
            self.dense.write(layer, *dense_at, *self.store.write_read(layer, slots, k, v))

    def move(self, src: torch.Tensor, dst: torch.Tensor, dense_at: Optional[tuple] = None) -> None:
        """Copy stored entries src -> dst (flat slots) in every layer; dense_at = (rows, src index, dst index)."""
        move_kv(self.store, src, dst, self.kern)
        if self.dense is not None:
            self.dense.move(*dense_at)


# ---------------------------------------------------------------------------------------- attention

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
    """
    mode = os.environ.get("BPCOMPILE_KERNELS", "auto")
    if mode == "torch":
        return None
    from .kvcache import QuantKVStore

    if isinstance(store, QuantKVStore) and (mode == "triton" or device.type == "cuda"):
        from . import kernels
        if _kernels_take(store.head_size, store.G):
            return kernels
    return None


@functools.lru_cache(maxsize=None)
def _kernels_take(head_size: int, group_size: int) -> bool:
    """Whether the kernels handle this cache shape; warns once per shape when they don't (the PyTorch path runs)."""
    from .kernels import check_shape

    why = check_shape(head_size, group_size)
    if why is not None:
        print(f"bpcompile: warning: Triton kernels cannot take this KV cache ({why}); using the PyTorch path",
              file=sys.stderr)
    return why is None


def write_kv(store: KVStore, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kern=False) -> None:
    """Quantize-and-append k, v [N, KV, D] at flat slots [N]: the store's oracle, or the kernel (kern: the
    kernels module or None as resolved by kernels_for; False: resolve here)."""
    kern = kernels_for(store, k.device) if kern is False else kern
    (kern.quantize_append if kern else type(store).write)(store, layer, slots, k, v)


def move_kv(store: KVStore, src: torch.Tensor, dst: torch.Tensor, kern=False) -> None:
    """Copy accepted tree entries' stored bytes src -> dst in every layer, on the device."""
    kern = kernels_for(store, src.device) if kern is False else kern
    (kern.move_slots if kern else type(store).move)(store, src, dst)


def paged_attention(q: torch.Tensor, store: KVStore, layer: int, batch: AttnBatch, kern=False) -> torch.Tensor:
    """q [B, T, H, D] (RoPE applied) over each sequence's paged K/V -> [B, T, H, D].

    The reference implementation: gather the visible pages (dequantized by the store) and run SDPA with
    a boolean mask built from context lengths and the packed tree mask. On CUDA with a quantized cache the
    Triton kernel (bpcompile/kernels.py) runs instead, reading the packed pages directly.
    """
    B, T, H, D = q.shape
    kern = kernels_for(store, q.device) if kern is False else kern  # False: resolve here
    if kern is not None:
        return kern.paged_attention(q, store, layer, batch.block_tables, batch.context_lens, batch.tree_mask,
                                    batch.tree_lens, D ** -0.5, q_lens=batch.q_lens)
    slots, visible = batch.plan(T)
    N = slots.shape[1]
    k, v = store.read(layer, slots.reshape(-1))
    kv = k.shape[1]
    k = k.to(q.dtype).view(B, N, kv, D).transpose(1, 2)
    v = v.to(q.dtype).view(B, N, kv, D).transpose(1, 2)
    if H != kv and not _HAS_GQA:
        k, v = k.repeat_interleave(H // kv, 1), v.repeat_interleave(H // kv, 1)
    extra = {"enable_gqa": True} if H != kv and _HAS_GQA else {}
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None], **extra)
    return out.transpose(1, 2)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: Optional[torch.Tensor]) -> torch.Tensor:
    """q [B, T, H, D] over k, v [B, KV, N, D] (GQA: query head h reads KV head h // (H/KV)) -> [B, T, H, D].

    hidden: [B, 1, T * H/KV, N] bool, True where a query must not see a key (rows t * H/KV + r), or None when
    every query sees every key. Plain matmul-softmax: at decode lengths (a few query rows, N in the hundreds)
    SDPA's setup costs more than the arithmetic."""
    B, T, H, D = q.shape
    KV = k.shape[1]
    rep = H // KV
    qh = (q * D ** -0.5).view(B, T, KV, rep, D).transpose(1, 2).reshape(B, KV, T * rep, D)
    s = qh @ k.transpose(-1, -2)
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype)
    return (p @ v).view(B, KV, T, rep, D).transpose(1, 2).reshape(B, T, H, D)


# ----------------------------------------------------------------------------------------- requests

@dataclass
class _Req:
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


def _default_factory(dtype: torch.dtype) -> KVStoreFactory:
    def make(cfg: ModelConfig, num_pages: int, page_size: int, device) -> KVStore:
        return FloatKVStore(cfg.num_layers, cfg.num_kv_heads, cfg.head_size, num_pages, page_size,
                            dtype=dtype, device=device)
    return make


class Generator:
    """Single-threaded in-flight batching engine over a verifier and an optional draft."""

    def __init__(self, verifier: Llama, draft: Optional[Llama], tree: Optional[TreeSpec], *, max_batch_size: int = 8,
                 max_seq_len: int = 512, page_size: int = 16, num_pages: Optional[int] = None,
                 kv_store_factory: Optional[KVStoreFactory] = None, device: str = "cpu",
                 draft_kv_store_factory: Optional[KVStoreFactory] = None, max_input_len: Optional[int] = None,
                 dense_kv: bool = True, backoff: bool = True):
        """kv_store_factory makes the verifier's KVStore; the draft's comes from draft_kv_store_factory (a KV
        plan describes one model's layers and heads); either defaults to a FloatKVStore in the model's dtype.
        max_input_len: longest prompt accepted (default max_seq_len - 1). dense_kv: where the kernels do not run,
        attend over a per-sequence DenseKV copy of the cache (False: gather from the store every time).
        backoff: draft less or not at all while speculation does not pay (speculative.BackOff)."""
        self.device = torch.device(device)
        self.tree = tree or TreeSpec("none")
        if self.tree.kind != "none" and draft is None:
            raise UserError(f"tree speculation ({self.tree.kind}) needs a draft model")
        if draft is not None and draft.cfg.vocab_size != verifier.cfg.vocab_size:
            raise UserError(f"draft vocabulary {draft.cfg.vocab_size} != verifier vocabulary {verifier.cfg.vocab_size}")
        if max_batch_size < 1 or max_seq_len < 2 or page_size < 1:
            raise UserError("max_batch_size >= 1, max_seq_len >= 2 and page_size >= 1 are required")
        self.verifier = verifier.to(self.device)
        self.draft = draft.to(self.device) if (draft is not None and self.tree.kind != "none") else None
        self.max_batch_size, self.max_seq_len, self.page_size = max_batch_size, max_seq_len, page_size
        self.max_input_len = max_input_len or max_seq_len - 1
        self.g_max = self.tree.draft_tokens + 1
        per_seq = -(-(max_seq_len + self.g_max) // page_size)
        self.num_pages = num_pages or max_batch_size * per_seq + 1

        def paged(model: Llama, factory: Optional[KVStoreFactory]) -> PagedKV:
            store = (factory or _default_factory(model.dtype))(model.cfg, self.num_pages, page_size, str(self.device))
            dense = DenseKV(store, max_batch_size, max_seq_len + self.g_max + 1, model.dtype, self.device) \
                if dense_kv and kernels_for(store, self.device) is None else None
            return PagedKV(store, self.device, dense)

        self.vkv = paged(self.verifier, kv_store_factory)
        self.dkv = paged(self.draft, draft_kv_store_factory) if self.draft is not None else None
        self.waiting: deque[_Req] = deque()
        self.waiting_ids: set[str] = set()
        self.running: dict[str, _Req] = {}
        self.outbox: list[StepOutput] = []
        self.reserved = 0
        self.forwards = {"draft": 0, "verifier": 0}  # batched forward passes after prefill (benchmarks read these)
        # greedy dynamic trees: acceptance rates seen so far (None: score by the raw draft probability)
        self.calib: Optional[AcceptanceCalibration] = AcceptanceCalibration()
        self.accept_rule: AcceptRule = residual_rule  # injectable (tests prove a wrong rule is caught)
        self.backoff: Optional[BackOff] = BackOff(self.tree) if backoff and self.draft is not None else None

    # ------------------------------------------------------------------------------------------ API

    @classmethod
    def from_engine(cls, engine_dir, *, tree: Optional[TreeSpec] = None, device: str = "cpu",
                    kv_store_factory: Optional[KVStoreFactory] = None,
                    draft_kv_store_factory: Optional[KVStoreFactory] = None) -> "Generator":
        """Load engine_dir/verifier, engine_dir/draft (converted checkpoints), engine_dir/recipe.yaml
        (speculative.{tree,nodes,length,choices}, limits.{max_batch_size,max_seq_len}, kv_cache.page_size) and,
        unless a factory is given, the verifier's KV plan in engine_dir/kv_plan (float cache without one)."""
        d = Path(engine_dir)
        if not (d / "verifier" / "config.json").is_file():
            raise UserError(f"{d}: no converted verifier checkpoint (expected {d / 'verifier' / 'config.json'})")
        recipe = _read_yaml(d / "recipe.yaml")
        spec, limits, kv = (recipe.get(k) or {} for k in ("speculative", "limits", "kv_cache"))
        has_draft = (d / "draft" / "config.json").is_file()
        if tree is None:
            kind = spec.get("tree", "dynamic") if has_draft else "none"
            tree = TreeSpec(kind, length=int(spec.get("length", 5)), choices=spec.get("choices"),
                            nodes=int(spec.get("nodes", 5)))
        if tree.kind != "none" and not has_draft:
            raise UserError(f"{d}: tree {tree.kind!r} needs a draft checkpoint at {d / 'draft'}")
        if kv_store_factory is None and (d / "kv_plan" / "plan.json").is_file():
            # the engine's calibrated KV plan (INT4/FP8 units) describes the verifier's cache
            from .kvcache import KVPlan, kv_store_factory as plan_factory

            kv_store_factory = plan_factory(KVPlan.load(d / "kv_plan"))
        elif kv_store_factory is None and kv.get("format") == "fp16":
            kv_store_factory = _default_factory(torch.float16)  # an FP16 cache whatever the model's dtype
        verifier = Llama.from_checkpoint(d / "verifier")
        draft = Llama.from_checkpoint(d / "draft") if tree.kind != "none" else None
        return cls(verifier, draft, tree, max_batch_size=int(limits.get("max_batch_size", 8)),
                   max_seq_len=int(limits.get("max_seq_len", 512)), page_size=int(kv.get("page_size", 16)),
                   kv_store_factory=kv_store_factory, device=device, draft_kv_store_factory=draft_kv_store_factory,
                   max_input_len=int(limits["max_input_len"]) if limits.get("max_input_len") else None,
                   backoff=bool(spec.get("backoff", True)))

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: Optional[str] = None) -> str:
        p, V = params, self.verifier.cfg.vocab_size
        if len(prompt_ids) > self.max_input_len:
            raise UserError(f"prompt has {len(prompt_ids)} tokens, more than limits.max_input_len "
                            f"({self.max_input_len})", key="max_input_len")
        if not prompt_ids or not all(isinstance(t, int) and 0 <= t < V for t in prompt_ids):
            raise UserError(f"prompt must be a non-empty list of token ids in [0, {V})")
        if p.max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1 (got {p.max_tokens})", key="max_tokens")
        if len(prompt_ids) + p.max_tokens > self.max_seq_len:
            raise UserError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({p.max_tokens}) exceeds max_seq_len "
                            f"({self.max_seq_len})", key="max_tokens")
        # `not (x >= 0)` rather than `x < 0`: NaN fails every comparison and would slip through.
        if not (0 <= p.temperature < math.inf) or p.top_k < 0 or not (0 < p.top_p <= 1):
            raise UserError("a finite temperature >= 0, top_k >= 0 and 0 < top_p <= 1 are required")
        rid = request_id or uuid.uuid4().hex
        if rid in self.running or rid in self.waiting_ids:
            raise UserError(f"request id {rid!r} is already in use")
        pages = -(-(len(prompt_ids) + p.max_tokens + self.g_max) // self.page_size)
        if pages > self.vkv.capacity:
            raise UserError(f"request needs {pages} KV pages, the cache has {self.vkv.capacity}")
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, ()).item())
        rng = torch.Generator().manual_seed(seed)
        s = Sampling(p.temperature, p.top_k, p.top_p, rng)
        self.waiting.append(_Req(rid, list(prompt_ids), p, s, tokens=list(prompt_ids), pages=pages))
        self.waiting_ids.add(rid)
        return rid

    def cancel(self, request_id: str) -> None:
        for r in list(self.waiting) if request_id in self.waiting_ids else ():
            if r.id == request_id:
                self.waiting.remove(r)
                self.waiting_ids.discard(r.id)
                self.outbox.append(StepOutput(r.id, [], True, "cancelled", r.stats))
        r = self.running.get(request_id)
        if r is not None:
            self._release(r)
            self.outbox.append(StepOutput(r.id, [], True, "cancelled", r.stats))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.outbox)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outs, self.outbox = self.outbox, []
        old = list(self.running.values())
        new = []
        while self.waiting and len(self.running) < self.max_batch_size \
                and self.reserved + self.waiting[0].pages <= self.vkv.capacity:
            r = self.waiting.popleft()
            self.waiting_ids.discard(r.id)
            self.reserved += r.pages
            self.running[r.id] = r
            new.append(r)
        if new:
            outs += self._prefill(new)
        if old:
            outs += self._decode(old)
        return outs

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 on_token: Optional[Callable[[int, list[int]], None]] = None) -> list[tuple[list[int], RequestStats]]:
        """Run prompts to completion; on_token(prompt_index, new_tokens) streams."""
        index = {self.add_request(p, params): i for i, p in enumerate(prompts)}
        res: list = [None] * len(prompts)
        toks: list[list[int]] = [[] for _ in prompts]
        while self.has_work():
            for o in self.step():
                i = index.get(o.request_id)
                if i is None:
                    continue
                toks[i] += o.new_tokens
                if on_token and o.new_tokens:
                    on_token(i, o.new_tokens)
                if o.finished:
                    res[i] = (toks[i], o.stats)
        return res

    # ------------------------------------------------------------------------------------ internals

    def _release(self, r: _Req) -> None:
        self.vkv.release(r.id)
        if self.dkv is not None:
            self.dkv.release(r.id)
        if self.running.pop(r.id, None) is not None:
            self.reserved -= r.pages

    def _forward(self, model: Llama, kv: PagedKV, reqs: list[_Req], tokens: list[list[int]],
                 positions: list[list[int]], writes: list[list[int]], ctx: list[int], tree_lens: list[int],
                 mask_rows: Optional[list[list[int]]] = None) -> torch.Tensor:
        """One batched forward of new tokens over paged caches -> logits [B, T, V].

        writes: logical cache index per new token; ctx/tree_lens/mask_rows: see AttnBatch (mask rows as
        Python-int bit rows over the tree region)."""
        dev = self.device
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
            at = (torch.tensor([[row] * len(w) + [kv.dense.null] * (T - len(w)) for row, w in zip(rows, writes)],
                               device=dev).view(-1), torch.tensor(pad(writes), device=dev).view(-1))
            N = max(c + t for c, t in zip(ctx, tree_lens))
            hidden = None
            if B > 1 or T > 1 or mask is not None:  # one new token of one sequence sees every entry
                batch = AttnBatch(None, torch.tensor(ctx, device=dev), torch.tensor(tree_lens, device=dev), None,
                                  mask, kv.ps)
                rep = model.cfg.num_heads // model.cfg.num_kv_heads
                hidden = ~batch.visible(T, N).repeat_interleave(rep, dim=1)[:, None]

            def attend(layer, q, k, v):
                kv.write(layer, flat, k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]), at)
                return dense_attention(q, *kv.dense.read(layer, rows, N), hidden)
        else:
            batch = AttnBatch(kv.block_tables([r.id for r in reqs], dev), torch.tensor(ctx, device=dev),
                              torch.tensor(tree_lens, device=dev), torch.tensor([len(t) for t in tokens], device=dev),
                              mask, kv.ps)

            def attend(layer, q, k, v):
                kv.write(layer, flat, k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]))
                return paged_attention(q, kv.store, layer, batch, kv.kern)

        self.forwards["draft" if model is self.draft else "verifier"] += 1
        return model(tok, pos, attend=attend)

    def _prefill_model(self, model: Llama, kv: PagedKV, reqs: list[_Req], last_logits: bool) -> Optional[torch.Tensor]:
        """Prompts through `model` (right-padded, causal over the prompt alone), K/V into the cache."""
        dev = self.device
        lens = [len(r.prompt) for r in reqs]
        B, T = len(reqs), max(lens)
        for r in reqs:
            kv.ensure(r.id, len(r.prompt) + self.g_max)
        tok = torch.tensor([r.prompt + [0] * (T - len(r.prompt)) for r in reqs], device=dev)
        flat = torch.tensor([[kv.slot(r.id, i) for i in range(len(r.prompt))] + [0] * (T - len(r.prompt))
                             for r in reqs], device=dev).reshape(-1)
        at = None
        if kv.dense is not None:
            at = (torch.tensor([[kv.rows[r.id]] * len(r.prompt) + [kv.dense.null] * (T - len(r.prompt))
                                for r in reqs], device=dev).view(-1), torch.arange(T, device=dev).repeat(B))

        def attend(layer, q, k, v):
            # Right padding: real tokens never see the padding under a causal mask. The prompt attends to
            # its unquantized K/V (as TensorRT-LLM's context phase does); the cache keeps the stored form.
            kv.write(layer, flat, k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]), at)
            return causal_attend(q, k, v)

        same = len(set(lens)) == 1
        logits = model(tok, None, attend=attend, last_only=same or not last_logits)
        if not last_logits:
            return None
        return logits[:, -1] if same else logits[torch.arange(B, device=dev), torch.tensor(lens, device=dev) - 1]

    def _pick(self, r: _Req, row: torch.Tensor) -> int:
        if r.sampling.greedy:
            return int(row.argmax())
        return sample(r.sampling.probs(row), r.sampling.rng)[0]

    def _prefill(self, reqs: list[_Req]) -> list[StepOutput]:
        t0 = time.perf_counter()
        last = self._prefill_model(self.verifier, self.vkv, reqs, True)
        first = [self._pick(r, last[b]) for b, r in enumerate(reqs)]
        t1 = time.perf_counter()
        if self.draft is not None:
            self._prefill_model(self.draft, self.dkv, reqs, False)
        t2 = time.perf_counter()
        outs = []
        for r, t in zip(reqs, first):
            r.v_len = r.d_len = len(r.prompt)
            r.tokens.append(t)
            r.stats.verify_s += t1 - t0
            r.stats.draft_s += t2 - t1
            outs.append(self._emit(r, [t]))
        t3 = time.perf_counter()
        for r in reqs:
            r.stats.bookkeeping_s += t3 - t2
        return outs

    def _draft(self, reqs: list[_Req], trees: list[DraftTree], builders: list) -> None:
        """Grow each request's tree with batched draft forwards (one per round)."""
        # Catch up: the tokens the draft has not run (the last committed token, maybe the last accepted draft).
        pend = [r.tokens[r.d_len:] for r in reqs]
        for r, p in zip(reqs, pend):
            self.dkv.ensure(r.id, r.d_len + len(p) + self.g_max)
        logits = self._forward(self.draft, self.dkv, reqs, pend,
                               [list(range(r.d_len, r.d_len + len(p))) for r, p in zip(reqs, pend)],
                               [list(range(r.d_len, r.d_len + len(p))) for r, p in zip(reqs, pend)],
                               [r.d_len for r in reqs], [len(p) for p in pend])
        todo = {}
        for b, (r, p) in enumerate(zip(reqs, pend)):
            r.d_len += len(p)
            todo[b] = builders[b].expand({0: logits[b, len(p) - 1]})
        # Rounds: draft tree node n (n >= 1) lives at draft logical slot d_len + n - 1; its mask row is the
        # verifier row shifted by one (node 0 is committed context for the draft).
        while any(todo.values()):
            bs = [b for b, nodes in todo.items() if nodes]
            sub = [reqs[b] for b in bs]
            nodes = [todo[b] for b in bs]
            logits = self._forward(
                self.draft, self.dkv, sub, [[trees[b].tokens[n] for n in ns] for b, ns in zip(bs, nodes)],
                [[r.d_len - 1 + trees[b].depths[n] for n in ns] for b, r, ns in zip(bs, sub, nodes)],
                [[r.d_len + n - 1 for n in ns] for r, ns in zip(sub, nodes)],
                [r.d_len for r in sub], [len(trees[b]) - 1 for b in bs],
                [[trees[b].bits[n] >> 1 for n in ns] for b, ns in zip(bs, nodes)])
            todo = {}
            for k, (b, ns) in enumerate(zip(bs, nodes)):
                trees[b].forwarded.update(ns)
                todo[b] = builders[b].expand({n: logits[k, j] for j, n in enumerate(ns)})

    def _decode(self, reqs: list[_Req]) -> list[StepOutput]:
        t0 = time.perf_counter()
        trees, builders = [], []
        spec = self.backoff.next_spec() if self.backoff is not None else self.tree
        for r in reqs:
            depth = r.params.max_tokens - len(r.out) - 1 if self.draft is not None else 0
            tree, b = make_builder(spec, r.tokens[-1], r.sampling, depth, self.calib)
            trees.append(tree)
            builders.append(b)
        drafting = [k for k, b in enumerate(builders) if b is not None]
        if drafting:
            self._draft([reqs[k] for k in drafting], [trees[k] for k in drafting], [builders[k] for k in drafting])
        t1 = time.perf_counter()

        for r, tree in zip(reqs, trees):
            self.vkv.ensure(r.id, r.v_len + len(tree))
        logits = self._forward(self.verifier, self.vkv, reqs, [t.tokens for t in trees],
                               [[r.v_len + d for d in t.depths] for r, t in zip(reqs, trees)],
                               [list(range(r.v_len, r.v_len + len(t))) for r, t in zip(reqs, trees)],
                               [r.v_len for r in reqs], [len(t) for t in trees],
                               [t.bits for t in trees] if any(len(t) > 1 for t in trees) else None)
        argmax = logits.argmax(-1).tolist() if any(r.sampling.greedy for r in reqs) else None
        results = []
        for b, (r, tree) in enumerate(zip(reqs, trees)):
            if r.sampling.greedy:
                results.append(verify_greedy(tree, argmax[b]))
                if tree.conf and self.calib is not None:
                    self.calib.update(tree, results[-1][0])
            else:
                results.append(verify_sampling(tree, lambda i, b=b, r=r: r.sampling.probs(logits[b, i]),
                                               r.sampling.rng, self.accept_rule))
        t2 = time.perf_counter()

        vmove, dmove, outs = ([], [], [], [], []), ([], [], [], [], []), []  # src/dst slots, row, src/dst index
        for r, tree, (path, bonus), bld in zip(reqs, trees, results, builders):
            for j, n in enumerate(path[1:], 1):
                if n != j:
                    _add_move(vmove, self.vkv, r.id, r.v_len + n, r.v_len + j)
            r.v_len += len(path)
            if bld is not None:
                m = 0  # accepted draft nodes the draft has run: their KV is kept, the rest is run next step
                for j, n in enumerate(path[1:], 1):
                    if n not in tree.forwarded:
                        break
                    if n != j:
                        _add_move(dmove, self.dkv, r.id, r.d_len + n - 1, r.d_len + j - 1)
                    m += 1
                r.d_len += m
            new = [tree.tokens[n] for n in path[1:]] + [bonus]
            r.tokens += new
            st = r.stats
            st.verifier_steps += 1
            st.committed += len(new)
            st.tau = st.committed / st.verifier_steps
            depth = max(tree.depths)
            for lst, upto in ((st.proposed_per_depth, depth), (st.accepted_per_depth, len(path) - 1)):
                lst.extend([0] * (depth - len(lst)))
                for d in range(upto):
                    lst[d] += 1
        for kv, mv in ((self.vkv, vmove), (self.dkv, dmove)):
            if mv[0]:
                src_, dst, *at = (torch.tensor(x, device=self.device) for x in mv)
                kv.move(src_, dst, at)
        for r, tree, (path, bonus) in zip(reqs, trees, results):
            self.vkv.truncate(r.id, r.v_len)
            if self.dkv is not None:
                self.dkv.truncate(r.id, r.d_len)
            outs.append(self._emit(r, [tree.tokens[n] for n in path[1:]] + [bonus]))
        t3 = time.perf_counter()
        for r in reqs:
            r.stats.draft_s += t1 - t0
            r.stats.verify_s += t2 - t1
            r.stats.bookkeeping_s += t3 - t2
        if self.backoff is not None:
            acc = [len(path) - 1 for (path, _), b in zip(results, builders) if b is not None]
            self.backoff.update(bool(acc), sum(acc) / max(1, len(acc)), t3 - t0, t2 - t1)
        return outs

    def _emit(self, r: _Req, toks: list[int]) -> StepOutput:
        """Apply end_id / stop words / max_tokens to newly committed tokens; release finished requests."""
        p, new, reason = r.params, [], None
        for t in toks:
            if p.end_id is not None and t == p.end_id:
                reason = "stop"
                break
            r.out.append(t)
            new.append(t)
            if any(sw and r.out[-len(sw):] == list(sw) for sw in p.stop_words):
                reason = "stop"
                break
            if len(r.out) >= p.max_tokens:
                reason = "length"
                break
        r.stats.tokens = len(r.out)
        if reason is not None:
            self._release(r)
        return StepOutput(r.id, new, reason is not None, reason, r.stats)


def _add_move(mv: tuple, kv: PagedKV, rid: str, src: int, dst: int) -> None:
    mv[0].append(kv.slot(rid, src))
    mv[1].append(kv.slot(rid, dst))
    mv[2].append(kv.rows.get(rid, 0))
    mv[3].append(src)
    mv[4].append(dst)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"not valid YAML: {e}", file=str(path)) from None
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------------------------------------- CLI

class IncrementalDetokenizer:
    """Text deltas for a growing id list: a BPE merge or a multi-byte character may span tokens, so text is
    released only once it no longer ends in a replacement character (vLLM's prefix/read offsets)."""

    def __init__(self, tokenizer, context: Optional[list[int]] = None):
        self.tok, self.ids = tokenizer, list(context or [])
        self.prefix = self.read = len(self.ids)
        if self.ids:  # a few context tokens make the first delta's leading space right
            self.prefix = max(0, len(self.ids) - 5)

    def add(self, new: list[int]) -> str:
        self.ids += new
        before = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (an incomplete character stays as U+FFFD)."""
        text = self.tok.decode(self.ids[self.prefix:])[len(self.tok.decode(self.ids[self.prefix:self.read])):]
        self.prefix = self.read = len(self.ids)
        return text


def chat_turn(tok, user: str) -> Optional[str]:
    """`user` as one user turn through a transformers tokenizer's chat template, ending where the assistant's
    answer starts; None when the tokenizer has no template."""
    if not getattr(tok, "chat_template", None):
        return None
    return tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)


def chat_prompt(tokenizer_dir: Path, user: str) -> Optional[str]:
    """chat_turn with the engine's tokenizer directory (transformers renders the template, helpers included)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        return chat_turn(tok, user)
    except Exception as e:  # a template that does not render is the user's input, not our crash
        raise UserError(f"the chat template does not render: {e} (use --raw)", file=str(tokenizer_dir)) from None


def generate_cli(engine_dir, prompt_text: str, max_tokens: int = 64, tree: Optional[str] = None,
                 no_speculation: bool = False, temperature: float = 0.0, seed: Optional[int] = None,
                 json_out: bool = False, chat: bool = True) -> dict:
    """`bpcompile generate`: stream tokens to stdout as they come, statistics at the end."""
    from tokenizers import Tokenizer

    d = Path(engine_dir)
    tj = d / "tokenizer" / "tokenizer.json"
    if not tj.is_file():
        raise UserError(f"{d}: no tokenizer (expected {tj})")
    tok = Tokenizer.from_file(str(tj))
    end_id = None
    tc = d / "tokenizer" / "tokenizer_config.json"
    if tc.is_file():
        eos = json.loads(tc.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        end_id = tok.token_to_id(eos) if isinstance(eos, str) else None
    spec = TreeSpec("none") if no_speculation else (parse_tree_spec(tree) if tree else None)
    gen = Generator.from_engine(d, tree=spec)
    templated = chat_prompt(d / "tokenizer", prompt_text) if chat else None
    ids = tok.encode(templated if templated is not None else prompt_text).ids
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, end_id=end_id)
    detok = IncrementalDetokenizer(tok, ids)
    t0 = time.perf_counter()
    stream = (lambda i, new: (sys.stdout.write(detok.add(new)), sys.stdout.flush())) if not json_out else None
    (out, stats), = gen.generate([ids], params, on_token=stream)
    wall = time.perf_counter() - t0
    result = {"tree": gen.tree.kind if gen.draft is not None else "none", "prompt_tokens": len(ids),
              "chat_template": templated is not None,
              "tokens": out, "text": tok.decode(out), "tokens_per_s": len(out) / wall if wall > 0 else None,
              "wall_s": wall, "tau": stats.tau, "verifier_steps": stats.verifier_steps,
              "accepted_per_depth": stats.accepted_per_depth, "proposed_per_depth": stats.proposed_per_depth,
              "draft_s": stats.draft_s, "verify_s": stats.verify_s, "bookkeeping_s": stats.bookkeeping_s}
    if json_out:
        print(json.dumps(result, indent=2))
    else:
        sys.stdout.write(detok.flush() + "\n")
        print(f"[{len(out)} tokens in {wall:.2f}s = {result['tokens_per_s']:.1f} tok/s; tree {result['tree']}; "
              f"tau {stats.tau:.2f} tokens/verifier step over {stats.verifier_steps} steps; accepted per depth "
              f"{stats.accepted_per_depth} of {stats.proposed_per_depth}; draft {stats.draft_s:.2f}s, verify "
              f"{stats.verify_s:.2f}s, bookkeeping {stats.bookkeeping_s:.2f}s]", file=sys.stderr)
    return result
