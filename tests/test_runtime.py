"""The native runtime: paged attention, paged KV bookkeeping, in-flight batching, greedy speculation == greedy."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import noisy_copy, one_thread, random_llama, write_engine_config  # noqa: E402,F401  (one_thread: fixture)

from bpcompile.commands import generate_text
from bpcompile.core.errors import UserError
from bpcompile.kernels import cpu_decode, cpu_rows
from bpcompile.kernels.tree_mask import pack_rows
from bpcompile.runtime.generator import Generator, SamplingParams, StepOutput, TreeSpec
from bpcompile.runtime.kvcache import FloatKVStore
from bpcompile.runtime.model import FeatureDraft, Llama, ModelConfig, causal_attend, cpu_packing_works
from bpcompile.runtime.paged_kv import AttnBatch, PagedKV, paged_attention

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"


pytestmark = pytest.mark.usefixtures("one_thread")


CFG = ModelConfig(
    vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=16, intermediate_size=128
)
PROMPTS = [[5, 17, 9, 200, 3], list(range(30, 41)), [7, 7, 7], [(i * 37) % 256 for i in range(19)]]
TREES = {
    "chain": TreeSpec("chain", length=4),
    "static": TreeSpec("static", choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]),
    "dynamic": TreeSpec("dynamic", nodes=5),
}


@pytest.fixture(scope="module")
def pair():
    v = random_llama(CFG, seed=0)
    return v, noisy_copy(v, 0.3, seed=1)


def plain_greedy(model: Llama, prompt: list[int], n: int) -> list[int]:
    """Oracle without any cache: recompute the whole sequence for every token."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def reference(pair_, prompts, max_tokens):
    gen = Generator(pair_[0], None, None, max_batch_size=len(prompts), page_size=4)
    return [t for t, _ in gen.generate(prompts, SamplingParams(max_tokens=max_tokens))]


# ------------------------------------------------------------------------------------------ weights


@pytest.mark.skipif(not cpu_rows.available(), reason="no C compiler or no AVX-512 here: the few-row kernel is off")
def test_rows_kernel_products():
    """The few-row CPU kernel against float64 products: 1..16 rows, sizes that leave a masked column tail and
    leftover weight rows, each row's result the same bits whatever rows it is multiplied with; more rows refused."""
    g = torch.Generator().manual_seed(0)
    for n, k in [(37, 70), (576, 576), (24, 16)]:
        w = torch.randn(n, k, generator=g)
        x = torch.randn(cpu_rows.MAX_ROWS, k, generator=g)
        alone = [cpu_rows.rows_matmul(x[i : i + 1].contiguous(), w)[0] for i in range(len(x))]
        for r in range(1, cpu_rows.MAX_ROWS + 1):
            y = cpu_rows.rows_matmul(x[:r].contiguous(), w)
            assert torch.allclose(y.double(), x[:r].double() @ w.double().t(), rtol=1e-5, atol=1e-4), (n, k, r)
            assert all(torch.equal(y[i], alone[i]) for i in range(r)), (n, k, r)
    with pytest.raises(ValueError, match="at most"):
        cpu_rows.rows_matmul(torch.randn(cpu_rows.MAX_ROWS + 1, 16), torch.randn(4, 16))


