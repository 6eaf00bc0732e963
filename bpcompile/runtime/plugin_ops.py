"""The custom ops of the exported step graphs: their names, attributes and input order (the contract shared by
the ONNX export, the TensorRT plugins in plugins/trt and the ONNX Runtime executor), and their
PyTorch reference implementations.

A graph's attention is two nodes per layer:
- append: quantize-and-append this step's K/V into the KV pools; its outputs are the updated pools (TensorRT
  aliases them to the inputs: an in-place update; ONNX Runtime copies);
- attention: paged tree attention of the queries over those pools (committed context plus the tree region).

`BpQuantizeAppend` / `BpPagedTreeAttention` take the mixed INT4/FP8/INT8 cache, in the kernels' basis: any
centering, channel scale or rotation of the plan is ordinary graph arithmetic around them (`QuantKVStore`'s
transform, kernel_query and kernel_output), so the nodes see exactly what the Triton kernels see. They are the
TensorRT plugins' creator names, and their attributes are the creators' fields (a test parses the C++).
`BpFloatKVAppend` / `BpFloatPagedTreeAttention` take an unquantized cache (`kv_cache.format: fp16`, and the
draft's cache); they have no TensorRT plugin yet.
"""

from __future__ import annotations

import torch

from bpcompile.runtime.kvcache import BY_CODE, FloatKVStore, KVPlan, QuantKVStore, reader_precisions
from bpcompile.runtime.paged_kv import AttnBatch, dense_attention

DOMAIN = "ai.onnx.contrib"  # where ONNX Runtime's Python custom ops resolve; TensorRT matches on op type
PLUGIN_NAMESPACE, PLUGIN_VERSION = "bpcompile", "1"
QUANT_APPEND, QUANT_ATTENTION = "BpQuantizeAppend", "BpPagedTreeAttention"
FLOAT_APPEND, FLOAT_ATTENTION = "BpFloatKVAppend", "BpFloatPagedTreeAttention"

# Attributes of each op, in the C++ creators' field order (sm_scale is a float, the rest int).
FIELDS = {
    QUANT_APPEND: ("layer", "num_kv_heads", "head_size", "page_size", "group_size"),
    QUANT_ATTENTION: ("layer", "num_kv_heads", "head_size", "page_size", "group_size", "num_splits", "sm_scale"),
    FLOAT_APPEND: ("layer", "num_kv_heads", "head_size", "page_size"),
    FLOAT_ATTENTION: ("layer", "num_kv_heads", "head_size", "page_size", "sm_scale"),
}
FLOAT_FIELDS = {"sm_scale"}

# Graph inputs after the op's own (k, v, slots / q and the attention metadata): the quantized cache's pools
# (payload and fp16 scales per precision the graphs read, registry order) and its unit tables; the float cache's
# K and V pools.
GRAPH_PRECISIONS = reader_precisions("onnxruntime")  # the TensorRT network is built from the same graphs
QUANT_POOLS = tuple(f"{p.name}_{part}" for p in GRAPH_PRECISIONS for part in ("payload", "scales"))
QUANT_TABLES = ("unit_precision", "unit_index", "k_channel_scale")  # + int4_clip for the append
FLOAT_POOLS = ("k_pool", "v_pool")
ATTENTION_META = ("block_tables", "context_lens", "tree_lens", "q_lens", "tree_mask")


def is_quantized(store) -> bool:
    return isinstance(store, QuantKVStore)


def pools_of(store) -> list[torch.Tensor]:
    """The store's pools as the graphs take them (a store's tensors themselves: binding them costs nothing)."""
    return store.reader_pools("onnxruntime") if is_quantized(store) else [store.k, store.v]


def pool_names(store) -> tuple[str, ...]:
    return QUANT_POOLS if is_quantized(store) else FLOAT_POOLS


def tables_of(store) -> dict[str, torch.Tensor]:
    """The static per-engine inputs of the quantized ops (empty for a float cache): what the kernels read."""
    if not is_quantized(store):
        return {}
    return {
        "unit_precision": store.unit_precision,
        "unit_index": store.unit_index,
        "k_channel_scale": store.kernel_k_channel_scale,
        "int4_clip": store.int4_clip,
    }


# ---------------------------------------------------------------------------------------------- stores

_VIEWS: dict = {}


