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
interpreter (what the tests use; slow, keep shapes small). `compile_engine_kernels` compiles the same
kernels ahead of time for an engine (sm_90a cubins + C launchers, plugins/trt wraps them for TensorRT);
`build_trt_plugin` builds that TensorRT plugin library where TensorRT exists.

Nothing at module level imports from the rest of bpcompile (only torch and triton): the AOT compile runs
this module in a bare subprocess, and plugins/bench_gpu.py runs on machines that have only torch + triton.
See docs/KERNELS.md for what is verified where.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch

# Without a GPU the kernels can only run in Triton's interpreter, and Triton decides interpreted vs compiled
# when `triton.language` is imported (its own library functions are decorated then). So on a CPU-only
# machine default to the interpreter, unless the caller chose (TRITON_INTERPRET=0: the AOT compile
# subprocess, which needs compilable kernels).
if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Unit precision codes (bpcompile.kvcache): 0 = INT4, 1 = FP8, 2 = INT8. Kernels use the literals: a
# Triton kernel cannot read plain module globals (the interpreter allows it, the compiler does not).


# =============================================================================================
# Kernels. Written against Triton 3.6 (the GPU machine) .. 3.9 (here); no libdevice or inline asm, so the
# interpreter runs them too.


@triton.jit
def _quantize_append_kernel(
        K, V, stride_kn, stride_kh, stride_vn, stride_vh,  # new keys/values [N, KVH, D], last dim contiguous
        slots, N,  # flat slots [N] int64
        q4, s4, q8, s8, qi8, si8, U4, U8, Ui8,  # pools: payload as uint8, scales fp16 ([P, U, PAGE, ...])
        unit_precision, unit_index, k_channel_scale, int4_clip,  # static tables [L, 2, KVH] / [L, KVH, D]
        layer, KVH,
        PAGE: tl.constexpr, D: tl.constexpr, GS: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program = BLOCK_T tokens of one unit (K or V of one KV head). Every operation follows
    docs/KV_FORMAT.md §3 in fp32 with IEEE division (div_rn), so the bytes equal the oracle's."""
    HALF: tl.constexpr = D // 2
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
    amax = tl.maximum(tl.max(tl.where(in_lo, tl.abs(x_lo)[:, None, :], 0.0), axis=2),
                      tl.max(tl.where(in_hi, tl.abs(x_hi)[:, None, :], 0.0), axis=2))  # [T, NG]
    qmax = tl.where(prec == 0, 7.0, tl.where(prec == 1, 448.0, 127.0))
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
    else:
        base = (page * Ui8 + idx) * PAGE + off
        for h in tl.static_range(2):
            y = tl.minimum(tl.maximum(y_lo if h == 0 else y_hi, -127.0), 127.0)
            q = ((y + 12582912.0) - 12582912.0).to(tl.int32)
            tl.store(qi8 + base[:, None] * D + h * HALF + j[None, :], (q & 0xFF).to(tl.uint8), mask=m2)
        tl.store(si8 + base[:, None] * NG + g[None, :], s, mask=m2)


@triton.jit
def _paged_attention_kernel(
        Q, stride_qb, stride_qg, stride_qh,  # queries [B, G, H, D], post-RoPE, last dim contiguous
        Out, stride_ob, stride_og, stride_oh,  # [B, G, H, D] (written when SPLIT == 0)
        part_acc, part_ml, nrows,  # SPLIT == 1: [NS, B*G*H, D] and [NS, B*G*H, 2] (m, l) fp32 partials
        q4, s4, q8, s8, qi8, si8, U4, U8, Ui8,
        unit_precision, unit_index, k_channel_scale,
        block_tables, stride_bt, context_lens, tree_mask, num_tree, num_q,
        layer, KVH, G, W, scale_bits, chunk,  # scale_bits: sm_scale's fp32 bits (AOT launchers pass fp32 args badly)
        PAGE: tl.constexpr, D: tl.constexpr, GS: tl.constexpr, R: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr):
    """One program = one (sequence, KV head, context split, block of query rows). Rows are (tree token g,
    query head r of this KV head's GQA group): GQA shares every K/V byte loaded among R query heads.

    Split s covers context tokens [s*chunk, min((s+1)*chunk, ctx)); split 0 also covers the tree tokens
    [ctx, ctx + num_tree), which are masked by the packed tree mask. Dequantization follows §4: K scales are
    applied to q·k per half-row when a half lies in one group (GS >= D/2), otherwise per element.
    """
    HALF: tl.constexpr = D // 2
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

    # The K and V units of this head: pool, unit count, row bytes (D/2 for int4, D otherwise) and the byte
    # offset of the high half (0 for int4: both halves share a byte; D/2 otherwise). Written as products with
    # the constexpr D/2 (not tl.where between constants) so the compiler sees 16-byte aligned rows and
    # vectorizes the payload loads.
    uk = layer * 2 * KVH + kvh
    uv = uk + KVH
    kprec = tl.load(unit_precision + uk).to(tl.int32)
    vprec = tl.load(unit_precision + uv).to(tl.int32)
    kidx = tl.load(unit_index + uk).to(tl.int64)
    vidx = tl.load(unit_index + uv).to(tl.int64)
    k_pay = tl.where(kprec == 0, q4, tl.where(kprec == 1, q8, qi8))
    v_pay = tl.where(vprec == 0, q4, tl.where(vprec == 1, q8, qi8))
    k_sc = tl.where(kprec == 0, s4, tl.where(kprec == 1, s8, si8))
    v_sc = tl.where(vprec == 0, s4, tl.where(vprec == 1, s8, si8))
    kU = tl.where(kprec == 0, U4, tl.where(kprec == 1, U8, Ui8)).to(tl.int64)
    vU = tl.where(vprec == 0, U4, tl.where(vprec == 1, U8, Ui8)).to(tl.int64)
    k_ho = (kprec != 0).to(tl.int64) * HALF
    v_ho = (vprec != 0).to(tl.int64) * HALF
    k_rb = k_ho + HALF
    v_rb = v_ho + HALF

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
        if kprec == 0:  # nibble n -> fp16 1024 + n by bit pattern, minus 1032 = n - 8 (no int->float convert)
            k_lo = ((b_lo & 15).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
            k_hi = ((b_hi >> 4).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        elif kprec == 1:
            k_lo = b_lo.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            k_hi = b_hi.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:  # int8 q: (q + 128) -> 1024 + q + 128, minus 1152
            k_lo = ((b_lo ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
            k_hi = ((b_hi ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
        if HALF_SCALE:
            ks_lo = tl.load(k_sc + krow * NG, mask=tok, other=0.0).to(tl.float32)
            ks_hi = tl.load(k_sc + krow * NG + HALF // GS, mask=tok, other=0.0).to(tl.float32)
            qk = (tl.dot(q_lo, tl.trans(k_lo.to(OP)), input_precision="ieee") * ks_lo[None, :]
                  + tl.dot(q_hi, tl.trans(k_hi.to(OP)), input_precision="ieee") * ks_hi[None, :])
        else:
            ks = k_sc + krow[:, None] * NG
            k_lo = k_lo.to(tl.float32) * tl.load(ks + (j // GS)[None, :], mask=m2, other=0.0).to(tl.float32)
            k_hi = k_hi.to(tl.float32) * tl.load(ks + ((j + HALF) // GS)[None, :], mask=m2, other=0.0).to(tl.float32)
            qk = (tl.dot(q_lo, tl.trans(k_lo.to(OP)), input_precision="ieee")
                  + tl.dot(q_hi, tl.trans(k_hi.to(OP)), input_precision="ieee"))

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
        if vprec == 0:
            v_lo = ((b_lo & 15).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
            v_hi = ((b_hi >> 4).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        elif vprec == 1:
            v_lo = b_lo.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            v_hi = b_hi.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            v_lo = ((b_lo ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
            v_hi = ((b_hi ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
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
def _combine_splits_kernel(part_acc, part_ml, Out, stride_ob, stride_og, stride_oh, NS, nrows, G, H,
                           D: tl.constexpr, BLOCK_R: tl.constexpr):
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
def _copy_rows_kernel(src, dst, src_index, dst_index, U, ROW, PAGE, src_slot, dst_slot,
                      BLOCK_U: tl.constexpr, BLOCK_B: tl.constexpr):
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
        raise RuntimeError("CPU tensors run in Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
                           "first imported (bpcompile.kernels does it when it is imported first on a CPU-only machine)")
    return kernel[grid](*args, **meta)


def _interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_shape(head_size: int, group_size: int) -> str | None:
    """Why the kernels can't serve this cache shape (None if they can): aranges need powers of two and
    tl.dot needs a reduction of at least 16 (the half-rows of D/2)."""
    if head_size < 32 or head_size & (head_size - 1):
        return f"head_size {head_size} is not a power of two >= 32"
    if group_size & (group_size - 1) or head_size % group_size:
        return f"group size {group_size} is not a power of two dividing head_size {head_size}"
    return None


def _store_args(store):
    if not hasattr(store, "q4"):
        raise TypeError(f"the kernels read a QuantKVStore (INT4/FP8/INT8 pools), got {type(store).__name__}")
    return (store.q4, store.s4, store.q8, store.s8, store.qi8.view(torch.uint8), store.si8,
            store.q4.shape[1], store.q8.shape[1], store.qi8.shape[1])


def quantize_append(store, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize-and-append k, v [N, KVH, D] into flat slots [N]: the bytes `store.write` produces."""
    N, KVH, D = k.shape
    if v.shape != k.shape or KVH != store.num_kv_heads or D != store.head_size:
        raise ValueError(f"k/v must be [N, {store.num_kv_heads}, {store.head_size}], got {tuple(k.shape)}, {tuple(v.shape)}")
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
    _launch(_quantize_append_kernel, (triton.cdiv(N, block_t), 2 * KVH),
            k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), slots, N, *_store_args(store),
            store.unit_precision, store.unit_index, store.kernel_k_channel_scale, store.int4_clip, layer, KVH,
            PAGE=store.page_size, D=D, GS=store.G, BLOCK_T=block_t, **extra)


DEFAULT_BLOCK_N = 32


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def default_num_splits(batch: int, kv_heads: int, m_blocks: int, max_tokens: int, sm_count: int,
                       min_tokens_per_split: int = 512) -> int:
    """Split the context so that about 4 programs per SM exist, but never below ~512 tokens per split
    (the merge costs a pass over the partials). Uses only shapes: no device sync."""
    base = batch * kv_heads * m_blocks
    want = triton.cdiv(4 * sm_count, base)
    return max(1, min(want, triton.cdiv(max_tokens, min_tokens_per_split), 64))


def paged_attention(q: torch.Tensor, store, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    tree_mask: torch.Tensor | None, num_tree: torch.Tensor, sm_scale: float, *,
                    q_lens: torch.Tensor | None = None, num_splits: int | None = None, block_n: int | None = None,
                    num_warps: int | None = None) -> torch.Tensor:
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
        tree_mask = pack_tree_mask(torch.ones(G, G, dtype=torch.bool, device=q.device).tril())[None].expand(B, G, W)
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
    # the interpreter prefers few large tiles. plugins/bench_gpu.py sweeps both knobs on the GPU.
    block_n = block_n or (DEFAULT_BLOCK_N if q.is_cuda else 64)
    max_tokens = block_tables.shape[1] * PAGE
    if num_splits is None:
        num_splits = 1 if not q.is_cuda else default_num_splits(
            B, KVH, m_blocks, max_tokens, torch.cuda.get_device_properties(dev).multi_processor_count)
    chunk = triton.cdiv(triton.cdiv(max(max_tokens, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max_tokens, chunk))
    split = num_splits > 1
    nrows = B * G * H
    if split:
        part_acc = torch.empty(num_splits, nrows, D, dtype=torch.float32, device=dev)
        part_ml = torch.empty(num_splits, nrows, 2, dtype=torch.float32, device=dev)
    else:
        part_acc = part_ml = out  # unused
    meta = dict(PAGE=PAGE, D=D, GS=GS, R=R, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=int(split),
                F32=int(q.dtype == torch.float32))
    if q.is_cuda:
        meta["num_warps"] = num_warps or (4 if block_m == 16 else 8)
    _launch(_paged_attention_kernel, (B * KVH, num_splits, m_blocks),
            q, q.stride(0), q.stride(1), q.stride(2), out, out.stride(0), out.stride(1), out.stride(2),
            part_acc, part_ml, nrows, *_store_args(store), store.unit_precision, store.unit_index,
            store.kernel_k_channel_scale, block_tables, block_tables.stride(0), context_lens, tree_mask, num_tree, q_lens,
            layer, KVH, G, W, _f32_bits(sm_scale), chunk, **meta)
    if split:
        block_r = 16 if q.is_cuda else min(_pow2(nrows), 64)
        _launch(_combine_splits_kernel, (triton.cdiv(nrows, block_r),), part_acc, part_ml, out,
                out.stride(0), out.stride(1), out.stride(2), num_splits, nrows, G, H, D=D, BLOCK_R=block_r)
    return store.kernel_output(out).to(dtype) if store.transformed else out


def move_slots(store, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the bytes (payload + scales, every layer and unit) of slots src[N] to dst[N] on the device:
    `store.move`. Two passes per pool (gather into a buffer, then scatter) so overlapping sets are safe."""
    n = int(src.numel())
    if n == 0:
        return
    dev = store.q4.device
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
            _launch(_copy_rows_kernel, grid, a, b_, src, dst, U, row, PAGE, ss, ds,
                    BLOCK_U=block_u, BLOCK_B=_pow2(row))


# =============================================================================================
# References (plain PyTorch) and tree-mask helpers.


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """Boolean [..., G, G] (row i, col j: node i sees node j) -> TensorRT-LLM's packed int32 [..., G, ceil(G/32)]:
    bit j % 32 of word j // 32, little-endian; bit 31 makes the word negative (two's complement)."""
    G = mask.shape[-1]
    W = (G + 31) // 32
    m = torch.zeros(*mask.shape[:-1], W * 32, dtype=torch.int64, device=mask.device)
    m[..., :G] = mask.to(torch.int64)
    words = (m.reshape(*mask.shape[:-1], W, 32) << torch.arange(32, device=mask.device)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


# Inverse of pack_tree_mask: int32 [..., G, W] -> bool [..., G, G] (the runtime's decoder, one definition).
from .speculative import unpack_tree_mask  # noqa: E402


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


def paged_attention_reference(q: torch.Tensor, store, layer: int, block_tables: torch.Tensor,
                              context_lens: torch.Tensor, tree_mask: torch.Tensor | None, num_tree: torch.Tensor,
                              sm_scale: float, *, q_lens: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of `paged_attention`: gather + dequantize with `store.read`, then softmax attention in fp32."""
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
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1).nan_to_num(0.0)
        out[b, :nq] = torch.einsum("hgt,thd->ghd", p, v)
    return out.to(q.dtype)


# =============================================================================================
# Ahead-of-time compilation for an engine version: cubin + PTX + a C launcher per specialization.
#
# Triton's own AOT tool (triton/tools/compile.py) is not used as is: its launcher computes the grid from the
# kernel's arguments (ours depends on batch and split count, which are not arguments), maps fp32 scalars to
# `double` (the kernel reads 4 bytes), and calls exit() on a CUDA error (inside a server). The launcher
# below takes the grid, returns the CUresult, and loads the cubin on first use or explicitly.

_ARG_TYPES = {  # kernel argument -> Triton signature type; {dt} is the activation dtype (fp16 / bf16)
    "K": "*{dt}", "V": "*{dt}", "Q": "*{dt}", "Out": "*{dt}", "slots": "*i64",
    "q4": "*u8", "s4": "*fp16", "q8": "*u8", "s8": "*fp16", "qi8": "*u8", "si8": "*fp16",
    "unit_precision": "*i8", "unit_index": "*i32", "k_channel_scale": "*fp32", "int4_clip": "*fp32",
    "part_acc": "*fp32", "part_ml": "*fp32", "block_tables": "*i32", "context_lens": "*i32",
    "tree_mask": "*i32", "num_tree": "*i32", "num_q": "*i32", "src": "*u8", "dst": "*u8", "src_index": "*i64", "dst_index": "*i64",
}
_ALIGNED = {"K", "V", "Q", "Out", "q4", "s4", "q8", "s8", "qi8", "si8", "part_acc", "part_ml"}  # 16-byte aligned
_C_TYPES = {"i8": "int8_t", "i32": "int32_t", "i64": "int64_t", "u8": "uint8_t", "fp32": "float"}
_KERNELS = {"quantize_append": "_quantize_append_kernel", "paged_attention": "_paged_attention_kernel",
            "combine_splits": "_combine_splits_kernel", "copy_rows": "_copy_rows_kernel"}


def aot_specs(head_size: int, group_size: int, page_size: int, gqa: int, dtype: str = "fp16") -> list[dict]:
    """The specializations an engine needs: one quantize-append, paged attention for decode (16 query rows)
    and for trees (64 rows per program), each with and without split-K, the split merge, and the move."""
    common = dict(PAGE=page_size, D=head_size, GS=group_size)
    specs = [dict(name="quantize_append", kernel="quantize_append", constexprs={**common, "BLOCK_T": 16},
                  num_warps=4, num_stages=1)]
    for rows, tag, warps in ((16, "decode", 4), (64, "tree", 8)):
        for split in (0, 1):
            specs.append(dict(name=f"paged_attention_{tag}{'_split' if split else ''}", kernel="paged_attention",
                              constexprs={**common, "R": gqa, "BLOCK_M": rows, "BLOCK_N": DEFAULT_BLOCK_N,
                                          "SPLIT": split, "F32": 0},
                              num_warps=warps, num_stages=2))
    specs.append(dict(name="combine_splits", kernel="combine_splits", constexprs={"D": head_size, "BLOCK_R": 16},
                      num_warps=4, num_stages=1))
    specs.append(dict(name="copy_rows", kernel="copy_rows", constexprs={"BLOCK_U": 16, "BLOCK_B": _pow2(head_size)},
                      num_warps=4, num_stages=1))
    for s in specs:
        s["dtype"] = dtype
        s["name"] = f"bp_{s['name']}_{dtype}"
    return specs


def _signature(kernel, spec: dict) -> list[tuple[str, str]]:
    """[(argument, type)] of the runtime arguments, in order (constexprs removed)."""
    return [(a, _ARG_TYPES.get(a, "i32").format(dt=spec["dtype"])) for a in kernel.arg_names
            if a not in spec["constexprs"]]


_LAUNCHER_C = """/* Generated by bpcompile.kernels (Triton {triton_version}, {target}) from {kernel}: {doc}.
   {name}_launch(stream, gridX, gridY, gridZ, args...) launches it; the cubin is loaded on first use
   (or by {name}_load()), so load it before capturing a CUDA graph. Returns the CUresult, never exits. */
#include <cuda.h>
#include <stdint.h>
#include "{name}.h"

static const unsigned char {name}_cubin[{size}] = {{
{data}
}};
static CUmodule {name}_mod = NULL;
static CUfunction {name}_func = NULL;

CUresult {name}_load(void) {{
  if ({name}_func) return CUDA_SUCCESS;
  CUresult r = cuModuleLoadData(&{name}_mod, {name}_cubin);
  if (r != CUDA_SUCCESS) return r;
  r = cuModuleGetFunction(&{name}_func, {name}_mod, "{symbol}");
  if (r == CUDA_SUCCESS && {shared} > 49152)
    r = cuFuncSetAttribute({name}_func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, {shared});
  return r;
}}

CUresult {name}_unload(void) {{
  CUresult r = {name}_mod ? cuModuleUnload({name}_mod) : CUDA_SUCCESS;
  {name}_mod = NULL;
  {name}_func = NULL;
  return r;
}}

CUresult {name}_launch(CUstream stream, unsigned int gridX, unsigned int gridY, unsigned int gridZ{params}) {{
  CUresult r = {name}_load();
  if (r != CUDA_SUCCESS) return r;
  if (gridX == 0 || gridY == 0 || gridZ == 0) return CUDA_SUCCESS;
  CUdeviceptr scratch = 0; /* Triton's trailing global/profile scratch pointers (unused: size 0) */
  void *args[] = {{ {arg_ptrs} }};
  return cuLaunchKernel({name}_func, gridX, gridY, gridZ, {threads}, 1, 1, {shared}, stream, args, NULL);
}}
"""

_LAUNCHER_H = """/* Generated by bpcompile.kernels: launcher of {name} ({kernel}; {doc}). */
#pragma once
#include <cuda.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {{
#endif
CUresult {name}_load(void);
CUresult {name}_unload(void);
CUresult {name}_launch(CUstream stream, unsigned int gridX, unsigned int gridY, unsigned int gridZ{params});
#ifdef __cplusplus
}}
#endif
"""


def _ptx_param_count(ptx: str, symbol: str) -> int:
    start = ptx.index(f".entry {symbol}(")
    return ptx[start:ptx.index(")", start)].count(".param")


def _aot_compile(spec_file: str) -> None:
    """Subprocess body (TRITON_INTERPRET=0): compile every spec in spec_file's JSON into its out dir."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    job = json.loads(Path(spec_file).read_text())
    out = Path(job["out_dir"])
    target = GPUTarget("cuda", job["capability"], 32)
    for spec in job["specs"]:
        kernel = globals()[_KERNELS[spec["kernel"]]]
        sig = _signature(kernel, spec)
        signature = {a: t for a, t in sig}
        signature.update({c: "constexpr" for c in spec["constexprs"]})
        signature = {a: signature[a] for a in kernel.arg_names}
        attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a, _ in sig if a in _ALIGNED}
        src = ASTSource(fn=kernel, signature=signature, constexprs=dict(spec["constexprs"]), attrs=attrs)
        cc = triton.compile(src, target=target, options={"num_warps": spec["num_warps"],
                                                         "num_stages": spec["num_stages"],
                                                         "enable_fp_fusion": False})
        md = cc.metadata
        if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
            raise RuntimeError(f"{spec['name']} needs global scratch memory; the launcher does not provide it")
        name, ptx, cubin = spec["name"], cc.asm["ptx"], cc.asm["cubin"]
        symbol = md.name
        extra = _ptx_param_count(ptx, symbol) - len(sig)
        params = "".join(f", {'CUdeviceptr' if t[0] == '*' else _C_TYPES[t]} {a}" for a, t in sig)
        arg_ptrs = ", ".join([f"&{a}" for a, _ in sig] + ["&scratch"] * extra)
        doc = ", ".join(f"{k}={v}" for k, v in spec["constexprs"].items()) + f", num_warps={spec['num_warps']}"
        hexes = [f"0x{b:02x}" for b in cubin]
        data = ",\n".join(", ".join(hexes[i:i + 16]) for i in range(0, len(hexes), 16))
        fmt = dict(name=name, kernel=spec["kernel"], doc=doc, triton_version=triton.__version__,
                   target=f"sm_{job['capability']}{'a' if job['capability'] == 90 else ''}", size=len(cubin), data=data, symbol=symbol, shared=md.shared,
                   params=params, arg_ptrs=arg_ptrs, threads=32 * spec["num_warps"])
        (out / f"{name}.cubin").write_bytes(cubin)
        (out / f"{name}.ptx").write_text(ptx)
        (out / f"{name}.c").write_text(_LAUNCHER_C.format(**fmt))
        (out / f"{name}.h").write_text(_LAUNCHER_H.format(**fmt))
        (out / f"{name}.meta.json").write_text(json.dumps(
            {"symbol": symbol, "shared": md.shared, "num_warps": spec["num_warps"], "num_stages": spec["num_stages"],
             "extra_params": extra, "signature": sig}, indent=1))


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# The compiler subprocess's entry point. It first asks the kernel to SIGKILL it when its parent dies (Linux
# PR_SET_PDEATHSIG; the parent check covers a parent that died before that), so a build killed with -9 does
# not leave a compiler running on as an orphan; only then does it import torch and triton.
_COMPILER_MAIN = """import os, signal, sys
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[2]):
    os._exit(1)
from bpcompile.kernels import _aot_compile
_aot_compile(sys.argv[1])
"""


def _run_compiler(job: Path, env: dict) -> None:
    from .store import fault_point

    cmd = [sys.executable, "-c", _COMPILER_MAIN, str(job), str(os.getpid())]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        fault_point("kernels")
        try:
            _, err = proc.communicate()
        except BaseException:  # interrupted: take the compiler down with us
            proc.kill()
            raise
    if proc.returncode != 0:
        raise RuntimeError(f"Triton AOT compile failed:\n{err[-6000:]}")


def _remove_dead_tmp(cache: Path) -> None:
    """Remove <key>.tmp<pid> directories of compiles whose process is gone (a build killed mid-compile)."""
    for d in cache.glob("*.tmp*"):
        pid = d.name.rpartition(".tmp")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


def _cache_root() -> Path:
    return Path(os.environ.get("BPCOMPILE_CACHE", Path.home() / ".cache" / "bpcompile")) / "kernels"


def find_cuda_include() -> Path | None:
    """cuda.h's directory: $CUDA_HOME/$CUDA_PATH, next to nvcc, or /usr/local/cuda."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if nvcc := shutil.which("nvcc"):
        cands.append(str(Path(nvcc).resolve().parent.parent))
    cands.append("/usr/local/cuda")
    for c in filter(None, cands):
        if (Path(c) / "include" / "cuda.h").is_file():
            return Path(c) / "include"
    return None


def check_launchers(kernels_dir: Path) -> dict:
    """Compile every generated launcher with the CUDA headers (a C compiler, else nvcc) to prove they build.
    Skipped, with the reason, where no CUDA headers or compiler exist."""
    inc = find_cuda_include()
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("nvcc")
    if inc is None:
        return {"status": "skipped", "reason": "no CUDA headers (cuda.h) found: set CUDA_HOME"}
    if cc is None:
        return {"status": "skipped", "reason": "no C compiler (cc, gcc or nvcc) on PATH"}
    import tempfile

    sources = sorted(str(p) for p in Path(kernels_dir).glob("*.c"))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [cc, "-c", "-O0", "-Wall", "-Werror", f"-I{inc}", f"-I{kernels_dir}", *sources]
        if Path(cc).name == "nvcc":
            cmd = [cc, "-c", f"-I{inc}", f"-I{kernels_dir}", *sources]
        r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"generated launchers do not compile ({' '.join(cmd[:2])} ...):\n{r.stderr[-4000:]}")
    return {"status": "ok", "compiler": cc, "cuda_include": str(inc), "files": len(sources)}


def _write_kernels_header(out_dir: Path, specs: list[dict], model: dict, gqa: int) -> None:
    """bp_kernels.h: the specialization's constants and generic launcher names for plugins/trt."""
    lines = ["/* Generated by bpcompile.kernels: the kernels in this directory, for plugins/trt. */", "#pragma once"]
    lines += [f'#include "{s["name"]}.h"' for s in specs]
    attn = next(s for s in specs if s["kernel"] == "paged_attention")
    const = {"BP_HEAD_SIZE": model["head_size"], "BP_GROUP_SIZE": model["group_size"], "BP_PAGE_SIZE": model["page_size"],
             "BP_GQA": gqa, "BP_BLOCK_N": attn["constexprs"]["BLOCK_N"], "BP_DTYPE_IS_BF16": int(model["dtype"] == "bf16"),
             "BP_QUANT_BLOCK_T": specs[0]["constexprs"]["BLOCK_T"],
             "BP_COMBINE_BLOCK_R": next(s for s in specs if s["kernel"] == "combine_splits")["constexprs"]["BLOCK_R"]}
    lines += [f"#define {k} {v}" for k, v in const.items()]
    suffix = f"_{model['dtype']}"
    lines += [f"#define {s['name'][:-len(suffix)]}_launch {s['name']}_launch" for s in specs]
    (out_dir / "bp_kernels.h").write_text("\n".join(lines) + "\n")


def compile_engine_kernels(stage_dir: Path, recipe, out_dir: Path) -> dict:
    """Compile the kernels for the engine in stage_dir (its verifier's shape, the recipe's KV page and group
    size, recipe.kernels.arch) into out_dir: per specialization a .cubin, .ptx, C launcher (.c/.h), plus
    kernels.json (every file's sha256, the specialization, Triton version, arch). Results are cached under
    ~/.cache/bpcompile/kernels keyed by kernel source, Triton version and specialization."""
    from .errors import UserError

    stage_dir, out_dir = Path(stage_dir), Path(out_dir)
    cfg_file = stage_dir / "verifier" / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
        heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        head_size = cfg.get("head_size") or cfg["hidden_size"] // heads
    except FileNotFoundError:
        raise UserError("converted verifier config not found", file=str(cfg_file)) from None
    except KeyError as e:
        raise UserError("missing key in converted checkpoint config", file=str(cfg_file), key=str(e.args[0])) from None
    arch = recipe.kernels.arch
    capability = int(arch[3:].rstrip("a"))
    group = min(recipe.kv_cache.group_size, head_size)
    dtype = {"float16": "fp16", "bfloat16": "bf16"}.get(cfg.get("dtype"), "fp16")  # fp32 models run fp16 on GPU
    model = {"head_size": head_size, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "page_size": recipe.kv_cache.page_size, "group_size": group, "dtype": dtype}
    out_dir.mkdir(parents=True, exist_ok=True)
    why = check_shape(head_size, group)
    if why is None and capability < 80:
        why = f"arch {arch}: the kernels need sm_80 or newer (fp16 tensor-core dots, fp8 decode)"
    if why is not None:
        record = {"status": "skipped", "reason": why, "arch": arch, "model": model}
        (out_dir / "kernels.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        return {"detail": f"skipped: {why}", **record}

    specs = aot_specs(head_size, group, recipe.kv_cache.page_size, heads // kv_heads, dtype)
    source = Path(__file__).read_bytes()
    key = hashlib.sha256(source + triton.__version__.encode() + arch.encode()
                         + json.dumps(specs, sort_keys=True).encode()).hexdigest()[:20]
    cached = _cache_root() / key
    t0 = time.perf_counter()
    hit = (cached / "done").is_file()
    if not hit:
        _remove_dead_tmp(cached.parent)
        tmp = cached.with_name(f"{key}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        job = tmp / "job.json"
        job.write_text(json.dumps({"out_dir": str(tmp), "capability": capability, "specs": specs}))
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp / ".triton"),
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                               os.environ.get("PYTHONPATH", "")]))
        _run_compiler(job, env)
        shutil.rmtree(tmp / ".triton", ignore_errors=True)
        job.unlink()
        (tmp / "done").write_text(key + "\n")
        try:
            tmp.rename(cached)
        except OSError:  # a concurrent build cached the same key first
            shutil.rmtree(tmp, ignore_errors=True)
    compile_s = time.perf_counter() - t0
    kernels = []
    for spec in specs:
        name = spec["name"]
        meta = json.loads((cached / f"{name}.meta.json").read_text())
        files = {}
        for ext in ("cubin", "ptx", "c", "h"):  # (bp_kernels.h is listed below)
            shutil.copy2(cached / f"{name}.{ext}", out_dir / f"{name}.{ext}")
            files[ext] = {"path": f"{name}.{ext}", "sha256": _sha256(out_dir / f"{name}.{ext}")}
        kernels.append({"name": name, "kernel": _KERNELS[spec["kernel"]], "constexprs": spec["constexprs"],
                        "signature": [list(x) for x in meta["signature"]], "num_warps": spec["num_warps"],
                        "num_stages": spec["num_stages"], "shared_bytes": meta["shared"],
                        "launch": f"{name}_launch(CUstream, gridX, gridY, gridZ, <signature>)", "files": files})
    _write_kernels_header(out_dir, specs, model, gqa=heads // kv_heads)
    check = check_launchers(out_dir)
    files_extra = {"bp_kernels.h": _sha256(out_dir / "bp_kernels.h")}
    record = {"status": "compiled", "arch": arch, "headers": files_extra, "target": f"cuda:{capability} (Triton emits sm_{capability}a)",
              "triton_version": triton.__version__, "source_sha256": hashlib.sha256(source).hexdigest(),
              "model": model, "kernels": kernels, "launcher_check": check}
    (out_dir / "kernels.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    detail = (f"{len(kernels)} kernels for {arch} (D={head_size}, group {group}, page {recipe.kv_cache.page_size}, "
              f"GQA {heads // kv_heads}, {dtype}) {'from cache' if hit else f'compiled in {compile_s:.1f}s'}; "
              f"launchers: {check['status']}" + (f" ({check['reason']})" if check["status"] == "skipped" else ""))
    return {"detail": detail, "status": "compiled", "cached": hit, "launcher_check": check["status"]}


# =============================================================================================
# TensorRT plugin library (plugins/trt): built only where TensorRT's headers and libraries exist.

PLUGIN_SRC = Path(__file__).resolve().parent.parent / "plugins" / "trt"
PLUGIN_LIB = "libbpcompile_trt_plugins.so"


def find_tensorrt() -> tuple[Path, Path] | None:
    """(include dir with NvInfer.h, libnvinfer.so) from $TENSORRT_ROOT or the usual install places."""
    roots = [os.environ.get("TENSORRT_ROOT"), "/usr/local/tensorrt", "/opt/tensorrt", "/usr"]
    for r in filter(None, roots):
        r = Path(r)
        incs = [r / "include", r / "include" / "x86_64-linux-gnu", r / "include" / "aarch64-linux-gnu"]
        libs = [r / "lib", r / "lib64", r / "lib" / "x86_64-linux-gnu", r / "lib" / "aarch64-linux-gnu"]
        inc = next((i for i in incs if (i / "NvInfer.h").is_file()), None)
        lib = next((f for d in libs if d.is_dir() for f in sorted(d.glob("libnvinfer.so*"))), None)
        if inc and lib:
            return inc, lib
    return None


def build_trt_plugin(kernels_dir: Path, out_dir: Path, *, required: bool = False) -> dict:
    """Build libbpcompile_trt_plugins.so (plugins/trt, CMake) against an engine's compiled kernels.

    Where TensorRT (or CMake, or the plugin sources, or compiled kernels) is missing, returns a "skipped"
    record with the reason, or raises MissingDependency when `required`. Never reports a library it did
    not build. Load the result before building or deserializing engines (ctypes.CDLL(path, RTLD_GLOBAL)),
    or LD_PRELOAD it for tritonserver's tensorrtllm backend."""
    from .errors import MissingDependency

    kernels_dir, out_dir = Path(kernels_dir), Path(out_dir)

    def skip(reason: str) -> dict:
        if required:
            raise MissingDependency(f"TensorRT plugin library: {reason}", key="target")
        return {"status": "skipped", "reason": reason, "detail": f"skipped: {reason}"}

    if not (PLUGIN_SRC / "CMakeLists.txt").is_file():
        return skip(f"plugin sources not found at {PLUGIN_SRC} (build from a source checkout of bpcompile)")
    try:
        kj = json.loads((kernels_dir / "kernels.json").read_text())
    except FileNotFoundError:
        return skip(f"{kernels_dir / 'kernels.json'} not found: compile the kernels first (kernels.compile: true)")
    if kj.get("status") != "compiled":
        return skip(f"the engine's kernels were not compiled ({kj.get('reason', kj.get('status'))})")
    trt = find_tensorrt()
    if trt is None:
        return skip("TensorRT headers and libraries (NvInfer.h, libnvinfer.so) not found; set TENSORRT_ROOT "
                    "to a TensorRT 10.x installation (the tensorrt-llm 1.2.x container has one)")
    cmake = shutil.which("cmake")
    if cmake is None:
        return skip("cmake not found on PATH")
    build = out_dir / "build"
    root = trt[0].parent if trt[0].name == "include" else trt[0].parent.parent
    cfg = [cmake, "-S", str(PLUGIN_SRC), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
           f"-DTENSORRT_ROOT={root}", f"-DBP_KERNELS_DIR={kernels_dir.resolve()}"]
    for cmd in (cfg, [cmake, "--build", str(build), "-j", "2"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"TensorRT plugin build failed: {' '.join(cmd)}\n{(r.stdout + r.stderr)[-6000:]}")
    lib = out_dir / PLUGIN_LIB
    shutil.copy2(build / PLUGIN_LIB, lib)
    shutil.rmtree(build, ignore_errors=True)
    record = {"status": "built", "library": lib.name, "sha256": _sha256(lib), "tensorrt_include": str(trt[0]),
              "tensorrt_library": str(trt[1]), "namespace": "bpcompile",
              "plugins": ["BpQuantizeAppend", "BpPagedTreeAttention"],
              "load": "ctypes.CDLL(path, RTLD_GLOBAL) before engine build and deserialization; "
                      "LD_PRELOAD=path for tritonserver (tensorrtllm backend)"}
    (out_dir / "plugin.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return {"detail": f"built {lib.name} against {trt[1]}", **record}


def load_trt_plugin(path: str | Path):
    """Load the plugin library so its creators register (namespace "bpcompile") in this process."""
    import ctypes

    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