@pytest.mark.parametrize("kernel,switch", [("cpu_rows", "BPCOMPILE_CPU_ROWS"), ("cpu_decode", "BPCOMPILE_CPU_DECODE")])
def test_cpu_kernels_build_into_their_cache_and_fall_back(tmp_path, kernel, switch):
    """A fresh process builds a CPU kernel (the few-row products, the few-query attention) into $BPCOMPILE_CACHE
    (one shared object, no temporary left); a compiler that fails, or its switch at 0, leaves it unavailable
    (callers keep PyTorch's ops) without an error."""
    import importlib
    import os
    import subprocess
    import sys

    if not importlib.import_module(f"bpcompile.kernels.{kernel}").available():
        pytest.skip(f"{kernel} cannot be built here (no C compiler, or no AVX-512 for cpu_rows)")
    probe = f"from bpcompile.kernels import {kernel}; print({kernel}.available())"

    def run(**env):
        out = subprocess.run(
            [sys.executable, "-c", probe], env=os.environ | env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run(BPCOMPILE_CACHE=str(tmp_path / "a")) == "True"
    # the shared object and the sha256 its build recorded (checked before each load)
    assert sorted((p.name.split("-")[0], p.suffix) for p in (tmp_path / "a").iterdir()) == [
        (kernel, ".sha256"),
        (kernel, ".so"),
    ]
    assert run(BPCOMPILE_CACHE=str(tmp_path / "b"), CC="/bin/false") == "False"
    assert list((tmp_path / "b").iterdir()) == []
    assert run(BPCOMPILE_CACHE=str(tmp_path / "c"), **{switch: "0"}) == "False"


@pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler here: the few-query attention kernel is off")
@pytest.mark.parametrize("build", ["native", "portable"])
def test_few_query_kernel_attends_as_float64_does(build, tmp_path, monkeypatch):
    """bpcompile's few-query attention kernel (decode and tree verify at batch 1 on CPU): against a float64 softmax
    attention over the same entries, for head sizes its vector path takes (64, 128) and others (16, 40), GQA groups of 1-4 heads,
    runs below, at and past a multiple of 16 (a few thousand: the threaded path), scores large enough to overflow a
    softmax without its max shift, a float32 run alone or with columns of an FP16 cache (a plan's exact copies),
    or the columns alone; one query, or a tree of six each seeing a random subset (one of them nothing: zeros).
    The new entries land where asked only (entry n - 1 of the float32 cache, FP16-rounded when
    asked, or its column of the FP16 cache), in the addressed layer and row; a bad shape is refused. Built for this
    CPU and for x86-64-v3 (AVX2, no AVX-512: the portable C path)."""
    import ctypes
    import shutil
    import subprocess

    if build == "portable":
        cc = shutil.which("cc") or shutil.which("gcc")
        so = tmp_path / "portable.so"
        subprocess.run(
            [cc, "-O3", "-march=x86-64-v3", "-fopenmp", "-shared", "-fPIC", str(cpu_decode.SOURCE), "-o", str(so)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        lib = ctypes.CDLL(str(so))
        cpu_decode.bind(lib)
        monkeypatch.setattr(cpu_decode, "_lib", lambda: lib)
    g = torch.Generator().manual_seed(0)
    cases = [
        (9, 3, 64, 1),
        (9, 3, 64, 16),
        (9, 3, 64, 37),
        (8, 2, 128, 300),
        (4, 4, 16, 33),
        (6, 2, 40, 17),
        (9, 3, 64, 2500),
        (4, 1, 128, 48),
    ]
    for (H, KV, D, n), mode in [(c, m) for c in cases for m in ("float", "float16", "exact", "exact only")] + [
        (c, "tree") for c in cases[2:]
    ]:
        L, R, S, C = 2, 3, n + 5, 14
        T = 6 if mode == "tree" else 1
        k, v = torch.randn(L, R, KV, S, D, generator=g), torch.randn(L, R, KV, S, D, generator=g)
        kh, vh = torch.randn(L, R, KV, C, D, generator=g).half(), torch.randn(L, R, KV, C, D, generator=g).half()
        q = torch.randn(T, H, D, generator=g) * (6.0 if n == 37 else 1.0)  # n 37: scores in the hundreds
        kn, vn = torch.randn(T, KV, D, generator=g), torch.randn(T, KV, D, generator=g)
        before = [t.clone() for t in (k, v, kh, vh)]
        mask = None
        if mode.startswith("exact"):
            a0 = 0 if mode == "exact only" else n // 3
            cols = torch.randperm(C, generator=g)[:5]
            out = cpu_decode.attend(
                q,
                k,
                v,
                (1, 2),
                (a0, a0 if mode == "exact only" else n),
                exact=(kh, vh, cols),
                new=(kn, vn),
                write=cols[2:3].clone(),
            )
            before[2][1, 2, :, cols[2]], before[3][1, 2, :, cols[2]] = kn[0].half(), vn[0].half()
            keys = torch.cat((k[1, 2, :, a0 : n if mode == "exact" else a0], kh[1, 2][:, cols].float()), 1)
            vals = torch.cat((v[1, 2, :, a0 : n if mode == "exact" else a0], vh[1, 2][:, cols].float()), 1)
        else:  # one query at the end, or a tree of six: each sees a random subset of the run, one of them nothing
            widx = torch.arange(n - T, n) if T <= n else torch.randperm(n, generator=g)[:T]
            if mode == "tree":
                mask = torch.rand(T, n, generator=g) < 0.7
                mask[3] = False
            out = cpu_decode.attend(
                q, k, v, (1, 2), (0, n), mask=mask, new=(kn, vn), write=widx, round16=mode == "float16"
            )
            for i in range(T):
                before[0][1, 2, :, widx[i]], before[1][1, 2, :, widx[i]] = (
                    t.half().float() if mode == "float16" else t for t in (kn[i], vn[i])
                )
            keys, vals = k[1, 2, :, :n], v[1, 2, :, :n]
        assert all(torch.equal(x, y) for x, y in zip((k, v, kh, vh), before))  # written there, nothing else
        kd, vd = (t.double().repeat_interleave(H // KV, 0) for t in (keys, vals))  # [H, n, D]
        s = torch.einsum("thd,hnd->thn", q.double(), kd) * D**-0.5
        if mask is not None:
            s = s.masked_fill(~mask[:, None], float("-inf"))
        ref = torch.einsum("thn,hnd->thd", torch.softmax(s, -1).nan_to_num(0.0), vd)
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5), (H, KV, D, n, mode, (out - ref).abs().max())
        if mask is not None:
            assert torch.equal(out[3], torch.zeros(H, D))
    k = torch.zeros(1, 4, 16)
    assert torch.equal(cpu_decode.attend(torch.ones(1, 2, 16), k, k, (), (0, 4)), torch.zeros(1, 2, 16))
    with pytest.raises(ValueError, match="bad shape"):
        cpu_decode.attend(torch.ones(1, 3, 16), torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), (), (0, 4))
    with pytest.raises(ValueError, match="bad shape"):
        cpu_decode.attend(torch.ones(1, 2, 16), k, k, (), (0, 0))


@pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler here: the few-query attention kernel is off")
def test_few_query_kernel_decodes_as_the_pytorch_path(pair, monkeypatch):
    """Verifier-only decoding at batch 1 takes the few-query kernel at every step after the prompt (counted), over
    a float cache (FP16, float32) and over a plan's INT4 codes with exact entries (sink and recent window, written
    by the kernel into their FP16 copies); its tokens equal the PyTorch path's (kernel off) and, for the float
    caches, an uncached recompute's; the dense view holds what the store holds; stored entries and exact copies
    equal the PyTorch path's to float32 rounding of the attention (one unit in the last place of an FP16 or INT4
    code). Over a float cache, batches of sequences (a call per sequence, prompts of different lengths) and tree
    verifies (several queries a call), alone and batched, take it too, with tokens equal to the PyTorch path's
    (and, float32, to plain greedy); a plan's tree steps and batches keep the PyTorch path."""
    from bpcompile.runtime import executor as executor_mod
    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory
    from bpcompile.runtime.paged_kv import float_store_factory

    c = pair[0].cfg
    calls = []
    real = cpu_decode.attend
    monkeypatch.setattr(
        executor_mod.cpu_decode, "attend", lambda *a, **kw: calls.append((a[0].shape[0], a[1])) or real(*a, **kw)
    )
    int4 = KVPlan.uniform("int4-naive", c.num_layers, c.num_kv_heads, c.head_size)
    factories = {
        "fp16": float_store_factory(torch.float16),
        "fp32": float_store_factory(torch.float32),
        "int4 sink 1 window 3": kv_store_factory(replace(int4, sink_tokens=1, recent_window=3)),
        "int4 window 8": kv_store_factory(replace(int4, recent_window=8)),
    }
    for name, factory in factories.items():
        runs = []
        for kernel in (True, False):
            gen = Generator(pair[0], None, None, max_batch_size=1, page_size=4, kv_store_factory=factory)
            assert gen.v_exec.few_query_kernel
            gen.v_exec.few_query_kernel = kernel
            del calls[:]
            gen.add_request(PROMPTS[3], SamplingParams(max_tokens=20), request_id="r")
            for _ in range(8):
                gen.step()
            r, kv = gen.running["r"], gen.vkv
            assert len(calls) == (8 - 1) * c.num_layers * kernel  # the first step is the prompt's
            slots = torch.tensor([kv.slot("r", i) for i in range(r.v_len)])
            cache = []
            for layer in range(c.num_layers):  # the dense view holds what the store holds
                ks, vs = kv.store.read(layer, slots)
                dk, dv = kv.dense.read(layer, [kv.rows["r"]], r.v_len)
                assert torch.equal(dk[0].transpose(0, 1), ks.float()) and torch.equal(dv[0].transpose(0, 1), vs.float())
                cache += [ks.float(), vs.float()]
            if kv.recent is not None:
                cache += [kv.recent.k.float(), kv.recent.v.float()]
            runs.append((list(r.tokens), cache))
        assert runs[0][0] == runs[1][0], name
        tol = 1e-4 if name == "fp32" else 2e-3 if name == "fp16" else 0.1  # an INT4 step of these values: ~0.3
        for a, b in zip(runs[0][1], runs[1][1]):
            assert torch.allclose(a, b, rtol=tol, atol=tol), (name, (a - b).abs().max())
            assert name.startswith("fp") or (a != b).float().mean() < 0.01, name
    gen = Generator(pair[0], None, None, max_batch_size=1, page_size=4, kv_store_factory=factories["fp16"])
    ((toks, _),) = gen.generate([PROMPTS[1]], SamplingParams(max_tokens=16))
    assert toks == plain_greedy(pair[0], PROMPTS[1], 16)
    for name in ("fp32", "fp16", "int4 sink 1 window 3"):  # batches and trees: a kernel call per sequence over a
        for batch, tree in ((3, None), (1, TREES["dynamic"]), (3, TREES["dynamic"])):  # float cache, PyTorch's
            outs = []  # for a plan's
            for kernel in (True, False):
                gen = Generator(
                    pair[0],
                    pair[1] if tree else None,
                    tree,
                    max_batch_size=batch,
                    page_size=4,
                    backoff=False,
                    kv_store_factory=factories[name],
                )
                for ex in (gen.v_exec, gen.d_exec):
                    if ex is not None:
                        ex.few_query_kernel = kernel
                del calls[:]
                ps = PROMPTS[:3] if batch > 1 else PROMPTS[:2]
                if batch > 1:
                    outs.append([t for t, _ in gen.generate(ps, SamplingParams(max_tokens=16))])
                else:
                    outs.append([t for p in ps for t, _ in gen.generate([p], SamplingParams(max_tokens=16))])
                mine = [t for t, cache in calls if cache is gen.vkv.dense.k]  # the verifier's calls
                if name.startswith("fp"):
                    assert bool(mine) == kernel and (not kernel or (max(mine) > 1) == (tree is not None)), name
                else:  # a plan: the kernel only where one sequence decodes alone, one query a call
                    assert all(t == 1 for t in mine) and (kernel or not mine), (name, batch, kernel)
            assert outs[0] == outs[1], (name, batch)
            assert name != "fp32" or outs[0] == [plain_greedy(pair[0], p, 16) for p in ps]


@pytest.mark.skipif(not cpu_rows.available(), reason="no C compiler or no AVX-512 here: the few-row kernel is off")
@pytest.mark.parametrize("tied,layout", [(False, "both"), (True, "both"), (True, "rows")])
def test_rows_layout_computes_what_plain_does(pair, tied, layout):
    """runtime.cpu_weights both and rows (the default's choice where the kernel builds): every linear and the head swapped for RowsLinear,
    the [out, in] weights in one buffer in forward order (a tied embedding is the head's), with both the
    transposed plain copies in another; logits equal the plain model's to float32 rounding for one token, a
    tree-sized batch and a prompt (PyTorch's product past 16 rows); with both one row is the plain product bit for
    bit, with rows a row alone equals that row in a tree; weights read back unchanged; the served path with trees is
    plain greedy. An unknown layout is refused."""
    from bpcompile.runtime.model import RowsLinear

    w = dict(pair[0].w)
    w["transformer.layers.0.attention.qkv.bias"] = torch.randn(w["transformer.layers.0.attention.qkv.weight"].shape[0])
    if tied:
        w["transformer.vocab_embedding.weight"] = w.pop("lm_head.weight")
    plain, m = Llama(CFG, w), Llama(CFG, w)
    assert m.pack_for_cpu(layout) and {type(x).__name__ for x in m.modules()} & {"Linear", "PackedLinear"} == set()
    lins = [x for x in m.modules() if type(x) is RowsLinear]
    for attr in ("w", "wt") if layout == "both" else ("w",):
        ws = [getattr(x, attr) for x in lins]
        assert len({t.untyped_storage().data_ptr() for t in ws}) == 1 and ws[-1] is getattr(m.head, attr)
        assert all(a.data_ptr() + a.numel() * 4 <= b.data_ptr() for a, b in zip(ws, ws[1:]))
    assert (m.head.wt is None) == (layout == "rows")
    assert not tied or m.embed.data_ptr() == m.head.w.data_ptr()
    for shape in [(1, 1), (1, 6), (3, 12)]:
        toks = torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(sum(shape)))
        a, b = plain(toks), m(toks)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (shape, (a - b).abs().max())
    x = torch.randn(6, CFG.hidden_size)
    lin = m.layers[1].gate_up
    if layout == "both":
        assert torch.equal(lin(x[:1]), x[:1] @ plain.layers[1].gate_up.wt)
    else:
        assert torch.equal(lin(x[2:3])[0], lin(x)[2])
    assert plain.w.keys() == m.w.keys() and all(torch.equal(plain.w[k], m.w[k]) for k in plain.w)
    gen = Generator(m, noisy_copy(plain, 0.3, seed=1), TreeSpec("dynamic", nodes=5), page_size=4)
    got = [t for t, _ in gen.generate(PROMPTS[:2], SamplingParams(max_tokens=12))]
    assert got == [plain_greedy(plain, p, 12) for p in PROMPTS[:2]]
    with pytest.raises(ValueError, match="layout"):
        Llama(CFG, w).pack_for_cpu("blocked")


@pytest.mark.parametrize("kernel", [True, False])
def test_auto_layout_keeps_one_copy_of_the_weights(pair, kernel, monkeypatch):
    """runtime.cpu_weights auto (the default) never doubles the weights: the few-row kernel's single copy where it
    builds, else the plain model untouched; the bytes the model holds (its distinct storages) are the plain
    model's, where `both` holds the linears twice; logits equal the plain model's to float32 rounding, a tied
    embedding reads the head's weight."""
    if not kernel:
        monkeypatch.setattr(cpu_rows, "available", lambda: False)  # as where the kernel cannot build
    elif not cpu_rows.available():
        pytest.skip("no C compiler or no AVX-512 here: the few-row kernel is off")

    def held(model) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.buffers()}
        storages.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.parameters()})
        return sum(storages.values())

    w = dict(pair[0].w)
    w["transformer.vocab_embedding.weight"] = w.pop("lm_head.weight")  # tied
    plain, m, both = Llama(CFG, w), Llama(CFG, w), Llama(CFG, w)
    assert m.pack_for_cpu("auto") == kernel
    kinds = {type(x).__name__ for x in m.modules()} & {"Linear", "RowsLinear", "PackedLinear"}
    assert kinds == ({"RowsLinear"} if kernel else {"Linear"})
    assert all(x.wt is None for x in m.modules() if type(x).__name__ == "RowsLinear")
    linears = sum(x.weight.numel() * 4 for x in plain.modules() if type(x).__name__ == "Linear")
    assert abs(held(m) - held(plain)) < 0.5 * linears  # (the one buffer's 4 KiB alignments: not a second copy)
    if kernel:  # (oneDNN's packed weights are opaque: their bytes are not storages to count)
        assert both.pack_for_cpu("both") and held(both) - held(plain) > 0.99 * linears
    for shape in [(1, 1), (1, 6)]:
        toks = torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(sum(shape)))
        a, b = plain(toks), m(toks)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (shape, (a - b).abs().max())
    assert torch.equal(m.embed, plain.embed)


