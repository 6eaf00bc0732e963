"""The KV format's oracle (docs/KV_FORMAT.md): bit patterns, error bounds, store layout, move(), bytes."""

from __future__ import annotations

import pytest
import torch

from bpcompile.core.errors import UserError
from bpcompile.runtime.kvcache import (  # noqa: E402
    FP8,
    INT3,
    INT6,
    FloatKVStore,
    KVPlan,
    QuantKVStore,
    decode_fp8_e4m3,
    dequantize_fp8,
    dequantize_int3,
    dequantize_int4,
    dequantize_int5,
    dequantize_int6,
    dequantize_int8,
    encode_fp8_e4m3,
    fake_quantize,
    kv_store_factory,
    make_kv_store,
    pack_int3,
    pack_int4,
    pack_int5,
    pack_int6,
    plan_support,
    quantize_fp8,
    quantize_int3,
    quantize_int4,
    quantize_int5,
    quantize_int6,
    quantize_int8,
    unpack_int3,
    unpack_int4,
    unpack_int5,
    unpack_int6,
)
from bpcompile.runtime.model import ModelConfig

# the shipped tiny verifier's shape: 4 layers x 2 KV heads x head 64
TINY = ModelConfig(
    vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_size=64, intermediate_size=512
)


def test_int4_nibble_order_half_split():
    n = torch.arange(16, dtype=torch.uint8)  # D = 16: element j low nibble, element j + 8 high nibble
    b = pack_int4(n)
    assert b.tolist() == [j | ((j + 8) << 4) for j in range(8)]
    assert torch.equal(unpack_int4(b), n)
    r = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(r)), r)


