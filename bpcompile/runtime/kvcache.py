"""KV cache storage: the bytes behind the runtime's paged cache.

The runtime (bpcompile/runtime/generator.py) owns *which* slots a sequence uses (pages, block tables, free
list); a `KVStore` owns *how* K and V are stored in those slots. A slot is
`page * page_size + offset`. Every store keeps, per layer, pages laid out
`[num_pages, num_kv_heads, page_size, ...]` so that one GPU program can read one head's page
contiguously.

`FloatKVStore` (fp32/fp16/bf16, no quantization) is the reference. The quantized formats
(INT4 with FP8 outlier heads, FP8, INT8) implement the same interface; see docs/KV_FORMAT.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import load_file, save_file

from bpcompile.core.errors import UserError
from bpcompile.core.kv_support import takes, unsupported


class KVStore:
    """Interface. Stores K/V for `num_layers` layers in `num_pages` pages of `page_size` tokens."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    num_pages: int
    page_size: int

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
    ) -> None:
        """Quantize-and-append: k, v [N, num_kv_heads, head_size] go to flat slots [N] (int64). positions [N]: the
        tokens' RoPE positions (needed by a plan whose keys are stored before RoPE, KLT units; others ignore it)."""
        raise NotImplementedError

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V for slots [N] -> each [N, num_kv_heads, head_size] in the compute dtype."""
        raise NotImplementedError

    def write_read(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
    ):
        """write(), then what read() of those slots returns (a store may decode without reading back)."""
        self.write(layer, slots, k, v, positions)
        return self.read(layer, slots)

    def write_layers(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> None:
        """write() of every layer at once: k, v [num_layers, N, num_kv_heads, head_size], the same slots in each."""
        for layer in range(k.shape[0]):
            self.write(layer, slots, k[layer], v[layer], positions)

    def write_read_layers(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """write_read() of every layer at once -> k, v [num_layers, N, num_kv_heads, head_size]."""
        out = [self.write_read(layer, slots, k[layer], v[layer], positions) for layer in range(k.shape[0])]
        return torch.stack([a for a, _ in out]), torch.stack([b for _, b in out])

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

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_size)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return slots // self.page_size, slots % self.page_size

    def write(self, layer, slots, k, v, positions=None):
        p, o = self._split(slots)
        self.k[layer, p, :, o] = k.to(self.dtype)
        self.v[layer, p, :, o] = v.to(self.dtype)

    def write_layers(self, slots, k, v, positions=None):
        p, o = self._split(slots)  # indexing [:, p, :, o] puts the slots first: [N, L, KV, D]
        self.k[:, p, :, o] = k.transpose(0, 1).to(self.dtype)
        self.v[:, p, :, o] = v.transpose(0, 1).to(self.dtype)

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


# ---------------------------------------------------------------------------------------------
# Reference quantizers: the oracle the GPU kernels are checked against (docs/KV_FORMAT.md §3-4).
# Inputs are float32 vectors [..., D]; groups are contiguous runs of G elements along the last dim.

FP8_MAX = 448.0
FP16_MAX = 65504.0


def round_half_even(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties to even (torch.round is RNE; CUDA rintf; Triton: magic-number trick)."""
    return torch.round(x)


def fp16_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float16 with RNE, saturating at 65504 instead of overflowing to inf."""
    return x.clamp(max=FP16_MAX).to(torch.float16)


_HADAMARD: dict = {}


def hadamard(n: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix H_n / sqrt(n) in float32 (n a power of two): symmetric and
    its own inverse (H @ H = I), entries ±1/sqrt(n) (exact for n = 4^k, e.g. ±1/8 at n = 64)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    key = (n, str(device))
    if key not in _HADAMARD:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[key] = (h / n**0.5).float().to(device)
    return _HADAMARD[key]


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    d = x.shape[-1]
    if d % group_size:
        raise ValueError(f"group_size {group_size} does not divide head size {d}")
    return x.reshape(*x.shape[:-1], d // group_size, group_size)


def _scales(x: torch.Tensor, group_size: int, qmax: float, clip=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group fp16 scale = fp16(clip * absmax / qmax); returns (grouped x, fp16 scales [..., D/G])."""
    xg = _groups(x.float(), group_size)
    amax = xg.abs().amax(-1)
    if not (isinstance(clip, float) and clip == 1.0):
        amax = amax * clip
    return xg, fp16_scale(amax / qmax)


def _divide(xg: torch.Tensor, s16: torch.Tensor) -> torch.Tensor:
    """x / s per group, 0 where the scale is 0 (all-zero group or fp16 underflow)."""
    s = s16.float()[..., None]
    return torch.where(s > 0, xg / s, 0.0)  # x / 0 is computed and discarded


def pack_int4(n: torch.Tensor) -> torch.Tensor:
    """Nibbles [..., D] (0..15) -> bytes [..., D/2]: low nibble = element j, high = element j + D/2."""
    n = n.to(torch.uint8)
    h = n.shape[-1] // 2
    return n[..., :h] | (n[..., h:] << 4)


def unpack_int4(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., D/2] -> nibbles [..., D] (uint8 0..15), inverse of pack_int4."""
    return torch.cat((b & 0xF, b >> 4), dim=-1)


INT4_ZERO = 8.0  # nibble of 0: nibble n holds the level n - 8 (n = 1..15; 0 is never written)


def quantize_int4(x: torch.Tensor, group_size: int, clip=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4: s = fp16(clip*absmax/7), q = clamp(rne(x/s), -7, 7), nibble = q + 8.

    x [..., D] -> (packed uint8 [..., D/2], scales fp16 [..., D/G]). clip: float or tensor
    broadcastable to [..., D/G] (the per-unit static clip ratio).

    A 16-level grid without a zero ((n - 7.5) s, same bytes) was measured on SmolLM2-135M (rotated plan): lower
    KL on held-out text (-0.0037, interval excluding 0) but passkey retrieval at 1k tokens fell from 150/150 to
    141/150 on the same trials (9 discordant pairs, all one way), so the grid keeps its zero.
    """
    n, s = _int4_levels(x, group_size, clip)
    return pack_int4(n.reshape(x.shape)), s