@pytest.mark.skipif(not cpu_packing_works(), reason="this torch build has no oneDNN packed linear")
@pytest.mark.parametrize("tied", [False, True])
def test_packed_weights_compute_what_plain_ones_do(pair, tied, monkeypatch):
    """oneDNN-packed weights (how engines run on CPU): every linear and the head swapped, logits equal the
    plain layout's to float32 rounding for 1-token decode and multi-row (tree-sized) batches, the weights read
    back unchanged, the model still moves; a non-float32 model is left as it is. Keeping the plain layout too
    (both, as where the few-row kernel cannot be built): one row is the plain product exactly, several rows the packed one exactly, and a tied embedding
    reads the head's plain copy (no third matrix)."""
    from bpcompile.runtime.model import PackedLinear

    w = dict(pair[0].w)
    w["transformer.layers.0.attention.qkv.bias"] = torch.randn(w["transformer.layers.0.attention.qkv.weight"].shape[0])
    if tied:
        w["transformer.vocab_embedding.weight"] = w.pop("lm_head.weight")
    plain, packed, both = Llama(CFG, w), Llama(CFG, w), Llama(CFG, w)
    monkeypatch.setattr(cpu_rows, "available", lambda: False)  # both as where the few-row kernel cannot be built
    assert plain.tied == tied and packed.pack_for_cpu("packed") and both.pack_for_cpu("both")
    for m in (packed, both):
        assert {type(x).__name__ for x in m.modules()} & {"Linear"} == set()
    assert packed.head.wt is None and both.head.wt is not None
    # the plain copies sit in one buffer, in the order a forward reads them
    plains = [m.wt for m in both.modules() if type(m) is PackedLinear]
    assert len({t.untyped_storage().data_ptr() for t in plains}) == 1
    assert all(a.data_ptr() + a.numel() * 4 <= b.data_ptr() for a, b in zip(plains, plains[1:]))
    assert plains[0] is both.layers[0].qkv.wt and plains[-1] is both.head.wt
    if tied:
        assert both.embed.data_ptr() == both.head.wt.data_ptr() and packed.embedding.is_contiguous()
    packed = packed.to("cpu")
    for shape in [(1, 1), (1, 6), (3, 12)]:
        toks = torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(sum(shape)))
        a, b, c = plain(toks), packed(toks), both(toks)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (shape, (a - b).abs().max())
        assert torch.equal(c, a if shape == (1, 1) else b)
    x = torch.randn(1, 1, CFG.hidden_size)
    lin = both.layers[1].gate_up
    assert type(lin) is PackedLinear and torch.equal(lin(x), x @ plain.layers[1].gate_up.wt)
    for m in (packed, both):
        assert plain.w.keys() == m.w.keys()
        assert all(torch.equal(plain.w[k], m.w[k]) for k in plain.w)
        assert torch.equal(plain.embed, m.embed)
    assert not Llama(CFG, w, dtype=torch.bfloat16).pack_for_cpu("both")
    # the served path: greedy decode through the paged cache with trees is identical to plain greedy
    gen = Generator(packed, noisy_copy(plain, 0.3, seed=1), TreeSpec("dynamic", nodes=5), page_size=4)
    got = [t for t, _ in gen.generate(PROMPTS[:2], SamplingParams(max_tokens=12))]
    assert got == [plain_greedy(plain, p, 12) for p in PROMPTS[:2]]