def _quant_view(
    pools, unit_precision, k_channel_scale, int4_clip, group_size: int, page_size: int, dtype: torch.dtype
) -> QuantKVStore:
    """A QuantKVStore over the given pools, in the kernels' basis (no centering or rotation; the channel scale
    the kernels multiply by). The static part is built once per set of tables."""
    key = (
        unit_precision.numpy().tobytes(),
        k_channel_scale.numpy().tobytes(),
        int4_clip.numpy().tobytes(),
        group_size,
        page_size,
        dtype,
    )
    store = _VIEWS.get(key)
    if store is None:
        L, _, KV = unit_precision.shape
        table = [
            {t: [BY_CODE[int(c)].name for c in unit_precision[layer, i]] for i, t in enumerate(("k", "v"))}
            for layer in range(L)
        ]
        plan = KVPlan(
            "int4-fp8-outlier",
            L,
            KV,
            k_channel_scale.shape[-1],
            group_size,
            table,
            k_channel_scale=k_channel_scale.clone(),
            int4_clip=int4_clip.clone(),
        )
        store = _VIEWS[key] = QuantKVStore(plan, 0, page_size, dtype=dtype)
    store.num_pages = pools[0].shape[0]
    for i, prec in enumerate(GRAPH_PRECISIONS):
        store.payload[prec.code], store.scales[prec.code] = pools[2 * i], pools[2 * i + 1]
    return store


def _float_view(k_pool: torch.Tensor, v_pool: torch.Tensor, page_size: int) -> FloatKVStore:
    L, P, KV, S, D = k_pool.shape
    store = FloatKVStore(L, KV, D, 0, page_size, dtype=k_pool.dtype)
    store.k, store.v, store.num_pages = k_pool, v_pool, P
    return store


# ------------------------------------------------------------------------------- reference implementations


def _attend(store, q, layer, block_tables, context_lens, tree_lens, q_lens, tree_mask, sm_scale) -> torch.Tensor:
    """q [B, T, H, D] over the store's entries per AttnBatch's rules (the torch executor's dense path math)."""
    batch = AttnBatch(block_tables, context_lens.long(), tree_lens.long(), q_lens.long(), tree_mask, store.page_size)
    k, v, visible = batch.gather(store, layer, q)
    hidden = ~visible.repeat_interleave(q.shape[2] // k.shape[1], dim=1)[:, None]
    return dense_attention(q, k, v, hidden, scale=sm_scale)


def quant_append(k, v, slots, *inputs, layer: int, page_size: int, group_size: int, **_) -> list[torch.Tensor]:
    """BpQuantizeAppend: (k, v [N, KV, D], slots [N], pools..., unit_precision, unit_index, k_channel_scale,
    int4_clip) -> the pools with these tokens' codes written (new tensors; the inputs are not modified)."""
    n = len(QUANT_POOLS)
    pools = [p.clone() for p in inputs[:n]]
    unit_precision, _, kcs, clip = inputs[n:]
    _quant_view(pools, unit_precision, kcs, clip, group_size, page_size, k.dtype).write(layer, slots, k, v)
    return pools


def quant_attention(
    q,
    block_tables,
    context_lens,
    tree_lens,
    q_lens,
    tree_mask,
    *inputs,
    layer: int,
    page_size: int,
    group_size: int,
    sm_scale: float,
    **_,
) -> torch.Tensor:
    """BpPagedTreeAttention: q [B, T, H, D] (in the kernels' basis) over the pools -> [B, T, H, D]."""
    n = len(QUANT_POOLS)
    unit_precision, _, kcs = inputs[n:]
    store = _quant_view(
        list(inputs[:n]), unit_precision, kcs, torch.ones(unit_precision.shape), group_size, page_size, q.dtype
    )
    return _attend(store, q, layer, block_tables, context_lens, tree_lens, q_lens, tree_mask, sm_scale)


def float_append(k, v, slots, k_pool, v_pool, *, layer: int, page_size: int, **_) -> list[torch.Tensor]:
    """BpFloatKVAppend: (k, v [N, KV, D], slots [N], k_pool, v_pool [L, P, KV, S, D]) -> updated pools."""
    pools = [k_pool.clone(), v_pool.clone()]
    _float_view(*pools, page_size).write(layer, slots, k, v)
    return pools


def float_attention(
    q,
    block_tables,
    context_lens,
    tree_lens,
    q_lens,
    tree_mask,
    k_pool,
    v_pool,
    *,
    layer: int,
    page_size: int,
    sm_scale: float,
    **_,
) -> torch.Tensor:
    """BpFloatPagedTreeAttention: q [B, T, H, D] over an unquantized paged cache -> [B, T, H, D]."""
    return _attend(
        _float_view(k_pool, v_pool, page_size),
        q,
        layer,
        block_tables,
        context_lens,
        tree_lens,
        q_lens,
        tree_mask,
        sm_scale,
    )


REFERENCE = {
    QUANT_APPEND: quant_append,
    QUANT_ATTENTION: quant_attention,
    FLOAT_APPEND: float_append,
    FLOAT_ATTENTION: float_attention,
}
