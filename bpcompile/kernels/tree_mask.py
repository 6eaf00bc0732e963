"""Tree attention masks in TensorRT-LLM's packed form (`spec_decoding_packed_mask`): row i of a tree of G
nodes is G bits (bit j: node i sees node j, i.e. j is i or one of its ancestors), stored as ceil(G/32) int32
words, bit j % 32 of word j // 32, little-endian, two's complement. One module for the runtime, the kernels
and their tests, so the packing has a single definition."""

from __future__ import annotations

import torch


def ancestor_bits(parents: list[int]) -> list[int]:
    """Row i of the tree mask as a Python int: bit j set iff j is i or an ancestor of i (parent -1 = root)."""
    bits: list[int] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"parent {p} of node {i} must come before it")
        bits.append((bits[p] if p >= 0 else 0) | (1 << i))
    return bits


def pack_rows(rows: list[int], words: int) -> torch.Tensor:
    """Python-int bit rows -> int32 [len(rows), words], little-endian words, two's complement."""
    out = []
    for r in rows:
        ws = []
        for w in range(words):
            x = (r >> (32 * w)) & 0xFFFFFFFF
            ws.append(x - (1 << 32) if x >= 1 << 31 else x)
        out.append(ws)
    return torch.tensor(out, dtype=torch.int32).reshape(len(rows), words)


def pack_tree_mask(parents: list[int]) -> torch.Tensor:
    """TensorRT-LLM's `spec_decoding_packed_mask` for one tree: int32 [G, ceil(G/32)]."""
    g = len(parents)
    return pack_rows(ancestor_bits(parents), (g + 31) // 32)


def unpack_tree_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [..., W] -> bool [..., n]. Arithmetic shift of a negative word keeps bit 31 readable."""
    shifts = torch.arange(32, device=packed.device, dtype=torch.int32)
    bits = (packed[..., None] >> shifts) & 1
    return bits.flatten(-2)[..., :n].bool()


def pack_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Boolean [..., G, G] (row i, col j: node i sees node j) -> TensorRT-LLM's packed int32 [..., G, ceil(G/32)]:
    bit j % 32 of word j // 32, little-endian; bit 31 makes the word negative (two's complement)."""
    G = mask.shape[-1]
    W = (G + 31) // 32
    m = torch.zeros(*mask.shape[:-1], W * 32, dtype=torch.int64, device=mask.device)
    m[..., :G] = mask.to(torch.int64)
    words = (m.reshape(*mask.shape[:-1], W, 32) << torch.arange(32, device=mask.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def tree_mask_from_parents(parents: list[int]) -> torch.Tensor:
    """Bool [G, G] mask of a tree given each node's parent (-1 for the root): a node sees its ancestors and itself."""
    G = len(parents)
    m = torch.zeros(G, G, dtype=torch.bool)
    for i, p in enumerate(parents):
        m[i, i] = True
        while p >= 0:
            m[i, p] = True
            p = parents[p]
    return m