def _int4_levels(x: torch.Tensor, group_size: int, clip=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int4 before packing: nibbles as float32, grouped [..., D/G, G], and the fp16 scales.
    (n - 8) * s of them is exactly what dequantize_int4 of the packed bytes gives."""
    xg, s = _scales(x, group_size, 7.0, clip)
    return round_half_even(_divide(xg, s)).clamp_(-7, 7).add_(INT4_ZERO), s


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    q = unpack_int4(packed).float() - INT4_ZERO
    return (_groups(q, group_size) * scales.float()[..., None]).reshape(q.shape)


INT5_ZERO = 16.0  # code of 0: code n holds the level n - 16 (n = 1..31; 0 is never written)


def pack_planes(bits: torch.Tensor) -> torch.Tensor:
    """One bit per element [..., D] (0 or 1) -> a plane of bytes [..., D/8]: bit b of byte i is element
    i + b*D/8. A row's low half j < D/2 then finds its bit at bit j // (D/8) and its high half j + D/2 at bit
    4 + j // (D/8) of the same byte j % (D/8): one gathered byte serves both halves, as INT4's nibbles do."""
    e = bits.shape[-1] // 8
    b = bits.to(torch.uint8).reshape(*bits.shape[:-1], 8, e)
    return (b << _BIT[:, None].to(b.device)).sum(-2, dtype=torch.uint8)  # distinct bits: the sum is their OR


def unpack_planes(plane: torch.Tensor) -> torch.Tensor:
    """A plane [..., D/8] -> its bits [..., D] (uint8 0/1), inverse of pack_planes."""
    bits = (plane[..., None, :] >> _BIT[:, None].to(plane.device)) & 1  # [..., 8, D/8]: bit b of byte i
    return bits.reshape(*plane.shape[:-1], -1)


_BIT = torch.arange(8, dtype=torch.uint8)  # bit positions of a plane byte


def pack_int5(n: torch.Tensor) -> torch.Tensor:
    """5-bit codes [..., D] (0..31) -> bytes [..., 5D/8]: the low 4 bits as pack_int4 packs nibbles (bytes
    [0, D/2)), then the plane of bit 4 (bytes [D/2, 5D/8), pack_planes)."""
    n = n.to(torch.uint8)
    return torch.cat((pack_int4(n & 0xF), pack_planes(n >> 4)), dim=-1)


def unpack_int5(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 5D/8] -> codes [..., D] (uint8 0..31), inverse of pack_int5."""
    d = b.shape[-1] * 8 // 5
    return unpack_int4(b[..., : d // 2]) | (unpack_planes(b[..., d // 2 :]) << 4)


def quantize_int5(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT5: s = fp16(absmax/15), q = clamp(rne(x/s), -15, 15), code = q + 16, packed by pack_int5.
    x [..., D] -> (uint8 [..., 5D/8], scales fp16 [..., D/G]). Plain absmax, like FP8 and INT8 (calibration
    searches clip ratios for INT4 units only). What it is for: the keys of the layers where INT4's noise changes
    what the model retrieves from far back (docs/KV_FORMAT.md §6)."""
    q, s = _symmetric_levels(x, group_size, 15.0)
    return pack_int5((q + INT5_ZERO).reshape(x.shape)), s


def dequantize_int5(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    return _scaled(unpack_int5(packed).float() - INT5_ZERO, scales, group_size)


def _symmetric_levels(x: torch.Tensor, group_size: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """INT5's and INT6's levels: s = fp16(absmax / qmax), q = clamp(rne(x / s), -qmax, qmax), grouped
    [..., D/G, G] as float32, and the fp16 scales."""
    xg, s = _scales(x, group_size, qmax)
    return round_half_even(_divide(xg, s)).clamp_(-qmax, qmax), s


def _scaled(levels: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Levels [..., D] times their group's scale -> float32 [..., D] (what a read gives)."""
    return (_groups(levels, group_size) * scales.float()[..., None]).reshape(levels.shape)


INT6_ZERO = 32.0  # code of 0: code n holds the level n - 32 (n = 1..63; 0 is never written)


def pack_int6(n: torch.Tensor) -> torch.Tensor:
    """6-bit codes [..., D] (0..63) -> bytes [..., 3D/4]: INT5's layout (low nibbles, plane of bit 4), then the
    plane of bit 5 (bytes [5D/8, 3D/4))."""
    n = n.to(torch.uint8)
    hi = n >> 4
    planes = pack_planes(torch.stack((hi & 1, hi >> 1), dim=-2))  # [..., 2, D/8]: bits 4 and 5
    return torch.cat((pack_int4(n & 0xF), planes.flatten(-2)), dim=-1)


def unpack_int6(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 3D/4] -> codes [..., D] (uint8 0..63), inverse of pack_int6."""
    d, e = b.shape[-1] * 4 // 3, b.shape[-1] // 6
    hi = unpack_planes(b[..., d // 2 :].unflatten(-1, (2, e)))  # [..., 2, D]: bits 4 and 5
    return unpack_int4(b[..., : d // 2]) | (hi[..., 0, :] << 4) | (hi[..., 1, :] << 5)


def quantize_int6(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT6: s = fp16(absmax/31), q = clamp(rne(x/s), -31, 31), code = q + 32, packed by pack_int6.
    What it is for: the keys of the first layers, whose INT4 and INT5 noise changes what SmolLM2 retrieves from
    2k tokens back (docs/KV_FORMAT.md §6)."""
    q, s = _symmetric_levels(x, group_size, 31.0)
    return pack_int6((q + INT6_ZERO).reshape(x.shape)), s


def dequantize_int6(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    return _scaled(unpack_int6(packed).float() - INT6_ZERO, scales, group_size)


INT3_CLIP = 0.8  # s = fp16(0.8 * absmax / 3.5): on a Gaussian group of 64 the error of the best RMS-set step


def pack_int3(n: torch.Tensor) -> torch.Tensor:
    """3-bit codes [..., D] (0..7) -> bytes [..., 3D/8]: the planes of bits 0, 1 and 2 (pack_planes)."""
    n = n.to(torch.uint8)
    bits = (n[..., None, :] >> _BIT[:3, None].to(n.device)) & 1  # [..., 3, D]: bits 0, 1, 2
    return pack_planes(bits).flatten(-2)


def unpack_int3(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 3D/8] -> codes [..., D] (uint8 0..7), inverse of pack_int3."""
    bits = unpack_planes(b.unflatten(-1, (3, b.shape[-1] // 3)))  # [..., 3, D]
    return (bits << _BIT[:3, None].to(b.device)).sum(-2, dtype=torch.uint8)


def quantize_int3(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """INT3 on a grid without a zero: code n (0..7) holds the level (n - 3.5) * s, s = fp16(0.8 * absmax / 3.5),
    n = clamp(floor(x / s) + 4, 0, 7) (the nearest level: levels sit at the cells' midpoints). Eight levels, all
    used; the clip is fixed: after the Hadamard rotation a group of 64 is close to Gaussian, where 0.8 of the
    absmax gives the squared error of the best RMS-set step and, unlike an RMS, a maximum does not depend on the
    order of a reduction. What it is for: value units, which tolerate the noise (docs/KV_FORMAT.md §6)."""
    n, s = _int3_levels(x, group_size)
    return pack_int3(n.reshape(x.shape)), s


def _int3_levels(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int3 before packing: codes as float32, grouped [..., D/G, G], and the fp16 scales."""
    xg, s = _scales(x, group_size, 3.5, INT3_CLIP)
    return (torch.floor(_divide(xg, s)) + 4).clamp_(0, 7), s


def dequantize_int3(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    return _scaled(unpack_int3(packed).float() - 3.5, scales, group_size)


# ---- KLT keys: transform coding before RoPE (docs/KV_FORMAT.md §3, "KLT units") ----------------------
# A key unit's pre-RoPE keys, centred and mapped by a calibrated basis A (the Karhunen-Loeve transform of the keys
# in the metric of the logit error the queries see), have a few high-variance coefficients and many small ones;
# storing each coefficient with its own bit width (water-filling on the variances) and one fp16 scale per token
# gives a far smaller logit error than the same bytes spread evenly over rotated channels. Before RoPE, because
# after it the basis would depend on the position.


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """GPT-NeoX RoPE (pairs i, i + D/2) of x [N, ..., D] at positions [N], float32, through the model's own
    apply_rope; sign -1 undoes it (a rotation by minus the angle)."""
    from bpcompile.runtime.model import apply_rope

    ang = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None]  # [N, D/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    s = sign * ang.sin()
    return apply_rope(x.float(), torch.cat([ang.cos()] * 2, -1).view(shape), torch.cat([-s, s], -1).view(shape))


def klt_qmax(bits: torch.Tensor) -> torch.Tensor:
    """Largest level of a coefficient of `bits` bits: 2^(b-1) - 1 for b >= 2 (symmetric, with a zero); 0 for the
    1-bit coefficients (a sign and a static magnitude) and the 0-bit ones (not stored)."""
    b = bits.to(torch.float32)
    return torch.where(bits >= 2, 2.0 ** (b - 1) - 1, torch.zeros_like(b))


_M32 = 0xFFFFFFFF


def klt_coefficients(
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    V: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
) -> torch.Tensor:
    """Post-RoPE keys k [N, U, D] of KLT units at positions [N] -> their coefficients ((unrope(k) - mean) * weight) @ V
    (V, weight, mean: the units' tables, [U, D, D] / [U, D])."""
    pre = rope_rotate(k, positions, inv_freq, -1.0)
    return torch.einsum("nhd,hde->nhe", (pre - mean) * weight, V.float())


def klt_keys(
    z: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    V: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
) -> torch.Tensor:
    """klt_coefficients inverted: coefficients z [N, U, D] -> post-RoPE keys (float32)."""
    pre = torch.einsum("nhe,hde->nhd", z, V.float()) / weight + mean
    return rope_rotate(pre, positions, inv_freq, 1.0)


def klt_dither(positions: torch.Tensor, units: torch.Tensor, D: int) -> torch.Tensor:
    """The subtractive dither of KLT coefficients: [N, U, D] float32 in [-0.5, 0.5], a fixed integer hash of (the
    token's position, the global unit id, the coefficient index), so writer and reader compute it alike.
    Why: before RoPE the keys of a repeated phrase are nearly identical wherever it occurs, so without a dither
    their rounding errors are too, and they add up over the repeats instead of averaging out (on SmolLM2 the
    cache then retrieved a passkey from long filler text far more often than FP16 KV did). With the dither added
    before rounding and subtracted after, the error is uniform and independent of the value and of the position."""
    p = positions.to(torch.int64).reshape(-1, 1, 1)
    u = units.to(device=p.device, dtype=torch.int64).reshape(1, -1, 1)
    i = torch.arange(D, device=p.device, dtype=torch.int64).reshape(1, 1, -1)
    h = (p * 2654435761 + u * 3266489917 + i * 2246822519 + 0x6A09E667) & _M32  # the offset: no fixed point at 0
    h = ((h ^ (h >> 15)) * 2246822519) & _M32  # int64 products wrap past 2^63; their low 32 bits are exact
    h = ((h ^ (h >> 13)) * 3266489917) & _M32
    h = h ^ (h >> 16)
    return ((h.to(torch.float64) + 0.5) / 4294967296.0 - 0.5).to(torch.float32)


def klt_pack_index(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bits [U, D] (each row summing to the same B) -> (coefficient [U, B], bit [U, B]) of each payload bit: the
    bits of coefficient 0 first (least significant first), then coefficient 1's, and so on."""
    coef, shift = [], []
    for row in bits.tolist():
        coef.append([i for i, b in enumerate(row) for _ in range(b)])
        shift.append([j for b in row for j in range(b)])
    if len({len(c) for c in coef}) > 1:
        raise ValueError("KLT units of one precision must have the same number of payload bits")
    return torch.tensor(coef, dtype=torch.long), torch.tensor(shift, dtype=torch.long)


def encode_klt(
    z: torch.Tensor,
    bits: torch.Tensor,
    step: torch.Tensor,
    level: torch.Tensor,
    coef: torch.Tensor,
    shift: torch.Tensor,
    dither: torch.Tensor,
    decoded: bool = False,
):
    """Coefficients z [N, U, D] (float32, in the unit's basis) -> (payload uint8 [N, U, B/8], fp16 scale [N, U, 1],
    the decoded coefficients or None). Per token s = fp16(max over coefficients of >= 2 bits of |z| / (qmax * step));
    such a coefficient's code is q + qmax + 1 with q = clamp(rne(z / (s * step) + u), -qmax, qmax) for its dither u
    (klt_dither), decoded (q - u) * s * step; a 1-bit one's code is 1 where z >= 0 (decoded +level, else -level);
    a 0-bit one is not stored (decoded 0)."""
    qmax = klt_qmax(bits)
    wide = bits >= 2
    unit = qmax * step
    ratio = torch.where(wide, z.abs() / torch.where(wide, unit, 1.0), 0.0)
    s16 = fp16_scale(ratio.amax(-1))
    t = s16.float()[..., None] * step
    q = torch.where(wide & (t > 0), round_half_even(z / torch.where(t > 0, t, 1.0) + dither), 0.0)
    q = torch.minimum(torch.maximum(q, -qmax), qmax)
    n = torch.where(wide, q + qmax + 1, torch.where(bits == 1, (z >= 0).float(), 0.0)).long()
    N, U = z.shape[:2]
    planes = (n.gather(-1, coef.expand(N, U, -1)) >> shift) & 1
    payload = (planes.view(N, U, -1, 8) << torch.arange(8, device=z.device)).sum(-1).to(torch.uint8)
    dec = _klt_values(n, s16, bits, step, level, dither) if decoded else None
    return payload, s16[..., None], dec


def _klt_values(n, s16, bits, step, level, dither):
    """Decoded coefficients; a token whose scale is 0 decodes 0 (its codes were written as 0)."""
    qmax, t = klt_qmax(bits), s16.float()[..., None] * step
    return torch.where(
        bits >= 2,
        torch.where(t > 0, (n.float() - qmax - 1 - dither) * t, 0.0),
        torch.where(bits == 1, torch.where(n > 0, level, -level), 0.0),
    )


def decode_klt(
    payload: torch.Tensor,
    scales: torch.Tensor,
    bits: torch.Tensor,
    step: torch.Tensor,
    level: torch.Tensor,
    coef: torch.Tensor,
    shift: torch.Tensor,
    dither: torch.Tensor,
) -> torch.Tensor:
    """encode_klt's payload and scales -> the coefficients [N, U, D] (float32)."""
    N, U = payload.shape[:2]
    planes = ((payload.long()[..., None] >> torch.arange(8, device=payload.device)) & 1).view(N, U, -1)
    n = torch.zeros(N, U, bits.shape[-1], dtype=torch.long, device=payload.device)
    n.scatter_add_(-1, coef.expand(N, U, -1), planes << shift)
    return _klt_values(n, scales[..., 0], bits, step, level, dither)


def encode_fp8_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3 (fn) bit patterns (uint8), RNE, saturating to ±448. Bit manipulation only, so
    it is independent of any library cast (docs/KV_FORMAT.md §3 has the same steps as pseudo-code)."""
    y = y.float().clamp(-FP8_MAX, FP8_MAX)
    bits = y.view(torch.int32)
    sign = (bits >> 24) & 0x80
    a = y.abs()
    sub = round_half_even(a * 512.0).to(torch.int32)  # exact scaling; multiples of 2^-9 below 2^-6
    b = a.view(torch.int32)
    b = b + 0x7FFFF + ((b >> 20) & 1)  # RNE on the 20 dropped mantissa bits
    normal = ((b >> 20) - (120 << 3)).clamp(max=0x7E)
    code = torch.where(a < 2.0**-6, sub, normal)
    return (code | sign).to(torch.uint8)


def decode_fp8_e4m3(code: torch.Tensor) -> torch.Tensor:
    """E4M3 bit patterns (uint8) -> float32, by the formula (0x7F/0xFF NaN never written)."""
    c = code.to(torch.int32)
    e, m = (c >> 3) & 0xF, (c & 7).float()
    mag = torch.where(e == 0, m * 2.0**-9, (1 + m / 8) * torch.exp2((e - 7).float()))
    return torch.where((c & 0x80) != 0, -mag, mag)


def quantize_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with a per-group fp16 scale s = fp16(absmax/448): (codes uint8 [..., D], scales fp16)."""
    xg, s = _scales(x, group_size, FP8_MAX)
    return _fp8_codes(_divide(xg, s)).reshape(x.shape), s


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    return (_groups(_fp8_values(codes), group_size) * scales.float()[..., None]).reshape(codes.shape)


# The store uses torch's float8_e4m3fn cast where it has one: one operator instead of the ~15 of the bit
# version, and equal to it bit for bit on every clamped float32 (tests/test_kvcache.py checks a dense grid).
_HAS_FP8 = hasattr(torch, "float8_e4m3fn")


def _fp8_codes(y: torch.Tensor) -> torch.Tensor:
    if not _HAS_FP8:
        return encode_fp8_e4m3(y)
    return y.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _fp8_values(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float() if _HAS_FP8 else decode_fp8_e4m3(codes)


def quantize_int8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8, s = fp16(absmax/127): (int8 [..., D], scales fp16 [..., D/G])."""
    xg, s = _scales(x, group_size, 127.0)
    q = round_half_even(_divide(xg, s)).clamp(-127, 127)
    return q.to(torch.int8).reshape(x.shape), s


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    return (_groups(q.float(), group_size) * scales.float()[..., None]).reshape(q.shape)


# ---------------------------------------------------------------------------------------------
# The unit precisions: one entry each, read by the store (pools, codecs), the plan (bytes per token), the
# kernels' launch code (pool order, unit counts) and the TensorRT plugin's constants (generated header).
# A new precision is an entry here plus its branch in the kernels.


@dataclass(frozen=True)
class UnitPrecision:
    name: str  # in KV plans
    code: int  # the kernels' and the plugin's unit_precision value (their branches use the literals)
    payload_dtype: torch.dtype  # element type of the payload pool; every precision has an fp16 scale pool
    payload_width: Callable[[int], int]  # payload bytes per unit and token, for head size D
    encode: Callable  # (x float32 [..., D], G, clip, decoded: bool) -> (payload, scales fp16, decoded float32 | None)
    decode: Callable  # (payload, scales, G) -> float32 [..., D]
    # KLT units: their codec takes per-unit tables (bits, steps, levels, packing) in place of the clip, and decode
    # takes them too; they hold keys only, as coefficients of the unit's basis (QuantKVStore._transform)
    tabled: bool = False


def _encode_int4(x, group_size, clip, decoded):
    n, s = _int4_levels(x, group_size, clip)
    # what dequantize_int4 of the bytes gives, computed from the levels instead of unpacking them
    dec = ((n - INT4_ZERO) * s.float()[..., None]).reshape(x.shape) if decoded else None
    return pack_int4(n.reshape(x.shape)), s, dec


def _encode_symmetric(qmax: float, pack):
    """INT5 / INT6's encode: s = fp16(absmax / qmax), q = clamp(rne(x / s), -qmax, qmax), code q + qmax + 1; what a
    read decodes, q * s, computed from the levels (the packed codes round-trip exactly)."""

    def encode(x, group_size, clip, decoded):
        q, s = _symmetric_levels(x, group_size, qmax)
        dec = (q * s.float()[..., None]).reshape(x.shape) if decoded else None
        return pack((q + (qmax + 1)).reshape(x.shape)), s, dec

    return encode


def _encode_int3(x, group_size, clip, decoded):
    n, s = _int3_levels(x, group_size)
    dec = ((n - 3.5) * s.float()[..., None]).reshape(x.shape) if decoded else None
    return pack_int3(n.reshape(x.shape)), s, dec


def _codec(quantize, dequantize):
    def encode(x, group_size, clip, decoded):
        q, s = quantize(x, group_size)
        return q, s, dequantize(q, s, group_size) if decoded else None

    return encode


PRECISIONS = (
    UnitPrecision("int4", 0, torch.uint8, lambda d: d // 2, _encode_int4, dequantize_int4),
    UnitPrecision("fp8", 1, torch.uint8, lambda d: d, _codec(quantize_fp8, dequantize_fp8), dequantize_fp8),
    UnitPrecision("int8", 2, torch.int8, lambda d: d, _codec(quantize_int8, dequantize_int8), dequantize_int8),
    UnitPrecision("int5", 3, torch.uint8, lambda d: d * 5 // 8, _encode_symmetric(15.0, pack_int5), dequantize_int5),
    UnitPrecision("int6", 4, torch.uint8, lambda d: d * 3 // 4, _encode_symmetric(31.0, pack_int6), dequantize_int6),
    UnitPrecision("int3", 5, torch.uint8, lambda d: d * 3 // 8, _encode_int3, dequantize_int3),
    UnitPrecision(
        "klt4",
        6,
        torch.uint8,
        lambda d: d // 2,
        lambda x, g, t, dec: encode_klt(x, *t, decoded=dec),
        lambda q, s, g, t: decode_klt(q, s, *t),
        tabled=True,
    ),
    UnitPrecision(
        "klt5",
        7,
        torch.uint8,
        lambda d: d * 5 // 8,
        lambda x, g, t, dec: encode_klt(x, *t, decoded=dec),
        lambda q, s, g, t: decode_klt(q, s, *t),
        tabled=True,
    ),
    UnitPrecision(
        "klt6",
        8,
        torch.uint8,
        lambda d: d * 3 // 4,
        lambda x, g, t, dec: encode_klt(x, *t, decoded=dec),
        lambda q, s, g, t: decode_klt(q, s, *t),
        tabled=True,
    ),
)
BY_CODE = {p.code: p for p in PRECISIONS}
PRECISION_CODES = {p.name: p.code for p in PRECISIONS}
INT4, FP8, INT8, INT5, INT6, INT3 = (PRECISION_CODES[n] for n in ("int4", "fp8", "int8", "int5", "int6", "int3"))
KLT_PRECISIONS = {
    "klt4": 4,
    "klt5": 5,
    "klt6": 6,
}  # name -> payload bits per key element (the unit's bits sum to that * D)
# the basis in float16: its transpose must invert it closely (a systematic error there distorts every key alike:
# INT8 rounding of it doubled SmolLM2's held-out KL), and half of float32's bytes count against the budget
KLT_TABLE_DTYPES = {"bits": torch.int8, "basis": torch.float16}


def reader_precisions(reader: str) -> tuple[UnitPrecision, ...]:
    """The precisions `reader` (bpcompile.core.kv_support.READERS) reads, in registry order: the pools its kernels,
    graphs or plugin take, in their argument order."""
    return tuple(p for p in PRECISIONS if takes(reader, p.name))


def plan_features(plan: "KVPlan") -> dict[str, str]:
    """The features (bpcompile.core.kv_support.SUPPORT) a plan is made of -> where each first occurs."""
    if plan.format == "fp16":
        return {"fp16": "kv_cache.format fp16"}
    out = {}
    for layer, p in enumerate(plan.precision):
        for t in ("k", "v"):
            for h, x in enumerate(p[t]):
                out.setdefault(x, f"first: layer {layer} {t.upper()} head {h}")
    if plan.has_exact:
        out["exact"] = f"sink_tokens {plan.sink_tokens}, recent_window {plan.recent_window}"
    if plan.rotation == "hadamard":
        out["rotation"] = "rotation hadamard"
    return out


def plan_support(plan: "KVPlan", reader: str) -> list[str]:
    """Why `reader` cannot run this plan, one reason per feature it does not take (empty: it can). The one question
    every reader's caller asks (validation, the runtime's choice of attention path, the executors' refusals)."""
    where = plan_features(plan)
    return unsupported(where, reader, where)


# ---------------------------------------------------------------------------------------------
# The KV plan: per-unit precision and static scales, decided at calibration (bpcompile/compiler/calibrate.py).

FORMATS = ("int4-fp8-outlier", "int4-naive", "fp8", "int8", "fp16")
DEFAULT_GROUP_SIZE = 128
ROTATIONS = ("none", "hadamard")
PLAN_VERSION = 2  # 2: rotation + k_mean; a version-1 plan (neither) loads as rotation "none", no k_mean


@dataclass
class KVPlan:
    """What the cache stores per (layer, KV head, K|V) unit. Saved as kv_plan/{plan.json,scales.safetensors}."""

    format: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    group_size: int = DEFAULT_GROUP_SIZE
    # per layer {"k": [precision per KV head], "v": [...]}, precision in PRECISION_CODES
    precision: list = field(default_factory=list)
    k_channel_scale: Optional[torch.Tensor] = None  # [L, KV, D] float32; None = ones
    int4_clip: Optional[torch.Tensor] = None  # [L, 2, KV] float32; None = ones
    outlier_fraction: float = 0.0
    calibration: dict = field(default_factory=dict)
    # "hadamard": K and V of every unit are stored rotated by H = hadamard(D) (docs/KV_FORMAT.md §3)
    rotation: str = "none"
    k_mean: Optional[torch.Tensor] = None  # [L, KV, D] float32, subtracted from keys first; None = zeros
    # exact entries (docs/KV_FORMAT.md §5): a query reads the FP16 copy of a key/value whose position is below
    # sink_tokens or within recent_window positions of its own (itself included), the stored codes otherwise
    sink_tokens: int = 0
    recent_window: int = 0
    # KLT key units' tables (docs/KV_FORMAT.md §3): {"mean", "weight", "step", "level" [L, KV, D] float32, "bits"
    # [L, KV, D] int8, "basis" [L, KV, D, D] float16 (an orthonormal matrix), "inv_freq" [D/2] float32}; None when
    # the plan has no KLT units
    klt: Optional[dict] = None
    # a tensor-parallel rank's plan (shard): its first KV head and the model's KV heads (0: num_kv_heads, the
    # whole model's plan). KLT units key their dither by the model's unit ids, so every tp rounds alike
    first_kv_head: int = 0
    total_kv_heads: int = 0

    def __post_init__(self):
        self.total_kv_heads = self.total_kv_heads or self.num_kv_heads
        if self.first_kv_head < 0 or self.first_kv_head + self.num_kv_heads > self.total_kv_heads:
            raise UserError(
                f"KV heads {self.first_kv_head}..{self.first_kv_head + self.num_kv_heads - 1} are not among the "
                f"model's {self.total_kv_heads}",
                key="first_kv_head",
            )
        if self.rotation not in ROTATIONS:
            raise UserError(
                f"unknown KV rotation {self.rotation!r}; expected one of {', '.join(ROTATIONS)}", key="rotation"
            )
        if self.rotation == "hadamard" and self.head_size & (self.head_size - 1):
            raise UserError(f"a Hadamard rotation needs a power-of-two head size, got {self.head_size}", key="rotation")
        for name in ("k_channel_scale", "k_mean"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (self.num_layers, self.num_kv_heads, self.head_size):
                raise UserError(
                    f"{name} must be [{self.num_layers}, {self.num_kv_heads}, {self.head_size}], got {list(t.shape)}",
                    key=name,
                )
        if self.format not in FORMATS:
            raise UserError(
                f"unknown KV cache format {self.format!r}; expected one of {', '.join(FORMATS)}", key="kv_cache.format"
            )
        if self.group_size <= 0:
            raise UserError(f"group_size must be positive, got {self.group_size}", key="kv_cache.group_size")
        for name in ("sink_tokens", "recent_window"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise UserError(f"{name} must be a non-negative integer, got {n!r}", key=f"kv_cache.{name}")
        if self.format == "fp16" and self.has_exact:
            raise UserError(
                "an fp16 cache is exact already: sink_tokens and recent_window are for quantized formats",
                key="kv_cache.recent_window",
            )
        if self.format != "fp16":
            g = self.effective_group_size
            if self.head_size % g or (self.head_size % 2):
                raise UserError(
                    f"group size {g} must divide the (even) head size {self.head_size}", key="kv_cache.group_size"
                )
            if len(self.precision) != self.num_layers or any(
                len(p.get(t, ())) != self.num_kv_heads for p in self.precision for t in ("k", "v")
            ):
                raise UserError(
                    f"precision table must have {self.num_layers} layers x {{k,v}} x {self.num_kv_heads} heads",
                    key="precision",
                )
            used = {x for p in self.precision for t in ("k", "v") for x in p[t]}
            if bad := used - set(PRECISION_CODES):
                raise UserError(
                    f"unknown unit precision(s) {sorted(bad)}; expected one of {', '.join(PRECISION_CODES)}",
                    key="precision",
                )
            self._check_klt(used)
            if used & {"int5", "int6", "int3"} and self.head_size % 8:
                raise UserError(
                    f"{'/'.join(sorted(used & {'int5', 'int6', 'int3'}))} units pack bit planes of 8 "
                    f"values a byte: head size {self.head_size} is not a multiple of 8",
                    key="precision",
                )

    def _check_klt(self, used: set) -> None:
        if not used & set(KLT_PRECISIONS):
            return
        L, KV, D = self.num_layers, self.num_kv_heads, self.head_size
        if any(x in KLT_PRECISIONS for p in self.precision for x in p["v"]):
            raise UserError("KLT precisions are for key units only", key="precision")
        if D % 8:
            raise UserError(
                f"KLT units pack bit planes of 8 coefficients: head size {D} is not a multiple of 8", key="precision"
            )
        shapes = {
            "mean": (L, KV, D),
            "weight": (L, KV, D),
            "basis": (L, KV, D, D),
            "bits": (L, KV, D),
            "step": (L, KV, D),
            "level": (L, KV, D),
            "inv_freq": (D // 2,),
        }
        for name, shape in shapes.items():
            t = (self.klt or {}).get(name)
            if t is None or tuple(t.shape) != shape:
                raise UserError(
                    f"a plan with KLT units needs klt_{name} of shape {list(shape)}, got "
                    f"{None if t is None else list(t.shape)}",
                    key=f"klt_{name}",
                )
        bits = self.klt["bits"]
        for layer, p in enumerate(self.precision):
            for h, x in enumerate(p["k"]):
                if x in KLT_PRECISIONS:
                    b = bits[layer, h].long()
                    if int(b.min()) < 0 or int(b.max()) > 8 or int(b.sum()) != KLT_PRECISIONS[x] * D:
                        raise UserError(
                            f"klt_bits of layer {layer} head {h} must be 0..8 and sum to "
                            f"{KLT_PRECISIONS[x] * D} ({x}), got sum {int(b.sum())}",
                            key="klt_bits",
                        )

    @property
    def has_klt(self) -> bool:
        """Whether some key units are stored as KLT coefficients before RoPE (their writes need positions)."""
        return any(x in KLT_PRECISIONS for p in self.precision for x in p["k"])

    @property
    def has_exact(self) -> bool:
        """Whether some entries are also kept exact (FP16) beside their codes (sink or recent window)."""
        return self.sink_tokens > 0 or self.recent_window > 0

    def exact_bytes_per_sequence(self, lookahead: int) -> int:
        """Bytes of one sequence's exact copies (runtime.paged_kv.RecentKV): K and V of every unit in FP16 for
        sink_tokens + recent_window + lookahead entries (the ring also holds one step's tree)."""
        if not self.has_exact:
            return 0
        return (
            self.num_layers
            * self.num_kv_heads
            * 2
            * 2
            * self.head_size
            * (self.sink_tokens + self.recent_window + lookahead)
        )

    @property
    def effective_group_size(self) -> int:
        return min(self.group_size, self.head_size)

    @classmethod
    def uniform(
        cls, format: str, num_layers: int, num_kv_heads: int, head_size: int, group_size: int = DEFAULT_GROUP_SIZE
    ) -> "KVPlan":
        """Plans that need no calibration: fp16, fp8, int8 and int4-naive (G = D, no channel scale)."""
        prec = {"fp8": "fp8", "int8": "int8", "int4-naive": "int4", "fp16": None, "int4-fp8-outlier": "int4"}[format]
        if format == "int4-naive":
            group_size = head_size
        table = (
            []
            if prec is None
            else [{"k": [prec] * num_kv_heads, "v": [prec] * num_kv_heads} for _ in range(num_layers)]
        )
        return cls(format, num_layers, num_kv_heads, head_size, group_size, table)

    def shard(self, rank: int, tp: int) -> "KVPlan":
        """The plan of tensor-parallel rank `rank`'s KV heads (the converter's split: a contiguous range of
        num_kv_heads / tp heads, or the one head rank // (tp / num_kv_heads) when tp exceeds them)."""
        KV = self.num_kv_heads
        heads = list(range(rank * KV // tp, (rank + 1) * KV // tp)) if tp <= KV else [rank // (tp // KV)]
        idx = torch.tensor(heads)
        pick = lambda t, dim: None if t is None else t.index_select(dim, idx).contiguous()  # noqa: E731
        klt = None if self.klt is None else {n: t if n == "inv_freq" else pick(t, 1) for n, t in self.klt.items()}
        return replace(
            self,
            num_kv_heads=len(heads),
            precision=[{t: [p[t][h] for h in heads] for t in ("k", "v")} for p in self.precision],
            k_channel_scale=pick(self.k_channel_scale, 1),
            int4_clip=pick(self.int4_clip, 2),
            k_mean=pick(self.k_mean, 1),
            klt=klt,
            first_kv_head=self.first_kv_head + heads[0],
            total_kv_heads=self.total_kv_heads,
        )

    def unit_precision(self) -> torch.Tensor:
        """[L, 2, KV] int8 precision codes."""
        return torch.tensor(
            [[[PRECISION_CODES[x] for x in p[t]] for t in ("k", "v")] for p in self.precision], dtype=torch.int8
        ).reshape(self.num_layers, 2, self.num_kv_heads)

    def bytes_per_token(self) -> int:
        """Payload + scales per token over all units (what the pools allocate per slot)."""
        d, g = self.head_size, self.effective_group_size
        if self.format == "fp16":
            return self.num_layers * self.num_kv_heads * 2 * 2 * d
        return sum(
            BY_CODE[int(c)].payload_width(d) + 2 * (1 if BY_CODE[int(c)].tabled else d // g)
            for c in self.unit_precision().flatten()
        )

    def compression_vs_fp16(self, seq_len: Optional[int] = None, lookahead: int = 0) -> float:
        """FP16 bytes / this plan's bytes per cached token; with exact entries, their per-sequence copies are
        spread over seq_len tokens (a sequence's pages hold seq_len + lookahead tokens)."""
        fp16 = self.num_layers * self.num_kv_heads * 2 * 2 * self.head_size
        if not self.has_exact:
            return fp16 / self.bytes_per_token()
        if seq_len is None:
            raise ValueError("a plan with exact entries has a compression only for a sequence length")
        n = seq_len + lookahead
        return fp16 * n / (self.bytes_per_token() * n + self.exact_bytes_per_sequence(lookahead))

    def to_json(self) -> dict:
        return {
            "format": self.format,
            "version": PLAN_VERSION,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "group_size": self.group_size,
            "outlier_fraction": self.outlier_fraction,
            "precision": self.precision,
            "has_k_channel_scale": self.k_channel_scale is not None,
            "has_int4_clip": self.int4_clip is not None,
            "rotation": self.rotation,
            "has_k_mean": self.k_mean is not None,
            "sink_tokens": self.sink_tokens,
            "recent_window": self.recent_window,
            "has_klt": self.klt is not None,
            "calibration": self.calibration,
        }

    def save(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")
        tensors = {}
        if self.k_channel_scale is not None:
            tensors["k_channel_scale"] = self.k_channel_scale.float().contiguous().cpu()
        if self.int4_clip is not None:
            tensors["int4_clip"] = self.int4_clip.float().contiguous().cpu()
        if self.k_mean is not None:
            tensors["k_mean"] = self.k_mean.float().contiguous().cpu()
        for name, t in (self.klt or {}).items():
            tensors[f"klt_{name}"] = t.to(KLT_TABLE_DTYPES.get(name, torch.float32)).contiguous().cpu()
        save_file(tensors, str(out / "scales.safetensors"))

    @classmethod
    def load(cls, plan_dir: str | Path) -> "KVPlan":
        d = Path(plan_dir)
        f = d / "plan.json"
        try:
            j = json.loads(f.read_text())
        except FileNotFoundError:
            raise UserError("KV plan not found (expected plan.json written by calibration)", file=str(f)) from None
        except json.JSONDecodeError as e:
            raise UserError(f"not valid JSON: {e}", file=str(f)) from None
        version = j.get("version", 1)
        if version not in (1, PLAN_VERSION):
            raise UserError(
                f"KV plan version {version!r} is not one this bpcompile reads (1 or {PLAN_VERSION}); "
                "rebuild the engine",
                file=str(f),
                key="version",
            )
        try:
            t = load_file(str(d / "scales.safetensors")) if (d / "scales.safetensors").exists() else {}
            plan = cls(
                j["format"],
                j["num_layers"],
                j["num_kv_heads"],
                j["head_size"],
                j["group_size"],
                j["precision"],
                t.get("k_channel_scale"),
                t.get("int4_clip"),
                j.get("outlier_fraction", 0.0),
                j.get("calibration", {}),
                j.get("rotation", "none"),
                t.get("k_mean"),
                j.get("sink_tokens", 0),
                j.get("recent_window", 0),
                {n[4:]: x for n, x in t.items() if n.startswith("klt_")} or None,
            )
        except KeyError as e:
            raise UserError("missing key in KV plan", file=str(f), key=str(e.args[0])) from None
        for name in ("k_channel_scale", "k_mean", "klt"):
            if j.get(f"has_{name}") and getattr(plan, name) is None:
                raise UserError(
                    f"plan says it has {name} but scales.safetensors lacks it",
                    file=str(d / "scales.safetensors"),
                    key=name,
                )
        return plan


# ---------------------------------------------------------------------------------------------
# The quantized store (layout: docs/KV_FORMAT.md §2).


class QuantKVStore(KVStore):
    """Mixed-precision paged cache: one pool per precision for all layers, [P, U, S, ...] each."""

    def __init__(
        self,
        plan: KVPlan,
        num_pages: int,
        page_size: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if plan.format == "fp16":
            raise ValueError("fp16 plans use FloatKVStore (make_kv_store picks it)")
        L, KV, D = plan.num_layers, plan.num_kv_heads, plan.head_size
        self.plan, self.num_layers, self.num_kv_heads, self.head_size = plan, L, KV, D
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        self.G = G = plan.effective_group_size
        dev = torch.device(device)
        self.unit_precision = plan.unit_precision().to(dev)
        # unit_index: position of each unit in its precision's pool, in increasing global unit id
        flat = self.unit_precision.flatten().cpu()
        index = torch.zeros_like(flat, dtype=torch.int32)
        counts = {}
        for u, c in enumerate(flat.tolist()):
            index[u] = counts.get(c, 0)
            counts[c] = index[u] + 1
        self.unit_index = index.reshape(L, 2, KV).to(dev)
        # per precision (registry order) a payload pool and an fp16 scale pool, [P, units, S, ...]
        self.payload, self.scales = {}, {}
        for prec in PRECISIONS:
            n = int(counts.get(prec.code, 0))
            self.payload[prec.code] = torch.zeros(
                num_pages, n, page_size, prec.payload_width(D), dtype=prec.payload_dtype, device=dev
            )
            # a KLT unit has one scale per token whatever the group size (its coefficients share one range)
            self.scales[prec.code] = torch.zeros(
                num_pages, n, page_size, 1 if prec.tabled else D // G, dtype=torch.float16, device=dev
            )
        kcs = plan.k_channel_scale if plan.k_channel_scale is not None else torch.ones(L, KV, D)
        clip = plan.int4_clip if plan.int4_clip is not None else torch.ones(L, 2, KV)
        self.k_channel_scale = kcs.float().to(dev).contiguous()
        self.int4_clip = clip.float().to(dev).contiguous()
        self._has_kcs = plan.k_channel_scale is not None
        self.rotation = plan.rotation
        self.k_mean = plan.k_mean.float().to(dev).contiguous() if plan.k_mean is not None else None
        self._H = hadamard(D, dev) if plan.rotation == "hadamard" else None
        # a shard's global unit id (layer * 2 + kv) * KV + head -> the model's, (layer * 2 + kv) * total + first + head
        # (None when the store holds every KV head: the ids are the same)
        self._model_unit = None
        if (plan.first_kv_head, plan.total_kv_heads) != (0, KV):
            lk, h = torch.arange(2 * L).repeat_interleave(KV), torch.arange(KV).repeat(2 * L)
            self._model_unit = (lk * plan.total_kv_heads + plan.first_kv_head + h).to(dev)
        # KLT key units: per layer (their heads, basis, inverse, mean); positions of every slot, for RoPE on read
        self._klt, self.positions = {}, None
        if plan.has_klt:
            t = {n: x.to(dev) for n, x in plan.klt.items()}
            self.inv_freq = t["inv_freq"].float()
            self.positions = torch.zeros(num_pages, page_size, dtype=torch.int32, device=dev)
            for layer in range(L):
                heads = [h for h, x in enumerate(plan.precision[layer]["k"]) if x in KLT_PRECISIONS]
                if heads:
                    hi = torch.tensor(heads, device=dev)
                    self._klt[layer] = (hi, *(t[n][layer, hi] for n in ("basis", "weight", "mean")))
        # what the kernels multiply dequantized keys by: with a transform the channel scale is folded into the
        # query instead (kernel_query), and the kernels see ones; so do KLT key units (their keys come back whole)
        self.kernel_k_channel_scale = (
            torch.ones_like(self.k_channel_scale) if self.transformed else self.k_channel_scale
        )
        if self._klt and not self.transformed:
            self.kernel_k_channel_scale = self.kernel_k_channel_scale.clone()
            for layer, (heads, *_) in self._klt.items():
                self.kernel_k_channel_scale[layer, heads] = 1.0
        self._kernel_tables: dict = {}
        # layer -> [(precision, unit ids on the stacked K|V axis (kv * KV + head), pool indices, INT4 clip)]:
        # write/read handle K and V of a layer together, one gather per precision (small ops dominate on CPU)
        self._groups = {}
        for layer in range(L):
            prec = self.unit_precision[layer].flatten().cpu()
            self._groups[layer] = [
                (
                    c,
                    units.to(dev),
                    self.unit_index[layer].flatten()[units.to(dev)].long(),
                    self._klt_tables(layer, units)
                    if BY_CODE[c].tabled
                    else self.int4_clip[layer].flatten()[units.to(dev)][None, :, None],
                )
                for c in BY_CODE
                if len(units := (prec == c).nonzero().flatten()) > 0
            ]
        # the same over every layer's units at once (global unit id layer * 2 * KV + unit), for write_layers; a KLT
        # group's tables are its units' rows of every layer, stacked
        prec = self.unit_precision.flatten().cpu()
        self._all_groups = [
            (
                c,
                units.to(dev),
                self.unit_index.flatten()[units.to(dev)].long(),
                self._klt_tables(units // (2 * KV), units % (2 * KV))
                if BY_CODE[c].tabled
                else self.int4_clip.flatten()[units.to(dev)][None, :, None],
            )
            for c in BY_CODE
            if len(units := (prec == c).nonzero().flatten()) > 0
        ]
        # every KLT key unit of the plan as (layer, head), with its basis, weight and mean stacked: write_layers
        # transforms them all in one product
        if self._klt:
            lh = [(layer, int(h)) for layer, (hi, *_) in self._klt.items() for h in hi.tolist()]
            self._klt_all = (
                torch.tensor([x[0] for x in lh], device=dev),
                torch.tensor([x[1] for x in lh], device=dev),
                *(torch.cat([self._klt[layer][i] for layer in self._klt]) for i in (1, 2, 3)),
            )

    def _dither(self, layer: int, units: torch.Tensor, p, o) -> torch.Tensor:
        """KLT units' dither for slots (p, o): from their recorded positions and global unit ids (K units; layer -1:
        `units` are this store's global ids already), as the whole model numbers them (a tensor-parallel rank's
        store holds some of its KV heads)."""
        ids = units if layer < 0 else layer * 2 * self.num_kv_heads + units
        if self._model_unit is not None:
            ids = self._model_unit[ids]
        return klt_dither(self.positions[p, o], ids, self.head_size)

    @property
    def dither_heads(self) -> tuple[int, int]:
        """(the model's KV heads, this store's first one): how the kernels number a unit for its KLT dither,
        (layer * 2 + kv) * total + first + head."""
        return self.plan.total_kv_heads, self.plan.first_kv_head

    def _klt_tables(self, layer, units: torch.Tensor) -> tuple:
        """A KLT group's codec tables: (bits, step, level [U, D], packing coefficient / bit [U, B]); the units are
        key units (ids < KV on the stacked K|V axis, i.e. heads) of `layer` (an int, or one layer per unit)."""
        t, heads = self.plan.klt, units.cpu()
        layer = layer.cpu() if isinstance(layer, torch.Tensor) else layer
        bits = t["bits"][layer, heads].long()
        coef, shift = klt_pack_index(bits)
        dev = self.unit_precision.device
        return tuple(
            x.to(dev) for x in (bits, t["step"][layer, heads].float(), t["level"][layer, heads].float(), coef, shift)
        )

    def pools(self, precisions=PRECISIONS) -> list[torch.Tensor]:
        """Payload and scale pool of each of `precisions` (default: all), in registry order. A reader's kernels,
        graphs or plugin take those of `reader_precisions(reader)`, in that order."""
        return [t for prec in precisions for t in (self.payload[prec.code], self.scales[prec.code])]

    def reader_pools(self, reader: str) -> list[torch.Tensor]:
        """The pools `reader`'s kernels, graphs or plugin take (those of reader_precisions(reader)), in order."""
        return self.pools(reader_precisions(reader))

    def support(self, reader: str) -> list[str]:
        """plan_support(self.plan, reader): why `reader` cannot read this cache (empty: it can)."""
        return plan_support(self.plan, reader)

    def kernel_transform(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions=None):
        """What a quantize kernel codes for k, v [N, KV, D] written at slots [N]: §3 step 1, with KLT key units as
        their coefficients (the slots' positions are recorded first, as write() does); k, v as they are for a plan
        without a transform."""
        if self.positions is not None:
            p, o = self._split(slots)
            kv = self._transform(layer, k, v, self._positions(p, o, positions))
            return kv[:, : self.num_kv_heads], kv[:, self.num_kv_heads :]
        return self.transform(layer, k, v) if self.transformed else (k, v)

    def kernel_klt(self) -> tuple[torch.Tensor, ...]:
        """The KLT tables as the kernels read them: (slot positions [P, S] int32, per key unit bits and bit-stream
        offsets [L, KV, D] int32, steps, levels, weights, means [L, KV, D] float32, basis [L, KV, D, D] float32,
        inverse frequencies [D/2] float32); one-element placeholders for a plan without KLT units."""
        if "klt" not in self._kernel_tables:
            dev = self.unit_precision.device
            if self.positions is None:
                z, zi = torch.zeros(1, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
                self._kernel_tables["klt"] = (zi, zi, zi, z, z, z, z, z, z)
            else:
                t = {n: x.to(dev) for n, x in self.plan.klt.items()}
                bits = t["bits"].to(torch.int32).contiguous()
                f = lambda n: t[n].float().contiguous()  # noqa: E731
                self._kernel_tables["klt"] = (
                    self.positions,
                    bits,
                    (bits.cumsum(-1, dtype=torch.int32) - bits).contiguous(),
                    f("step"),
                    f("level"),
                    f("basis"),
                    f("weight"),
                    f("mean"),
                    f("inv_freq"),
                )
        tables = self._kernel_tables["klt"]
        return (self.positions, *tables[1:]) if self.positions is not None else tables

    def kernel_exact_maps(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """How kernels that attend in the stored basis (kernel_query) read an exact FP16 copy k, v: k @ Mk + bk and
        v @ Mv, so that q'·k' = q·(k - k_mean) as for the codes. (Mk [L, KV, D, D] = diag(1/c) @ H, bk [L, KV, D]
        = -(k_mean / c) @ H, Mv [D, D] = H; H the identity without rotation; KLT key units: Mk = I, bk = 0, their
        queries are the model's.)"""
        if "exact" not in self._kernel_tables:
            L, KV, D = self.num_layers, self.num_kv_heads, self.head_size
            dev = self.unit_precision.device
            H = self._H if self._H is not None else torch.eye(D, device=dev)
            c = self.k_channel_scale if self._has_kcs else torch.ones(L, KV, D, device=dev)
            m = self.k_mean if self.k_mean is not None else torch.zeros(L, KV, D, device=dev)
            mk = (1.0 / c)[..., :, None] * H
            bk = -(m / c) @ H
            for layer, (heads, *_) in self._klt.items():
                mk[layer, heads] = torch.eye(D, device=dev)
                bk[layer, heads] = 0.0
            self._kernel_tables["exact"] = (mk.contiguous(), bk.contiguous(), H.contiguous())
        return self._kernel_tables["exact"]

    def _split(self, slots):
        return slots // self.page_size, slots % self.page_size

    def _quantize(
        self, x: torch.Tensor, layer: int, p, o, out: Optional[torch.Tensor] = None, groups: Optional[list] = None
    ) -> None:
        """x [N, 2 * KV, D]: K units then V units of one layer, transformed. out (same shape): also receives what
        a read of these slots returns, decoded from the codes just made (no gather from the pools). groups: the
        units to encode (default: the layer's; `_all_groups` with x [N, L * 2 * KV, D], every layer's units)."""
        groups = self._groups[layer] if groups is None else groups
        whole = len(groups) == 1  # every unit of the layer in one precision: no gather, no scatter
        for c, units, idx, clip in groups:
            xs = x if whole else x[:, units]
            pi, ii, oi = p[:, None], idx[None, :], o[:, None]
            if BY_CODE[c].tabled:
                clip = clip + (self._dither(layer, units, p, o),)
            q, sc, dec = BY_CODE[c].encode(xs, self.G, clip, out is not None)
            self.payload[c][pi, ii, oi], self.scales[c][pi, ii, oi] = q, sc
            if out is None:
                continue
            if whole:
                out.copy_(dec)
            else:
                out[:, units] = dec

    def _dequantize(self, layer: int, p, o) -> torch.Tensor:
        """-> [N, 2 * KV, D]: K units then V units of one layer, in the transformed basis."""
        out = torch.empty(len(p), 2 * self.num_kv_heads, self.head_size, dtype=torch.float32, device=p.device)
        for c, heads, idx, tables in self._groups[layer]:
            pi, ii, oi = p[:, None], idx[None, :], o[:, None]
            prec = BY_CODE[c]
            out[:, heads] = prec.decode(
                self.payload[c][pi, ii, oi],
                self.scales[c][pi, ii, oi],
                self.G,
                *((tables + (self._dither(layer, heads, p, o),),) if prec.tabled else ()),
            )
        return out

    @property
    def transformed(self) -> bool:
        """Whether keys are centered or anything is rotated before quantization (docs/KV_FORMAT.md §3 step 1)."""
        return self._H is not None or self.k_mean is not None

    def transform(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1 of §3 for k, v [N, KV, D]: k -> ((k - k_mean) / c) @ H, v -> v @ H, in float32 (without a
        rotation H is the identity, without k_mean the mean is 0). The kernels quantize exactly these values."""
        kv = self._transform(layer, k, v)
        return kv[:, : self.num_kv_heads], kv[:, self.num_kv_heads :]

    def _transform(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """transform() as one [N, 2 * KV, D] tensor, K units then V units; KLT key units (which need the tokens'
        positions) as their coefficients, (unrope(k) - mean) @ basis."""
        raw = k
        k = k.float()
        if self.k_mean is not None:
            k = k - self.k_mean[layer]
        if self._has_kcs:
            k = k / self.k_channel_scale[layer]
        kv = torch.cat([k, v.float()], dim=1)
        kv = kv @ self._H if self._H is not None else kv
        if layer in self._klt:
            heads, *tables = self._klt[layer]
            kv[:, heads] = klt_coefficients(raw[:, heads], positions, self.inv_freq, *tables)
        return kv

    def kernel_query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [..., H, D] as kernels that attend over the transformed K/V directly take it: (q * c) @ H, float32.
        Then q'·k' = q·(k - k_mean) (H is orthonormal and symmetric), which differs from q·k by a constant per
        query that softmax ignores; the attention output comes back rotated (kernel_output)."""
        H, KV = q.shape[-2], self.num_kv_heads
        raw = q = q.float()
        if self._has_kcs:
            q = q * self.k_channel_scale[layer].repeat_interleave(H // KV, dim=0)
        q = q @ self._H if self._H is not None else q
        if layer in self._klt:  # KLT key units: the kernels rebuild the model's keys, so their queries stay the model's
            klt = torch.zeros(KV, dtype=torch.bool, device=q.device)
            klt[self._klt[layer][0]] = True
            q = torch.where(klt.repeat_interleave(H // KV)[:, None], raw, q)
        return q

    def kernel_output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output over the transformed V [..., D] -> the model's: out @ H (H is its own inverse)."""
        return out.float() @ self._H if self._H is not None else out

    def _positions(self, p, o, positions):
        """Record the written slots' RoPE positions (KLT plans: a read re-applies RoPE at them)."""
        if self.positions is None:
            return None
        if positions is None:
            raise ValueError("this KV plan stores keys before RoPE (KLT units): write() needs the tokens' positions")
        positions = positions.reshape(-1).to(self.positions.device)
        self.positions[p, o] = positions.to(torch.int32)
        return positions

    def write(self, layer, slots, k, v, positions=None):
        p, o = self._split(slots)
        positions = self._positions(p, o, positions)
        self._quantize(self._transform(layer, k, v, positions), layer, p, o)

    def write_read(self, layer, slots, k, v, positions=None) -> tuple[torch.Tensor, torch.Tensor]:
        """write(), returning what read(layer, slots) now gives (k, v [N, KV, D] in the compute dtype)."""
        p, o = self._split(slots)
        positions = self._positions(p, o, positions)
        x = self._transform(layer, k, v, positions)
        out = torch.empty_like(x)
        self._quantize(x, layer, p, o, out)
        return self._untransform(layer, out, positions)

    def write_layers(self, slots, k, v, positions=None):
        self._write_layers(slots, k, v, positions, decoded=False)

    def write_read_layers(self, slots, k, v, positions=None):
        return self._write_layers(slots, k, v, positions, decoded=True)

    def _write_layers(self, slots, k, v, positions, decoded: bool):
        """Every layer's K/V in one transform, one encode per precision and one scatter per pool (a store
        written layer by layer costs ~15 small ops per layer: on CPU at decode they were a fifth of a step);
        element for element the arithmetic of write/write_read."""
        L, N, KV, D = k.shape
        p, o = self._split(slots)
        positions = self._positions(p, o, positions)
        kf = k.float()
        if self.k_mean is not None:
            kf = kf - self.k_mean[:, None]
        if self._has_kcs:
            kf = kf / self.k_channel_scale[:, None]
        x = torch.cat([kf, v.float()], dim=2)  # [L, N, 2 * KV, D]
        x = x @ self._H if self._H is not None else x
        if self._klt:  # KLT key units: their coefficients, (unrope(k) - mean) @ basis, as _transform computes them
            ll, hh, *tables = self._klt_all
            x[ll, :, hh] = klt_coefficients(k[ll, :, hh].transpose(0, 1), positions, self.inv_freq, *tables).transpose(
                0, 1
            )
        x = x.transpose(0, 1).reshape(N, L * 2 * KV, D)
        out = torch.empty_like(x) if decoded else None
        self._quantize(x, -1, p, o, out, self._all_groups)
        if not decoded:
            return None
        z = out = out.view(N, L, 2 * KV, D).transpose(0, 1)
        out = out @ self._H if self._H is not None else out
        kk, vv = out[:, :, :KV], out[:, :, KV:]
        if self._has_kcs:
            kk = kk * self.k_channel_scale[:, None]
        if self.k_mean is not None:
            kk = kk + self.k_mean[:, None]
        if self._klt:
            kk = kk.clone()
            kk[ll, :, hh] = klt_keys(z[ll, :, hh].transpose(0, 1), positions, self.inv_freq, *tables).transpose(0, 1)
        return kk.to(self.dtype), vv.to(self.dtype)

    def read(self, layer, slots):
        p, o = self._split(slots)
        positions = self.positions[p, o] if self.positions is not None else None
        return self._untransform(layer, self._dequantize(layer, p, o), positions)

    def _untransform(
        self, layer: int, kv: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 2 * KV, D] in the stored basis -> k, v [N, KV, D] as the model sees them, in the compute dtype."""
        z = kv
        if self._H is not None:
            kv = kv @ self._H
        k, v = kv[:, : self.num_kv_heads], kv[:, self.num_kv_heads :]
        if self._has_kcs:
            k = k * self.k_channel_scale[layer]
        if self.k_mean is not None:
            k = k + self.k_mean[layer]
        if layer in self._klt:
            heads, *tables = self._klt[layer]
            k = k.clone()
            k[:, heads] = klt_keys(z[:, heads], positions, self.inv_freq, *tables)
        return k.to(self.dtype), v.to(self.dtype)

    def move(self, src, dst):
        sp, so = self._split(src)
        dp, do = self._split(dst)
        for t in self.pools():
            t[dp, :, do] = t[sp, :, so].clone()
        if self.positions is not None:
            self.positions[dp, do] = self.positions[sp, so].clone()

    def nbytes(self) -> int:
        static = [self.unit_precision, self.unit_index, self.k_channel_scale, self.int4_clip]
        static += [t for t in (self.k_mean, self._H, self.positions) if t is not None]
        static += [t for tables in self._klt.values() for t in tables[1:]]
        if self._klt:
            static += [self.plan.klt[n] for n in ("step", "level", "bits", "inv_freq")]
        return sum(t.numel() * t.element_size() for t in self.pools() + static)


def make_kv_store(
    plan: KVPlan, model_cfg, num_pages: int, page_size: int, device: str | torch.device = "cpu"
) -> KVStore:
    """The store a plan describes. `read` returns float32 (FloatKVStore fp16 returns fp16): cast to the
    compute dtype at the call site."""
    c = model_cfg
    if (plan.num_layers, plan.num_kv_heads, plan.head_size) != (c.num_layers, c.num_kv_heads, c.head_size):
        raise UserError(
            f"KV plan is for {plan.num_layers} layers x {plan.num_kv_heads} KV heads x head size "
            f"{plan.head_size}, model has {c.num_layers} x {c.num_kv_heads} x {c.head_size}",
            key="kv_plan",
        )
    if plan.format == "fp16":
        return FloatKVStore(
            c.num_layers, c.num_kv_heads, c.head_size, num_pages, page_size, dtype=torch.float16, device=device
        )
    return QuantKVStore(plan, num_pages, page_size, device)


def kv_store_factory(plan: KVPlan):
    """For Generator(kv_store_factory=...): (model_cfg, num_pages, page_size, device) -> KVStore."""

    def factory(model_cfg, num_pages, page_size, device="cpu"):
        return make_kv_store(plan, model_cfg, num_pages, page_size, device)

    return factory


def fake_quantize(
    x: torch.Tensor,
    precision: str,
    group_size: int,
    channel_scale: Optional[torch.Tensor] = None,
    clip=1.0,
    mean: Optional[torch.Tensor] = None,
    rotate: bool = False,
) -> torch.Tensor:
    """Quantize then dequantize x [..., D] exactly as the store does (calibration and tests use it):
    x -> (x - mean) / channel_scale -> @ H (rotate) -> quantize -> dequantize -> @ H -> * channel_scale + mean."""
    x = x.float()
    if mean is not None:
        x = x - mean
    if channel_scale is not None:
        x = x / channel_scale
    if rotate:
        x = x @ hadamard(x.shape[-1], x.device)
    if precision not in PRECISION_CODES or BY_CODE[PRECISION_CODES[precision]].tabled:
        raise ValueError(f"fake_quantize: unknown or tabled (KLT) precision {precision!r}")
    prec = BY_CODE[PRECISION_CODES[precision]]
    y = prec.decode(*prec.encode(x, group_size, clip, False)[:2], group_size)
    if rotate:
        y = y @ hadamard(y.shape[-1], y.device)
    if channel_scale is not None:
        y = y * channel_scale
    return y + mean if mean is not None else y
