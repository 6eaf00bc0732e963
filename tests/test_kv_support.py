"""The support table (bpcompile.core.kv_support): one place says which reader takes which part of the KV format,
and every reader that runs here is checked against the PyTorch oracle for every precision the table says it takes,
as llama.cpp's test-backend-ops checks each backend against the CPU one (small shapes: the interpreter is slow)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors run interpreted

import re  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bpcompile.core.kv_support import READERS, SUPPORT, support_matrix, takes  # noqa: E402
from bpcompile.kernels import paged as K  # noqa: E402
from bpcompile.kernels.reference import paged_attention_reference  # noqa: E402
from bpcompile.kernels.tree_mask import pack_bool_mask, tree_mask_from_parents  # noqa: E402
from bpcompile.runtime import plugin_ops  # noqa: E402
from bpcompile.runtime.kvcache import (  # noqa: E402
    PRECISIONS,
    KVPlan,
    QuantKVStore,
    plan_support,
    reader_precisions,
    rope_rotate,
)
from bpcompile.runtime.paged_kv import AttnBatch, paged_attention  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
L, KV, D, G = 1, 2, 32, 32


def test_the_table_covers_the_registry_and_the_kernels_take_its_pools_in_order():
    assert [p.name for p in PRECISIONS] == [f for f in SUPPORT if f in {p.name for p in PRECISIONS}]
    assert {"exact", "rotation", "fp16"} <= set(SUPPORT) and all(r in READERS for f in SUPPORT for r in SUPPORT[f][0])
    # the kernels' pool arguments follow reader_precisions("triton"): payload q<x>, scales s<x>, count U<x>
    suffix = {"int4": "4", "fp8": "8", "int8": "i8", "int5": "5", "int6": "6", "int3": "3"}
    for kernel in (K._quantize_append_kernel, K._paged_attention_kernel):
        names = kernel.arg_names
        want = [f"{x}{suffix.get(p.name, 'k' + p.name[3:])}" for p in reader_precisions("triton") for x in "qs"]
        start = names.index("q4")
        assert names[start : start + len(want)] == want
        units = [f"U{suffix.get(p.name, 'k' + p.name[3:])}" for p in reader_precisions("triton")]
        assert names[start + len(want) : start + len(want) + len(units)] == units
    assert len(reader_precisions("triton")) * 2 == K.N_POOLS
    assert plugin_ops.QUANT_POOLS == tuple(
        f"{p.name}_{x}" for p in reader_precisions("onnxruntime") for x in ("payload", "scales")
    )


def test_no_slice_of_the_registry_and_one_list_of_readers():
    """The readers of a precision are listed in one place: no positional slice of the registry stands for them."""
    for path in (p for d in ("bpcompile", "benchmarks", "tools", "tests") for p in (REPO / d).rglob("*.py")):
        assert not re.search(r"PRECISIONS\[[^\]]*:", path.read_text()), path


def test_plan_support_names_each_feature_and_where():
    plan = KVPlan(
        "int4-fp8-outlier",
        2,
        1,
        32,
        32,
        [{"k": ["int4"], "v": ["int3"]}, {"k": ["int6"], "v": ["int4"]}],
        recent_window=4,
    )
    assert plan_support(plan, "torch") == [] and plan_support(plan, "triton") == []
    why = plan_support(plan, "onnxruntime")
    assert why == [
        "the onnxruntime executor's step graphs do not read exact FP16 (sink / recent-window) entries "
        "(sink_tokens 0, recent_window 4)",
    ]
    assert plan_support(plan, "tensorrt-llm") == [
        "TensorRT-LLM do not read INT4 units (first: layer 0 K head 0)",
        "TensorRT-LLM do not read INT6 units (first: layer 1 K head 0)",
        "TensorRT-LLM do not read INT3 units (first: layer 0 V head 0)",
        "TensorRT-LLM do not read exact FP16 (sink / recent-window) entries (sink_tokens 0, recent_window 4)",
    ]
    with pytest.raises(ValueError, match="unknown KV reader"):
        takes("vllm", "int4")


def test_kv_format_page_carries_the_table():
    assert support_matrix() in (REPO / "docs" / "KV_FORMAT.md").read_text()
    assert all(len(cell) <= 300 for row in support_matrix().splitlines() for cell in row.split("|"))


# ------------------------------------------------------------------------------------------------
# every reader that runs here against the oracle, for every precision it claims


def _plan(name: str) -> KVPlan:
    """One precision on every key unit (values INT4, or the precision itself where values may take it)."""
    klt = None
    if name.startswith("klt"):
        from bpcompile.compiler.calibrate import water_filling_bits

        g = torch.Generator().manual_seed(0)
        lam = torch.logspace(0, -3, D)
        b = water_filling_bits(lam, int(name[3]) * D)
        basis = torch.stack(
            [torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0] for _ in range(KV)]
        )
        klt = {
            "mean": torch.randn(L, KV, D, generator=g) * 0.1,
            "weight": torch.rand(L, KV, D, generator=g) + 0.5,
            "bits": b.to(torch.int8).expand(L, KV, D).clone(),
            "step": (lam.sqrt() / 2.0 ** b.float()).expand(L, KV, D).clone(),
            "level": torch.where(b == 1, lam.sqrt() * 0.8, 0.0).expand(L, KV, D).clone(),
            "basis": basis.half()[None],
            "inv_freq": 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)),
        }
    values = "int4" if name.startswith("klt") else name
    prec = [{"k": [name] * KV, "v": [values] * KV}]
    g = torch.Generator().manual_seed(1)
    return KVPlan(
        "int4-fp8-outlier",
        L,
        KV,
        D,
        G,
        prec,
        k_channel_scale=torch.rand(L, KV, D, generator=g) + 0.5,
        rotation="hadamard",
        k_mean=torch.randn(L, KV, D, generator=g) * 0.1,
        klt=klt,
    )


def _inputs(n_ctx=21, tree=(-1, 0, 0, 1)):
    g = torch.Generator().manual_seed(2)
    T = n_ctx + len(tree)
    pos = torch.arange(T)
    k = rope_rotate(
        torch.randn(T, KV, D, generator=g) * torch.logspace(0, -3, D).sqrt() * 2,
        pos,
        1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)),
    )
    v = torch.randn(T, KV, D, generator=g)
    q = torch.randn(1, len(tree), 2 * KV, D, generator=g)
    mask = pack_bool_mask(tree_mask_from_parents(list(tree))[None])
    return k, v, pos, q, mask


CLAIMS = [(r, p.name) for r in ("torch", "triton", "onnxruntime") for p in reader_precisions(r)]


@pytest.mark.parametrize("reader,precision", CLAIMS)
def test_every_reader_matches_the_oracle_for_every_precision_it_claims(reader, precision):
    plan = _plan(precision)
    assert plan_support(plan, reader) == []
    k, v, pos, q, mask = _inputs()
    T, nt, S = k.shape[0], q.shape[1], 8
    oracle, ours = QuantKVStore(plan, 8, S), QuantKVStore(plan, 8, S)
    bt = torch.tensor([[5, 2, 7, 1]], dtype=torch.int32)
    slots = bt[0, torch.arange(T) // S].long() * S + torch.arange(T) % S
    oracle.write(0, slots, k, v, pos)
    ctx, ntree = torch.tensor([T - nt]), torch.tensor([nt])
    ref = paged_attention_reference(q, oracle, 0, bt, ctx, mask, ntree, D**-0.5)
    if reader == "torch":  # the torch executor's paged path: SDPA over the store's reads
        ours.write(0, slots, k, v, pos)
        out = paged_attention(q, ours, 0, AttnBatch(bt, ctx, ntree, ntree, mask, S), kern=None)
    elif reader == "triton":
        K.quantize_append(ours, 0, slots, k, v, pos)
        out = K.paged_attention(q, ours, 0, bt, ctx, mask, ntree, D**-0.5)
    else:  # the step graphs' custom ops, as ONNX Runtime calls them (in the stored basis, as the graphs put them)
        pools, tables = plugin_ops.pools_of(ours), plugin_ops.tables_of(ours)
        kt, vt = ours.transform(0, k, v)
        attrs = dict(layer=0, page_size=S, group_size=G)
        pools = plugin_ops.quant_append(kt, vt, slots, *pools, *tables.values(), **attrs)
        for dst, src in zip(plugin_ops.pools_of(ours), pools):
            dst.copy_(src)
        qq = ours.kernel_query(0, q)
        out = plugin_ops.quant_attention(
            qq,
            bt,
            ctx.int(),
            ntree.int(),
            ntree.int(),
            mask,
            *pools,
            *list(tables.values())[:3],
            **attrs,
            sm_scale=D**-0.5,
        )
        out = ours.kernel_output(out)
    assert all(torch.equal(a, b) for a, b in zip(oracle.pools(), ours.pools())), "the bytes differ"
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err <= 1e-4, err


def test_onnx_export_refuses_what_the_step_graphs_do_not_read(tmp_path):
    """A KLT plan's graphs would need the tokens' positions inside the append: the export names the unread
    features (exit-2 UserError) before tracing, and writes nothing."""
    from conftest import random_llama

    from bpcompile.compiler.onnx_export import export_model
    from bpcompile.core.errors import UserError
    from bpcompile.runtime.model import ModelConfig

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=L,
        num_heads=2 * KV,
        num_kv_heads=KV,
        head_size=D,
        intermediate_size=64,
    )
    with pytest.raises(UserError, match="cannot export ONNX step graphs for this KV plan") as e:
        export_model(random_llama(cfg, seed=0), QuantKVStore(_plan("klt6"), 4, 8), tmp_path / "g", 64)
    assert "onnxruntime executor's step graphs do not read KLT6 key units" in str(e.value) and e.value.exit_code == 2
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_every_shipped_recipes_plan_is_read_by_the_oracle_and_the_kernels(recipe):
    """Each shipped recipe's KV settings, resolved as a build resolves them (and with only the format, group and
    page size given: what auto settings choose), ask nothing of the torch executor, the Triton kernels or the
    recipe's own readers that the support table says they do not read: the kernels run them with no fallback
    (benchmarks/check_recipe_plans.py generates with them, docs/KV_FORMAT.md)."""
    import yaml

    from bpcompile.compiler.recipe import kv_problems
    from bpcompile.core.engine import EngineConfig

    raw = yaml.safe_load((REPO / "recipes" / recipe).read_text())
    auto = {k: v for k, v in raw["kv_cache"].items() if k in ("format", "group_size", "page_size")}
    for kv in (raw["kv_cache"], auto):
        cfg = EngineConfig.from_sections({**raw, "kv_cache": kv})
        assert kv_problems(cfg, ("torch", "triton", *cfg.kv_readers)) == []
