"""Static-shape decode and tree-verify steps, captured as CUDA graphs on CUDA (gpt-fast / vLLM style).

A step after prefill (a decode step, a draft round, a tree verify) is copied into buffers preallocated for its
bucket: the batch rounded up to a power of two (at most the engine's batch size) by the step's query rows per
sequence (1 .. lookahead, each a bucket of its own: they are few). The buffers hold token ids, positions, write
slots, block tables (every sequence's full width), context / tree / query lengths, the packed tree masks and a
feature draft's inputs; one function computes from them alone, so no shape depends on the step's values. On CUDA
each bucket is captured once with `torch.cuda.CUDAGraph` and replayed (launching a step op by op from Python
costs more than a small model's arithmetic); on CPU the very same function runs eagerly, which is how the tests
check it against the executor's own step.

Padding never changes a real row: padded batch rows are sequences of one query at position 0 with an empty
context whose block table is all page 0 (the null page, which only padding writes), padded query rows of a real
sequence write to the null page too and are hidden from every real query by its tree mask (and the attention
reads a key beyond a sequence's context and tree region for no real query), as the executor's own padding does.

A plan's exact entries (FP16 copies of the sink / recent window, `RecentKV`) are written with fixed shapes
(`RecentKV.write_fixed`: every write slot writes, a padding one repeating the step's first real write) and read
by the kernels, or by the reference attention, from per-bucket buffers: each sequence's row of copies, its query
positions and its tree entries' positions. Nothing on the step's path waits for the device.

Tensor parallelism: rank 0 does the host bookkeeping and turns a step into tensors (`inputs`); the tensor channel
(runtime/tp.py) carries them to every other rank, and each rank copies them into its own bucket of the same shape
and runs the same function on its shard, whose row-split linears all-reduce inside it (`run`). On CUDA each rank
captures its buckets in the order the steps arrive, the same on every rank, so their graphs hold the same NCCL
collectives in the same order; the broadcast of the inputs stays outside the graphs.

What runs here: the paged attention (the Triton kernels where `kernels_for` picks them, else the PyTorch
reference over a fixed-width gather), any tensor-parallel size, the torch executor, any KV plan. `static_support`
says why a configuration cannot have it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from bpcompile.kernels.tree_mask import pack_rows
from bpcompile.runtime.paged_kv import AttnBatch, paged_attention

MODES = ("auto", "on", "off")


def static_support(executor: str) -> Optional[str]:
    """Why the static-buffer step cannot run for this configuration, or None."""
    if executor != "torch":
        return f"the {executor} executor runs its exported graphs"
    return None


def wants_static(mode: str, device: torch.device) -> bool:
    """runtime.cuda_graphs: on, off, or auto = on for CUDA (on CPU the executor's own step is faster: it attends
    over each sequence's real length, where a static step reads every sequence's full block table)."""
    return mode == "on" or (mode == "auto" and torch.device(device).type == "cuda")


def buckets(n: int) -> list[int]:
    """Batch-size buckets up to n: powers of two, and n itself."""
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    return out + [n]


@dataclass
class Bucket:
    """One (batch, query rows) shape's static inputs, and on CUDA its graph and the graph's outputs."""

    B: int
    T: int
    tok: torch.Tensor
    pos: torch.Tensor
    flat: torch.Tensor  # [B * T] write slots
    tables: torch.Tensor  # [B, pages] int32
    ctx: torch.Tensor
    tree: torch.Tensor
    qlen: torch.Tensor
    mask: torch.Tensor  # [B, T, ceil(T / 32)] int32 packed
    feats: Optional[torch.Tensor] = None  # a feature draft's input features [B, T, hidden]
    rows: Optional[torch.Tensor] = None  # its one logits row per sequence [B]
    # a plan's exact copies (RecentKV): where each write goes there (row, logical index) [B * T] (padding: row
    # RecentKV.rows, which writes nothing), each sequence's row [B] (padding: 0, only read) and its tree
    # entries' positions [B, tree width]
    e_row: Optional[torch.Tensor] = None
    e_idx: Optional[torch.Tensor] = None
    seq_row: Optional[torch.Tensor] = None
    tree_pos: Optional[torch.Tensor] = None
    graph: Optional[object] = None
    outputs: Optional[tuple] = None
    replays: int = field(default=0)


class StaticStep:
    """The static-buffer step of one `Executor` (its model, paged cache and lookahead)."""

    def __init__(self, ex, max_batch: int, max_tokens: int, capture: bool):
        """max_tokens: the most cache entries a sequence holds (the block tables' width covers it). capture:
        record each bucket as a CUDA graph (CUDA only)."""
        self.ex, self.kv = ex, ex.kv
        self.capture = capture and torch.device(ex.device).type == "cuda"
        self.batch_buckets = buckets(max_batch)
        self.pages = -(-max_tokens // self.kv.ps)
        self.buckets: dict[tuple[int, int, bool, bool], Bucket] = {}
        self.padded = 0  # batch rows run as padding so far (steps with fewer sequences than their bucket)
        self.pool = None  # one memory pool for every graph (they never run at once: a step's outputs are copied)

    # ------------------------------------------------------------------------------------------ buffers

    def _bucket(self, B: int, T: int, feats: bool, rows: bool) -> Bucket:
        Bb = next(b for b in self.batch_buckets if b >= B)
        key = (Bb, T, feats, rows)
        bk = self.buckets.get(key)
        if bk is None:
            dev, hidden = self.ex.device, self.ex.model.cfg.hidden_size
            z = lambda *s, dt=torch.int64: torch.zeros(s, dtype=dt, device=dev)  # noqa: E731
            bk = Bucket(
                Bb,
                T,
                z(Bb, T),
                z(Bb, T),
                z(Bb * T),
                z(Bb, self.pages, dt=torch.int32),
                z(Bb),
                z(Bb),
                z(Bb),
                z(Bb, T, -(-T // 32), dt=torch.int32),
                z(Bb, T, hidden, dt=self.ex.model.dtype) if feats else None,
                z(Bb) if rows else None,
            )
            if self.kv.recent is not None:
                bk.e_row, bk.e_idx, bk.seq_row = z(Bb * T), z(Bb * T), z(Bb)
                bk.tree_pos = z(Bb, max(T, self.ex.lookahead), dt=torch.int32)
            self._pad(bk, 0)
            self.buckets[key] = bk
        return bk

    def _pad(self, bk: Bucket, B: int) -> None:
        """Rows B.. of the bucket as padding: one query at position 0 over nothing, writing to the null page."""
        for t in (bk.tok, bk.pos, bk.tables, bk.ctx):
            t[B:] = 0
        bk.flat.view(bk.B, bk.T)[B:] = 0
        bk.tree[B:] = 1
        bk.qlen[B:] = 1
        bk.mask[B:] = 0
        bk.mask[B:, :, 0] = 1
        if bk.feats is not None:
            bk.feats[B:] = 0
        if bk.rows is not None:
            bk.rows[B:] = 0
        if bk.e_row is not None:
            bk.e_row.view(bk.B, bk.T)[B:] = self.kv.recent.rows
            bk.e_idx.view(bk.B, bk.T)[B:] = 0
            bk.seq_row[B:] = 0
            bk.tree_pos[B:] = 0

    def inputs(self, reqs, tokens, positions, writes, ctx, tree_lens, mask_rows, feats, logit_rows) -> tuple:
        """One step's inputs as tensors of its real rows (host bookkeeping: pages, slots, exact rows), the arguments
        of `run`: what rank 0 sends the other ranks of a tensor-parallel group."""
        kv, T = self.kv, max(len(t) for t in tokens)
        pad = lambda xs: [x + [0] * (T - len(x)) for x in xs]  # noqa: E731
        if mask_rows is None:  # causal over the new tokens, which are the whole tree region: row i sees 0..i
            mask_rows = [[(1 << (i + 1)) - 1 for i in range(len(t))] for t in tokens]
        tables = []
        for r in reqs:
            t = kv.tables[r.id]
            if len(t) > self.pages:
                raise RuntimeError(f"sequence {r.id} holds {len(t)} pages, the static step's tables {self.pages}")
            tables.append(t + [0] * (self.pages - len(t)))
        exact = None
        if kv.recent is not None:
            exact = self._exact_inputs(reqs, positions, writes, ctx, tree_lens, T)
        return (
            torch.tensor(pad(tokens)),
            torch.tensor(pad(positions)),
            torch.tensor(pad([[kv.slot(r.id, i) for i in w] for r, w in zip(reqs, writes)])),
            torch.tensor(tables, dtype=torch.int32),
            torch.tensor(ctx),
            torch.tensor(tree_lens),
            torch.tensor([len(t) for t in tokens]),
            torch.stack([pack_rows(m + [0] * (T - len(m)), -(-T // 32)) for m in mask_rows]),
            None if feats is None else feats[:, :T].to(self.ex.model.dtype),
            None if logit_rows is None else torch.tensor(logit_rows),
            exact,
        )

    def _exact_inputs(self, reqs, positions, writes, ctx, tree_lens, T: int) -> tuple:
        """The exact copies' inputs: as the executor's `_kernel_exact` makes them, at the bucket's fixed width. A
        tree entry sits at its token's position when this step writes it, else at its logical index."""
        rec = self.kv.recent
        rows = [self.kv.rows[r.id] for r in reqs]
        width = max(T, self.ex.lookahead)
        tree_pos = []
        for w, p, c, t in zip(writes, positions, ctx, tree_lens):
            late = [i for i in w if i >= rec.sink]
            if t > width or (late and max(late) - min(late) >= rec.ring):
                raise RuntimeError(f"a step of tree {t} writing {w}: beyond the static step's exact copies")
            tp = [c + j for j in range(width)]
            for i, x in zip(w, p):
                if c <= i < c + t:
                    tp[i - c] = x
            tree_pos.append(tp)
        return (
            torch.tensor([[r] * len(w) + [rec.rows] * (T - len(w)) for r, w in zip(rows, writes)]),
            torch.tensor([w + [0] * (T - len(w)) for w in writes]),
            torch.tensor(rows),
            torch.tensor(tree_pos, dtype=torch.int32),
        )

    def _fill(self, bk: Bucket, tok, pos, flat, tables, ctx, tree, qlen, mask, feats, rows, exact) -> None:
        """Copy one step's inputs (`inputs`) into the bucket's first rows; the rest become padding."""
        B = tok.shape[0]
        for buf, x in ((bk.tok, tok), (bk.pos, pos), (bk.tables, tables), (bk.ctx, ctx), (bk.tree, tree)):
            buf[:B].copy_(x)
        bk.flat.view(bk.B, bk.T)[:B].copy_(flat)
        bk.qlen[:B].copy_(qlen)
        bk.mask[:B].copy_(mask)
        if bk.feats is not None:
            bk.feats[:B].copy_(feats)
        if bk.rows is not None:
            bk.rows[:B].copy_(rows)
        if bk.e_row is not None:
            e_row, e_idx, seq_row, tree_pos = exact
            bk.e_row.view(bk.B, bk.T)[:B].copy_(e_row)
            bk.e_idx.view(bk.B, bk.T)[:B].copy_(e_idx)
            bk.seq_row[:B].copy_(seq_row)
            bk.tree_pos[:B].copy_(tree_pos)
        self._pad(bk, B)

    # ------------------------------------------------------------------------------------------ the step

    def _compute(self, bk: Bucket) -> tuple:
        """The step from the bucket's buffers alone: (logits, hidden states or None)."""
        kv, ex = self.kv, self.ex
        B, T, N = bk.B, bk.T, self.pages * kv.ps
        batch = AttnBatch(bk.tables, bk.ctx, bk.tree, bk.qlen, bk.mask, kv.ps)
        if kv.kern is None:  # the reference gathers every sequence's full table width: N is fixed, not the max
            n = torch.arange(N, device=bk.ctx.device)
            slots = bk.tables.gather(1, (n // kv.ps).expand(B, N)).long() * kv.ps + n % kv.ps
            batch._plan = (slots, batch.visible(T, N))
        flat, flat_pos = bk.flat, bk.pos.reshape(-1)
        at = None
        if kv.recent is not None:  # the kernels (or the reference) read the copies; writes of fixed shape
            batch.exact = (kv.recent, bk.seq_row, bk.pos, bk.tree_pos)
            at = (bk.e_row, bk.e_idx)

        def attend(layer, q, k, v):
            k, v = k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:])
            kv.write(layer, flat, k, v, at, positions=flat_pos, fixed=True)
            return paged_attention(q, kv.store, layer, batch, kv.kern)

        model = ex.model
        if bk.feats is not None:
            return model(bk.tok, bk.pos, attend=attend, feats=bk.feats, rows=bk.rows)
        if ex.features:
            return model(bk.tok, bk.pos, attend=attend, return_hidden=True)
        return model(bk.tok, bk.pos, attend=attend), None

    def _run(self, bk: Bucket) -> tuple:
        if not self.capture:
            return self._compute(bk)
        if bk.graph is None:
            self._record(bk)
        bk.graph.replay()
        bk.replays += 1
        return bk.outputs

    def _record(self, bk: Bucket) -> None:
        """Capture the bucket as gpt-fast and vLLM do: warm up on a side stream (Triton's compilation, cuBLAS's
        workspace and every lazy allocation happen outside the capture), then record one call on the buffers.
        The buffers hold padding only while this runs (`_bucket` pads a new bucket; `forward` fills it after),
        so the warm-up's cache writes go to the null page."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._compute(bk)
        torch.cuda.current_stream().wait_stream(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self._compute(bk)
        bk.graph, bk.outputs = g, out

    def forward(self, reqs, tokens, positions, writes, ctx, tree_lens, mask_rows, feats, logit_rows) -> torch.Tensor:
        """As `Executor.forward` (the same arguments and result), from the bucket's static buffers: the inputs
        through `Executor.run_static`, which at tp > 1 runs on every rank."""
        args = self.inputs(reqs, tokens, positions, writes, ctx, tree_lens, mask_rows, feats, logit_rows)
        return self.ex._call("run_static", *args)

    def run(self, tok, pos, flat, tables, ctx, tree, qlen, mask, feats, rows, exact) -> torch.Tensor:
        """One step from `inputs`' tensors (rank 0's own, or received from it): into the bucket of their shape,
        then computed (CUDA: replayed). Every rank of a tensor-parallel group gets the same calls in the same
        order, so each creates, and on CUDA captures, the same buckets in the same order: their graphs hold the
        same collectives in the same order, as NCCL requires."""
        B, T = tok.shape
        bk = self._bucket(B, T, feats is not None, rows is not None)
        if self.capture and bk.graph is None:
            self._record(bk)  # on the padding the new bucket holds, before this step's inputs go in
        self.padded += bk.B - B
        self._fill(bk, tok, pos, flat, tables, ctx, tree, qlen, mask, feats, rows, exact)
        logits, hidden = self._run(bk)
        # copies: the next replay overwrites the graph's outputs, and callers keep rows of them across steps
        if hidden is not None:
            self.ex.hidden = hidden[:B, :T].clone()
        return logits[:B, : (1 if rows is not None else T)].clone()