def _spread_values() -> torch.Tensor:
    """[64, 3, 64] Gaussian values over six decades of scale, and an all-zero group of 32 at [0, 0, :32]."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]
    x[0, 0, :32] = 0
    return x


def test_int4_codes_and_error_bound():
    x = _spread_values()
    packed, s = quantize_int4(x, 32)
    assert packed.shape == (64, 3, 32) and s.shape == (64, 3, 2) and s.dtype == torch.float16
    nib = unpack_int4(packed)
    assert nib.min() == 1 and nib.max() == 15  # offset binary, q in [-7, 7]
    assert s[0, 0, 0] == 0 and (nib[0, 0, :32] == 8).all()
    y = dequantize_int4(packed, s, 32)
    # each value is the nearest of the 15 levels q * s, q = -7..7, found here by brute force
    sg = s.float().repeat_interleave(32, -1)
    levels = torch.arange(-7, 8).float()[None, None, None, :] * sg[..., None]
    nearest = levels.gather(-1, (x[..., None] - levels).abs().argmin(-1, keepdim=True))[..., 0]
    assert torch.equal(y, nearest)
    err = (y - x).abs().reshape(64, 3, 2, 32)
    amax = x.abs().reshape(64, 3, 2, 32).amax(-1, keepdim=True)
    # half a step, plus what rounding the scale to fp16 can push past the clamp at ±7
    assert (err <= s.float()[..., None] / 2 + amax * 2**-10).all()
    # the plain bound holds away from the group maximum
    inner = x.abs().reshape(64, 3, 2, 32) < 0.9 * amax
    assert (err[inner] <= (s.float()[..., None] / 2 * (1 + 1e-6)).expand_as(err)[inner]).all()


def test_int4_clip_saturates():
    x = torch.tensor([[14.0, 1.0, -2.5, 0.5]])
    packed, s = quantize_int4(x, 4, clip=0.5)
    assert s.item() == 1.0  # 0.5 * 14 / 7
    # x / s = 14 (saturates at 7), 1, -2.5 and 0.5 (ties: to even)
    assert (unpack_int4(packed).int() - 8).tolist() == [[7, 1, -2, 0]]


def test_int5_layout_nibbles_then_high_bit_plane():
    # D = 16: bytes 0..7 are INT4's nibble pairs of the low 4 bits, bytes 8..9 the plane of bit 4, where bit b of
    # byte 8 + i is element i + 2b
    n = torch.zeros(16, dtype=torch.uint8)
    n[13] = 31  # element 13 = 1 + 2 * 6: low nibble 15 in the high nibble of byte 5, bit 6 of plane byte 9
    n[2] = 16  # element 2 = 0 + 2 * 1: only bit 4 set, bit 1 of plane byte 8
    b = pack_int5(n)
    assert b.shape == (10,) and b.tolist() == [0, 0, 0, 0, 0, 0xF0, 0, 0, 0b10, 0b1000000]
    r = torch.randint(0, 32, (3, 5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int5(pack_int5(r)), r)


def test_int5_codes_are_the_nearest_of_31_levels():
    x = _spread_values()
    packed, s = quantize_int5(x, 32)
    assert packed.shape == (64, 3, 40) and s.shape == (64, 3, 2)
    codes = unpack_int5(packed)
    assert codes.min() == 1 and codes.max() == 31 and (codes[0, 0, :32] == 16).all() and s[0, 0, 0] == 0
    assert torch.equal(s, (x.abs().reshape(64, 3, 2, 32).amax(-1) / 15).half())
    y = dequantize_int5(packed, s, 32)
    sg = s.float().repeat_interleave(32, -1)
    levels = torch.arange(-15, 16).float()[None, None, None, :] * sg[..., None]
    inner = x.abs() < 14.5 * sg  # away from the clamp, where fp16 rounding of the scale can matter
    nearest = levels.gather(-1, (x[..., None] - levels).abs().argmin(-1, keepdim=True))[..., 0]
    assert torch.equal(y[inner], nearest[inner]) and inner.float().mean() > 0.9


def test_int6_layout_nibbles_then_two_bit_planes():
    # D = 16: bytes 0..7 INT4's nibble pairs of the low 4 bits, bytes 8..9 the plane of bit 4, bytes 10..11 the
    # plane of bit 5 (bit b of byte 10 + i is bit 5 of element i + 2b)
    n = torch.zeros(16, dtype=torch.uint8)
    n[13] = 63  # element 13 = 1 + 2 * 6: nibble 15 high in byte 5, bit 6 of bytes 9 and 11
    n[2] = 32  # element 2 = 0 + 2 * 1: only bit 5, bit 1 of byte 10
    b = pack_int6(n)
    assert b.shape == (12,) and b.tolist() == [0, 0, 0, 0, 0, 0xF0, 0, 0, 0, 0b1000000, 0b10, 0b1000000]
    r = torch.randint(0, 64, (3, 5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int6(pack_int6(r)), r)


def test_int6_codes_are_the_nearest_of_63_levels():
    x = _spread_values()
    packed, s = quantize_int6(x, 32)
    assert packed.shape == (64, 3, 48) and s.shape == (64, 3, 2)
    codes = unpack_int6(packed)
    assert codes.min() == 1 and codes.max() == 63 and (codes[0, 0, :32] == 32).all() and s[0, 0, 0] == 0
    assert torch.equal(s, (x.abs().reshape(64, 3, 2, 32).amax(-1) / 31).half())
    y = dequantize_int6(packed, s, 32)
    sg = s.float().repeat_interleave(32, -1)
    levels = torch.arange(-31, 32).float()[None, None, None, :] * sg[..., None]
    inner = x.abs() < 30.5 * sg
    nearest = levels.gather(-1, (x[..., None] - levels).abs().argmin(-1, keepdim=True))[..., 0]
    assert torch.equal(y[inner], nearest[inner]) and inner.float().mean() > 0.9


def test_int3_layout_three_bit_planes():
    # D = 16: bytes 0..1 the plane of bit 0, 2..3 of bit 1, 4..5 of bit 2; bit b of byte i of a plane is element
    # i + 2b
    n = torch.zeros(16, dtype=torch.uint8)
    n[13] = 5  # element 13 = 1 + 2 * 6: bits 0 and 2, bit 6 of bytes 1 and 5
    n[2] = 2  # element 2 = 0 + 2 * 1: bit 1, bit 1 of byte 2
    b = pack_int3(n)
    assert b.shape == (6,) and b.tolist() == [0, 0b1000000, 0b10, 0, 0, 0b1000000]
    r = torch.randint(0, 8, (3, 5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int3(pack_int3(r)), r)


def test_int3_codes_are_the_nearest_of_8_levels_without_a_zero():
    x = _spread_values()
    packed, s = quantize_int3(x, 32)
    assert packed.shape == (64, 3, 24) and s.shape == (64, 3, 2)
    assert torch.equal(s, (x.abs().reshape(64, 3, 2, 32).amax(-1) * 0.8 / 3.5).half())
    y = dequantize_int3(packed, s, 32)
    assert (y[0, 0, :32] == 0).all() and s[0, 0, 0] == 0  # a zero scale decodes to zeros whatever the code
    sg = s.float().repeat_interleave(32, -1)
    levels = (torch.arange(8).float() - 3.5)[None, None, None, :] * sg[..., None]
    inner = x.abs() < 3.4 * sg  # away from the clamp (0.8 of the absmax saturates the largest values)
    nearest = levels.gather(-1, (x[..., None] - levels).abs().argmin(-1, keepdim=True))[..., 0]
    assert torch.equal(y[inner], nearest[inner]) and inner.float().mean() > 0.8
    big = x.abs() > 3.5 * sg  # beyond the outer levels: saturated to them
    assert big.any() and torch.equal(unpack_int3(packed)[big], torch.where(x > 0, 7, 0)[big].to(torch.uint8))


def _e4m3_probe_values() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    v = vals[~vals.isnan()].unique()
    mids = (v[1:] + v[:-1]) / 2  # exact ties
    big, small = torch.tensor(1e9), torch.tensor(-1e9)
    g = torch.Generator().manual_seed(0)
    return torch.cat(
        [
            v,
            mids,
            torch.nextafter(mids, big),
            torch.nextafter(mids, small),
            torch.randn(20000, generator=g) * 100,
            torch.randn(20000, generator=g) * 1e-2,
            torch.tensor([0.0, -0.0, 1e-12, -1e-12, 447.9, 448.0, 460.0, 1e6, -1e6]),
        ]
    )


def test_fp8_encode_matches_torch_bit_for_bit():
    y = _e4m3_probe_values().clamp(-448, 448)
    ours = encode_fp8_e4m3(y)
    ref = y.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, ref)
    assert encode_fp8_e4m3(torch.tensor([1e6, -1e6])).tolist() == [0x7E, 0xFE]  # saturates, never NaN


def test_fp8_decode_matches_torch():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).float()
    ok = ~ref.isnan()
    assert torch.equal(decode_fp8_e4m3(codes)[ok], ref[ok])


def test_fp8_relative_error_in_normal_range():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(500, 64, generator=g) * torch.logspace(-2, 2, 500)[:, None]
    codes, s = quantize_fp8(x, 64)
    y = dequantize_fp8(codes, s, 64)
    normal = (x / s.float()).abs() >= 2**-6
    assert ((y - x).abs() <= 2**-4 * x.abs() * (1 + 1e-5))[normal].all()


def test_int8_error_bound():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 64, generator=g)
    q, s = quantize_int8(x, 16)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (dequantize_int8(q, s, 16) - x).abs().reshape(200, 4, 16)
    assert (err <= s.float()[..., None] / 2 + x.abs().reshape(200, 4, 16).amax(-1, keepdim=True) * 2**-10).all()


def mixed_plan(cfg=TINY, group_size=32) -> KVPlan:
    """Every precision present, channel scales and clip ratios not 1: the whole write/read path."""
    L, KV, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_size
    prec = [
        {"k": ["fp8", "int4"], "v": ["int4", "int8"]} if l % 2 else {"k": ["int4", "int4"], "v": ["int4", "fp8"]}
        for l in range(L)
    ]
    prec[2] = {"k": ["int6", "int5"], "v": ["int3", "int4"]}
    g = torch.Generator().manual_seed(3)
    kcs = torch.rand(L, KV, D, generator=g) * 4 + 0.25
    clip = torch.full((L, 2, KV), 0.9)
    return KVPlan("int4-fp8-outlier", L, KV, D, group_size, prec, kcs, clip, 0.25)


def test_store_read_is_fake_quantize_per_unit():
    plan = mixed_plan()
    store = make_kv_store(plan, TINY, num_pages=4, page_size=8)
    g = torch.Generator().manual_seed(4)
    slots = torch.tensor([0, 5, 9, 31, 17])
    for layer in range(TINY.num_layers):
        k = torch.randn(5, 2, 64, generator=g) * 3
        v = torch.randn(5, 2, 64, generator=g)
        store.write(layer, slots, k, v)
        kr, vr = store.read(layer, slots)
        for h in range(2):
            pk, pv = plan.precision[layer]["k"][h], plan.precision[layer]["v"][h]
            ck = plan.int4_clip[layer, 0, h].item() if pk == "int4" else 1.0
            cv = plan.int4_clip[layer, 1, h].item() if pv == "int4" else 1.0
            assert torch.equal(kr[:, h], fake_quantize(k[:, h], pk, 32, plan.k_channel_scale[layer, h], ck))
            assert torch.equal(vr[:, h], fake_quantize(v[:, h], pv, 32, None, cv))
        assert (kr - k).norm() < 0.5 * k.norm() and (vr - v).norm() < 0.2 * v.norm()  # a quantization, not garbage
        # write_read computes what a read gives from the levels, without unpacking: the same values and bytes
        other = torch.tensor([1, 2, 3, 4, 6])
        kw, vw = store.write_read(layer, other, k, v)
        assert torch.equal(kw, kr) and torch.equal(vw, vr)
        assert all(torch.equal(t[0, :, s], t[0, :, o]) for t in store.pools() for s, o in zip(slots[:1], other[:1]))


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_all_layer_writes_equal_layer_by_layer_writes(rotation):
    """write_layers / write_read_layers (one encode per precision for a whole forward) store the same bytes and
    return the same values as write / write_read layer by layer; a float store too."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(6)
    L = TINY.num_layers
    plan = replace(mixed_plan(), rotation=rotation, k_mean=torch.randn(L, 2, 64, generator=g))
    slots = torch.tensor([3, 17, 9, 30])
    k, v = torch.randn(L, 4, 2, 64, generator=g) * 3, torch.randn(L, 4, 2, 64, generator=g)
    one, every, decoded = (make_kv_store(plan, TINY, num_pages=4, page_size=8) for _ in range(3))
    per_layer = [one.write_read(layer, slots, k[layer], v[layer]) for layer in range(L)]
    every.write_layers(slots, k, v)
    kd, vd = decoded.write_read_layers(slots, k, v)
    for a, b, c in zip(one.pools(), every.pools(), decoded.pools()):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(kd, torch.stack([x for x, _ in per_layer])) and torch.equal(
        vd, torch.stack([y for _, y in per_layer])
    )
    f_one, f_every = (FloatKVStore(L, 2, 64, num_pages=4, page_size=8, dtype=torch.float16) for _ in range(2))
    for layer in range(L):
        f_one.write(layer, slots, k[layer], v[layer])
    f_every.write_layers(slots, k, v)
    assert torch.equal(f_one.k, f_every.k) and torch.equal(f_one.v, f_every.v)