# ------------------------------------------------------------------------------------------ attention


def test_paged_attention_matches_dense():
    """Two sequences, different contexts and tree regions, arbitrary mask rows, pages scattered."""
    torch.manual_seed(0)
    L, KV, H, D, ps = 1, 2, 4, 8, 4
    store = FloatKVStore(L, KV, D, num_pages=16, page_size=ps)
    kv = PagedKV(store)
    kv.free = [15, 3, 9, 1, 12, 6, 2, 14, 5, 7, 11, 4]  # scattered pages
    ctx, tree_lens, q_lens, T = [5, 11], [4, 6], [3, 2], 3
    rows = [[0b0001, 0b0011, 0b1101], [0b100001, 0b110011]]  # per query: which tree entries it sees
    keys = {}
    for b, rid in enumerate("ab"):
        n = ctx[b] + tree_lens[b]
        kv.ensure(rid, n)
        k, v = torch.randn(n, KV, D), torch.randn(n, KV, D)
        store.write(0, torch.tensor([kv.slot(rid, i) for i in range(n)]), k, v)
        keys[rid] = (k, v)
    q = torch.randn(2, T, H, D)
    mask = torch.stack([pack_rows(r + [0] * (T - len(r)), 1) for r in rows])
    batch = AttnBatch(
        kv.block_tables(["a", "b"], "cpu"), torch.tensor(ctx), torch.tensor(tree_lens), torch.tensor(q_lens), mask, ps
    )
    out = paged_attention(q, store, 0, batch)
    for b, rid in enumerate("ab"):
        k, v = keys[rid]
        for i in range(q_lens[b]):
            vis = [j for j in range(ctx[b] + tree_lens[b]) if j < ctx[b] or rows[b][i] >> (j - ctx[b]) & 1]
            for h in range(H):
                s = k[vis, h // 2] @ q[b, i, h] / math.sqrt(D)
                ref = torch.softmax(s, 0) @ v[vis, h // 2]
                assert torch.allclose(out[b, i, h], ref, atol=1e-5)


# ------------------------------------------------------------------------------------------- greedy


def test_verifier_only_matches_full_recompute(pair):
    got = reference(pair, PROMPTS[:3], 20)
    for p, g in zip(PROMPTS[:3], got):
        assert g == plain_greedy(pair[0], p, 20)


@pytest.mark.parametrize("kind", list(TREES))
def test_greedy_speculation_is_identical(pair, kind):
    ref = reference(pair, PROMPTS, 40)
    # backoff off: the draft costs as much as the verifier here, so back-off would (rightly) stop drafting
    gen = Generator(pair[0], pair[1], TREES[kind], max_batch_size=4, page_size=4, backoff=False)
    batched = gen.generate(PROMPTS, SamplingParams(max_tokens=40))  # batch 4, different prompt lengths
    assert [t for t, _ in batched] == ref
    one = Generator(pair[0], pair[1], TREES[kind], max_batch_size=1, page_size=8, backoff=False).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=40)
    )
    assert one[0][0] == ref[1]
    stats = [s for _, s in batched]
    assert sum(s.committed for s in stats) / sum(s.verifier_steps for s in stats) > 1.15  # drafts do get accepted
    assert all(s.tokens == 40 and s.accepted_per_depth[0] <= s.proposed_per_depth[0] for s in stats)
    assert gen.vkv.available() == gen.vkv.capacity and gen.dkv.available() == gen.dkv.capacity  # all pages back


def test_identical_draft_accepts_everything(pair):
    """draft == verifier: every chain token is accepted, tau = length + 1 (until max_tokens caps the tree)."""
    gen = Generator(pair[0], pair[0], TreeSpec("chain", length=4), max_batch_size=2, page_size=4, backoff=False)
    ((toks, st),) = gen.generate([PROMPTS[0]], SamplingParams(max_tokens=31))  # 1 + 6 steps x 5
    assert toks == reference(pair, [PROMPTS[0]], 31)[0]
    assert st.verifier_steps == 6 and st.accepted_per_depth == st.proposed_per_depth == [6, 6, 6, 6]


def feature_draft(verifier: Llama, block: dict, fc: torch.Tensor, subset=None) -> FeatureDraft:
    """A one-layer FeatureDraft of `verifier` from a block's weights (layer 0 of `block`) and fc [H, 2H]."""
    w = {k: v for k, v in block.items() if k.startswith("transformer.layers.0.")}
    w.update({"fc.weight": fc, "fc.bias": torch.zeros(fc.shape[0])})
    if subset is not None:
        w["vocab_subset"] = torch.tensor(subset)
    return FeatureDraft(replace(verifier.cfg, num_layers=1), w, verifier)


