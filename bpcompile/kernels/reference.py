"""The PyTorch oracle of the paged tree-attention kernel: gather and dequantize through `store.read`, then
softmax attention in fp32. Slow and obvious on purpose; the kernels are tested against it."""

from __future__ import annotations

import torch

from bpcompile.kernels.tree_mask import unpack_tree_mask


def paged_attention_reference(
    q: torch.Tensor,
    store,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    num_tree: torch.Tensor,
    sm_scale: float,
    *,
    q_lens: torch.Tensor | None = None,
    exact: tuple | None = None,
) -> torch.Tensor:
    """The oracle of `paged_attention`: gather + dequantize with `store.read`, then softmax attention in fp32.
    exact (as paged_attention takes it: the FP16 copies, each sequence's row there, its queries' positions, its
    tree entries' positions): a (query, key) pair whose key sits at a sink position or within the window of the
    query's position reads the key's and value's copies (docs/KV_FORMAT.md §4 "Exact entries")."""
    B, G, H, D = q.shape
    R, S = H // store.num_kv_heads, store.page_size
    if tree_mask is None:
        visible = torch.ones(G, G, dtype=torch.bool).tril()[None].expand(B, G, G)
    else:
        visible = unpack_tree_mask(tree_mask.cpu(), G)
    q_lens = num_tree if q_lens is None else q_lens
    out = torch.zeros(B, G, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        ctx, nt, nq = int(context_lens[b]), int(num_tree[b]), int(q_lens[b])
        if nq == 0:
            continue
        t = torch.arange(ctx + nt, device=block_tables.device)
        slots = block_tables[b, t // S].long() * S + t % S
        k, v = store.read(layer, slots.to(q.device))
        k = k.float().repeat_interleave(R, dim=1)
        v = v.float().repeat_interleave(R, dim=1)
        s = torch.einsum("ghd,thd->hgt", q[b, :nq].float(), k) * sm_scale
        vis = torch.ones(nq, ctx + nt, dtype=torch.bool, device=q.device)
        vis[:, ctx:] = visible[b, :nq, :nt].to(q.device)
        if exact is not None:
            rec, rows, q_pos, tree_pos = exact
            kp = t.clone().to(q.device)
            kp[ctx:] = tree_pos[b, :nt].to(kp)
            qp = q_pos[b, :nq].to(kp)
            ex = (kp[None, :] < rec.sink) | (qp[:, None] - kp[None, :] < rec.window)  # [nq, N]
            col = rec.column(t.to(q.device))
            ke = rec.k[layer, int(rows[b]), :, col].float().transpose(0, 1).repeat_interleave(R, dim=1)  # [N, H, D]
            ve = rec.v[layer, int(rows[b]), :, col].float().transpose(0, 1).repeat_interleave(R, dim=1)
            s = torch.where(ex[None], torch.einsum("ghd,thd->hgt", q[b, :nq].float(), ke) * sm_scale, s)
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1).nan_to_num(0.0)
        if exact is not None:
            out[b, :nq] = torch.einsum("hgt,thd->ghd", p * ~ex[None], v) + torch.einsum(
                "hgt,thd->ghd", p * ex[None], ve
            )
        else:
            out[b, :nq] = torch.einsum("hgt,thd->ghd", p, v)
    return out.to(q.dtype)