def test_all_layer_writes_equal_layer_by_layer_writes_with_klt_units():
    """The same with KLT key units in some layers next to INT4 / INT5 keys and INT3 values: one transform of every
    layer's KLT keys (stacked tables) stores the same bytes and positions and returns the same values."""
    from dataclasses import replace

    from bpcompile.runtime.kvcache import QuantKVStore

    plan, _ = klt_plan(L=3, KV=2, D=16, seed=3)
    plan = replace(
        plan,
        precision=[
            {"k": ["klt4", "klt4"], "v": ["int4", "int3"]},
            {"k": ["int4", "int4"], "v": ["int4", "int4"]},
            {"k": ["int5", "klt4"], "v": ["int3", "int4"]},
        ],
    )
    g = torch.Generator().manual_seed(8)
    slots, pos = torch.tensor([3, 17, 9, 30]), torch.tensor([5, 40, 7, 1000])
    k, v = torch.randn(3, 4, 2, 16, generator=g) * 3, torch.randn(3, 4, 2, 16, generator=g)
    one, every, decoded = (QuantKVStore(plan, num_pages=4, page_size=8) for _ in range(3))
    per_layer = [one.write_read(layer, slots, k[layer], v[layer], positions=pos) for layer in range(3)]
    every.write_layers(slots, k, v, pos)
    kd, vd = decoded.write_read_layers(slots, k, v, pos)
    for a, b, c in zip(one.pools(), every.pools(), decoded.pools()):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(one.positions, every.positions) and torch.equal(one.positions, decoded.positions)
    assert torch.equal(kd, torch.stack([x for x, _ in per_layer])) and torch.equal(
        vd, torch.stack([y for _, y in per_layer])
    )
    assert all(torch.equal(every.read(layer, slots)[0], kd[layer]) for layer in range(3))