@pytest.mark.parametrize("kind", list(TREES))
def test_feature_draft_speculation_is_identical(pair, kind):
    """A draft on the verifier's features (random weights): greedy output still the verifier's own, batched
    over prompts of different lengths, with and without back-off; every page returned."""
    ref = reference(pair, PROMPTS, 30)
    H = CFG.hidden_size
    fc = torch.randn(H, 2 * H, generator=torch.Generator().manual_seed(3)) / H**0.5
    d = feature_draft(pair[0], pair[1].w, fc)
    for backoff in (False, True):
        gen = Generator(pair[0], d, TREES[kind], max_batch_size=4, page_size=4, backoff=backoff)
        assert gen.spec.features and gen.v_exec.features
        assert [t for t, _ in gen.generate(PROMPTS, SamplingParams(max_tokens=30))] == ref
        assert gen.vkv.available() == gen.vkv.capacity and gen.dkv.available() == gen.dkv.capacity
    # a draft that may propose only some token ids: one logits column per id, the verifier's head rows for them
    # (as the draft without a subset scores those ids), and the output is still the verifier's
    sub = feature_draft(pair[0], pair[1].w, fc, subset=list(range(1, CFG.vocab_size, 2)))
    toks, pos, f = torch.tensor([[3, 8, 1]]), torch.arange(3)[None], torch.randn(1, 3, H)
    logits, h = sub(toks, pos, feats=f)
    full, h_full = d(toks, pos, feats=f)
    assert sub.proposable.tolist() == list(range(1, CFG.vocab_size, 2)) and d.proposable is None
    assert logits.shape == (1, 3, (CFG.vocab_size) // 2) and torch.allclose(logits, full[..., 1::2], atol=1e-5)
    gen = Generator(pair[0], sub, TREES[kind], max_batch_size=4, page_size=4, backoff=False)
    assert [t for t, _ in gen.generate(PROMPTS, SamplingParams(max_tokens=30))] == ref
    with pytest.raises(ValueError, match="vocab_subset"):
        feature_draft(pair[0], pair[1].w, fc, subset=[1, 1, 2])
    if cpu_packing_works(torch.bfloat16):  # a draft packed in bfloat16: logits to its rounding, output the verifier's
        low = feature_draft(pair[0], pair[1].w, fc, subset=list(range(1, CFG.vocab_size, 2)))
        assert low.pack_for_cpu(bf16=True) and low.layers[0].qkv.packed.dtype == torch.bfloat16
        lo, _ = low(toks, pos, feats=f)
        assert lo.dtype == torch.float32 and 0 < (lo - logits).abs().max() < 0.05 * logits.abs().max()
        gen = Generator(pair[0], low, TREES[kind], max_batch_size=4, page_size=4, backoff=False)
        assert [t for t, _ in gen.generate(PROMPTS, SamplingParams(max_tokens=30))] == ref
    with pytest.raises(UserError, match="torch executor"):
        Generator(pair[0], d, TREES[kind], executor="onnxruntime", graphs="/nonexistent")


def test_feature_draft_copy_of_a_one_layer_verifier_accepts_everything():
    """A one-layer verifier whose final norm is all ones, and a FeatureDraft with its block and fc = [I | 0]:
    the draft's hidden state is the verifier's before the norm (a positive multiple of it), so its greedy
    token is the verifier's and every tree token is accepted; chain 4 commits 5 tokens per step."""
    cfg = replace(CFG, num_layers=1)
    v = random_llama(cfg, seed=4)
    v.norm.fill_(1.0)
    H = cfg.hidden_size
    d = feature_draft(v, v.w, torch.cat((torch.eye(H), torch.zeros(H, H)), 1))
    gen = Generator(v, d, TreeSpec("chain", length=4), max_batch_size=2, page_size=4, backoff=False)
    ((toks, st),) = gen.generate([PROMPTS[3]], SamplingParams(max_tokens=31))
    assert toks == plain_greedy(v, PROMPTS[3], 31)
    assert st.verifier_steps == 6 and st.accepted_per_depth == st.proposed_per_depth == [6, 6, 6, 6]


def _capture_kv(model: Llama, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K/V of a plain causal forward over `tokens`, per layer (the oracle for cache contents)."""
    cap = []

    def attend(layer, q, k, v):
        cap.append((k[0], v[0]))
        return causal_attend(q, k, v)

    model(torch.tensor([tokens]), attend=attend)
    return cap


@pytest.mark.parametrize("kind", ["chain", "dynamic"])
def test_kv_compaction_matches_sequential(pair, kind):
    """After speculative steps, both caches hold exactly the K/V of the committed tokens, in order."""
    gen = Generator(pair[0], pair[1], TREES[kind], max_batch_size=2, page_size=4, backoff=False)
    for p in PROMPTS[:2]:
        gen.add_request(p, SamplingParams(max_tokens=60))
    for _ in range(6):
        gen.step()
    checked = 0
    for r in gen.running.values():
        assert r.v_len == len(r.tokens) - 1 and r.d_len < len(r.tokens) and r.stats.committed > r.stats.verifier_steps
        for model, kv, n in ((pair[0], gen.vkv, r.v_len), (pair[1], gen.dkv, r.d_len)):
            ref = _capture_kv(model, r.tokens[:n])
            slots = torch.tensor([kv.slot(r.id, i) for i in range(n)])
            assert len(kv.tables[r.id]) == -(-n // kv.ps)  # rejected tree entries' pages were freed
            for layer, (k, v) in enumerate(ref):
                ks, vs = kv.store.read(layer, slots)
                assert torch.allclose(ks, k, atol=1e-4) and torch.allclose(vs, v, atol=1e-4)
                # the dense copy the attention reads holds exactly what the store holds, in logical order
                dk, dv = kv.dense.read(layer, [kv.rows[r.id]], n)
                assert torch.equal(dk[0].transpose(0, 1), ks) and torch.equal(dv[0].transpose(0, 1), vs)
            checked += 1
    assert checked == 4


def test_dense_view_of_a_quantized_cache_is_what_the_store_holds(pair):
    """With a rotated mixed-precision cache the attention reads a dense copy that write_read fills by decoding the
    codes it just made: after speculative steps (tree entries moved), it must equal store.read of the committed
    slots, and greedy output must equal the gather-from-the-store path's (dense_kv=False)."""
    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory

    c = pair[0].cfg
    g = torch.Generator().manual_seed(3)
    prec = [
        {"k": ["int4", "fp8"][: c.num_kv_heads] + ["int4"] * (c.num_kv_heads - 2), "v": ["int4"] * c.num_kv_heads}
        for _ in range(c.num_layers)
    ]
    plan = KVPlan(
        "int4-fp8-outlier",
        c.num_layers,
        c.num_kv_heads,
        c.head_size,
        c.head_size,
        prec,
        k_channel_scale=torch.rand(c.num_layers, c.num_kv_heads, c.head_size, generator=g) + 0.5,
        rotation="hadamard",
        k_mean=torch.randn(c.num_layers, c.num_kv_heads, c.head_size, generator=g),
    )
    outs = []
    for dense in (True, False):
        gen = Generator(
            pair[0],
            pair[1],
            TREES["dynamic"],
            max_batch_size=2,
            page_size=4,
            backoff=False,
            kv_store_factory=kv_store_factory(plan),
            dense_kv=dense,
        )
        outs.append([t for t, _ in gen.generate(PROMPTS[:2], SamplingParams(max_tokens=12))])
        if dense:
            gen.add_request(PROMPTS[2], SamplingParams(max_tokens=30), request_id="r")
            for _ in range(5):
                gen.step()
            r, kv = gen.running["r"], gen.vkv
            slots = torch.tensor([kv.slot("r", i) for i in range(r.v_len)])
            for layer in range(c.num_layers):
                ks, vs = kv.store.read(layer, slots)
                dk, dv = kv.dense.read(layer, [kv.rows["r"]], r.v_len)
                assert torch.equal(dk[0].transpose(0, 1), ks) and torch.equal(dv[0].transpose(0, 1), vs)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("sink,window", [(1, 3), (2, 5), (0, 8)])
def test_exact_entries_read_what_the_eval_oracle_reads(pair, sink, window):
    """A plan with exact entries (an FP16 sink and recent window beside INT4 codes): the runtime's logits, verifier-only
    and through dynamic trees (ring writes, tree masks, moves of accepted entries, prompts longer than the ring), equal
    those of the reference decoder (kv_oracle.decode_logits), which builds its masks from positions alone; and the window changes them (the
    same oracle without it is far off), so the test sees whether exact entries are read at all."""
    from dataclasses import replace

    from kv_oracle import decode_logits, prefix_kv

    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory

    v, d = pair
    c = v.cfg
    base = KVPlan.uniform("int4-naive", c.num_layers, c.num_kv_heads, c.head_size)
    plan = replace(base, sink_tokens=sink, recent_window=window)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    for tree in (None, TREES["dynamic"]):
        gen = Generator(
            v,
            d if tree else None,
            tree,
            max_batch_size=3,
            page_size=4,
            backoff=False,
            kv_store_factory=kv_store_factory(plan),
        )
        assert gen.vkv.recent is not None and gen.vkv.nbytes() == gen.vkv.store.nbytes() + gen.vkv.recent.nbytes()
        batched = []  # forwards whose writes the store took all layers at once (window >= the step's tokens)
        store = gen.vkv.store
        store.write_read_layers = lambda *a, f=store.write_read_layers: batched.append(1) or f(*a)
        params = SamplingParams(max_tokens=12, generation_logits=True)
        ids = {gen.add_request(p, params): p for p in prompts}
        toks, rows = {r: [] for r in ids}, {r: [] for r in ids}
        while gen.has_work():
            for o in gen.step():
                toks[o.request_id] += o.new_tokens
                if o.new_tokens:
                    rows[o.request_id].append(o.generation_logits)
        for rid, prompt in ids.items():
            got = torch.cat(rows[rid])[1:]  # row 0 comes from the prefill, which attends unquantized K/V
            kv = prefix_kv(v, prompt)
            assert torch.allclose(got, decode_logits(v, kv, toks[rid][:-1], plan), atol=1e-3)
            assert (got - decode_logits(v, kv, toks[rid][:-1], base)).abs().max() > 0.1
        # prefills always batch (at most one per prompt); steps do where the window holds their tokens (1 or up to 6)
        assert len(batched) > len(prompts) if tree is None or window >= 6 else len(batched) <= len(prompts)


def test_exact_entries_and_the_default_plans_units_by_reader(pair):
    """Who reads what is the support table's answer (bpcompile.core.kv_support): the Triton kernels read exact
    entries and INT6 / INT3 units (tests/test_runtime_kernels.py generates through them); the onnxruntime
    executor's graphs read INT6 / INT3 units but not exact entries: a Generator refuses such a plan, naming what."""
    from dataclasses import replace

    from bpcompile.core.kv_support import takes
    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory

    c = pair[0].cfg
    exact = replace(KVPlan.uniform("int4-naive", c.num_layers, c.num_kv_heads, c.head_size), recent_window=4)
    bands = KVPlan.uniform("int4-naive", c.num_layers, c.num_kv_heads, c.head_size)
    bands.precision[0] = {"k": ["int6"] * c.num_kv_heads, "v": ["int3"] * c.num_kv_heads}
    for plan, feature in ((exact, "exact"), (bands, "int6")):
        store = kv_store_factory(plan)(c, 4, 4, "cpu")
        assert (store.support("triton") == []) == takes("triton", feature)
        assert (store.support("onnxruntime") == []) == takes("onnxruntime", feature) == (feature == "int6")
    with pytest.raises(UserError, match="onnxruntime executor's step graphs do not read exact"):
        Generator(
            pair[0],
            None,
            None,
            page_size=4,
            kv_store_factory=kv_store_factory(exact),
            executor="onnxruntime",
            graphs="/nonexistent",
        )


# -------------------------------------------------------------------------------- batching & lifetime


def test_inflight_batching_pages_and_cancel(pair):
    prompts = PROMPTS + [[1, 2, 3, 4]]
    lengths = [12, 3, 20, 7, 9]
    ref = [reference(pair, [p], n)[0] for p, n in zip(prompts, lengths)]
    gen = Generator(pair[0], pair[1], TREES["chain"], max_batch_size=2, page_size=4)
    ids = [gen.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, lengths)]
    extra = gen.add_request([9, 9], SamplingParams(max_tokens=50), request_id="x")
    gen.cancel(extra)  # cancelled while waiting
    got = {i: [] for i in ids}
    joined_mid_flight, cancelled = False, []
    while gen.has_work():
        before = set(gen.running)
        outs = gen.step()
        assert len(gen.running) <= 2
        new = set(gen.running) - before
        if new and before & set(gen.running):
            joined_mid_flight = True
        for o in outs:
            assert isinstance(o, StepOutput)
            if o.finish_reason == "cancelled":
                cancelled.append(o.request_id)
                continue
            got[o.request_id] += o.new_tokens
            assert o.finished == (o.finish_reason == "length")
    assert cancelled == ["x"] and joined_mid_flight
    assert [got[i] for i in ids] == ref
    assert gen.vkv.available() == gen.vkv.capacity and gen.dkv.available() == gen.dkv.capacity and gen.reserved == 0

    a = gen.add_request(PROMPTS[3], SamplingParams(max_tokens=40))
    b = gen.add_request(PROMPTS[1], SamplingParams(max_tokens=40))
    gen.step()
    gen.step()
    assert a in gen.vkv.tables and a in gen.dkv.tables
    gen.cancel(a)
    assert a not in gen.vkv.tables and a not in gen.dkv.tables and a not in gen.running
    outs = gen.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [(a, "cancelled")]
    assert {o.request_id for o in outs} == {a, b}


def test_inflight_loop_serves_requests_from_other_threads(pair):
    """The in-flight loop a frontend builds on (the Triton generator model is one): requests submitted from
    another thread while others run get the verifier's own greedy tokens; a prompt the runtime refuses is
    rejected without stopping the loop; a request whose client goes away is cancelled and its pages freed;
    stop() ends the thread once the rest is done."""
    import queue
    import threading

    from bpcompile.runtime.inflight import InflightLoop, LoopRequest

    ref = reference(pair, PROMPTS[:3], 24)
    events: queue.Queue = queue.Queue()
    gone = threading.Event()

    class Frontend(InflightLoop):
        def is_cancelled(self, req):
            return req.prompt == PROMPTS[3] and gone.is_set()

        def on_output(self, req, out):
            events.put(("out", req, out))

        def on_rejected(self, req, error):
            events.put(("rejected", req, error))

        def on_cancelled(self, req):
            events.put(("cancelled", req, None))

    gen = Generator(pair[0], pair[1], TREES["chain"], max_batch_size=4, page_size=4, max_seq_len=64)
    loop = Frontend(gen).start()
    reqs = [LoopRequest(p, SamplingParams(max_tokens=24)) for p in PROMPTS[:3]]
    slow = LoopRequest(PROMPTS[3], SamplingParams(max_tokens=40))
    loop.submit(slow)
    loop.submit(reqs[0])
    loop.submit(LoopRequest([1] * 70, SamplingParams(max_tokens=4)))  # longer than max_input_len
    finished, seen, joined = {}, [], False
    while len(finished) < 3 or "rejected" not in seen or "cancelled" not in seen:
        kind, req, out = events.get(timeout=120)
        seen.append(kind)
        if kind == "out" and req is reqs[0] and len(req.out) >= 4 and not joined:
            loop.submit(reqs[1])  # they join a running batch
            loop.submit(reqs[2])
            joined = True
        if kind == "out" and req is slow and len(req.out) >= 8:
            gone.set()
        if kind == "out" and out.finished:
            finished[id(req)] = req
        if kind == "rejected":
            assert "max_input_len" in str(out)
    assert [r.out for r in reqs] == ref and all(id(r) in finished for r in reqs)
    assert id(slow) not in finished and 8 <= len(slow.out) < 40
    loop.stop()
    loop.thread.join(timeout=60)
    assert not loop.thread.is_alive() and not loop.running
    assert gen.vkv.available() == gen.vkv.capacity and gen.reserved == 0


def test_stop_conditions(pair):
    ref = reference(pair, [PROMPTS[1]], 30)[0]
    gen = Generator(pair[0], pair[1], TREES["chain"], max_batch_size=2, page_size=4)
    end = ref[10]
    ((toks, _),) = gen.generate([PROMPTS[1]], SamplingParams(max_tokens=30, end_id=end))
    assert toks == ref[: ref.index(end)]
    out = []
    gen.add_request(PROMPTS[1], SamplingParams(max_tokens=30, stop_words=[[99999], ref[6:8]]))
    while gen.has_work():
        for o in gen.step():
            out += o.new_tokens
            last = o
    first = next(i for i in range(2, 9) if ref[i - 2 : i] == ref[6:8])  # the 2-gram may occur earlier
    assert out == ref[:first] and last.finish_reason == "stop"


def test_bad_requests_are_user_errors(pair):
    gen = Generator(pair[0], None, None, max_seq_len=32)
    for prompt, params in (
        ([], SamplingParams()),
        ([1, 256], SamplingParams()),
        ([1] * 20, SamplingParams(max_tokens=13)),
        ([1], SamplingParams(max_tokens=0)),
        ([1], SamplingParams(top_p=0.0)),
    ):
        with pytest.raises(UserError):
            gen.add_request(prompt, params)
    with pytest.raises(UserError):
        Generator(pair[0], None, TreeSpec("chain"))


def test_sampling_is_seeded(pair):
    gen = Generator(pair[0], pair[1], TREES["dynamic"], max_batch_size=4, page_size=4)
    p = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=7)
    a, b = gen.generate([PROMPTS[0], PROMPTS[0]], p)
    (c,) = gen.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=8))
    assert a[0] == b[0] and a[0] != c[0] and len(a[0]) == 24


