"""The memory plan of a recipe, per GPU: weights, KV caches at the recipe's limits, the largest step's
activations; how many sequences of what length fit; a projected decode speed from the bytes a step moves.

Arithmetic from the two models' config.json alone (no weight is read), so it answers before a build. The
shapes are the ones the converter writes (bpcompile/core/checkpoint.py: q/k/v, o, MLP and lm_head split over
tp, KV heads repeated when tp exceeds them, the embedding and norms replicated) and the runtime allocates
(bpcompile/runtime/generator.py: max_batch_size sequences of max_seq_len plus one step's tree, in pages, for
the verifier and the draft). KV bytes per unit come from the unit-precision registry. Activations and the
decode speed are estimates and say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from bpcompile.compiler.calibrate import int5_key_layers, int6_key_layers, klt_key_layers, n_outlier_units
from bpcompile.core.errors import UserError
from bpcompile.runtime.kvcache import PRECISIONS
from bpcompile.runtime.paged_kv import cache_pages, pages_per_sequence
from bpcompile.runtime.speculative import TreeSpec

GB = 1e9
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Device:
    name: str
    memory: float  # bytes
    bandwidth: float  # bytes/s (HBM)


DEVICES = {
    "h200": Device("H200 (141 GB, 4.8 TB/s)", 141 * GB, 4.8e12),
    "h100": Device("H100 SXM (80 GB, 3.35 TB/s)", 80 * GB, 3.35e12),
    "a100-80gb": Device("A100 80GB (2.0 TB/s)", 80 * GB, 2.0e12),
}
USABLE = 0.9  # of device memory: the CUDA context, the allocator's fragmentation and NCCL buffers take the rest


def tree_tokens(recipe) -> int:
    """Tokens one verifier step writes per sequence: the true token plus the draft tokens of the tree."""
    s = recipe.speculative
    return TreeSpec(s.tree, length=s.length, choices=s.choices, nodes=s.nodes).draft_tokens + 1


def cache_tokens(recipe) -> int:
    """Token slots the runtime allocates per cache: max_batch_size sequences of max_seq_len + one tree, in
    whole pages, plus the padding page."""
    lim, page = recipe.limits, recipe.kv_cache.page_size
    return cache_pages(lim.max_batch_size, lim.max_seq_len, tree_tokens(recipe), page) * page


def kv_heads_per_rank(cfg: dict, tp: int) -> int:
    return max(cfg["num_key_value_heads"] // tp, 1)


def kv_bytes_per_token(cfg: dict, recipe, tp: int, fmt: Optional[str] = None, dtype_bytes: int = 2) -> float:
    """KV bytes per token on one rank. fmt: the recipe's format for the verifier; None = a float cache in the
    compute dtype (the draft's)."""
    L, KV, D = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    share = kv_heads_per_rank(cfg, tp) / KV  # of the model's (layer, KV head, K|V) units on this rank
    units = 2 * L * KV
    if fmt is None:
        return share * units * D * dtype_bytes
    if fmt == "fp16":
        return share * units * D * 2
    G = min(recipe.kv_cache.group_size, D)
    width = {p.name: p.payload_width(D) + 2 * (D // G) for p in PRECISIONS}  # payload + fp16 scales
    if fmt == "int4-fp8-outlier":  # the calibrated plan keeps this many units in INT5 / INT6 / INT8 / INT3 / the
        kv = recipe.kv_cache  # outlier precision (calibrate.plan_from_measurement's order)
        i5 = len(int5_key_layers(kv.int5_keys, L)) * KV
        i6 = len(int6_key_layers(kv.int6_keys, L)) * KV
        ret = min(n_outlier_units(kv.retrieval_fraction, units), L * KV - i5 - i6)
        i3 = n_outlier_units(kv.int3_values, L * KV)
        wide = min(n_outlier_units(kv.outlier_fraction, units), units - ret - i5 - i6 - i3)
        total = share * (
            i5 * width["int5"]
            + i6 * width["int6"]
            + ret * width["int8"]
            + i3 * width["int3"]
            + wide * width[kv.outlier_precision]
            + (units - i5 - i6 - ret - i3 - wide) * width["int4"]
        )
        if kv.key_transform == "klt":  # KLT keys keep one scale per token; the store keeps a position per slot
            total += 4 - share * len(klt_key_layers(L)) * KV * 2 * (D // G - 1)
        return total
    return share * units * width[fmt]


def exact_bytes_per_sequence(cfg: dict, recipe, tp: int) -> int:
    """The verifier's exact (FP16) copies per sequence on one rank: sink_tokens + recent_window + one tree of
    entries of every unit (runtime.paged_kv.RecentKV)."""
    kv = recipe.kv_cache
    if not (kv.sink_tokens or kv.recent_window):
        return 0
    return (
        cfg["num_hidden_layers"]
        * kv_heads_per_rank(cfg, tp)
        * 2
        * 2
        * cfg["head_dim"]
        * (kv.sink_tokens + kv.recent_window + tree_tokens(recipe))
    )


def klt_table_bytes(cfg: dict, recipe, tp: int, device: str = "cpu") -> int:
    """The verifier's KLT tables on one rank, allocated once per engine (runtime.kvcache.QuantKVStore): per KLT key
    unit its basis (D x D float16), weight and mean (D float32 each); per (layer, KV head) of the rank the bits (int8),
    steps and levels (float32) of D coefficients; D/2 inverse frequencies (float32). On CUDA the kernels read their
    own copies (QuantKVStore.kernel_klt): a float32 basis for every (layer, KV head), its D bits, bit offsets (int32),
    steps, levels, weights and means (float32), and the inverse frequencies."""
    kv = recipe.kv_cache
    if kv.format != "int4-fp8-outlier" or kv.key_transform != "klt":
        return 0
    L, D, heads = cfg["num_hidden_layers"], cfg["head_dim"], kv_heads_per_rank(cfg, tp)
    store = len(klt_key_layers(L)) * heads * (2 * D * D + 2 * 4 * D) + L * heads * D * (1 + 4 + 4) + 4 * D // 2
    kernels = L * heads * (4 * D * D + 6 * 4 * D) + 4 * D // 2 if device != "cpu" else 0
    return store + kernels


def weight_params_per_rank(cfg: dict, tp: int) -> int:
    """Parameters one tensor-parallel rank holds (pp = 1), as the converter splits them."""
    h, L, I, V, D = (
        cfg[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "head_dim")
    )
    hq = cfg["num_attention_heads"] // tp * D
    hkv = kv_heads_per_rank(cfg, tp) * D
    layer = 2 * h + (hq + 2 * hkv) * h + h * hq + 3 * h * (I // tp)
    layer += (hq + 2 * hkv) * cfg.get("qkv_bias", False) + h * cfg.get("o_bias", False)
    layer += (2 * (I // tp) + h) * cfg.get("mlp_bias", False)
    if cfg.get("architecture") == "FeatureDraft":  # fc over [embedding, feature] and its own head rows, if
        return 2 * h * h + h + L * layer + cfg.get("head_rows", 0) * h  # any; it reads the verifier's embedding
    lm_head = -(-V // tp) * h  # written (and split) even when tied
    return V * h + L * layer + h + lm_head


def kv_pool_bytes(recipe, verifier: dict, draft: Optional[dict]) -> int:
    """Bytes of the KV caches the native runtime allocates on this machine for the recipe's limits: one process
    holds the whole model (tp 1), the verifier's cache in the recipe's format, the draft's in float32 (the CPU
    runtime computes in float32)."""
    per_token = kv_bytes_per_token(verifier, recipe, 1, recipe.kv_cache.format)
    if draft is not None and recipe.speculative.tree != "none":
        per_token += kv_bytes_per_token(draft, recipe, 1, None, 4)
    exact = recipe.limits.max_batch_size * exact_bytes_per_sequence(verifier, recipe, 1)
    return int(cache_tokens(recipe) * per_token) + exact + klt_table_bytes(verifier, recipe, 1)


def _dtype_bytes(spec, cfg: dict) -> int:
    name = cfg.get("dtype") if spec.dtype == "auto" else spec.dtype
    return DTYPE_BYTES.get(name or "bfloat16", 2)


def _linear_params(cfg: dict, tp: int) -> int:
    """Parameters in one rank's linear layers (q/k/v, o, MLP, the head; not the embedding, norms or biases): what
    runtime.cpu_weights both holds twice."""
    h, L, I, D = (cfg[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "head_dim"))
    hq, hkv = cfg["num_attention_heads"] // tp * D, kv_heads_per_rank(cfg, tp) * D
    layer = (hq + 2 * hkv) * h + h * hq + 3 * h * (I // tp)
    if cfg.get("architecture") == "FeatureDraft":
        return 2 * h * h + L * layer + cfg.get("head_rows", 0) * h
    return L * layer + -(-cfg["vocab_size"] // tp) * h


def runtime_bytes(recipe, verifier: dict, draft: Optional[dict], device: str = "cpu", tp: int = 1) -> dict:
    """What the native runtime allocates on one rank (device cpu or cuda) at the recipe's limits, by part, in bytes
    (bpcompile/runtime/generator.py, executor.py, paged_kv.py; the runtime's own figures are compared with these
    in tests/test_plan.py):
    weights: the models as loaded (a tied head once at tp 1, where the embedding reads it; on CPU in float32 with
      runtime.cpu_weights both, the linears twice);
    kv_pools: the verifier's pool in the recipe's format, the draft's in its compute dtype (max_batch_size
      sequences of max_seq_len + a tree, in pages, + the padding page), the plan's exact copies and KLT tables;
    dense: the per-sequence copy of a cache that the PyTorch attention reads (every cache on CPU; on CUDA a float
      cache) at its full length, max_batch_size + 1 rows; none where the steps after prefill are static
      (runtime.cuda_graphs: auto on CUDA, on anywhere; the torch executor, any tp or KV plan). Not counted: the
      static step's buffers per bucket (batch rounded up to a power of two x query rows T), of which the block
      tables are the most, B x pages of a sequence x 4 bytes (recipes/70b.yaml's largest: 64 x 257 x 4 = 66 KB);
      and on CUDA the logits each captured bucket keeps, B x T x vocab x 4 bytes (the 70B verifier's tree steps, T = 6,
      over its 7 batch buckets: (1 + 2 + ... + 64) x 6 x 128256 x 4 = 0.39 GB, 0.3% of an H200);
    chunk: the K/V copy, in the compute dtype, of the one prompt (max_input_len) prefilling in chunks, both models;
    activations: an estimate of the largest forward (prompt tokens of one step: the chunk budget, else a full
    batch of max_input_len prompts; hidden states, q/k/v, the MLP's inputs, a chunk's attention scores) plus a
    step's logits in fp32."""
    lim, kvc, rt = recipe.limits, recipe.kv_cache, recipe.runtime
    speculating = draft is not None and recipe.speculative.tree != "none"
    vb = _dtype_bytes(recipe.models.verifier, verifier)
    db = vb if draft is not None and draft.get("architecture") == "FeatureDraft" else None
    db = db or (_dtype_bytes(recipe.models.draft, draft) if speculating else vb)
    models = [(verifier, vb)] + ([(draft, db)] if speculating else [])
    cpu = device == "cpu"
    weights = []
    for cfg, b in models:
        params = weight_params_per_rank(cfg, tp)
        if tp == 1 and cfg.get("tie_word_embeddings") and cfg.get("architecture") != "FeatureDraft":
            params -= cfg["vocab_size"] * cfg["hidden_size"]  # the embedding is the head's weight
        if cpu and b == 4 and rt.cpu_weights == "both" and rt.executor == "torch":
            params += _linear_params(cfg, tp)
        weights.append(params * b)
    kv_token = kv_bytes_per_token(verifier, recipe, tp, kvc.format)
    draft_token = kv_bytes_per_token(draft, recipe, tp, None, db) if speculating else 0.0
    kv = int(cache_tokens(recipe) * (kv_token + draft_token)) + lim.max_batch_size * exact_bytes_per_sequence(
        verifier, recipe, tp
    )
    kv += klt_table_bytes(verifier, recipe, tp, device)
    # runtime.static_step: wants_static and static_support (only the torch executor runs it)
    static = rt.executor == "torch" and (rt.cuda_graphs == "on" or (rt.cuda_graphs == "auto" and not cpu))
    length = lim.max_seq_len + tree_tokens(recipe) + 1  # a DenseKV row: max_seq_len + a tree + 1

    def per_token(cfg: dict, b: int) -> int:  # K and V of one token, every layer, this rank's heads
        return 2 * cfg["num_hidden_layers"] * kv_heads_per_rank(cfg, tp) * cfg["head_dim"] * b

    dense = 0
    for i, (cfg, b) in enumerate(models):
        quantized = i == 0 and kvc.format != "fp16"
        if not static and (cpu or not quantized):
            dense += (lim.max_batch_size + 1) * length * per_token(cfg, b)
    chunked = 0 < rt.prefill_chunk < lim.max_input_len
    chunk = lim.max_input_len * sum(per_token(cfg, b) for cfg, b in models) if chunked else 0
    h, I = verifier["hidden_size"], verifier["intermediate_size"]
    qkv = (verifier["num_attention_heads"] // tp + 2 * kv_heads_per_rank(verifier, tp)) * verifier["head_dim"]
    tokens = lim.max_batch_size * lim.max_input_len
    if rt.prefill_chunk > 0:
        tokens = min(tokens, rt.prefill_chunk)
    activations = tokens * (4 * h + qkv + 2 * (I // tp)) * vb
    if chunked:  # scores and probabilities of a chunk's queries over the prompt so far, fp32
        activations += 2 * verifier["num_attention_heads"] // tp * rt.prefill_chunk * lim.max_input_len * 4
    activations += lim.max_batch_size * tree_tokens(recipe) * -(-verifier["vocab_size"] // tp) * 4
    return {
        "weights": sum(weights),
        "weights_by_model": weights,  # verifier, draft
        "kv_pools": kv,
        "dense": dense,
        "chunk": chunk,
        "activations": activations,
        "total": sum(weights) + kv + dense + chunk + activations,
    }


def plan(recipe, verifier: dict, draft: Optional[dict], device: Device, tp: Optional[int] = None) -> dict:
    """The plan at tensor-parallel size tp (default: the recipe's). recipe: a bpcompile.compiler.recipe.Recipe;
    verifier/draft: normalized HF configs (bpcompile.compiler.hf.read_hf_config)."""
    tp = tp or recipe.parallel.tp
    lim = recipe.limits
    speculating = draft is not None and recipe.speculative.tree != "none"

    def dtype_of(spec, cfg):
        name = cfg.get("dtype") if spec.dtype == "auto" else spec.dtype
        return DTYPE_BYTES.get(name or "bfloat16", 2)

    vb, db = dtype_of(recipe.models.verifier, verifier), dtype_of(recipe.models.draft, draft or {})
    tokens = cache_tokens(recipe)
    weights = weight_params_per_rank(verifier, tp) * vb + (weight_params_per_rank(draft, tp) * db if speculating else 0)
    kv_token = kv_bytes_per_token(verifier, recipe, tp, recipe.kv_cache.format)
    draft_token = kv_bytes_per_token(draft, recipe, tp, None, db) if speculating else 0.0
    exact = exact_bytes_per_sequence(verifier, recipe, tp)
    kv = tokens * (kv_token + draft_token) + lim.max_batch_size * exact + klt_table_bytes(verifier, recipe, tp, "cuda")
    # what the runtime adds on a GPU (runtime_bytes): dense copies of float caches it reads by PyTorch, a chunked
    # prompt's K/V copy, the largest forward's activations (the chunk budget's tokens, else a full batch's)
    rb = runtime_bytes(recipe, verifier, draft, "cuda", tp)
    dense, chunk, activations = rb["dense"], rb["chunk"], rb["activations"]
    total = weights + kv + dense + chunk + activations
    usable = device.memory * USABLE
    per_seq = (
        pages_per_sequence(lim.max_seq_len, tree_tokens(recipe), recipe.kv_cache.page_size)
        * recipe.kv_cache.page_size
        * (kv_token + draft_token)
        + exact
    )
    per_seq += dense / (lim.max_batch_size + 1)  # a dense row per sequence (and one for padding)
    room = usable - weights - activations - chunk
    fits_seqs = max(0, int(room // per_seq)) if per_seq else 0

    def decode(batch: int, context: int) -> float:
        """Projected verifier-only decode tokens/s: one step reads this rank's verifier weights and every
        sequence's KV once (bandwidth-bound; no speculation, no compute or launch time)."""
        moved = weight_params_per_rank(verifier, tp) * vb + batch * context * kv_token
        return batch * device.bandwidth / moved

    return {
        "tp": tp,
        "device": device.name,
        "usable_bytes": usable,
        "weights_bytes": weights,
        "kv_bytes": kv,
        "kv_bytes_per_token": kv_token,
        "draft_kv_bytes_per_token": draft_token,
        "cache_tokens": tokens,
        "dense_kv_bytes": dense,
        "chunk_kv_bytes": chunk,
        "activations_bytes": activations,
        "total_bytes": total,
        "fits": total <= usable,
        "sequences_that_fit_at_max_seq_len": fits_seqs,
        "projected_decode_tokens_per_s": {
            "batch_1_at_max_seq_len": decode(1, lim.max_seq_len),
            f"batch_{lim.max_batch_size}_at_max_seq_len": decode(lim.max_batch_size, lim.max_seq_len),
        },
    }


def valid_tps(verifier: dict, draft: Optional[dict], upto: int = 64) -> list[int]:
    """Tensor-parallel sizes (powers of two) that both models split under (the converter's rules)."""
    out = []
    for tp in (2**i for i in range(int(math.log2(upto)) + 1)):
        ok = True
        for cfg in filter(None, (verifier, draft)):
            H, KV, I = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
            ok &= not (H % tp or I % tp or (tp > KV and tp % KV) or (tp <= KV and KV % tp))
        if ok:
            out.append(tp)
    return out


def plan_report(recipe, verifier: dict, draft: Optional[dict], device: Device) -> dict:
    """The plan at the recipe's tp and at the smallest tp that fits (None when none does)."""
    at_recipe = plan(recipe, verifier, draft, device)
    smallest = next(
        (p for tp in valid_tps(verifier, draft) if (p := plan(recipe, verifier, draft, device, tp))["fits"]), None
    )
    return {"recipe": recipe.name, "at_recipe_tp": at_recipe, "smallest_tp_that_fits": smallest}


def device_from(name: str, memory_gb: Optional[float], bandwidth_tbs: Optional[float]) -> Device:
    if name not in DEVICES:
        raise UserError(
            f"unknown device {name!r}; one of {', '.join(DEVICES)} (or give --memory-gb and --bandwidth-tbs)",
            key="device",
        )
    d = DEVICES[name]
    if memory_gb is None and bandwidth_tbs is None:
        return d
    return Device(
        f"{memory_gb or d.memory / GB:g} GB, {bandwidth_tbs or d.bandwidth / 1e12:g} TB/s",
        (memory_gb or d.memory / GB) * GB,
        (bandwidth_tbs or d.bandwidth / 1e12) * 1e12,
    )


def markdown(report: dict) -> str:
    def col(p):
        if p is None:
            return ["no tp that fits"] + [""] * 10
        return [
            f"tp = {p['tp']}",
            f"{p['weights_bytes'] / GB:.2f} GB",
            f"{p['kv_bytes'] / GB:.2f} GB "
            f"({p['cache_tokens']:,} tokens, {p['kv_bytes_per_token']:,.0f} B/token verifier)",
            f"{p['dense_kv_bytes'] / GB:.2f} GB",
            f"{p['chunk_kv_bytes'] / GB:.2f} GB",
            f"{p['activations_bytes'] / GB:.2f} GB (estimate)",
            f"{p['total_bytes'] / GB:.2f} GB",
            f"{p['usable_bytes'] / GB:.1f} GB",
            "yes" if p["fits"] else "**no**",
            f"{p['sequences_that_fit_at_max_seq_len']:,}",
            ", ".join(f"{k.replace('_', ' ')}: {v:,.0f}" for k, v in p["projected_decode_tokens_per_s"].items()),
        ]

    rows = [
        "per GPU",
        "weights",
        "KV caches at the limits",
        "dense KV copies (PyTorch attention)",
        "chunked prompt's K/V copy",
        "activations",
        "total",
        "usable (90%)",
        "fits",
        "sequences of max_seq_len that fit",
        "projected decode tok/s (bandwidth bound, verifier only)",
    ]
    a, b = col(report["at_recipe_tp"]), col(report["smallest_tp_that_fits"])
    lines = [
        f"memory plan of {report['recipe']} on {report['at_recipe_tp']['device']}",
        "",
        "| | recipe's tp | smallest tp that fits |",
        "|---|---|---|",
    ]
    lines += [f"| {r} | {x} | {y} |" for r, x, y in zip(rows, a, b)]
    return "\n".join(lines)