def test_move_is_an_exact_copy():
    """Compaction after tree verification: moved bytes == bytes appended in order at the destination."""
    plan = mixed_plan()
    a = make_kv_store(plan, TINY, 4, 8)
    b = make_kv_store(plan, TINY, 4, 8)
    g = torch.Generator().manual_seed(5)
    src, dst = torch.tensor([20, 22, 25]), torch.tensor([3, 4, 5])
    for layer in range(TINY.num_layers):
        k, v = torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g)
        a.write(layer, src, k, v)
        b.write(layer, dst, k, v)
    a.move(src, dst)
    for pa, pb in zip(a.pools(), b.pools()):
        pgs, offs = dst // 8, dst % 8
        assert torch.equal(pa[pgs, :, offs], pb[pgs, :, offs])
    for layer in range(TINY.num_layers):
        for x, y in zip(a.read(layer, dst), b.read(layer, dst)):
            assert torch.equal(x, y)


def test_float_store_still_works():
    s = FloatKVStore(2, 2, 8, num_pages=2, page_size=4, dtype=torch.float16)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    s.write(1, torch.tensor([0, 5, 6]), k, v)
    s.move(torch.tensor([5, 6]), torch.tensor([1, 2]))
    kr, vr = s.read(1, torch.tensor([0, 1, 2]))
    assert torch.equal(kr, k.half()) and torch.equal(vr, v.half())


