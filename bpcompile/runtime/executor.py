"""The model executor: one model over its paged KV cache. It turns a batch of requests' new tokens into
tensors and attention metadata, writes their K/V into the cache and returns logits; it knows nothing of
trees, sampling or stop conditions."""
from __future__ import annotations

from typing import Optional

import torch

from bpcompile.kernels.tree_mask import pack_rows
from bpcompile.runtime.model import Llama, causal_attend
from bpcompile.runtime.paged_kv import AttnBatch, PagedKV, dense_attention, paged_attention
from bpcompile.runtime.request import Request


class Executor:
    def __init__(self, model: Llama, kv: PagedKV, device: torch.device, lookahead: int):
        """lookahead: cache entries reserved past a prompt at prefill (the largest tree a step writes)."""
        self.model, self.kv, self.device, self.lookahead = model, kv, device, lookahead
        self.forwards = 0  # batched forwards after prefill (benchmarks read these)

    def prefill(self, reqs: list[Request], last_logits: bool) -> Optional[torch.Tensor]:
        """Prompts through the model (right-padded, causal over the prompt alone), K/V into the cache;
        the logits of each prompt's last token [B, V] when last_logits."""
        dev, kv = self.device, self.kv
        lens = [len(r.prompt) for r in reqs]
        B, T = len(reqs), max(lens)
        for r in reqs:
            kv.ensure(r.id, len(r.prompt) + self.lookahead)
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
        logits = self.model(tok, None, attend=attend, last_only=same or not last_logits)
        if not last_logits:
            return None
        return logits[:, -1] if same else logits[torch.arange(B, device=dev), torch.tensor(lens, device=dev) - 1]

    def forward(self, reqs: list[Request], tokens: list[list[int]], positions: list[list[int]],
                writes: list[list[int]], ctx: list[int], tree_lens: list[int],
                mask_rows: Optional[list[list[int]]] = None) -> torch.Tensor:
        """One batched forward of new tokens over the paged cache -> logits [B, T, V].

        writes: logical cache index per new token; ctx/tree_lens/mask_rows: see AttnBatch (mask rows as
        Python-int bit rows over the tree region)."""
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

        self.forwards += 1
        return model(tok, pos, attend=attend)

    def move(self, moves: "Moves") -> None:
        """Apply the collected KV moves (accepted tree entries to their committed slots)."""
        if moves.src:
            src, dst, rows, src_i, dst_i = (torch.tensor(x, device=self.device) for x in
                                            (moves.src, moves.dst, moves.rows, moves.src_index, moves.dst_index))
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