def test_quantized_store_via_factory(pair):
    """Any KVStore plugs in: the int8 QuantKVStore for the verifier, fp16 floats for the draft."""
    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory

    c = pair[0].cfg
    plan = KVPlan.uniform("int8", c.num_layers, c.num_kv_heads, c.head_size, group_size=16)
    calls = []

    def draft_factory(cfg, num_pages, page_size, device):
        calls.append((cfg, num_pages, page_size, device))
        return FloatKVStore(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_size, num_pages, page_size, dtype=torch.float16, device=device
        )

    plain = Generator(pair[0], None, None, page_size=4, kv_store_factory=kv_store_factory(plan))
    spec = Generator(
        pair[0],
        pair[1],
        TREES["static"],
        page_size=4,
        kv_store_factory=kv_store_factory(plan),
        draft_kv_store_factory=draft_factory,
    )
    assert type(spec.vkv.store).__name__ == "QuantKVStore" and calls == [(pair[1].cfg, spec.num_pages, 4, "cpu")]
    p = SamplingParams(max_tokens=24)
    assert [t for t, _ in spec.generate(PROMPTS[:2], p)] == [t for t, _ in plain.generate(PROMPTS[:2], p)]


# ------------------------------------------------------------------------------- engine dir and CLI


def save_hf(model: Llama, out: Path) -> Path:
    """Write `model` as an HF Llama checkpoint (config.json + model.safetensors) without importing transformers."""
    from conftest import trtllm_to_hf
    from safetensors.torch import save_file

    c = model.cfg
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_size,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    hf = trtllm_to_hf(
        model.w,
        {
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads,
            "head_size": c.head_size,
            "hidden_size": c.hidden_size,
        },
    )
    save_file({k: v.contiguous() for k, v in hf.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _engine(tmp: Path, recipe: str) -> Path:
    from pairs import make_tokenizer

    from bpcompile.compiler.convert import convert_checkpoint

    cfg = ModelConfig(
        vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=16, intermediate_size=128
    )
    v = random_llama(cfg, seed=3)
    eng = tmp / "engine"
    convert_checkpoint(save_hf(v, tmp / "hf_v"), eng / "verifier")
    convert_checkpoint(save_hf(noisy_copy(v, 0.3, seed=4), tmp / "hf_d"), eng / "draft")
    make_tokenizer(eng / "tokenizer", vocab=300)
    import yaml

    write_engine_config(eng, **yaml.safe_load(recipe))
    return eng


def test_from_engine_and_generate_text(tmp_path, capsys):
    eng = _engine(
        tmp_path,
        "name: t\nlimits: {max_batch_size: 3, max_seq_len: 96, max_input_len: 95}\n"
        "kv_cache: {format: fp16, page_size: 8}\n"
        "speculative: {tree: static, choices: [[0], [1], [0, 0]]}\n",
    )
    from bpcompile.runtime.kvcache import KVPlan

    gen = Generator.from_engine(eng)
    assert type(gen.vkv.store).__name__ == "FloatKVStore"
    # engines run on CPU with the few-row kernel where it builds, else oneDNN-packed weights (runtime.cpu_weights;
    # see test_rows_kernel_... and test_packed_weights_...)
    few = "RowsLinear" if cpu_rows.available() else "PackedLinear"
    kinds = {"both": few, "rows": few, "packed": "PackedLinear", "plain": "Linear"}
    if cpu_packing_works():
        # auto (the default): one copy of the weights, the few-row kernel's where it builds, else the plain one
        auto = "RowsLinear" if cpu_rows.available() else "Linear"
        assert type(gen.verifier.head).__name__ == type(gen.draft.layers[0].qkv).__name__ == auto
        assert all(m.wt is None for m in gen.verifier.modules() if type(m).__name__ == "RowsLinear")
        conf = eng / "engine.json"
        raw = json.loads(conf.read_text())
        for layout, kind in kinds.items():
            conf.write_text(json.dumps(raw | {"runtime": raw["runtime"] | {"cpu_weights": layout}}))
            g = Generator.from_engine(eng)
            assert type(g.verifier.head).__name__ == type(g.draft.layers[0].qkv).__name__ == kind
            assert (getattr(g.verifier.head, "wt", None) is None) == (
                layout == "packed" or (layout == "rows" and few == "RowsLinear")
            )
        conf.write_text(json.dumps(raw))
    KVPlan.uniform("int8", 2, 2, 16, group_size=16).save(eng / "kv_plan")
    gen = Generator.from_engine(eng)
    assert type(gen.vkv.store).__name__ == "QuantKVStore" and type(gen.dkv.store).__name__ == "FloatKVStore"
    assert (gen.tree.kind, gen.tree.choices, gen.max_batch_size, gen.max_seq_len, gen.page_size) == (
        "static",
        [[0], [1], [0, 0]],
        3,
        96,
        8,
    )
    assert Generator.from_engine(eng, tree=TreeSpec("none")).draft is None
    res = generate_text(eng, "The for statement", max_tokens=12, tree="chain:3", json_out=True)
    js = json.loads(capsys.readouterr().out)
    assert js["tokens"] == res["tokens"] and js["tree"] == "chain" and js["verifier_steps"] >= 1
    assert js["cpu_weights"] in (("both", "rows") if cpu_rows.available() else ("both-packed", "packed", "plain"))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(eng / "tokenizer" / "tokenizer.json"))
    ids = tok.encode("The for statement").ids
    plain = Generator.from_engine(eng, tree=TreeSpec("none")).generate([ids], SamplingParams(max_tokens=12))[0][0]
    assert res["tokens"] == plain[: len(res["tokens"])]  # may stop early at </s>
    streamed = generate_text(eng, "The for statement", max_tokens=12, no_speculation=True)
    out = capsys.readouterr()
    assert out.out == tok.decode(streamed["tokens"]) + "\n" and "tok/s" in out.err
    assert streamed["tokens"] == res["tokens"]


def test_from_engine_errors(tmp_path):
    with pytest.raises(UserError):
        Generator.from_engine(tmp_path)
    with pytest.raises(UserError):
        generate_text(tmp_path, "x", tree="beam:3")


# ------------------------------------------------------------------------------------- the tiny pair


@pytest.mark.slow
@pytest.mark.skipif(
    not (TINY / "verifier" / "config.json").is_file() or not (TINY / "draft" / "config.json").is_file(),
    reason="the shipped tiny pair (models/tiny) is not built yet",
)
def test_tiny_pair_heldout_greedy_identical(tmp_path):
    """The issue's bar: 50 held-out prompts x 64 tokens, greedy speculation == verifier-only, every tree kind."""
    from bpcompile.compiler.convert import convert_checkpoint
    from bpcompile.compiler.corpus import heldout_prompts

    models = {}
    for name in ("verifier", "draft"):
        convert_checkpoint(TINY / name, tmp_path / name)
        models[name] = Llama.from_checkpoint(tmp_path / name)
    prompts = heldout_prompts(TINY / "verifier", 50, 32)
    p = SamplingParams(max_tokens=64)
    kw = dict(max_batch_size=50, max_seq_len=128, page_size=16)
    ref = [t for t, _ in Generator(models["verifier"], None, None, **kw).generate(prompts, p)]
    for spec in (
        TreeSpec("chain", length=5),
        TreeSpec("static", choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]),
        TreeSpec("dynamic", nodes=5),
    ):
        res = Generator(models["verifier"], models["draft"], spec, backoff=False, **kw).generate(prompts, p)
        assert [t for t, _ in res] == ref, spec.kind
        # batch 1: one request in flight at a time, against the same (batched) verifier-only reference
        one = Generator(models["verifier"], models["draft"], spec, **dict(kw, max_batch_size=1)).generate(prompts, p)
        assert [t for t, _ in one] == ref, (spec.kind, "batch 1")
        tau = sum(s.committed for _, s in res) / sum(s.verifier_steps for _, s in res)
        assert tau > 1.5, (spec.kind, tau)