def test_nbytes_and_compression_of_default_plan():
    """Default tiny plan: 15 INT4 units (32 B + one fp16 scale) + 1 FP8 unit (64 B + scale) per token."""
    L, KV, D = 4, 2, 64
    prec = [{"k": ["int4", "int4"], "v": ["int4", "int4"]} for _ in range(L)]
    prec[0]["v"][1] = "fp8"
    plan = KVPlan("int4-fp8-outlier", L, KV, D, 64, prec, torch.ones(L, KV, D), torch.ones(L, 2, KV), 0.08)
    assert plan.bytes_per_token() == 15 * 34 + 66 == 576
    pages, S = 64, 16
    store = make_kv_store(plan, TINY, pages, S)
    static = 16 + 16 * 4 + L * KV * D * 4 + 16 * 4  # unit_precision, unit_index, k_channel_scale, int4_clip
    assert store.nbytes() == pages * S * 576 + static
    fp16 = make_kv_store(KVPlan.uniform("fp16", L, KV, D), TINY, pages, S)
    assert isinstance(fp16, FloatKVStore) and fp16.nbytes() == pages * S * 2048
    assert fp16.nbytes() / store.nbytes() >= 3.5
    naive = KVPlan.uniform("int4-naive", L, KV, D)
    assert naive.effective_group_size == 64 and naive.bytes_per_token() == 16 * 34
    assert KVPlan.uniform("fp8", L, KV, D).compression_vs_fp16() == pytest.approx(128 / 66)


def test_plan_save_load_roundtrip_and_factory(tmp_path):
    plan = mixed_plan()
    plan.save(tmp_path / "a")
    back = KVPlan.load(tmp_path / "a")
    assert back.precision == plan.precision and back.group_size == 32
    assert torch.equal(back.k_channel_scale, plan.k_channel_scale) and torch.equal(back.int4_clip, plan.int4_clip)
    back.save(tmp_path / "b")
    for f in ("plan.json", "scales.safetensors"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    store = kv_store_factory(back)(TINY, 2, 16, "cpu")
    assert isinstance(store, QuantKVStore) and store.payload[FP8].shape == (2, 3, 16, 64)
    assert store.payload[INT6].shape == (2, 1, 16, 48) and store.payload[INT3].shape == (2, 1, 16, 24)


def test_bad_plans_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="format"):
        KVPlan("int3", 1, 1, 64)
    with pytest.raises(UserError, match="precision"):
        KVPlan("int4-fp8-outlier", 1, 2, 64, 64, [{"k": ["int4"], "v": ["int4", "int4"]}])
    with pytest.raises(UserError, match="int2"):
        KVPlan("int4-fp8-outlier", 1, 1, 64, 64, [{"k": ["int2"], "v": ["int4"]}])
    with pytest.raises(UserError, match="multiple of 8"):
        KVPlan("int4-fp8-outlier", 1, 1, 12, 12, [{"k": ["int6"], "v": ["int3"]}])
    with pytest.raises(UserError, match="divide"):
        KVPlan.uniform("fp8", 1, 1, 64, group_size=48)
    with pytest.raises(UserError, match="plan.json"):
        KVPlan.load(tmp_path)
    with pytest.raises(UserError, match="KV heads"):
        make_kv_store(KVPlan.uniform("fp8", 4, 1, 64), TINY, 2, 16)


