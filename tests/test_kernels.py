"""The Triton kernels (bpcompile/kernels/paged.py) against the PyTorch oracle (bpcompile/runtime/kvcache.py), on CPU in
Triton's interpreter: quantize-and-append bit for bit, paged tree attention within float tolerance,
the compaction move byte for byte. Small shapes, few program instances (the interpreter costs ~1 ms each)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors run interpreted

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bpcompile.compiler import aot, plugin  # noqa: E402
from bpcompile.kernels import paged as K  # noqa: E402
from bpcompile.kernels import tree_mask as TM  # noqa: E402
from bpcompile.kernels.reference import paged_attention_reference  # noqa: E402
from bpcompile.runtime.kvcache import FP8, INT4, INT5, INT8, KVPlan, QuantKVStore, encode_fp8_e4m3  # noqa: E402  # noqa: E402

L, KV, D = 2, 2, 64
# every unit kind but KLT present (INT4, FP8, INT8, INT5, INT6, INT3; KLT: below); K and V of one head may differ
PRECISION = [{"k": ["int4", "fp8"], "v": ["int3", "int4"]}, {"k": ["int8", "int5"], "v": ["int6", "int3"]}]


def make_store(
    group_size: int, num_pages: int = 24, page_size: int = 16, seed: int = 0, rotation: str = "none"
) -> QuantKVStore:
    g = torch.Generator().manual_seed(seed)
    plan = KVPlan(
        "int4-fp8-outlier",
        L,
        KV,
        D,
        group_size,
        PRECISION,
        k_channel_scale=torch.rand(L, KV, D, generator=g) + 0.5,
        int4_clip=torch.rand(L, 2, KV, generator=g) * 0.3 + 0.7,
        rotation=rotation,
        k_mean=torch.randn(L, KV, D, generator=g) if rotation == "hadamard" else None,
    )
    return QuantKVStore(plan, num_pages, page_size)


def clone_store(st: QuantKVStore) -> QuantKVStore:
    c = QuantKVStore(st.plan, st.num_pages, st.page_size)
    for a, b in zip(c.pools(), st.pools()):
        a.copy_(b)
    return c


def same_bytes(a: QuantKVStore, b: QuantKVStore) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.pools(), b.pools()))


def attention_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to the output scale: the comparison every attention test uses."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()


def medusa_tree(choices: list[list[int]]) -> list[int]:
    """Parents of the tree a Medusa/EAGLE choices list describes (node 0 = the true token), nodes ordered by
    (depth, choice) as TensorRT-LLM's _medusa_setup sorts them; paths-only lists are expanded to all prefixes."""
    full = sorted({tuple(c[:i]) for c in choices for i in range(1, len(c) + 1)}, key=lambda c: (len(c), c))
    index = {(): 0, **{c: i + 1 for i, c in enumerate(full)}}
    return [-1] + [index[c[:-1]] for c in full]


# the reference's example (TensorRT-LLM docs, paths-only form), plus a chain and a branching tree
TRTLLM_EXAMPLE = medusa_tree([[0, 0, 0, 0], [0, 1, 0], [1, 0], [1, 1]])


