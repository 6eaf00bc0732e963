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

# Unit precision codes (bpcompile.runtime.kvcache): 0 = INT4, 1 = FP8, 2 = INT8, 3 = INT5. Kernels use the literals: a
# Triton kernel cannot read plain module globals (the interpreter allows it, the compiler does not). Codes 4 (INT6)
# and 5 (INT3) are not read here: a plan with them runs on the PyTorch path (paged_kv.kernels_for).


# =============================================================================================
# Kernels. Written against Triton 3.6 (the GPU machine) .. 3.9 (here); no libdevice or inline asm, so the
# interpreter runs them too.


@triton.jit
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
    U4,
    U8,
    Ui8,
    U5,  # pools: payload as uint8, scales fp16 ([P, U, PAGE, ...])
    unit_precision,
    unit_index,
    k_channel_scale,
    int4_clip,  # static tables [L, 2, KVH] / [L, KVH, D]
    layer,
    KVH,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    GS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program = BLOCK_T tokens of one unit (K or V of one KV head). Every operation follows
    docs/KV_FORMAT.md §3 in fp32 with IEEE division (div_rn), so the bytes equal the oracle's."""
    HALF: tl.constexpr = D // 2
    EIGHTH: tl.constexpr = D // 8
    NG: tl.constexpr = D // GS
    pid_t = tl.program_id(0)
    unit = tl.program_id(1)  # kv * KVH + head
    kv = unit // KVH
    head = unit % KVH
    u = (layer * 2 + kv) * KVH + head
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
    qmax = tl.where(prec == 0, 7.0, tl.where(prec == 1, 448.0, tl.where(prec == 2, 127.0, 15.0)))
    amax = tl.where(prec == 0, clip * amax, amax)  # the clip ratio applies to INT4 units only
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
    else:  # INT5: the low 4 bits packed as INT4's nibbles, then the plane of high bits (§3)
        base = (page * U5 + idx) * PAGE + off
        ROW: tl.constexpr = HALF + EIGHTH
        n_lo = ((tl.minimum(tl.maximum(y_lo, -15.0), 15.0) + 12582912.0) - 12582912.0 + 16.0).to(tl.int32)
        n_hi = ((tl.minimum(tl.maximum(y_hi, -15.0), 15.0) + 12582912.0) - 12582912.0 + 16.0).to(tl.int32)
        tl.store(q5 + base[:, None] * ROW + j[None, :], ((n_lo & 15) | ((n_hi & 15) << 4)).to(tl.uint8), mask=m2)
        # plane byte i: bit b is bit 4 of element i + b * D/8 (low half: b = j // (D/8), high half: 4 + that);
        # a [T, D/8, D/2] select-and-sum gathers them (one non-zero term per bit, so the sum is an OR)
        pe = tl.arange(0, EIGHTH)
        bit = (j // EIGHTH)[None, :]
        bits = ((n_lo >> 4) << bit) | ((n_hi >> 4) << (bit + 4))  # [T, HALF]
        plane = tl.sum(tl.where(((j % EIGHTH)[None, :] == pe[:, None])[None, :, :], bits[:, None, :], 0), axis=2)
        tl.store(q5 + base[:, None] * ROW + HALF + pe[None, :], plane.to(tl.uint8), mask=m2)
        tl.store(s5 + base[:, None] * NG + g[None, :], s, mask=m2)


@triton.jit
def _by_precision(prec, int4, fp8, int8, int5):
    """A unit's pool (or unit count) by its precision code."""
    return tl.where(prec == 0, int4, tl.where(prec == 1, fp8, tl.where(prec == 2, int8, int5)))


@triton.jit
def _codes(b_lo, b_hi, b_x, sh, prec):
    """Payload bytes of a row's low and high halves -> its codes as fp16 (exact), before the scales. INT5 also
    reads b_x, the high-bit plane byte of each element (bit sh for the low half, sh + 4 for the high half)."""
    if prec == 0:  # nibble n -> fp16 1024 + n by bit pattern, minus 1032 = n - 8 (no int->float convert)
        lo = ((b_lo & 15).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        hi = ((b_hi >> 4).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
    elif prec == 1:
        lo = b_lo.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = b_hi.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif prec == 2:  # int8 q: (q + 128) -> 1024 + q + 128, minus 1152
        lo = ((b_lo ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
        hi = ((b_hi ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
    else:  # int5 code n = nibble | high bit << 4 -> 1024 + n, minus 1040 = n - 16
        x = b_x.to(tl.uint16)
        s = sh.to(tl.uint16)[None, :]
        lo = ((b_lo & 15).to(tl.uint16) | (((x >> s) & 1) << 4) | 0x6400).to(tl.float16, bitcast=True) - 1040.0
        hi = ((b_hi >> 4).to(tl.uint16) | (((x >> (s + 4)) & 1) << 4) | 0x6400).to(tl.float16, bitcast=True) - 1040.0
    return lo, hi


@triton.jit
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
    U4,
    U8,
    Ui8,
    U5,
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
    PAGE: tl.constexpr,
    D: tl.constexpr,
    GS: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    F32: tl.constexpr,
):
    """One program = one (sequence, KV head, context split, block of query rows). Rows are (tree token g,
    query head r of this KV head's GQA group): GQA shares every K/V byte loaded among R query heads.

    Split s covers context tokens [s*chunk, min((s+1)*chunk, ctx)); split 0 also covers the tree tokens
    [ctx, ctx + num_tree), which are masked by the packed tree mask. Dequantization follows §4: K scales are
    applied to q·k per half-row when a half lies in one group (GS >= D/2), otherwise per element.
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

    # The K and V units of this head: pool, unit count, row bytes (D/2 for int4, 5D/8 for int5, D otherwise) and
    # the byte offset of the high half (0 for int4 and int5: both halves share a byte; D/2 otherwise). Written as
    # products with the constexprs D/2 and D/8 (not tl.where between constants) so the compiler sees aligned
    # rows and vectorizes the payload loads.
    uk = layer * 2 * KVH + kvh
    uv = uk + KVH
    kprec = tl.load(unit_precision + uk).to(tl.int32)
    vprec = tl.load(unit_precision + uv).to(tl.int32)
    kidx = tl.load(unit_index + uk).to(tl.int64)
    vidx = tl.load(unit_index + uv).to(tl.int64)
    k_pay, v_pay = _by_precision(kprec, q4, q8, qi8, q5), _by_precision(vprec, q4, q8, qi8, q5)
    k_sc, v_sc = _by_precision(kprec, s4, s8, si8, s5), _by_precision(vprec, s4, s8, si8, s5)
    kU = _by_precision(kprec, U4, U8, Ui8, U5).to(tl.int64)
    vU = _by_precision(vprec, U4, U8, Ui8, U5).to(tl.int64)
    k_ho = ((kprec == 1) | (kprec == 2)).to(tl.int64) * HALF
    v_ho = ((vprec == 1) | (vprec == 2)).to(tl.int64) * HALF
    k_rb = k_ho + HALF + (kprec == 3).to(tl.int64) * EIGHTH
    v_rb = v_ho + HALF + (vprec == 3).to(tl.int64) * EIGHTH
    sh = j // EIGHTH  # INT5: which bit of its plane byte holds a low-half element's bit 4
    x_off = HALF + j % EIGHTH  # INT5: where in the row that plane byte is

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

        # ---- K: codes (exact in fp16), scales
        krow = (page * kU + kidx) * PAGE + off
        kb = k_pay + (krow * k_rb)[:, None] + j[None, :]
        b_lo = tl.load(kb, mask=m2, other=0)
        b_hi = tl.load(kb + k_ho, mask=m2, other=0)
        if kprec == 3:
            b_x = tl.load(kb - j[None, :] + x_off[None, :], mask=m2, other=0)
        else:
            b_x = b_lo
        k_lo, k_hi = _codes(b_lo, b_hi, b_x, sh, kprec)
        if HALF_SCALE:
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

        # ---- visibility: committed context is visible to every row; tree token jt only where bit (g, jt) is set
        vis = row_ok[:, None] & tok[None, :]
        if is_tree:
            jt = t - ctx
            words = tl.load(tree_mask + ((b * G + g) * W)[:, None] + (jt // 32)[None, :], mask=vis, other=0)
            vis = vis & (((words >> (jt % 32)[None, :]) & 1) != 0)
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
        vb = v_pay + (vrow * v_rb)[:, None] + j[None, :]
        b_lo = tl.load(vb, mask=m2, other=0)
        b_hi = tl.load(vb + v_ho, mask=m2, other=0)
        if vprec == 3:
            b_x = tl.load(vb - j[None, :] + x_off[None, :], mask=m2, other=0)
        else:
            b_x = b_lo
        v_lo, v_hi = _codes(b_lo, b_hi, b_x, sh, vprec)
        vs = v_sc + vrow[:, None] * NG
        if HALF_SCALE:
            v_lo = v_lo.to(tl.float32) * tl.load(vs, mask=m2, other=0.0).to(tl.float32)
            v_hi = v_hi.to(tl.float32) * tl.load(vs + HALF // GS, mask=m2, other=0.0).to(tl.float32)
        else:
            v_lo = v_lo.to(tl.float32) * tl.load(vs + (j // GS)[None, :], mask=m2, other=0.0).to(tl.float32)
            v_hi = v_hi.to(tl.float32) * tl.load(vs + ((j + HALF) // GS)[None, :], mask=m2, other=0.0).to(tl.float32)
        pp = p.to(OP)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(pp, v_lo.to(OP), input_precision="ieee")
        acc_hi = acc_hi * alpha[:, None] + tl.dot(pp, v_hi.to(OP), input_precision="ieee")

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


@triton.jit
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
    """The pools in the kernels' argument order (payload as bytes, scales; per precision in the store's registry
    order: INT4, FP8, INT8, INT5), then each precision's unit count."""
    if not hasattr(store, "payload"):
        raise TypeError(f"the kernels read a QuantKVStore (INT4/FP8/INT8/INT5 pools), got {type(store).__name__}")
    if not store.kernel_readable:
        raise ValueError(
            "the kernels read INT4/FP8/INT8/INT5 units; this plan has INT6, INT3 or KLT units (PyTorch path)"
        )
    pools = store.kernel_pools()
    payloads = pools[0::2]
    return (*(t.view(torch.uint8) if t.dtype == torch.int8 else t for t in pools), *(t.shape[1] for t in payloads))


def quantize_append(store, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize-and-append k, v [N, KVH, D] into flat slots [N]: the bytes `store.write` produces."""
    N, KVH, D = k.shape
    if v.shape != k.shape or KVH != store.num_kv_heads or D != store.head_size:
        raise ValueError(
            f"k/v must be [N, {store.num_kv_heads}, {store.head_size}], got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if N == 0:
        return
    if (why := check_shape(D, store.G)) is not None:
        raise ValueError(f"quantize_append: {why}")
    if store.transformed:  # centering, channel scale and rotation are matmuls; the kernel quantizes the result
        k, v = store.transform(layer, k, v)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    slots = slots.to(device=k.device, dtype=torch.int64).contiguous()
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
        PAGE=store.page_size,
        D=D,
        GS=store.G,
        BLOCK_T=block_t,
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
) -> torch.Tensor:
    """Attention of q [B, G, H, D] over each sequence's committed context (context_lens[b] tokens, read
    through block_tables [B, max_pages]) plus its num_tree[b] tree tokens stored right after it, visible
    per the packed tree_mask [B, G, ceil(G/32)] (row i bit j: query i sees tree token j; None = causal).
    Query rows g >= q_lens[b] (default num_tree[b]) are padding and come out 0. Returns q's shape and dtype.
    The tree tokens' K/V must already be appended."""
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
    for pool in store.pools():
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