def test_exact_entries_are_saved_validated_and_counted(tmp_path):
    """sink_tokens / recent_window round-trip through plan.json; the compression of a plan with exact entries exists
    only for a sequence length, and counts exactly the FP16 copies the runtime allocates (RecentKV)."""
    from dataclasses import replace

    from bpcompile.runtime.paged_kv import RecentKV

    plan = replace(mixed_plan(), sink_tokens=1, recent_window=16)
    plan.save(tmp_path / "a")
    back = KVPlan.load(tmp_path / "a")
    assert (back.sink_tokens, back.recent_window) == (1, 16) and back.has_exact
    with pytest.raises(ValueError, match="sequence length"):
        back.compression_vs_fp16()
    store = kv_store_factory(back)(TINY, 2, 16, "cpu")
    assert RecentKV(store, 3, 1, 16, 6, "cpu").nbytes() == 3 * back.exact_bytes_per_sequence(6)
    fp16 = TINY.num_layers * TINY.num_kv_heads * 2 * 2 * TINY.head_size
    n = 512 + 6
    want = fp16 * n / (back.bytes_per_token() * n + 2 * 2 * 64 * 23 * TINY.num_layers * TINY.num_kv_heads)
    assert back.compression_vs_fp16(512, 6) == pytest.approx(want)
    assert mixed_plan().compression_vs_fp16(512, 6) == mixed_plan().compression_vs_fp16()  # no copies: no change
    for bad in (-1, 1.5, True):
        with pytest.raises(UserError, match="recent_window"):
            replace(mixed_plan(), recent_window=bad)
    with pytest.raises(UserError, match="exact already"):
        replace(KVPlan.uniform("fp16", 1, 1, 64), sink_tokens=1)


# ------------------------------------------------------------------------------------------- KLT keys


def klt_plan(L=2, KV=2, D=16, seed=0, scale=1.0):
    """A plan whose keys are KLT4 units with a random well-conditioned basis (values INT4)."""
    from bpcompile.compiler.calibrate import water_filling_bits

    g = torch.Generator().manual_seed(seed)
    t = {
        "mean": torch.randn(L, KV, D, generator=g) * 0.1,
        "bits": torch.zeros(L, KV, D, dtype=torch.int8),
        "weight": torch.rand(L, KV, D, generator=g) + 0.5,
        "step": torch.zeros(L, KV, D),
        "level": torch.zeros(L, KV, D),
        "inv_freq": 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)),
        "basis": torch.zeros(L, KV, D, D, dtype=torch.float16),
    }
    lam = torch.logspace(2, -3, D) * scale**2  # coefficient variances: a few large, many small (as keys)
    for layer in range(L):
        for h in range(KV):
            Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
            t["basis"][layer, h] = Q.to(torch.float16)
            b = water_filling_bits(lam, 4 * D)
            t["bits"][layer, h] = b.to(torch.int8)
            t["step"][layer, h] = lam.sqrt().float() / 2.0 ** b.float()
            t["level"][layer, h] = torch.where(b == 1, lam.sqrt().float() * 0.8, 0.0)
    prec = [{"k": ["klt4"] * KV, "v": ["int4"] * KV} for _ in range(L)]
    return KVPlan("int4-fp8-outlier", L, KV, D, D, prec, rotation="hadamard", klt=t), lam