def setup_batch(st, ctxs, trees, G, H, dtype, seed=0):
    """Append each sequence's context + tree tokens (oracle write) and build the attention inputs."""
    g = torch.Generator().manual_seed(seed)
    S, B = st.page_size, len(ctxs)
    pages_per_seq = st.num_pages // B
    block_tables = torch.randperm(st.num_pages, generator=g)[: B * pages_per_seq].reshape(B, pages_per_seq).int()
    for b in range(B):
        T = ctxs[b] + len(trees[b])
        assert T <= pages_per_seq * S
        t = torch.arange(T)
        slots = block_tables[b, t // S].long() * S + t % S
        for layer in range(L):
            st.write(layer, slots, torch.randn(T, KV, D, generator=g) * 2, torch.randn(T, KV, D, generator=g))
    masks = torch.zeros(B, G, G, dtype=torch.bool)
    for b, parents in enumerate(trees):
        masks[b, : len(parents), : len(parents)] = TM.tree_mask_from_parents(parents)
    q = (torch.randn(B, G, H, D, generator=g) * 1.5).to(dtype)
    return q, block_tables, torch.tensor(ctxs), TM.pack_bool_mask(masks), torch.tensor([len(p) for p in trees])


# ------------------------------------------------------------------------------------------------
# quantize-and-append


@pytest.mark.parametrize(
    "group_size,dtype,rotation",
    [
        (64, torch.float32, "none"),
        (32, torch.float16, "none"),
        (16, torch.bfloat16, "none"),
        (64, torch.float32, "hadamard"),
    ],
)
def test_quantize_append_is_bit_exact(group_size, dtype, rotation):
    ref, ker = make_store(group_size, rotation=rotation), make_store(group_size, rotation=rotation)
    g = torch.Generator().manual_seed(1)
    N = 37  # not a multiple of the kernel's token block, slots scattered over pages
    slots = torch.randperm(ref.num_pages * ref.page_size, generator=g)[:N]
    k = (torch.randn(N, KV, D, generator=g) * 3).to(dtype)
    v = torch.randn(N, KV, D, generator=g).to(dtype)
    k[3, 0, :group_size] = 0  # an all-zero group: scale 0, codes of zero
    v[5, 1] *= 1e-30  # scales underflow fp16
    k[7, 1, 0] = 1e4  # one large outlier in a group
    for layer in range(L):
        ref.write(layer, slots, k, v)
        K.quantize_append(ker, layer, slots, k, v)
    assert same_bytes(ref, ker)
    assert ref.scales[INT4].abs().sum() > 0 and ref.payload[FP8].sum() > 0 and ref.payload[INT8].abs().sum() > 0
    assert ref.payload[INT5].sum() > 0  # every pool was written


def test_fp8_encoding_edge_values_match_torch():
    """x / s = x when the group's absmax is 448 (s = 1): the kernel's bit-level E4M3 encoder sees these values
    directly: RNE ties, subnormals, the saturation bound, signed zero."""
    st_ref, st_ker = make_store(64), make_store(64)
    vals = torch.tensor(
        [
            448.0,
            1.0625,
            1.1875,
            -1.0625,
            2.0**-7,
            3 * 2.0**-10,
            2.0**-10,
            5 * 2.0**-10,
            2.0**-6 - 2.0**-11,
            -0.0,
            0.0,
            240.0,
            232.0,
            0.0146484375,
            -447.9,
            17.5,
            18.5,
            19.5,
        ]
    )
    x = torch.zeros(1, KV, D)
    x[0, 1, : len(vals)] = vals  # layer 0 K head 1 is an FP8 unit
    x[0, 1, len(vals)] = 448.0
    x[0, 0] = 1.0
    one = torch.ones(L, KV, D)
    st_ref.k_channel_scale.copy_(one)
    st_ker.k_channel_scale.copy_(one)
    slot = torch.tensor([5])
    st_ref.write(0, slot, x, x)
    K.quantize_append(st_ker, 0, slot, x, x)
    assert same_bytes(st_ref, st_ker)
    idx = int(st_ref.unit_index[0, 0, 1])
    codes = st_ker.payload[FP8][0, idx, 5, : len(vals)]
    assert torch.equal(codes, vals.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(codes, encode_fp8_e4m3(vals))


def test_quantize_append_detects_a_wrong_clip():
    """The bit-exact comparison must fail when the kernel is given different static scales."""
    ref, ker = make_store(64), make_store(64)
    g = torch.Generator().manual_seed(2)
    slots = torch.arange(8)
    k, v = torch.randn(8, KV, D, generator=g), torch.randn(8, KV, D, generator=g)
    ker.int4_clip[0, 0, 0] *= 0.9  # layer 0 K head 0 is INT4
    ref.write(0, slots, k, v)
    K.quantize_append(ker, 0, slots, k, v)
    assert not same_bytes(ref, ker)


# ------------------------------------------------------------------------------------------------
# paged tree attention


CASES = {
    # decode (G = 1), GQA 4:1, fp32, partial last pages, a sequence with no committed context
    "decode-gqa4": dict(
        group_size=64,
        H=8,
        dtype=torch.float32,
        G=1,
        trees=[[-1]] * 3,
        ctxs=[37, 100, 0],
        splits=1,
        block_n=None,
        tol=1e-4,
    ),
    # TRT-LLM's example tree and a branching tree, GQA 1:1, two context splits, 32-token tiles
    "tree-gqa1-split": dict(
        group_size=32,
        H=2,
        dtype=torch.float32,
        G=10,
        trees=[TRTLLM_EXAMPLE, [-1, 0, 0, 1, 2, 1]],
        ctxs=[70, 21],
        splits=2,
        block_n=32,
        tol=1e-4,
    ),
    # a 40-token chain (two mask words, bit 31 set), fp16 queries, per-element scales (G < D/2), 3 splits
    "chain40-fp16": dict(
        group_size=16,
        H=4,
        dtype=torch.float16,
        G=40,
        trees=[list(range(-1, 39)), [-1, 0, 1]],
        ctxs=[50, 9],
        splits=3,
        block_n=32,
        tol=2e-2,
    ),
    # causal (tree_mask None), fewer real query rows than tree tokens in the second sequence
    # the rotated format (keys centered, channel-scaled, K and V Hadamard-rotated): the kernel attends in the
    # stored basis with a transformed query and rotates the output back
    "rotated-tree-gqa2": dict(
        group_size=64,
        H=4,
        dtype=torch.float32,
        G=6,
        trees=[[-1, 0, 0, 1, 2, 1], [-1]],
        ctxs=[45, 17],
        splits=2,
        block_n=32,
        tol=1e-4,
        rotation="hadamard",
    ),
    "causal-qlens": dict(
        group_size=64,
        H=4,
        dtype=torch.float32,
        G=5,
        trees=[[-1, 0, 1, 2, 3], [-1, 0, 1, 2]],
        ctxs=[20, 33],
        splits=1,
        block_n=None,
        tol=1e-4,
        causal=True,
        q_lens=[5, 2],
    ),
}


def run_case(c, perturb=None):
    st = make_store(c["group_size"], num_pages=24, rotation=c.get("rotation", "none"))
    q, bt, ctx, tm, nt = setup_batch(st, c["ctxs"], c["trees"], c["G"], c["H"], c["dtype"])
    scale = 1 / math.sqrt(D)
    kst, ktm = st, tm
    if perturb:
        kst, ktm = perturb(clone_store(st), tm.clone(), bt, ctx)
    if c.get("causal"):  # the runtime's prefill / chain form: no mask tensor, causal over the new tokens
        tm = ktm = None
    ql = torch.tensor(c["q_lens"]) if "q_lens" in c else None
    errs = []
    for layer in range(L):
        ref = paged_attention_reference(q, st, layer, bt, ctx, tm, nt, scale, q_lens=ql)
        out = K.paged_attention(
            q, kst, layer, bt, ctx, ktm, nt, scale, q_lens=ql, num_splits=c["splits"], block_n=c["block_n"]
        )
        assert out.shape == q.shape and out.dtype == q.dtype
        errs.append(attention_error(out, ref))
        G = c["G"]
        for b, n in enumerate((nt if ql is None else ql).tolist()):  # padding query rows are zero
            assert not out[b, n:G].any()
    return max(errs)


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_reference(name):
    c = CASES[name]
    assert run_case(c) <= c["tol"]


def test_attention_comparison_detects_a_wrong_scale():
    c = CASES["decode-gqa4"]

    def perturb(st, tm, bt, ctx):
        # the INT4 K scale of token 3 of sequence 0 (layer 0, head 0), and an FP8 V scale
        slot = int(bt[0, 0]) * st.page_size + 3
        st.scales[INT4][slot // st.page_size, int(st.unit_index[0, 0, 0]), slot % st.page_size] *= 4
        st.scales[FP8][slot // st.page_size, int(st.unit_index[0, 1, 0]), slot % st.page_size] *= 4
        return st, tm

    assert run_case(c, perturb) > 10 * c["tol"]


def test_attention_comparison_detects_a_flipped_mask_bit():
    c = CASES["tree-gqa1-split"]

    def perturb(st, tm, bt, ctx):
        tm[0, 5, 0] ^= 1 << 1  # node 5 ([1, 0]) of TRT-LLM's example now also sees node 1 ([0]): not its ancestor
        return st, tm

    assert run_case(c, perturb) > 10 * c["tol"]


# ------------------------------------------------------------------------------------------------
# compaction move and the tree-mask helpers


def test_move_slots_matches_store_move_with_overlap():
    ref = make_store(32)
    g = torch.Generator().manual_seed(3)
    n = 12
    slots = torch.arange(40, 40 + n)
    for layer in range(L):
        ref.write(layer, slots, torch.randn(n, KV, D, generator=g), torch.randn(n, KV, D, generator=g))
    ker = clone_store(ref)
    # accepted path nodes 0, 2, 5, 9 of a tree stored at 40.. -> compacted to 40..43: dst overlaps src
    src = torch.tensor([40, 42, 45, 49])
    dst = torch.tensor([40, 41, 42, 43])
    ref.move(src, dst)
    K.move_slots(ker, src, dst)
    assert same_bytes(ref, ker)
    # and a move across pages that does not overlap
    ref.move(torch.tensor([41, 43]), torch.tensor([300, 17]))
    K.move_slots(ker, torch.tensor([41, 43]), torch.tensor([300, 17]))
    assert same_bytes(ref, ker)
    assert not same_bytes(ref, make_store(32))  # the comparison is not vacuous


def test_packed_tree_mask_format():
    m = TM.tree_mask_from_parents(TRTLLM_EXAMPLE)
    p = TM.pack_bool_mask(m)
    assert p.shape == (10, 1) and p.dtype == torch.int32
    assert int(p[0, 0]) == 1  # row 0 (the true token) sees only itself
    # nodes by (depth, choice): 1 = [0], 2 = [1], 3 = [0, 0], ..., 7 = [0, 0, 0] sees 0, 1, 3 and itself
    assert int(p[7, 0]) == (1 << 0) | (1 << 1) | (1 << 3) | (1 << 7)
    assert TRTLLM_EXAMPLE == [-1, 0, 0, 1, 1, 2, 2, 3, 4, 7]
    chain = TM.pack_bool_mask(TM.tree_mask_from_parents(list(range(-1, 39))))
    assert chain.shape == (40, 2) and int(chain[31, 0]) == -1 and int(chain[39, 1]) == 0xFF
    assert torch.equal(TM.unpack_tree_mask(chain, 40), TM.tree_mask_from_parents(list(range(-1, 39))))


# ------------------------------------------------------------------------------------------------
# ahead-of-time compilation (sm_90a cubins + C launchers, no GPU needed) and the TensorRT plugin project


def _recipe(page_size=16, group_size=64, arch="sm_90a"):
    from bpcompile.compiler.recipe import Recipe

    return Recipe(
        name="k",
        models={"verifier": {"path": "v"}, "draft": {"path": "d"}},
        kv_cache={"page_size": page_size, "group_size": group_size},
        kernels={"arch": arch},
    )


def _stage(tmp_path, head_size=64, heads=4, kv_heads=2):
    import json

    (tmp_path / "stage" / "verifier").mkdir(parents=True)
    (tmp_path / "stage" / "verifier" / "config.json").write_text(
        json.dumps(
            {
                "num_attention_heads": heads,
                "num_key_value_heads": kv_heads,
                "head_size": head_size,
                "hidden_size": heads * head_size,
                "dtype": "float16",
            }
        )
    )
    return tmp_path / "stage"


def test_compile_engine_kernels_sm90a(tmp_path, monkeypatch):
    import hashlib
    import json

    monkeypatch.setenv("BPCOMPILE_CACHE", str(tmp_path / "cache"))  # really compile, don't reuse ~/.cache
    stage = _stage(tmp_path)
    out = tmp_path / "kernels"
    res = aot.compile_engine_kernels(stage, _recipe(), out)
    assert res["status"] == "compiled" and not res["cached"] and "sm_90a" in res["detail"]
    kj = json.loads((out / "kernels.json").read_text())
    assert kj["arch"] == "sm_90a" and kj["triton_version"] and kj["model"]["head_size"] == 64
    names = {k["name"] for k in kj["kernels"]}
    assert {
        "bp_quantize_append_fp16",
        "bp_paged_attention_decode_fp16",
        "bp_paged_attention_tree_split_fp16",
        "bp_combine_splits_fp16",
        "bp_copy_rows_fp16",
    } <= names
    for k in kj["kernels"]:
        for f in k["files"].values():
            assert hashlib.sha256((out / f["path"]).read_bytes()).hexdigest() == f["sha256"]
        assert (out / k["files"]["cubin"]["path"]).read_bytes()[:4] == b"\x7fELF"
        assert ".target sm_90a" in (out / k["files"]["ptx"]["path"]).read_text()
        assert k["constexprs"] and k["signature"]
    attn = next(k for k in kj["kernels"] if k["name"] == "bp_paged_attention_decode_fp16")
    assert attn["constexprs"]["R"] == 2 and attn["constexprs"]["GS"] == 64 and attn["constexprs"]["PAGE"] == 16
    header = (out / "bp_paged_attention_decode_fp16.h").read_text()
    assert "bp_paged_attention_decode_fp16_launch(CUstream stream, unsigned int gridX" in header
    # second build: from the cache, same artifacts (kernels.json carries no timestamps)
    out2 = tmp_path / "kernels2"
    res2 = aot.compile_engine_kernels(stage, _recipe(), out2)
    assert res2["cached"] and (out2 / "kernels.json").read_text() == (out / "kernels.json").read_text()
    check = kj["launcher_check"]
    if aot.find_cuda_include() is None:
        assert check["status"] == "skipped" and check["reason"]
        pytest.skip("no cuda.h here: the generated C launchers were not compiled")
    assert check["status"] == "ok", check  # the generated C launchers compiled against cuda.h


def test_compile_engine_kernels_skips_unsupported_shape(tmp_path):
    import json

    res = aot.compile_engine_kernels(_stage(tmp_path, head_size=16), _recipe(), tmp_path / "kernels")
    assert res["status"] == "skipped" and "head_size 16" in res["detail"]
    assert json.loads((tmp_path / "kernels" / "kernels.json").read_text())["status"] == "skipped"


def test_trt_plugin_source_compiles_strictly(tmp_path):
    """Where TENSORRT_ROOT points at TensorRT's headers, the plugin source compiles with -Wall -Wextra -Werror
    against them and an engine's generated kernel headers (TensorRT's and CUDA's headers are system headers,
    as the CMake project includes them). The same check the CMake build makes, without TensorRT's libraries."""
    import os
    import shutil
    import subprocess

    root = os.environ.get("TENSORRT_ROOT")
    if not root or not (Path(root) / "include" / "NvInfer.h").is_file():
        pytest.skip("TENSORRT_ROOT does not point at TensorRT headers (include/NvInfer.h)")
    cuda = aot.find_cuda_include()
    cxx = shutil.which("c++") or shutil.which("g++")
    if cuda is None or cxx is None:
        pytest.skip("no CUDA headers or no C++ compiler here")
    kdir = tmp_path / "kernels"
    res = aot.compile_engine_kernels(_stage(tmp_path), _recipe(), kdir)
    assert res["status"] == "compiled"
    cmd = [
        cxx,
        "-std=c++17",
        "-fsyntax-only",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-isystem",
        str(Path(root) / "include"),
        "-isystem",
        str(cuda),
        f"-I{kdir}",
        str(plugin.PLUGIN_SRC / "src" / "bpcompile_plugins.cpp"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]


def test_trt_plugin_is_not_pretended(tmp_path, monkeypatch):
    """TensorRT is absent here: the build reports why (or raises when required), and the CMake project
    configures far enough to say TensorRT is missing. Where TensorRT exists this test does not apply."""
    import json
    import shutil
    import subprocess

    from bpcompile.core.errors import MissingDependency

    if plugin.find_tensorrt() is not None:
        pytest.skip("TensorRT is installed here: the plugin build itself is exercised instead")
    src = plugin.PLUGIN_SRC
    assert (src / "CMakeLists.txt").is_file() and (src / "src" / "bpcompile_plugins.cpp").is_file()
    kdir = tmp_path / "kernels"
    kdir.mkdir()
    (kdir / "kernels.json").write_text(json.dumps({"status": "compiled"}))
    res = plugin.build_trt_plugin(kdir, tmp_path / "plugin")
    assert res["status"] == "skipped" and "TensorRT" in res["reason"]
    assert not (tmp_path / "plugin" / plugin.PLUGIN_LIB).exists()
    with pytest.raises(MissingDependency, match="TensorRT"):
        plugin.build_trt_plugin(kdir, tmp_path / "plugin", required=True)
    if shutil.which("cmake") is None:
        pytest.skip("cmake not installed: the configure step can't be checked here")
    monkeypatch.delenv("TENSORRT_ROOT", raising=False)
    r = subprocess.run(["cmake", "-S", str(src), "-B", str(tmp_path / "build")], capture_output=True, text=True)
    assert r.returncode != 0 and "TensorRT not found" in r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------
# KLT key units (stored before RoPE in a calibrated basis) and exact FP16 entries: what the default plan holds


KLT_PRECISION = [{"k": ["klt6", "klt5"], "v": ["int3", "int4"]}, {"k": ["klt4", "int6"], "v": ["int5", "fp8"]}]


def klt_store(
    num_pages: int = 24, page_size: int = 16, seed: int = 0, group_size: int = 64, rank: tuple | None = None
) -> QuantKVStore:
    """A rotated plan with KLT6 / KLT5 / KLT4 key units beside INT6, INT5, INT4, INT3 and FP8 units, random tables
    as calibration shapes them (an orthonormal basis, water-filled bits, variances spanning orders of magnitude).
    rank: (rank, tp), that tensor-parallel rank's shard of the plan."""
    from bpcompile.compiler.calibrate import water_filling_bits

    g = torch.Generator().manual_seed(seed)
    lam = torch.logspace(1, -3, D)
    t = {
        "mean": torch.randn(L, KV, D, generator=g) * 0.1,
        "bits": torch.zeros(L, KV, D, dtype=torch.int8),
        "weight": torch.rand(L, KV, D, generator=g) + 0.5,
        "step": torch.zeros(L, KV, D),
        "level": torch.zeros(L, KV, D),
        "inv_freq": 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)),
        "basis": torch.zeros(L, KV, D, D, dtype=torch.float16),
    }
    for layer, p in enumerate(KLT_PRECISION):
        for h, x in enumerate(p["k"]):
            if x.startswith("klt"):
                basis, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
                b = water_filling_bits(lam, int(x[3]) * D)
                t["basis"][layer, h] = basis.to(torch.float16)
                t["bits"][layer, h] = b.to(torch.int8)
                t["step"][layer, h] = lam.sqrt() / 2.0 ** b.float()
                t["level"][layer, h] = torch.where(b == 1, lam.sqrt() * 0.8, 0.0)
    plan = KVPlan(
        "int4-fp8-outlier",
        L,
        KV,
        D,
        group_size,
        KLT_PRECISION,
        k_channel_scale=torch.rand(L, KV, D, generator=g) + 0.5,
        int4_clip=torch.rand(L, 2, KV, generator=g) * 0.3 + 0.7,
        rotation="hadamard",
        k_mean=torch.randn(L, KV, D, generator=g),
        klt=t,
    )
    return QuantKVStore(plan.shard(*rank) if rank else plan, num_pages, page_size)


def klt_keys(n: int, g: torch.Generator, st: QuantKVStore, positions: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys whose pre-RoPE form has the coefficient variances the tables were made for."""
    from bpcompile.runtime.kvcache import rope_rotate

    pre = torch.randn(n, KV, D, generator=g) * torch.logspace(1, -3, D).sqrt() * 2
    return rope_rotate(pre, positions, st.plan.klt["inv_freq"])


def test_quantize_append_klt_is_bit_exact():
    ref, ker = klt_store(), klt_store()
    g = torch.Generator().manual_seed(4)
    N = 29
    slots = torch.randperm(ref.num_pages * ref.page_size, generator=g)[:N]
    positions = torch.randint(0, 3000, (N,), generator=g)
    k, v = klt_keys(N, g, ref, positions), torch.randn(N, KV, D, generator=g)
    k[4] = 0  # an all-zero key: scale 0
    for layer in range(L):
        ref.write(layer, slots, k, v, positions)
        K.quantize_append(ker, layer, slots, k, v, positions)
    assert same_bytes(ref, ker) and torch.equal(ref.positions, ker.positions)
    assert all(ref.payload[c].any() for c in set(ref.unit_precision.flatten().tolist()))  # every pool written
    K.quantize_append(ker, 0, slots[:3], k[:3], v[:3], positions[:3] + 1)  # the dither follows the position
    assert not same_bytes(ref, ker)


def test_a_ranks_shard_codes_and_reads_its_head_as_the_whole_model_does():
    """Rank 1 of tp 2 holds KV head 1 (first_kv_head 1 of 2): its store codes that head's units, KLT keys included,
    into the bytes the whole model's store gives them (the dither keyed by the model's unit ids), the kernels into
    the same bytes as its torch store; attention over its head reads what the whole store's gives those heads."""
    whole, ref, ker = klt_store(), klt_store(rank=(1, 2)), klt_store(rank=(1, 2))
    assert (ref.num_kv_heads, ref.plan.first_kv_head, ref.plan.total_kv_heads) == (1, 1, 2)
    g = torch.Generator().manual_seed(6)
    N, G, H = 40, 4, 4  # 36 context tokens then 4 causal ones; 2 query heads per KV head
    slots, pos = torch.arange(N), torch.arange(N) * 3 + 5
    k, v = klt_keys(N, g, whole, pos), torch.randn(N, KV, D, generator=g)
    for layer in range(L):
        whole.write(layer, slots, k, v, pos)
        ref.write(layer, slots, k[:, 1:], v[:, 1:], pos)
        K.quantize_append(ker, layer, slots, k[:, 1:], v[:, 1:], pos)
    assert same_bytes(ref, ker)
    for layer in range(L):
        for kv in range(2):
            c = int(whole.unit_precision[layer, kv, 1])
            a, b = int(whole.unit_index[layer, kv, 1]), int(ref.unit_index[layer, kv, 0])
            assert torch.equal(whole.payload[c][:, a], ref.payload[c][:, b]), (layer, kv)
            assert torch.equal(whole.scales[c][:, a], ref.scales[c][:, b]), (layer, kv)
    q = torch.randn(1, G, H, D, generator=g)
    bt, ctx, nt = torch.arange(whole.num_pages)[None].int(), torch.tensor([N - G]), torch.tensor([G])
    for layer in range(L):
        full = paged_attention_reference(q, whole, layer, bt, ctx, None, nt, D**-0.5)[:, :, 2:]
        mine = paged_attention_reference(q[:, :, 2:], ref, layer, bt, ctx, None, nt, D**-0.5)
        assert torch.equal(mine, full)
        assert attention_error(K.paged_attention(q[:, :, 2:], ker, layer, bt, ctx, None, nt, D**-0.5), full) <= 1e-4


def exact_setup(st, ctxs, trees, G, H, sink, window, seed=0):
    """setup_batch for a plan with exact entries, through the runtime's RecentKV: each sequence's FP16 copies of
    its context and tree entries, its queries' positions (ctx + depth) and its tree entries' (the same)."""
    from bpcompile.runtime.paged_kv import RecentKV

    g = torch.Generator().manual_seed(seed)
    S, B = st.page_size, len(ctxs)
    per = st.num_pages // B
    block_tables = torch.randperm(st.num_pages, generator=g)[: B * per].reshape(B, per).int()
    rec = RecentKV(st, B + 1, sink, window, max(len(p) for p in trees), "cpu")
    rows = torch.randperm(B + 1, generator=g)[:B]
    q_pos = torch.zeros(B, G, dtype=torch.int32)
    tree_pos = torch.zeros(B, G, dtype=torch.int32)
    for b in range(B):
        depth = [0] * len(trees[b])
        for i, parent in enumerate(trees[b]):
            depth[i] = depth[parent] + 1 if parent >= 0 else 0
        T = ctxs[b] + len(trees[b])
        t = torch.arange(T)
        pos = torch.cat([t[: ctxs[b]], ctxs[b] + torch.tensor(depth)])
        q_pos[b, : len(depth)] = pos[ctxs[b] :]
        tree_pos[b, : len(depth)] = pos[ctxs[b] :]
        slots = block_tables[b, t // S].long() * S + t % S
        for layer in range(L):
            k = klt_keys(T, g, st, pos) if st.positions is not None else torch.randn(T, KV, D, generator=g) * 2
            v = torch.randn(T, KV, D, generator=g)
            st.write(layer, slots, k, v, pos)
            keep = t >= T - rec.ring  # what the ring holds after writing in order (and the sink)
            keep[:sink] = True
            rec.write(layer, torch.full((int(keep.sum()),), int(rows[b])), t[keep], k[keep], v[keep])
    masks = torch.zeros(B, G, G, dtype=torch.bool)
    for b, parents in enumerate(trees):
        masks[b, : len(parents), : len(parents)] = TM.tree_mask_from_parents(parents)
    q = torch.randn(B, G, H, D, generator=g) * 1.5
    nt = torch.tensor([len(p) for p in trees])
    return q, block_tables, torch.tensor(ctxs), TM.pack_bool_mask(masks), nt, (rec, rows, q_pos, tree_pos)


@pytest.mark.parametrize("klt,sink,window", [(True, 0, 0), (False, 1, 4), (True, 2, 10)])
def test_paged_attention_klt_and_exact_entries_match_reference(klt, sink, window):
    st = klt_store() if klt else make_store(64, rotation="hadamard")
    trees = [TRTLLM_EXAMPLE, [-1, 0, 0, 1, 2, 1]]
    q, bt, ctx, tm, nt, exact = exact_setup(st, [70, 21], trees, 10, 4, sink, window)
    exact = exact if sink or window else None
    for layer in range(L):
        ref = paged_attention_reference(q, st, layer, bt, ctx, tm, nt, D**-0.5, exact=exact)
        out = K.paged_attention(q, st, layer, bt, ctx, tm, nt, D**-0.5, num_splits=2, block_n=32, exact=exact)
        assert attention_error(out, ref) <= 1e-4
        if exact is not None:  # the copies are read: the same cache without them attends differently
            plain = paged_attention_reference(q, st, layer, bt, ctx, tm, nt, D**-0.5)
            assert attention_error(plain, ref) > 1e-3


def test_move_slots_moves_klt_positions():
    ref = klt_store()
    g = torch.Generator().manual_seed(5)
    slots, pos = torch.arange(40, 52), torch.arange(100, 112)
    for layer in range(L):
        ref.write(layer, slots, klt_keys(12, g, ref, pos), torch.randn(12, KV, D, generator=g), pos)
    ker = clone_store(ref)
    ker.positions.copy_(ref.positions)
    src, dst = torch.tensor([40, 42, 45, 49]), torch.tensor([40, 41, 42, 43])
    ref.move(src, dst)
    K.move_slots(ker, src, dst)
    assert same_bytes(ref, ker) and torch.equal(ref.positions, ker.positions)


def test_klt_and_exact_variants_compile_for_sm90a(tmp_path):
    """The engine's plugin specializations compile the KLT and exact-entry branches out (KLT = EXACT = 0, tested
    above); a GPU's JIT compiles them in for the default plan. Compiled here for sm_90a as the AOT build would
    (the interpreter does not type-check what the compiler does): the decode kernel with both, the KLT append."""
    import json
    import subprocess
    import sys

    specs = aot.aot_specs(64, 64, 16, 3)
    job = [
        {**s, "name": s["name"] + "_klt", "constexprs": {**s["constexprs"], "KLT": 1, "EXACT": 1}}
        if "EXACT" in s["constexprs"]
        else {**s, "name": s["name"] + "_klt", "constexprs": {**s["constexprs"], "KLT": 1}}
        for s in specs
        if s["name"].startswith(("bp_quantize_append", "bp_paged_attention_decode_fp16"))
    ]
    (tmp_path / "job.json").write_text(json.dumps({"out_dir": str(tmp_path), "capability": 90, "specs": job}))
    code = "import sys; from bpcompile.compiler.aot import _aot_compile; _aot_compile(sys.argv[1])"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "job.json")], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p.name for p in tmp_path.glob("*.cubin")} == {s["name"] + ".cubin" for s in job}
