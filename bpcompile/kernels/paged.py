"""Custom kernels (OpenAI Triton) for the INT4/FP8-outlier paged KV cache and tree verification.

Three kernels over the `QuantKVStore` layout (docs/KV_FORMAT.md, the contract) and their entry points:

- `quantize_append(store, layer, slots, k, v)`: new K/V -> packed INT4 / FP8 / INT8 bytes + fp16 scales,
  bit for bit what `QuantKVStore.write` (the oracle) stores.
- `paged_attention(q, store, layer, block_tables, context_lens, tree_mask, num_tree, sm_scale)`: attention
  of G query tokens per sequence over the committed context (read through the block table) plus the tree
  tokens after it (visible per the packed tree mask), dequantizing in the kernel; decode is G = 1.
  Split-K ("flash decoding") over the context so that a few long sequences still fill every SM.
  `paged_attention_reference` is the same function in plain PyTorch over `store.read()`.
- `move_slots(store, src, dst)`: the accept/compaction byte copy, what `QuantKVStore.move` does.

The entry points run on CUDA tensors (compiled by Triton's JIT) and on CPU tensors through Triton's
interpreter (what the tests use; slow, keep shapes small). `bpcompile.compiler.aot` compiles the same kernels
ahead of time for an engine (sm_90a cubins + C launchers, which the TensorRT plugin wraps).

Nothing here imports from the rest of bpcompile but the tree-mask packing and the shape rule (only torch and triton): the AOT compile imports this module
in a bare subprocess, and benchmarks/gpu_check.py checks them on a GPU (docs/GPU.md).
See docs/KERNELS.md for what is verified where.
"""

from __future__ import annotations

import os
import struct
import sys

import torch

# Without a GPU the kernels can only run in Triton's interpreter, and Triton decides interpreted vs compiled
# when `triton.language` is imported (its own library functions are decorated then). So on a CPU-only
# machine default to the interpreter, unless the caller chose (TRITON_INTERPRET=0: the AOT compile
# subprocess, which needs compilable kernels).
if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bpcompile.kernels.shapes import check_shape  # noqa: E402, F401  (the kernels' entry points and callers use it)
from bpcompile.kernels.tree_mask import pack_bool_mask  # noqa: E402

# Unit precision codes (bpcompile.runtime.kvcache.PRECISIONS): 0 = INT4, 1 = FP8, 2 = INT8, 3 = INT5, 4 = INT6, 5 = INT3,
# 6 / 7 / 8 = KLT4 / KLT5 / KLT6. Kernels use the literals: a Triton kernel cannot read plain module globals (the
# interpreter allows it, the compiler does not). The pools are passed in the registry's order
# (`reader_precisions("triton")`; tests/test_kernels.py checks the argument names against it).


# =============================================================================================
# Kernels. Written against Triton 3.6 (the GPU machine) .. 3.9 (here); no libdevice or inline asm, so the
# interpreter runs them too.


@triton.jit
def _plane(b_lo, b_hi, j, EIGHTH: tl.constexpr):
    """One bit per element of a row's low and high halves ([T, D/2] each, 0 or 1) -> its bit plane [T, D/8]: bit b of
    byte i is element i + b*D/8 (low half: b = j // (D/8); high half: 4 + that). A [T, D/8, D/2] select-and-sum
    gathers them (one non-zero term per bit, so the sum is an OR)."""
    pe = tl.arange(0, EIGHTH)
    bit = (j // EIGHTH)[None, :]
    bits = (b_lo << bit) | (b_hi << (bit + 4))
    return tl.sum(tl.where(((j % EIGHTH)[None, :] == pe[:, None])[None, :, :], bits[:, None, :], 0), axis=2)


@triton.jit
def _dither(pos, unit, i):
    """klt_dither (docs/KV_FORMAT.md §3 "KLT units"): the hash of (position [T] int64, global unit id, coefficient
    index [X]) -> [T, X] float32 in [-0.5, 0.5]. int64 products wrap; their low 32 bits are exact. The value
    (h + 0.5) / 2^32 - 0.5 is the odd integer 2h + 1 - 2^32 times 2^-33: one rounding, int64 -> float32."""
    h = (pos[:, None] * 2654435761 + unit.to(tl.int64) * 3266489917 + i.to(tl.int64)[None, :] * 2246822519) + 0x6A09E667
    h = h & 0xFFFFFFFF
    h = ((h ^ (h >> 15)) * 2246822519) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * 3266489917) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    return (2 * h + 1 - 4294967296).to(tl.float32) * 1.1641532182693481e-10


@triton.jit
def _qmax(bits):
    """A KLT coefficient's largest level: 2^(b-1) - 1 for b >= 2, 0 otherwise (float32)."""
    return tl.where(bits >= 2, (1 << tl.maximum(bits - 1, 0)) - 1, 0).to(tl.float32)


# Triton's JIT compiles a kernel per specialization of its run-time arguments too (an int equal to 1 becomes a
# constant, an int or pointer divisible by 16 gets an alignment hint), so the arguments whose values change from
# call to call (token and row counts, the layer, the query rows, the split size, table widths, index tensors that
# may be views at any offset) and the KLT dither's head numbering (it differs between tensor-parallel ranks) are
# left unspecialized: the kernels a process compiles are then fixed by the constexprs alone, which `warm_up`
# enumerates when an engine loads on CUDA. Strides and the K/V/query/pool pointers keep their hints: they are
# multiples of the head size (a power of two >= 32) in every call.
_INDEX = ["slots", "block_tables", "context_lens", "tree_mask", "num_tree", "num_q", "positions", "seq_row"]


