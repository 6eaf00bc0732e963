"""KV cache storage: the bytes behind the runtime's paged cache.

The runtime (bpcompile/runtime.py) owns *which* slots a sequence uses (pages, block tables, free
list); a `KVStore` owns *how* K and V are stored in those slots. A slot is
`page * page_size + offset`. Every store keeps, per layer, pages laid out
`[num_pages, num_kv_heads, page_size, ...]` so that one GPU program can read one head's page
contiguously.

`FloatKVStore` (fp32/fp16/bf16, no quantization) is the reference. The quantized formats
(INT4 with FP8 outlier heads, FP8, INT8) implement the same interface; see docs/KV_FORMAT.md.
"""
from __future__ import annotations

import torch


class KVStore:
    """Interface. Stores K/V for `num_layers` layers in `num_pages` pages of `page_size` tokens."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    num_pages: int
    page_size: int

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize-and-append: k, v [N, num_kv_heads, head_size] go to flat slots [N] (int64)."""
        raise NotImplementedError

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V for slots [N] -> each [N, num_kv_heads, head_size] in the compute dtype."""
        raise NotImplementedError

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the stored bytes (payload and scales) of slots src[N] to dst[N], in every layer.

        Used after tree verification to compact the accepted path: no re-quantization, no recompute,
        so a compacted cache is bit-identical to one that was appended in order.
        """
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes actually allocated (payload, scales and any per-head metadata)."""
        raise NotImplementedError


class FloatKVStore(KVStore):
    """Unquantized pages: [num_pages, num_kv_heads, page_size, head_size] per layer for K and for V."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, num_pages: int, page_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_size)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return slots // self.page_size, slots % self.page_size

    def write(self, layer, slots, k, v):
        p, o = self._split(slots)
        self.k[layer, p, :, o] = k.to(self.dtype)
        self.v[layer, p, :, o] = v.to(self.dtype)

    def read(self, layer, slots):
        p, o = self._split(slots)
        return self.k[layer, p, :, o], self.v[layer, p, :, o]

    def move(self, src, dst):
        sp, so = self._split(src)
        dp, do = self._split(dst)
        self.k[:, dp, :, do] = self.k[:, sp, :, so].clone()
        self.v[:, dp, :, do] = self.v[:, sp, :, so].clone()

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