def test_klt_codec_packs_coefficients_bit_by_bit_and_round_trips():
    """encode_klt's payload is each coefficient's code, least significant bit first, coefficient after
    coefficient; decode_klt of it gives what encode_klt says a read decodes; rounding is within half a step."""
    from bpcompile.runtime.kvcache import decode_klt, encode_klt, klt_dither, klt_pack_index

    bits = torch.tensor([[8, 6, 4, 4, 3, 3, 2, 1, 1, 0]])  # 32 bits: 4 bytes
    step = torch.tensor([[0.01, 0.05, 0.2, 0.2, 0.3, 0.3, 0.5, 0.0, 0.0, 0.0]])
    level = torch.tensor([[0.0] * 7 + [0.7, 0.4, 0.0]])
    coef, shift = klt_pack_index(bits)
    z = torch.tensor([[[0.9, -1.3, 0.55, -0.2, 0.6, -0.61, 0.4, 2.0, -0.3, 5.0]]])
    u = klt_dither(torch.tensor([17]), torch.tensor([3]), 10)
    payload, s, dec = encode_klt(z, bits, step, level, coef, shift, u, decoded=True)
    assert payload.shape == (1, 1, 4) and s.dtype == torch.float16
    # the codes, recomputed by hand from the format's rule, packed by hand
    t = s.float()[0, 0, 0] * step[0]
    expect = []
    for i, b in enumerate(bits[0].tolist()):
        if b >= 2:
            qmax = 2 ** (b - 1) - 1
            expect.append(int(max(-qmax, min(qmax, torch.round(z[0, 0, i] / t[i] + u[0, 0, i]).item()))) + qmax + 1)
        elif b == 1:
            expect.append(int(z[0, 0, i] >= 0))
        else:
            expect.append(0)
    stream = [(n >> j) & 1 for n, b in zip(expect, bits[0].tolist()) for j in range(b)]
    assert payload[0, 0].tolist() == [sum(bit << j for j, bit in enumerate(stream[k : k + 8])) for k in range(0, 32, 8)]
    assert torch.equal(decode_klt(payload, s, bits, step, level, coef, shift, u), dec)
    wide = bits[0] >= 2
    assert ((dec - z)[0, 0, wide].abs() <= t[wide] / 2 + 1e-6).all()  # no coefficient clipped here
    assert dec[0, 0, 7] == 0.7 and dec[0, 0, 8] == -0.4 and dec[0, 0, 9] == 0  # 1-bit signs, a 0-bit zero


def test_klt_dither_is_a_fixed_function_of_position_unit_and_coefficient():
    from bpcompile.runtime.kvcache import klt_dither

    a = klt_dither(torch.arange(4096), torch.tensor([0, 1, 7]), 64)
    assert a.shape == (4096, 3, 64) and a.abs().max() <= 0.5
    assert torch.equal(a, klt_dither(torch.arange(4096), torch.tensor([0, 1, 7]), 64))
    assert abs(a.mean()) < 0.01 and abs(a.var() - 1 / 12) < 0.002  # uniform on (-0.5, 0.5)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[:, 0], a[:, 1])  # varies with position and unit


def test_klt_store_quantizes_keys_before_rope_and_reapplies_it():
    """The same key before RoPE written at two positions reads back as that key rotated to each position, within
    the codec's error; a write without positions is refused; move() carries the positions with the bytes."""
    from bpcompile.runtime.kvcache import rope_rotate

    plan, lam = klt_plan()
    L, KV, D = 2, 2, 16
    inv = plan.klt["inv_freq"]
    store = QuantKVStore(plan, num_pages=8, page_size=4)
    g = torch.Generator().manual_seed(1)
    basis = plan.klt["basis"].float()
    for layer in range(L):  # keys with those coefficient variances: z = ((pre - mean) * weight) @ basis
        coeffs = torch.randn(3, KV, D, generator=g) * lam.sqrt().float()
        pre = (
            torch.einsum("nhe,hed->nhd", coeffs, torch.linalg.inv(basis[layer])) / plan.klt["weight"][layer]
            + plan.klt["mean"][layer]
        )
        pos = torch.tensor([5, 900, 3000])
        k = rope_rotate(pre, pos, inv, 1.0)
        v = torch.randn(3, KV, D, generator=g)
        with pytest.raises(ValueError, match="positions"):
            store.write(layer, torch.tensor([0, 1, 2]), k, v)
        store.write(layer, torch.tensor([0, 1, 2]), k, v, pos)
        kr, vr = store.read(layer, torch.tensor([0, 1, 2]))
        # a skewed spectrum in 4 bits an element: well under the error of INT4 on the rotated keys (same bytes)
        int4 = fake_quantize(k, "int4", D, rotate=True)
        assert (kr - k).norm() < 0.6 * (int4 - k).norm()
        # the same key before RoPE at another position: read back rotated there
        store.write(
            layer, torch.tensor([7]), rope_rotate(pre[:1], torch.tensor([77]), inv, 1.0), v[:1], torch.tensor([77])
        )
        k7, _ = store.read(layer, torch.tensor([7]))
        assert (rope_rotate(k7, torch.tensor([77]), inv, -1.0) - pre[:1]).norm() < 0.15 * pre[:1].norm()
    # move: the destination reads what an in-order write there reads (bytes and positions)
    other = QuantKVStore(plan, num_pages=8, page_size=4)
    k = torch.randn(2, KV, D, generator=g)
    for s_ in (store, other):
        for layer in range(L):
            (
                s_.write(layer, torch.tensor([20, 21]), k, k, torch.tensor([40, 41]))
                if s_ is store
                else s_.write(layer, torch.tensor([12, 13]), k, k, torch.tensor([40, 41]))
            )
    store.move(torch.tensor([20, 21]), torch.tensor([12, 13]))
    for layer in range(L):
        for x, y in zip(store.read(layer, torch.tensor([12, 13])), other.read(layer, torch.tensor([12, 13]))):
            assert torch.equal(x, y)