@triton.jit(do_not_specialize=["N", "layer", "dither_kvh", "dither_head0"], do_not_specialize_on_alignment=_INDEX)
def _quantize_append_kernel(
    K,
    V,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,  # new keys/values [N, KVH, D], last dim contiguous
    slots,
    N,  # flat slots [N] int64
    q4,
    s4,
    q8,
    s8,
    qi8,
    si8,
    q5,
    s5,
    q6,
    s6,
    q3,
    s3,
    qk4,
    sk4,
    qk5,
    sk5,
    qk6,
    sk6,
    U4,
    U8,
    Ui8,
    U5,
    U6,
    U3,
    Uk4,
    Uk5,
    Uk6,  # pools: payload as uint8, scales fp16 ([P, U, PAGE, ...]), in the registry's order, then unit counts
    unit_precision,
    unit_index,
    k_channel_scale,
    int4_clip,  # static tables [L, 2, KVH] / [L, KVH, D]
    layer,
    KVH,
    positions,
    klt_bits,
    klt_offset,
    klt_step,  # KLT: each slot's position [P, PAGE] int32; per key unit bits / stream offsets / steps [L, KVH, D]
    dither_kvh,
    dither_head0,  # KLT: the model's KV heads and this store's first (a tensor-parallel rank's), for the dither
    PAGE: tl.constexpr,
    D: tl.constexpr,
    GS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    KLT: tl.constexpr,
):
    """One program = BLOCK_T tokens of one unit (K or V of one KV head). Every operation follows
    docs/KV_FORMAT.md §3 in fp32 with IEEE division (div_rn), so the bytes equal the oracle's. KLT units get their
    coefficients (the launcher's transform: unrope, centre, weight, basis) and code them here."""
    HALF: tl.constexpr = D // 2
    EIGHTH: tl.constexpr = D // 8
    NG: tl.constexpr = D // GS
    pid_t = tl.program_id(0)
    unit = tl.program_id(1)  # kv * KVH + head
    kv = unit // KVH
    head = unit % KVH
    u = (layer * 2 + kv) * KVH + head
    u_model = (layer * 2 + kv) * dither_kvh + dither_head0 + head  # the unit's id in the whole model: its dither's
    prec = tl.load(unit_precision + u).to(tl.int32)
    idx = tl.load(unit_index + u).to(tl.int64)
    clip = tl.load(int4_clip + u)

    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok = t < N
    slot = tl.load(slots + t, mask=tok, other=0).to(tl.int64)
    page = slot // PAGE
    off = slot % PAGE
    j = tl.arange(0, HALF)
    # The two halves of the vector (int4 packs element j with element j + D/2 into one byte).
    src = tl.where(kv == 0, K, V)
    sn = tl.where(kv == 0, stride_kn, stride_vn)
    sh = tl.where(kv == 0, stride_kh, stride_vh)
    row = src + t.to(tl.int64)[:, None] * sn + head * sh
    m2 = tok[:, None]
    x_lo = tl.load(row + j[None, :], mask=m2, other=0.0).to(tl.float32)  # fp32 first (bf16 under the interpreter)
    x_hi = tl.load(row + HALF + j[None, :], mask=m2, other=0.0).to(tl.float32)
    if kv == 0:  # key channel scale c (ones when the plan has none: x / 1 == x exactly)
        cbase = k_channel_scale + (layer * KVH + head) * D
        x_lo = tl.math.div_rn(x_lo, tl.load(cbase + j)[None, :])
        x_hi = tl.math.div_rn(x_hi, tl.load(cbase + HALF + j)[None, :])

    # Per-group absmax. Group of element e is e // GS; a [T, NG, HALF] select keeps this exact for any
    # GS dividing D (groups may straddle the halves when GS = D).
    g = tl.arange(0, NG)
    in_lo = ((j // GS)[None, :] == g[:, None])[None, :, :]
    in_hi = (((j + HALF) // GS)[None, :] == g[:, None])[None, :, :]
    amax = tl.maximum(
        tl.max(tl.where(in_lo, tl.abs(x_lo)[:, None, :], 0.0), axis=2),
        tl.max(tl.where(in_hi, tl.abs(x_hi)[:, None, :], 0.0), axis=2),
    )  # [T, NG]
    # qmax by code: INT4 7, FP8 448, INT8 127, INT5 15, INT6 31, INT3 3.5 (its levels (n - 3.5) s)
    qmax = tl.where(
        prec == 0,
        7.0,
        tl.where(
            prec == 1, 448.0, tl.where(prec == 2, 127.0, tl.where(prec == 3, 15.0, tl.where(prec == 4, 31.0, 3.5)))
        ),
    )
    amax = tl.where(prec == 0, clip * amax, tl.where(prec == 5, amax * 0.8, amax))  # INT4's clip, INT3's fixed one
    s = tl.minimum(tl.math.div_rn(amax, qmax), 65504.0).to(tl.float16)  # fp16(...), RNE, saturating
    sf = s.to(tl.float32)
    # scale of each element, [T, HALF] per half (exact: one non-zero term per max)
    s_lo = tl.max(tl.where(in_lo, sf[:, :, None], 0.0), axis=1)
    s_hi = tl.max(tl.where(in_hi, sf[:, :, None], 0.0), axis=1)
    y_lo = tl.where(s_lo > 0, tl.math.div_rn(x_lo, tl.where(s_lo > 0, s_lo, 1.0)), 0.0)
    y_hi = tl.where(s_hi > 0, tl.math.div_rn(x_hi, tl.where(s_hi > 0, s_hi, 1.0)), 0.0)

    if prec == 0:
        base = (page * U4 + idx) * PAGE + off
        # clamp then round half to even with the 1.5 * 2^23 trick (|y| <= 7, exact in fp32)
        n_lo = ((tl.minimum(tl.maximum(y_lo, -7.0), 7.0) + 12582912.0) - 12582912.0 + 8.0).to(tl.int32)
        n_hi = ((tl.minimum(tl.maximum(y_hi, -7.0), 7.0) + 12582912.0) - 12582912.0 + 8.0).to(tl.int32)
        tl.store(q4 + base[:, None] * HALF + j[None, :], (n_lo | (n_hi << 4)).to(tl.uint8), mask=m2)
        tl.store(s4 + base[:, None] * NG + g[None, :], s, mask=m2)
    elif prec == 1:
        base = (page * U8 + idx) * PAGE + off
        for h in tl.static_range(2):  # encode_fp8_e4m3 by bit manipulation (§3), lo half then hi half
            y = tl.minimum(tl.maximum(y_lo if h == 0 else y_hi, -448.0), 448.0)
            sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
            a = tl.abs(y)
            sub = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
            b = a.to(tl.int32, bitcast=True)
            b = b + 0x7FFFF + ((b >> 20) & 1)
            normal = tl.minimum((b >> 20) - (120 << 3), 0x7E)
            code = tl.where(a < 0.015625, sub, normal) | sign
            tl.store(q8 + base[:, None] * D + h * HALF + j[None, :], code.to(tl.uint8), mask=m2)
        tl.store(s8 + base[:, None] * NG + g[None, :], s, mask=m2)
    elif prec == 2:
        base = (page * Ui8 + idx) * PAGE + off
        for h in tl.static_range(2):
            y = tl.minimum(tl.maximum(y_lo if h == 0 else y_hi, -127.0), 127.0)
            q = ((y + 12582912.0) - 12582912.0).to(tl.int32)
            tl.store(qi8 + base[:, None] * D + h * HALF + j[None, :], (q & 0xFF).to(tl.uint8), mask=m2)
        tl.store(si8 + base[:, None] * NG + g[None, :], s, mask=m2)
    elif prec == 3:  # INT5: the low 4 bits packed as INT4's nibbles, then the plane of bit 4 (§3)
        base = (page * U5 + idx) * PAGE + off
        ROW: tl.constexpr = HALF + EIGHTH
        n_lo = ((tl.minimum(tl.maximum(y_lo, -15.0), 15.0) + 12582912.0) - 12582912.0 + 16.0).to(tl.int32)
        n_hi = ((tl.minimum(tl.maximum(y_hi, -15.0), 15.0) + 12582912.0) - 12582912.0 + 16.0).to(tl.int32)
        tl.store(q5 + base[:, None] * ROW + j[None, :], ((n_lo & 15) | ((n_hi & 15) << 4)).to(tl.uint8), mask=m2)
        pe = tl.arange(0, EIGHTH)
        plane = _plane(n_lo >> 4, n_hi >> 4, j, EIGHTH)
        tl.store(q5 + base[:, None] * ROW + HALF + pe[None, :], plane.to(tl.uint8), mask=m2)
        tl.store(s5 + base[:, None] * NG + g[None, :], s, mask=m2)
    elif prec == 4:  # INT6: INT5's layout, then the plane of bit 5
        base = (page * U6 + idx) * PAGE + off
        ROW6: tl.constexpr = HALF + 2 * EIGHTH
        n_lo = ((tl.minimum(tl.maximum(y_lo, -31.0), 31.0) + 12582912.0) - 12582912.0 + 32.0).to(tl.int32)
        n_hi = ((tl.minimum(tl.maximum(y_hi, -31.0), 31.0) + 12582912.0) - 12582912.0 + 32.0).to(tl.int32)
        tl.store(q6 + base[:, None] * ROW6 + j[None, :], ((n_lo & 15) | ((n_hi & 15) << 4)).to(tl.uint8), mask=m2)
        pe = tl.arange(0, EIGHTH)
        for b in tl.static_range(2):
            plane = _plane((n_lo >> (4 + b)) & 1, (n_hi >> (4 + b)) & 1, j, EIGHTH)
            tl.store(q6 + base[:, None] * ROW6 + HALF + b * EIGHTH + pe[None, :], plane.to(tl.uint8), mask=m2)
        tl.store(s6 + base[:, None] * NG + g[None, :], s, mask=m2)
    elif prec == 5:  # INT3: n = clamp(floor(x / s) + 4, 0, 7), the planes of bits 0, 1, 2
        base = (page * U3 + idx) * PAGE + off
        ROW3: tl.constexpr = 3 * EIGHTH
        n_lo = tl.minimum(tl.maximum(tl.floor(y_lo) + 4.0, 0.0), 7.0).to(tl.int32)
        n_hi = tl.minimum(tl.maximum(tl.floor(y_hi) + 4.0, 0.0), 7.0).to(tl.int32)
        pe = tl.arange(0, EIGHTH)
        for b in tl.static_range(3):
            plane = _plane((n_lo >> b) & 1, (n_hi >> b) & 1, j, EIGHTH)
            tl.store(q3 + base[:, None] * ROW3 + b * EIGHTH + pe[None, :], plane.to(tl.uint8), mask=m2)
        tl.store(s3 + base[:, None] * NG + g[None, :], s, mask=m2)
    elif KLT:  # KLT4 / KLT5 / KLT6 key units: x are the coefficients; one scale per token, a bit stream per row
        pay = tl.where(prec == 6, qk4, tl.where(prec == 7, qk5, qk6))
        sc = tl.where(prec == 6, sk4, tl.where(prec == 7, sk5, sk6))
        nu = tl.where(prec == 6, Uk4, tl.where(prec == 7, Uk5, Uk6)).to(tl.int64)
        rb = HALF + (prec - 6) * EIGHTH  # D/2, 5D/8, 3D/4 bytes
        base = (page * nu + idx) * PAGE + off
        tb = (layer * KVH + head) * D
        b_lo, b_hi = tl.load(klt_bits + tb + j), tl.load(klt_bits + tb + HALF + j)
        t_lo, t_hi = tl.load(klt_step + tb + j), tl.load(klt_step + tb + HALF + j)
        o_lo, o_hi = tl.load(klt_offset + tb + j), tl.load(klt_offset + tb + HALF + j)
        qm_lo, qm_hi = _qmax(b_lo), _qmax(b_hi)
        w_lo, w_hi = b_lo >= 2, b_hi >= 2
        r_lo = tl.where(w_lo[None, :], tl.math.div_rn(tl.abs(x_lo), tl.where(w_lo, qm_lo * t_lo, 1.0)[None, :]), 0.0)
        r_hi = tl.where(w_hi[None, :], tl.math.div_rn(tl.abs(x_hi), tl.where(w_hi, qm_hi * t_hi, 1.0)[None, :]), 0.0)
        ks = tl.minimum(tl.maximum(tl.max(r_lo, axis=1), tl.max(r_hi, axis=1)), 65504.0).to(tl.float16)  # [T]
        kf = ks.to(tl.float32)
        pos = tl.load(positions + page * PAGE + off, mask=tok, other=0).to(tl.int64)
        kb = tl.arange(0, D)  # payload byte k of the row (D >= 3D/4 bytes, masked)
        out = tl.zeros([BLOCK_T, D], tl.int32)
        for h in tl.static_range(2):
            x = x_lo if h == 0 else x_hi
            bits = b_lo if h == 0 else b_hi
            st = t_lo if h == 0 else t_hi
            qm = qm_lo if h == 0 else qm_hi
            o = o_lo if h == 0 else o_hi
            tt = kf[:, None] * st[None, :]
            v = tl.math.div_rn(x, tl.where(tt > 0, tt, 1.0)) + _dither(pos, u_model, j + h * HALF)
            q = (tl.minimum(tl.maximum(v, -qm[None, :]), qm[None, :]) + 12582912.0) - 12582912.0
            q = tl.where((bits[None, :] >= 2) & (tt > 0), q, 0.0)
            n = tl.where(
                bits[None, :] >= 2, q + qm[None, :] + 1.0, tl.where((bits[None, :] == 1) & (x >= 0.0), 1.0, 0.0)
            ).to(tl.int32)
            wsh = n << (o & 7)[None, :]  # < 2^15: its low byte goes to byte o >> 3, its high byte to the next
            at = (o >> 3)[None, None, :]
            out += tl.sum(tl.where(at == kb[None, :, None], (wsh & 255)[:, None, :], 0), axis=2)
            out += tl.sum(tl.where(at + 1 == kb[None, :, None], (wsh >> 8)[:, None, :], 0), axis=2)
        tl.store(pay + base[:, None] * rb + kb[None, :], out.to(tl.uint8), mask=m2 & (kb < rb)[None, :])
        tl.store(sc + base, ks, mask=tok)


@triton.jit
def _by_precision(prec, int4, fp8, int8, int5, int6, int3, klt4, klt5, klt6):
    """A unit's pool (or unit count) by its precision code."""
    return tl.where(
        prec == 0,
        int4,
        tl.where(
            prec == 1,
            fp8,
            tl.where(
                prec == 2,
                int8,
                tl.where(
                    prec == 3,
                    int5,
                    tl.where(
                        prec == 4,
                        int6,
                        tl.where(prec == 5, int3, tl.where(prec == 6, klt4, tl.where(prec == 7, klt5, klt6))),
                    ),
                ),
            ),
        ),
    )


@triton.jit
def _row_layout(prec, HALF: tl.constexpr, EIGHTH: tl.constexpr):
    """A unit's row bytes, the byte offset of its high half (D/2 for FP8 / INT8, 0 where both halves share a byte)
    and where its bit planes start (INT5 / INT6 after the nibbles, INT3 at 0). Products with the constexprs (not
    tl.where between constants) so the compiler sees aligned rows and vectorizes the payload loads."""
    ho = ((prec == 1) | (prec == 2)).to(tl.int64) * HALF
    planes = ((prec == 3) | (prec == 7)).to(tl.int64) + 2 * ((prec == 4) | (prec == 8)).to(tl.int64)
    rb = (prec != 5).to(tl.int64) * (ho + HALF + planes * EIGHTH) + (prec == 5).to(tl.int64) * 3 * EIGHTH
    pb = ((prec == 3) | (prec == 4)).to(tl.int64) * HALF
    return rb, ho, pb


@triton.jit
def _codes(rowp, m2, j, ho, pb, prec, EIGHTH: tl.constexpr):
    """The codes of a tile of rows (rowp [N] row pointers, m2 [N, 1] the tokens loaded) as the values they stand for
    before the scales, low half and high half [N, D/2] fp16 (exact: integers and half-integers below 64).
    Nibbles n -> fp16 1024 + n by bit pattern, minus 1024 + zero (no int->float convert)."""
    pre = rowp[:, None]
    sh = (j // EIGHTH).to(tl.uint16)[None, :]  # which bit of its plane byte holds a low-half element's bit
    if prec == 5:  # INT3: three planes, no nibbles
        x0 = tl.load(pre + (j % EIGHTH)[None, :], mask=m2, other=0).to(tl.uint16)
        x1 = tl.load(pre + EIGHTH + (j % EIGHTH)[None, :], mask=m2, other=0).to(tl.uint16)
        x2 = tl.load(pre + 2 * EIGHTH + (j % EIGHTH)[None, :], mask=m2, other=0).to(tl.uint16)
        lo = ((x0 >> sh) & 1) | (((x1 >> sh) & 1) << 1) | (((x2 >> sh) & 1) << 2)
        hi = ((x0 >> (sh + 4)) & 1) | (((x1 >> (sh + 4)) & 1) << 1) | (((x2 >> (sh + 4)) & 1) << 2)
        lo = ((lo | 0x6400).to(tl.float16, bitcast=True) - 1024.0) - 3.5
        hi = ((hi | 0x6400).to(tl.float16, bitcast=True) - 1024.0) - 3.5
    else:
        b_lo = tl.load(pre + j[None, :], mask=m2, other=0)
        b_hi = tl.load(pre + ho + j[None, :], mask=m2, other=0)
        if prec == 1:
            lo = b_lo.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            hi = b_hi.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        elif prec == 2:  # int8 q: (q + 128) -> 1024 + q + 128, minus 1152
            lo = ((b_lo ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
            hi = ((b_hi ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
        else:  # INT4 (nibbles), INT5 (+ the plane of bit 4), INT6 (+ the plane of bit 5)
            lo = (b_lo & 15).to(tl.uint16)
            hi = (b_hi >> 4).to(tl.uint16)
            if (prec == 3) | (prec == 4):
                x = tl.load(pre + pb + (j % EIGHTH)[None, :], mask=m2, other=0).to(tl.uint16)
                lo = lo | (((x >> sh) & 1) << 4)
                hi = hi | (((x >> (sh + 4)) & 1) << 4)
            if prec == 4:
                x = tl.load(pre + pb + EIGHTH + (j % EIGHTH)[None, :], mask=m2, other=0).to(tl.uint16)
                lo = lo | (((x >> sh) & 1) << 5)
                hi = hi | (((x >> (sh + 4)) & 1) << 5)
            zero = tl.where(prec == 0, 1032.0, tl.where(prec == 3, 1040.0, 1056.0))
            lo = (lo | 0x6400).to(tl.float16, bitcast=True) - zero.to(tl.float16)
            hi = (hi | 0x6400).to(tl.float16, bitcast=True) - zero.to(tl.float16)
    return lo, hi


@triton.jit
def _klt_half(rowp, m2, rb, s, pos, uk, i, bits, o, st, lev):
    """One half of a tile of KLT key rows -> its coefficients [N, D/2] float32 (docs/KV_FORMAT.md §3 "KLT units"):
    each code from the bit stream (the two bytes at its offset), minus the level's offset and the dither, times the
    token's scale s [N] and the coefficient's step; 1-bit coefficients are a sign and a level; 0-bit ones 0."""
    at = (o >> 3)[None, :]
    b0 = tl.load(rowp[:, None] + at, mask=m2, other=0).to(tl.int32)
    b1 = tl.load(rowp[:, None] + at + 1, mask=m2 & (at + 1 < rb), other=0).to(tl.int32)
    n = ((b0 | (b1 << 8)) >> (o & 7)[None, :]) & ((1 << bits) - 1)[None, :]
    qm = _qmax(bits)[None, :]
    t = s[:, None] * st[None, :]
    u = _dither(pos, uk, i)
    return tl.where(
        bits[None, :] >= 2,
        tl.where(t > 0, (n.to(tl.float32) - qm - 1.0 - u) * t, 0.0),
        tl.where(bits[None, :] == 1, tl.where(n > 0, lev[None, :], -lev[None, :]), 0.0),
    )


@triton.jit
def _square(base, j, D: tl.constexpr, HALF: tl.constexpr):
    """The four [D/2, D/2] blocks of a row-major [D, D] float32 matrix: (rows lo|hi) x (columns lo|hi)."""
    r = j[:, None] * D
    return (
        tl.load(base + r + j[None, :]),
        tl.load(base + r + HALF + j[None, :]),
        tl.load(base + HALF * D + r + j[None, :]),
        tl.load(base + HALF * D + r + HALF + j[None, :]),
    )


@triton.jit
def _times(x_lo, x_hi, M_ll, M_lh, M_hl, M_hh):
    """[x_lo | x_hi] @ M for M given as its four blocks -> the product's low and high half (fp32 dots)."""
    lo = tl.dot(x_lo, M_ll, input_precision="ieee") + tl.dot(x_hi, M_hl, input_precision="ieee")
    hi = tl.dot(x_lo, M_lh, input_precision="ieee") + tl.dot(x_hi, M_hh, input_precision="ieee")
    return lo, hi


@triton.jit
def _quant_scores(
    q_lo, q_hi, k_rows, k_sc, krow, tok, j, k_ho, k_pb, kprec, D: tl.constexpr, GS: tl.constexpr, OP: tl.constexpr
):
    """q·k̂ of a tile of quantized key rows [BLOCK_M, N]: codes (exact in fp16) and their scales (per half-row when
    a half lies in one group, GS >= D/2, else per element)."""
    HALF: tl.constexpr = D // 2
    NG: tl.constexpr = D // GS
    m2 = tok[:, None]
    k_lo, k_hi = _codes(k_rows, m2, j, k_ho, k_pb, kprec, D // 8)
    if GS >= HALF:
        ks_lo = tl.load(k_sc + krow * NG, mask=tok, other=0.0).to(tl.float32)
        ks_hi = tl.load(k_sc + krow * NG + HALF // GS, mask=tok, other=0.0).to(tl.float32)
        qk = (
            tl.dot(q_lo, tl.trans(k_lo.to(OP)), input_precision="ieee") * ks_lo[None, :]
            + tl.dot(q_hi, tl.trans(k_hi.to(OP)), input_precision="ieee") * ks_hi[None, :]
        )
    else:
        ks = k_sc + krow[:, None] * NG
        k_lo = k_lo.to(tl.float32) * tl.load(ks + (j // GS)[None, :], mask=m2, other=0.0).to(tl.float32)
        k_hi = k_hi.to(tl.float32) * tl.load(ks + ((j + HALF) // GS)[None, :], mask=m2, other=0.0).to(tl.float32)
        qk = tl.dot(q_lo, tl.trans(k_lo.to(OP)), input_precision="ieee") + tl.dot(
            q_hi, tl.trans(k_hi.to(OP)), input_precision="ieee"
        )
    return qk


@triton.jit(
    do_not_specialize=["nrows", "stride_bt", "layer", "G", "W", "chunk", "stride_tp", "dither_kvh", "dither_head0"],
    do_not_specialize_on_alignment=_INDEX + ["q_pos", "tree_pos"],
)
def _paged_attention_kernel(
    Q,
    stride_qb,
    stride_qg,
    stride_qh,  # queries [B, G, H, D], post-RoPE, last dim contiguous
    Out,
    stride_ob,
    stride_og,
    stride_oh,  # [B, G, H, D] (written when SPLIT == 0)
    part_acc,
    part_ml,
    nrows,  # SPLIT == 1: [NS, B*G*H, D] and [NS, B*G*H, 2] (m, l) fp32 partials
    q4,
    s4,
    q8,
    s8,
    qi8,
    si8,
    q5,
    s5,
    q6,
    s6,
    q3,
    s3,
    qk4,
    sk4,
    qk5,
    sk5,
    qk6,
    sk6,
    U4,
    U8,
    Ui8,
    U5,
    U6,
    U3,
    Uk4,
    Uk5,
    Uk6,
    unit_precision,
    unit_index,
    k_channel_scale,
    block_tables,
    stride_bt,
    context_lens,
    tree_mask,
    num_tree,
    num_q,
    layer,
    KVH,
    G,
    W,
    scale_bits,
    chunk,  # scale_bits: sm_scale's fp32 bits (AOT launchers pass fp32 args badly)
    positions,
    klt_bits,
    klt_offset,
    klt_step,
    klt_level,
    klt_basis,
    klt_weight,
    klt_mean,
    inv_freq,  # KLT (KLT == 1): slot positions [P, PAGE]; per key unit tables [L, KVH, D] / basis [L, KVH, D, D]
    dither_kvh,
    dither_head0,  # and the model's KV heads and this store's first (a tensor-parallel rank's), for the dither
    rec_k,
    rec_v,
    seq_row,
    q_pos,
    tree_pos,
    stride_tp,
    exact_k_map,
    exact_k_bias,
    exact_v_map,
    SINK,
    WINDOW,
    RING,
    ROWS,  # exact entries (EXACT == 1): the FP16 copies [L, ROWS, KVH, SINK + RING, D], each sequence's row [B],
    # its queries' positions [B, G] and its tree entries' [B, *]; the maps of the copies into the stored basis
    PAGE: tl.constexpr,
    D: tl.constexpr,
    GS: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    F32: tl.constexpr,
    KLT: tl.constexpr,
    EXACT: tl.constexpr,
):
    """One program = one (sequence, KV head, context split, block of query rows). Rows are (tree token g,
    query head r of this KV head's GQA group): GQA shares every K/V byte loaded among R query heads.

    Split s covers context tokens [s*chunk, min((s+1)*chunk, ctx)); split 0 also covers the tree tokens
    [ctx, ctx + num_tree), which are masked by the packed tree mask. Dequantization follows §4: K scales are
    applied to q·k per half-row when a half lies in one group (GS >= D/2), otherwise per element. With exact
    entries a (query, key) pair whose key is a sink position or within the window of the query's position reads
    the key's and value's FP16 copies instead (§4 "Exact entries"), mapped into the basis the codes are in.
    """
    HALF: tl.constexpr = D // 2
    EIGHTH: tl.constexpr = D // 8
    NG: tl.constexpr = D // GS
    HALF_SCALE: tl.constexpr = GS >= HALF
    OP: tl.constexpr = tl.float32 if F32 else tl.float16  # dot operand type: codes are exact in fp16
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // KVH
    kvh = pid_bh % KVH
    ctx = tl.load(context_lens + b).to(tl.int32)
    nt = tl.load(num_tree + b).to(tl.int32)
    nq = tl.load(num_q + b).to(tl.int32)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    g = rows // R
    qh = kvh * R + rows % R
    row_in = g < G
    row_ok = row_in & (g < nq)  # query rows past num_q are padding: no visible token, output 0
    j = tl.arange(0, HALF)

    # q with the key channel scale and softmax scale (in log2 units) folded in: q·(x̂∘c) = (q∘c)·x̂
    qscale = scale_bits.to(tl.float32, bitcast=True) * 1.4426950408889634
    c_base = k_channel_scale + (layer * KVH + kvh) * D
    q_ptr = Q + b * stride_qb + g[:, None] * stride_qg + qh[:, None] * stride_qh
    q_lo = tl.load(q_ptr + j[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_hi = tl.load(q_ptr + HALF + j[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_lo = (q_lo * (tl.load(c_base + j) * qscale)[None, :]).to(OP)
    q_hi = (q_hi * (tl.load(c_base + HALF + j) * qscale)[None, :]).to(OP)

    # The K and V units of this head: pool, unit count, row bytes, high-half offset, where the bit planes start
    uk = layer * 2 * KVH + kvh
    uv = uk + KVH
    kprec = tl.load(unit_precision + uk).to(tl.int32)
    vprec = tl.load(unit_precision + uv).to(tl.int32)
    kidx = tl.load(unit_index + uk).to(tl.int64)
    vidx = tl.load(unit_index + uv).to(tl.int64)
    k_pay = _by_precision(kprec, q4, q8, qi8, q5, q6, q3, qk4, qk5, qk6)
    v_pay = _by_precision(vprec, q4, q8, qi8, q5, q6, q3, qk4, qk5, qk6)
    k_sc = _by_precision(kprec, s4, s8, si8, s5, s6, s3, sk4, sk5, sk6)
    v_sc = _by_precision(vprec, s4, s8, si8, s5, s6, s3, sk4, sk5, sk6)
    kU = _by_precision(kprec, U4, U8, Ui8, U5, U6, U3, Uk4, Uk5, Uk6).to(tl.int64)
    vU = _by_precision(vprec, U4, U8, Ui8, U5, U6, U3, Uk4, Uk5, Uk6).to(tl.int64)
    k_rb, k_ho, k_pb = _row_layout(kprec, HALF, EIGHTH)
    v_rb, v_ho, v_pb = _row_layout(vprec, HALF, EIGHTH)

    if KLT:  # this head's key tables (zeros where its key unit is not KLT; then unused)
        kt = (layer * KVH + kvh) * D
        kb_lo, kb_hi = tl.load(klt_bits + kt + j), tl.load(klt_bits + kt + HALF + j)
        ko_lo, ko_hi = tl.load(klt_offset + kt + j), tl.load(klt_offset + kt + HALF + j)
        kst_lo, kst_hi = tl.load(klt_step + kt + j), tl.load(klt_step + kt + HALF + j)
        klv_lo, klv_hi = tl.load(klt_level + kt + j), tl.load(klt_level + kt + HALF + j)
        kw_lo, kw_hi = tl.load(klt_weight + kt + j), tl.load(klt_weight + kt + HALF + j)
        km_lo, km_hi = tl.load(klt_mean + kt + j), tl.load(klt_mean + kt + HALF + j)
        invf = tl.load(inv_freq + j)
        uk_model = layer * 2 * dither_kvh + dither_head0 + kvh  # the key unit's id in the whole model: its dither's
        # z @ V^T: the transposed blocks of the basis V [D (channel), D (coefficient)]
        V_ll, V_lh, V_hl, V_hh = _square(klt_basis + kt * D, j, D, HALF)
        Vt_ll, Vt_lh, Vt_hl, Vt_hh = tl.trans(V_ll), tl.trans(V_hl), tl.trans(V_lh), tl.trans(V_hh)
    if EXACT:
        srow = tl.load(seq_row + b).to(tl.int64)
        qp = tl.load(q_pos + b * G + g, mask=row_ok, other=0)
        C = SINK + RING
        ebase = ((layer * ROWS + srow) * KVH + kvh) * C
        eb = (layer * KVH + kvh) * D
        Mk_ll, Mk_lh, Mk_hl, Mk_hh = _square(exact_k_map + eb * D, j, D, HALF)
        Mv_ll, Mv_lh, Mv_hl, Mv_hh = _square(exact_v_map, j, D, HALF)
        bk_lo, bk_hi = tl.load(exact_k_bias + eb + j), tl.load(exact_k_bias + eb + HALF + j)

    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, ctx)
    n_ctx = tl.where(hi > lo, (hi - lo + BLOCK_N - 1) // BLOCK_N, 0)
    n_tree = tl.where(pid_s == 0, (nt + BLOCK_N - 1) // BLOCK_N, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
    for it in range(0, n_ctx + n_tree):
        is_tree = it >= n_ctx
        start = tl.where(is_tree, ctx + (it - n_ctx) * BLOCK_N, lo + it * BLOCK_N)
        end = tl.where(is_tree, ctx + nt, hi)
        t = start + tl.arange(0, BLOCK_N)
        tok = t < end
        page = tl.load(block_tables + b * stride_bt + t // PAGE, mask=tok, other=0).to(tl.int64)
        off = t % PAGE
        m2 = tok[:, None]

        # ---- K: codes (exact in fp16) and scales, or a KLT unit's keys
        krow = (page * kU + kidx) * PAGE + off
        k_rows = k_pay + krow * k_rb
        if KLT:
            if kprec >= 6:
                kpos = tl.load(positions + page * PAGE + off, mask=tok, other=0).to(tl.int64)
                ks = tl.load(k_sc + krow, mask=tok, other=0.0).to(tl.float32)
                z_lo = _klt_half(k_rows, m2, k_rb, ks, kpos, uk_model, j, kb_lo, ko_lo, kst_lo, klv_lo)
                z_hi = _klt_half(k_rows, m2, k_rb, ks, kpos, uk_model, j + HALF, kb_hi, ko_hi, kst_hi, klv_hi)
                y_lo, y_hi = _times(z_lo, z_hi, Vt_ll, Vt_lh, Vt_hl, Vt_hh)
                y_lo = tl.math.div_rn(y_lo, kw_lo[None, :]) + km_lo[None, :]
                y_hi = tl.math.div_rn(y_hi, kw_hi[None, :]) + km_hi[None, :]
                ang = kpos.to(tl.float32)[:, None] * invf[None, :]
                cs, sn = tl.cos(ang), tl.sin(ang)
                qk = tl.dot(q_lo, tl.trans((y_lo * cs - y_hi * sn).to(OP)), input_precision="ieee") + tl.dot(
                    q_hi, tl.trans((y_hi * cs + y_lo * sn).to(OP)), input_precision="ieee"
                )
            else:
                qk = _quant_scores(q_lo, q_hi, k_rows, k_sc, krow, tok, j, k_ho, k_pb, kprec, D, GS, OP)
        else:
            qk = _quant_scores(q_lo, q_hi, k_rows, k_sc, krow, tok, j, k_ho, k_pb, kprec, D, GS, OP)

        # ---- visibility: committed context is visible to every row; tree token jt only where bit (g, jt) is set
        vis = row_ok[:, None] & tok[None, :]
        if is_tree:
            jt = t - ctx
            words = tl.load(tree_mask + ((b * G + g) * W)[:, None] + (jt // 32)[None, :], mask=vis, other=0)
            vis = vis & (((words >> (jt % 32)[None, :]) & 1) != 0)

        # ---- exact entries: the pairs that read the FP16 copies (a sink position, or within the query's window)
        if EXACT:
            kp = tl.where(t >= ctx, tl.load(tree_pos + b * stride_tp + (t - ctx), mask=tok & (t >= ctx), other=0), t)
            ex = vis & ((kp[None, :] < SINK) | ((qp[:, None] - kp[None, :]) < WINDOW))
            e_keys = m2 & (tl.max(ex.to(tl.int32), axis=0) > 0)[:, None]  # keys some query reads exact: loaded
            col = tl.where(t < SINK, t, SINK + (t - SINK) % RING).to(tl.int64)
            e_rows = (ebase + col)[:, None] * D
            e_lo = tl.load(rec_k + e_rows + j[None, :], mask=e_keys, other=0.0).to(tl.float32)
            e_hi = tl.load(rec_k + e_rows + HALF + j[None, :], mask=e_keys, other=0.0).to(tl.float32)
            e_lo, e_hi = _times(e_lo, e_hi, Mk_ll, Mk_lh, Mk_hl, Mk_hh)
            e_lo, e_hi = e_lo + bk_lo[None, :], e_hi + bk_hi[None, :]
            qk_e = tl.dot(q_lo, tl.trans(e_lo.to(OP)), input_precision="ieee") + tl.dot(
                q_hi, tl.trans(e_hi.to(OP)), input_precision="ieee"
            )
            qk = tl.where(ex, qk_e, qk)
        qk = tl.where(vis, qk, float("-inf"))

        # ---- online softmax (base 2)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

        # ---- V: dequantized into the dot operand (its scale varies along the reduction axis)
        vrow = (page * vU + vidx) * PAGE + off
        v_lo, v_hi = _codes(v_pay + vrow * v_rb, m2, j, v_ho, v_pb, vprec, EIGHTH)
        vs = v_sc + vrow[:, None] * NG
        if HALF_SCALE:
            v_lo = v_lo.to(tl.float32) * tl.load(vs, mask=m2, other=0.0).to(tl.float32)
            v_hi = v_hi.to(tl.float32) * tl.load(vs + HALF // GS, mask=m2, other=0.0).to(tl.float32)
        else:
            v_lo = v_lo.to(tl.float32) * tl.load(vs + (j // GS)[None, :], mask=m2, other=0.0).to(tl.float32)
            v_hi = v_hi.to(tl.float32) * tl.load(vs + ((j + HALF) // GS)[None, :], mask=m2, other=0.0).to(tl.float32)
        acc_lo = acc_lo * alpha[:, None]
        acc_hi = acc_hi * alpha[:, None]
        if EXACT:
            e_lo = tl.load(rec_v + e_rows + j[None, :], mask=e_keys, other=0.0).to(tl.float32)
            e_hi = tl.load(rec_v + e_rows + HALF + j[None, :], mask=e_keys, other=0.0).to(tl.float32)
            e_lo, e_hi = _times(e_lo, e_hi, Mv_ll, Mv_lh, Mv_hl, Mv_hh)
            pe = tl.where(ex, p, 0.0).to(OP)
            acc_lo += tl.dot(pe, e_lo.to(OP), input_precision="ieee")
            acc_hi += tl.dot(pe, e_hi.to(OP), input_precision="ieee")
            p = tl.where(ex, 0.0, p)
        pp = p.to(OP)
        acc_lo += tl.dot(pp, v_lo.to(OP), input_precision="ieee")
        acc_hi += tl.dot(pp, v_hi.to(OP), input_precision="ieee")

    if SPLIT:
        r = ((b * G + g) * (KVH * R) + qh).to(tl.int64) + pid_s.to(tl.int64) * nrows
        tl.store(part_acc + r[:, None] * D + j[None, :], acc_lo, mask=row_in[:, None])
        tl.store(part_acc + r[:, None] * D + HALF + j[None, :], acc_hi, mask=row_in[:, None])
        tl.store(part_ml + r * 2, m_i, mask=row_in)
        tl.store(part_ml + r * 2 + 1, l_i, mask=row_in)
    else:
        inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
        o_ptr = Out + b * stride_ob + g[:, None] * stride_og + qh[:, None] * stride_oh + j[None, :]
        tl.store(o_ptr, (acc_lo * inv[:, None]).to(Out.dtype.element_ty), mask=row_in[:, None])
        tl.store(o_ptr + HALF, (acc_hi * inv[:, None]).to(Out.dtype.element_ty), mask=row_in[:, None])


@triton.jit(do_not_specialize=["NS", "nrows", "G"])
def _combine_splits_kernel(
    part_acc, part_ml, Out, stride_ob, stride_og, stride_oh, NS, nrows, G, H, D: tl.constexpr, BLOCK_R: tl.constexpr
):
    """Merge the split-K partials (m, l, acc) of each query row: out = Σ 2^(m_s - M) acc_s / Σ 2^(m_s - M) l_s."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < nrows
    d = tl.arange(0, D)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, NS):
        m = tl.maximum(m, tl.load(part_ml + (s * nrows + r) * 2, mask=ok, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for s in range(0, NS):
        row = s * nrows + r
        w = tl.exp2(tl.load(part_ml + row * 2, mask=ok, other=float("-inf")) - m_use)
        den += w * tl.load(part_ml + row * 2 + 1, mask=ok, other=0.0)
        acc += w[:, None] * tl.load(part_acc + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)
    b = r // (G * H)
    g = (r // H) % G
    h = r % H
    o_ptr = Out + (b * stride_ob + g * stride_og + h * stride_oh)[:, None] + d[None, :]
    tl.store(o_ptr, (acc * inv[:, None]).to(Out.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _copy_rows_kernel(
    src, dst, src_index, dst_index, U, ROW, PAGE, src_slot, dst_slot, BLOCK_U: tl.constexpr, BLOCK_B: tl.constexpr
):
    """Copy token i's bytes of every unit between a pool [P, U, PAGE, ROW] (addressed by slot) and a
    dense buffer [N, U, ROW] (addressed by i). Used twice per pool, gather then scatter, so overlapping
    src/dst slot sets behave like the oracle's `t[dst] = t[src].clone()`."""
    i = tl.program_id(0)
    u = (tl.program_id(1) * BLOCK_U + tl.arange(0, BLOCK_U)).to(tl.int64)
    x = tl.arange(0, BLOCK_B)
    ok = (u < U)[:, None] & (x < ROW)[None, :]
    s_off = (i.to(tl.int64) * U + u) * ROW
    d_off = (i.to(tl.int64) * U + u) * ROW
    if src_slot != 0:
        slot = tl.load(src_index + i).to(tl.int64)
        s_off = ((slot // PAGE * U + u) * PAGE + slot % PAGE) * ROW
    if dst_slot != 0:
        slot = tl.load(dst_index + i).to(tl.int64)
        d_off = ((slot // PAGE * U + u) * PAGE + slot % PAGE) * ROW
    tl.store(dst + d_off[:, None] + x[None, :], tl.load(src + s_off[:, None] + x[None, :], mask=ok), mask=ok)


# =============================================================================================
# Entry points: same arguments as the PyTorch oracle (QuantKVStore.write / paged_attention_reference /
# QuantKVStore.move). CUDA tensors -> compiled kernels; CPU tensors -> Triton's interpreter.


def _launch(kernel, grid, *args, **meta):
    if not args[0].is_cuda and not _interpreted(kernel):
        raise RuntimeError(
            "CPU tensors run in Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
            "first imported (bpcompile.kernels does it when it is imported first on a CPU-only machine)"
        )
    return kernel[grid](*args, **meta)


def _interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


N_POOLS = 18  # the kernels' pool arguments: a payload and a scale pool for each of the 9 unit precisions


def _store_args(store):
    """The pools in the kernels' argument order (payload as bytes, scales; per precision in the registry's order,
    INT4, FP8, INT8, INT5, INT6, INT3, KLT4, KLT5, KLT6), then each precision's unit count."""
    if not hasattr(store, "payload"):
        raise TypeError(f"the kernels read a QuantKVStore, got {type(store).__name__}")
    why = store.support("triton")
    if why:
        raise ValueError(f"the Triton kernels cannot read this KV plan: {'; '.join(why)}")
    pools = store.reader_pools("triton")
    if len(pools) != N_POOLS:
        raise ValueError(f"the kernels take {N_POOLS} pools, the store gives {len(pools)} (kernel and registry differ)")
    payloads = pools[0::2]
    return (*(t.view(torch.uint8) if t.dtype == torch.int8 else t for t in pools), *(t.shape[1] for t in payloads))


def quantize_append(
    store, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None
) -> None:
    """Quantize-and-append k, v [N, KVH, D] into flat slots [N]: the bytes `store.write` produces. positions [N]: the
    tokens' RoPE positions (a plan with KLT key units records them and codes the keys before RoPE)."""
    N, KVH, D = k.shape
    if v.shape != k.shape or KVH != store.num_kv_heads or D != store.head_size:
        raise ValueError(
            f"k/v must be [N, {store.num_kv_heads}, {store.head_size}], got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if N == 0:
        return
    if (why := check_shape(D, store.G)) is not None:
        raise ValueError(f"quantize_append: {why}")
    slots = slots.to(device=k.device, dtype=torch.int64).contiguous()
    # centering, channel scale, rotation and the KLT basis are matmuls; the kernel quantizes the result
    k, v = store.kernel_transform(layer, slots, k, v, positions)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    pos, bits, offset, step = store.kernel_klt()[:4]
    block_t = 16 if k.is_cuda else min(_pow2(N), 64)  # interpreter: few, large programs
    extra = {"enable_fp_fusion": False} if k.is_cuda else {}  # no FMA contraction in the exact arithmetic
    _launch(
        _quantize_append_kernel,
        (triton.cdiv(N, block_t), 2 * KVH),
        k,
        v,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        slots,
        N,
        *_store_args(store),
        store.unit_precision,
        store.unit_index,
        store.kernel_k_channel_scale,
        store.int4_clip,
        layer,
        KVH,
        pos,
        bits,
        offset,
        step,
        *store.dither_heads,
        PAGE=store.page_size,
        D=D,
        GS=store.G,
        BLOCK_T=block_t,
        KLT=int(store.positions is not None),
        **extra,
    )


DEFAULT_BLOCK_N = 32


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def default_num_splits(
    batch: int, kv_heads: int, m_blocks: int, max_tokens: int, sm_count: int, min_tokens_per_split: int = 512
) -> int:
    """Split the context so that about 4 programs per SM exist, but never below ~512 tokens per split
    (the merge costs a pass over the partials). Uses only shapes: no device sync."""
    base = batch * kv_heads * m_blocks
    want = triton.cdiv(4 * sm_count, base)
    return max(1, min(want, triton.cdiv(max_tokens, min_tokens_per_split), 64))


def _exact_args(store, exact, B: int, G: int, dev) -> tuple:
    """The kernel's exact-entry arguments (see paged_attention), or placeholders when exact is None."""
    if exact is None:
        z, zi = torch.zeros(1, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
        return (z, z, zi, zi, zi, 0, z, z, z, 0, 0, 1, 0)
    rec, rows, q_pos, tree_pos = exact
    i32 = lambda x: x.to(device=dev, dtype=torch.int32).contiguous()  # noqa: E731
    q_pos, tree_pos = i32(q_pos), i32(tree_pos)
    if tuple(q_pos.shape) != (B, G) or tree_pos.dim() != 2 or tree_pos.shape[0] != B:
        raise ValueError(
            f"exact: q_pos must be [{B}, {G}] and tree_pos [{B}, *], got {tuple(q_pos.shape)}, {tuple(tree_pos.shape)}"
        )
    return (
        rec.k,
        rec.v,
        i32(rows),
        q_pos,
        tree_pos,
        tree_pos.stride(0),
        *store.kernel_exact_maps(),
        rec.sink,
        rec.window,
        max(rec.ring, 1),
        rec.rows,
    )


def paged_attention(
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
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    exact: tuple | None = None,
) -> torch.Tensor:
    """Attention of q [B, G, H, D] over each sequence's committed context (context_lens[b] tokens, read
    through block_tables [B, max_pages]) plus its num_tree[b] tree tokens stored right after it, visible
    per the packed tree_mask [B, G, ceil(G/32)] (row i bit j: query i sees tree token j; None = causal).
    Query rows g >= q_lens[b] (default num_tree[b]) are padding and come out 0. Returns q's shape and dtype.
    The tree tokens' K/V must already be appended. exact: for a plan with exact entries, (its FP16 copies, a
    `bpcompile.runtime.paged_kv.RecentKV`; each sequence's row there [B]; the positions of its query rows [B, G]
    and of its tree entries [B, >= max num_tree]): a query reads the copy of a key at a sink position or within
    the window of its own position (docs/KV_FORMAT.md §4)."""
    B, G, H, D = q.shape
    KVH, PAGE, GS = store.num_kv_heads, store.page_size, store.G
    if H % KVH or D != store.head_size:
        raise ValueError(f"q [B, G, H, D] with H a multiple of {KVH} and D = {store.head_size}, got {tuple(q.shape)}")
    if (why := check_shape(D, GS)) is not None:
        raise ValueError(f"paged_attention: {why}")
    W = triton.cdiv(G, 32)
    if tree_mask is None:
        tree_mask = pack_bool_mask(torch.ones(G, G, dtype=torch.bool, device=q.device).tril())[None].expand(B, G, W)
    if tuple(tree_mask.shape) != (B, G, W):
        raise ValueError(f"tree_mask must be packed [B, G, ceil(G/32)] = {(B, G, W)}, got {tuple(tree_mask.shape)}")
    R = H // KVH
    dev = q.device
    dtype = q.dtype
    if store.transformed:  # attend in the stored (rotated) basis: q' = (q * c) @ H, out = out' @ H
        q = store.kernel_query(layer, q).to(dtype)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables.to(device=dev, dtype=torch.int32).contiguous()
    context_lens = context_lens.to(device=dev, dtype=torch.int32).contiguous()
    num_tree = num_tree.to(device=dev, dtype=torch.int32).contiguous()
    tree_mask = tree_mask.to(device=dev, dtype=torch.int32).contiguous()
    q_lens = num_tree if q_lens is None else q_lens.to(device=dev, dtype=torch.int32).contiguous()
    out = torch.empty_like(q)
    block_m = 16 if G * R <= 16 else 64
    m_blocks = triton.cdiv(G * R, block_m)
    # 32-token tiles keep the compiled kernel near 160 registers/thread (64 reaches ~240 at D = 128, sm_90);
    # the interpreter prefers few large tiles. benchmarks/gpu_check.py --sweep times both knobs on the GPU.
    block_n = block_n or (DEFAULT_BLOCK_N if q.is_cuda else 64)
    max_tokens = block_tables.shape[1] * PAGE
    if num_splits is None:
        num_splits = (
            1
            if not q.is_cuda
            else default_num_splits(
                B, KVH, m_blocks, max_tokens, torch.cuda.get_device_properties(dev).multi_processor_count
            )
        )
    chunk = triton.cdiv(triton.cdiv(max(max_tokens, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max_tokens, chunk))
    split = num_splits > 1
    nrows = B * G * H
    if split:
        part_acc = torch.empty(num_splits, nrows, D, dtype=torch.float32, device=dev)
        part_ml = torch.empty(num_splits, nrows, 2, dtype=torch.float32, device=dev)
    else:
        part_acc = part_ml = out  # unused
    meta = dict(
        PAGE=PAGE,
        D=D,
        GS=GS,
        R=R,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPLIT=int(split),
        F32=int(q.dtype == torch.float32),
        KLT=int(store.positions is not None),
        EXACT=int(exact is not None),
    )
    if q.is_cuda:
        meta["num_warps"] = num_warps or (4 if block_m == 16 else 8)
    _launch(
        _paged_attention_kernel,
        (B * KVH, num_splits, m_blocks),
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        part_acc,
        part_ml,
        nrows,
        *_store_args(store),
        store.unit_precision,
        store.unit_index,
        store.kernel_k_channel_scale,
        block_tables,
        block_tables.stride(0),
        context_lens,
        tree_mask,
        num_tree,
        q_lens,
        layer,
        KVH,
        G,
        W,
        _f32_bits(sm_scale),
        chunk,
        *store.kernel_klt(),
        *store.dither_heads,
        *_exact_args(store, exact, B, G, dev),
        **meta,
    )
    if split:
        block_r = 16 if q.is_cuda else min(_pow2(nrows), 64)
        _launch(
            _combine_splits_kernel,
            (triton.cdiv(nrows, block_r),),
            part_acc,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            num_splits,
            nrows,
            G,
            H,
            D=D,
            BLOCK_R=block_r,
        )
    return store.kernel_output(out).to(dtype) if store.transformed else out


def move_slots(store, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the bytes (payload + scales, every layer and unit) of slots src[N] to dst[N] on the device:
    `store.move`. Two passes per pool (gather into a buffer, then scatter) so overlapping sets are safe."""
    n = int(src.numel())
    if n == 0:
        return
    dev = store.unit_precision.device
    src = src.to(device=dev, dtype=torch.int64).contiguous()
    dst = dst.to(device=dev, dtype=torch.int64).contiguous()
    pools = store.pools()
    if getattr(store, "positions", None) is not None:  # KLT plans: each slot's position moves with its bytes
        pools.append(store.positions[:, None, :, None])
    for pool in pools:
        P, U, PAGE, X = pool.shape
        if U == 0:
            continue
        raw = pool.view(torch.uint8)  # [P, U, PAGE, X * itemsize], contiguous
        row = raw.shape[-1]
        buf = torch.empty(n, U, row, dtype=torch.uint8, device=dev)
        block_u = min(_pow2(U), 16 if pool.is_cuda else 1024)
        grid = (n, triton.cdiv(U, block_u))
        for a, b_, ss, ds in ((raw, buf, 1, 0), (buf, raw, 0, 1)):
            _launch(_copy_rows_kernel, grid, a, b_, src, dst, U, row, PAGE, ss, ds, BLOCK_U=block_u, BLOCK_B=_pow2(row))


def warm_up(store, heads: int, dtype: torch.dtype, recent=None) -> None:
    """Launch every kernel specialization a runtime over `store` can use, once each, on the null page (page 0,
    which only padding writes): quantize-append; paged attention with decode-sized (G x R <= 16 rows) and
    tree-sized (64-row) query blocks, each without and with split-K (then the merge), with and without the
    exact entries where the plan has them (`recent`: its FP16 copies, a `runtime.paged_kv.RecentKV`); the move.
    On CUDA this is what compiles them (Triton's JIT, on first launch), so an engine that calls it when it loads
    has no request waiting on a compile. heads: the model's query heads; dtype: its activations'."""
    dev, KVH, D = store.unit_precision.device, store.num_kv_heads, store.head_size
    R = heads // KVH
    z = lambda *s, dt=torch.int32: torch.zeros(s, dtype=dt, device=dev)  # noqa: E731
    kv = torch.zeros(1, KVH, D, dtype=dtype, device=dev)
    quantize_append(store, 0, z(1, dt=torch.int64), kv, kv, z(1, dt=torch.int64))
    # 4 tiles of the widest block_n: two context splits on either device (the entry point picks block_n)
    tables = z(1, triton.cdiv(4 * 64, store.page_size))
    for G in sorted({1, 16 // R + 1}):
        q = torch.zeros(1, G, heads, D, dtype=dtype, device=dev)
        for exact in [None] + ([(recent, z(1), z(1, G), z(1, G))] if recent is not None else []):
            for splits in (1, 2):
                paged_attention(q, store, 0, tables, z(1), None, z(1) + G, D**-0.5, num_splits=splits, exact=exact)
    move_slots(store, z(1, dt=torch.int64), z(1, dt=torch.int64))