@pytest.mark.parametrize("temperature, kind", [(0.0, "dynamic"), (0.8, "chain"), (0.0, "none")])
def test_logprobs_are_the_verifiers_own(tmp_path, pair, temperature, kind):
    """Each generated token's log probability (asked for with SamplingParams.logprobs), whether it came from an
    accepted draft, the verifier's bonus token or the prefill, equals transformers' log-softmax (over
    logits / temperature when sampling) of the HF checkpoint at that position, on the tokens the runtime chose."""
    from transformers import AutoModelForCausalLM

    v, d = pair
    gen = Generator(v, d if kind != "none" else None, TREES.get(kind), max_batch_size=4, page_size=4)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, logprobs=True)
    ids = {gen.add_request(p, params): p for p in PROMPTS[:3]}
    toks = {rid: [] for rid in ids}
    lps = {rid: [] for rid in ids}
    while gen.has_work():
        for o in gen.step():
            toks[o.request_id] += o.new_tokens
            lps[o.request_id] += o.logprobs
            assert len(o.logprobs) == len(o.new_tokens)
    hf = AutoModelForCausalLM.from_pretrained(save_hf(v, tmp_path / "hf"), dtype=torch.float32).eval()
    for rid, prompt in ids.items():
        t = toks[rid]
        assert len(t) == 12
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + t])).logits[0, len(prompt) - 1 : -1].double()
        want = torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, torch.tensor(t)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lps[rid], dtype=torch.float64), want, atol=1e-4), (lps[rid], want)
    plain = Generator(v, None, None, max_batch_size=4, page_size=4)
    plain.add_request(PROMPTS[0], SamplingParams(max_tokens=3))
    assert all(o.logprobs is None for o in plain.step())  # not asked: none computed