def test_klt_plans_save_load_validate_and_count_their_tables(tmp_path):
    from dataclasses import replace

    plan, _ = klt_plan()
    plan.save(tmp_path / "p")
    back = KVPlan.load(tmp_path / "p")
    assert back.has_klt and plan_support(back, "triton") == [] and plan_support(back, "tensorrt")
    assert all(torch.equal(back.klt[n].float(), plan.klt[n].float()) for n in plan.klt)
    assert back.klt["basis"].dtype == torch.float16 and back.klt["bits"].dtype == torch.int8
    bad = {n: t.clone() for n, t in plan.klt.items()}
    bad["bits"][0, 0, 0] += 1  # 65 bits: not a KLT4 unit
    with pytest.raises(UserError, match="klt_bits"):
        replace(plan, klt=bad)
    with pytest.raises(UserError, match="klt_basis"):
        replace(plan, klt={n: t for n, t in plan.klt.items() if n != "basis"})
    with pytest.raises(UserError, match="key units only"):
        replace(plan, precision=[{"k": p["k"], "v": ["klt4", "int4"]} for p in plan.precision])
    # its tables are bytes of record: a D x D float16 matrix per KLT unit at least
    with_tables = QuantKVStore(plan, 8, 4).nbytes()
    plain = QuantKVStore(replace(plan, precision=[{"k": ["int4"] * 2, "v": ["int4"] * 2}] * 2, klt=None), 8, 4).nbytes()
    assert with_tables - plain >= 4 * 16 * 16 * 2


def test_allocated_compression_counts_tables_once_per_pool_and_windows_per_sequence():
    """The runtime allocates one pool for max_batch_size sequences: a KLT plan's per-engine tables weigh less in a
    larger pool, an exact window's copies (one ring per sequence) and the payload do not."""
    from dataclasses import replace

    from bpcompile.runtime.paged_kv import allocated_compression

    cfg = ModelConfig(
        vocab_size=8, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, head_size=16, intermediate_size=8
    )
    plan, _ = klt_plan()
    int4 = replace(plan, precision=[{"k": ["int4"] * 2, "v": ["int4"] * 2}] * 2, klt=None)
    windowed = replace(int4, recent_window=8)

    def gain(p):  # compression in a pool of 8 sequences over that at one
        return allocated_compression(p, cfg, 256, 6, sequences=8) / allocated_compression(p, cfg, 256, 6)

    assert allocated_compression(plan, cfg, 256, 6, sequences=8) < allocated_compression(int4, cfg, 256, 6, sequences=8)
    assert gain(plan) > gain(int4) * 1.05  # the D x D tables, once per pool
    assert gain(windowed) == pytest.approx(gain(int4), rel=0.02)  # a window ring per sequence: no gain of its own
    # what the stores the runtime would allocate for that pool hold (3 sequences of 40 tokens + a 6-token tree)
    from bpcompile.runtime.kvcache import make_kv_store
    from bpcompile.runtime.paged_kv import RecentKV, cache_pages

    pages = cache_pages(3, 40, 6, 4)
    for p in (plan, windowed):
        store = make_kv_store(p, cfg, pages, 4)
        ours = store.nbytes() + (RecentKV(store, 3, 0, p.recent_window, 6, "cpu").nbytes() if p.has_exact else 0)
        fp16 = FloatKVStore(2, 2, 16, pages, 4, dtype=torch.float16).nbytes()
        assert allocated_compression(p, cfg, 40, 6, page_size=4, sequences=3) == pytest.approx(fp16 / ours, rel=1e-12)