def test_context_and_generation_logits_are_the_verifiers(tmp_path, pair):
    """Asked for, the first output carries the verifier's logits at every prompt position and each output the
    logits each of its tokens was chosen from (drafted and verified in one tree forward, or the prefill's): both
    equal transformers' logits of the HF checkpoint on the same sequence, in a batch of prompts of three lengths."""
    from transformers import AutoModelForCausalLM

    v, d = pair
    gen = Generator(v, d, TREES["dynamic"], max_batch_size=4, page_size=4)
    params = SamplingParams(max_tokens=10, context_logits=True, generation_logits=True)
    ids = {gen.add_request(p, params): p for p in PROMPTS[:3]}
    toks, ctx, rows = {r: [] for r in ids}, {}, {r: [] for r in ids}
    while gen.has_work():
        for o in gen.step():
            toks[o.request_id] += o.new_tokens
            if o.context_logits is not None:
                assert o.request_id not in ctx
                ctx[o.request_id] = o.context_logits
            if o.new_tokens:
                assert o.generation_logits.shape == (len(o.new_tokens), CFG.vocab_size)
                rows[o.request_id].append(o.generation_logits)
    hf = AutoModelForCausalLM.from_pretrained(save_hf(v, tmp_path / "hf"), dtype=torch.float32).eval()
    for rid, prompt in ids.items():
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + toks[rid]])).logits[0]
        assert torch.allclose(ctx[rid], logits[: len(prompt)], atol=1e-4)
        assert torch.allclose(torch.cat(rows[rid]), logits[len(prompt) - 1 : -1], atol=1e-4)


@pytest.mark.parametrize("kind", ["none", "dynamic"])
def test_repetition_penalty_matches_transformers(tmp_path, pair, kind):
    """Greedy with repetition_penalty 1.3 (TensorRT-LLM's and transformers' rule: a seen token's positive logit
    divided, a negative one multiplied, prompt included) gives transformers' own generate(repetition_penalty=1.3)
    tokens, verifier only and with a dynamic tree (each tree node penalized with its own path)."""
    from transformers import AutoModelForCausalLM

    v, d = pair
    hf = AutoModelForCausalLM.from_pretrained(save_hf(v, tmp_path / "hf"), dtype=torch.float32).eval()
    gen = Generator(v, d if kind != "none" else None, TREES.get(kind), max_batch_size=4, page_size=4)
    out = gen.generate(PROMPTS, SamplingParams(max_tokens=16, repetition_penalty=1.3))
    for prompt, (toks, _) in zip(PROMPTS, out):
        ids = torch.tensor([prompt])  # (an explicit mask: token 0 is also the pad id these prompts may hold)
        want = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=0,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
        assert toks == want
    plain = [
        t
        for t, _ in Generator(v, None, None, max_batch_size=4, page_size=4).generate(
            PROMPTS, SamplingParams(max_tokens=16)
        )
    ]
    assert [t for t, _ in out] != plain  # the penalty changed something


def test_presence_frequency_and_min_tokens(pair):
    """The additive penalties on a hand-made row, and speculation = verifier only with all penalties on."""
    from bpcompile.runtime.request import apply_penalties

    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, min_tokens=3, end_id=1)
    row = torch.tensor([1.0, 2.0, -1.0, 4.0, 0.5])
    got = apply_penalties(row, p, [2, 2, 3, 0], generated=2)
    # token 2 (x2): -1 * 2 - 0.5 - 0.5; token 3: 4 / 2 - 0.5 - 0.25; token 0: 1 / 2 - 0.75; end id 1: held back
    assert got.tolist() == [1.0 / 2 - 0.75, float("-inf"), -2.0 - 1.0, 2.0 - 0.75, 0.5]
    assert apply_penalties(row, p, [], generated=3).tolist() == row.tolist()  # nothing seen, min_tokens reached
    v, d = pair
    params = SamplingParams(
        max_tokens=16,
        presence_penalty=0.7,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        min_tokens=10,
        end_id=int(v(torch.tensor([PROMPTS[2]]))[0, -1].argmax()),
    )
    ref = Generator(v, None, None, max_batch_size=4, page_size=4).generate(PROMPTS, params)
    spec = Generator(v, d, TREES["dynamic"], max_batch_size=4, page_size=4).generate(PROMPTS, params)
    assert [t for t, _ in spec] == [t for t, _ in ref]
    assert all(len(t) >= 10 for t, _ in ref)
    with pytest.raises(UserError, match="min_tokens"):
        Generator(v, None, None).add_request([5], SamplingParams(max_tokens=4, min_tokens=5))


def test_a_seeded_sampled_request_ignores_backoff(pair, monkeypatch):
    """Backoff picks each step's tree from timings (here: at random, off or shorter); a seeded sampled request
    draws its random numbers along its tree, so it keeps the configured tree and the same seed gives the same
    tokens every run, whatever backoff chose."""
    import random

    from bpcompile.runtime.speculative import BackOff, TreeSpec

    choices = [TreeSpec("none"), TreeSpec("dynamic", length=1, nodes=1), TREES["dynamic"]]
    monkeypatch.setattr(BackOff, "next_spec", lambda self: random.choice(choices))
    v, d = pair
    gen = Generator(v, d, TREES["dynamic"], max_batch_size=4, page_size=4)
    assert gen.spec.backoff is not None
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11)
    runs = [gen.generate([PROMPTS[1]], params)[0][0] for _ in range(4)]
    assert all(r == runs[0] for r in runs) and len(runs[0]) == 16


def test_openai_penalties_count_generated_tokens_only():
    """penalties_over_output (the OpenAI API's definition): presence / frequency count the last `generated` tokens
    only and are not scaled by the temperature; repetition_penalty still covers the prompt."""
    from bpcompile.runtime.request import apply_penalties

    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, temperature=2.0, penalties_over_output=True)
    row = torch.tensor([1.0, 2.0, -1.0, 4.0, 0.5])
    # prompt [2, 2], generated [3, 0, 3]: token 3 twice, token 0 once; token 2 (prompt only) untouched
    got = apply_penalties(row, p, [2, 2, 3, 0, 3], generated=3)
    assert got.tolist() == [1.0 - 0.75, 2.0, -1.0, 4.0 - 1.0, 0.5]
    assert apply_penalties(row, p, [2, 2], generated=0).tolist() == row.tolist()
    p.repetition_penalty = 2.0
    assert apply_penalties(row, p, [2, 2], generated=0).tolist() == [1.0, 2.0, -2.0, 4.0, 0.5]
