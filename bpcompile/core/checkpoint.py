"""The engine checkpoint format, TensorRT-LLM 1.2's (`config.json` + `rank{N}.safetensors`): the contract between
the converter (bpcompile.compiler.convert writes it) and the runtime (merge_ranks reads it back).

Names and tensor-parallel splits follow TensorRT-LLM's own Llama checkpoint converter:

  transformer.vocab_embedding.weight          <- model.embed_tokens          replicated, first pp stage only
  transformer.layers.L.input_layernorm.weight <- input_layernorm             replicated
  transformer.layers.L.attention.qkv.*        <- self_attn.{q,k,v}_proj      per rank [q_r; k_r; v_r]
  transformer.layers.L.attention.dense.weight <- self_attn.o_proj            split dim 1 (row), bias replicated
  transformer.layers.L.post_layernorm.weight  <- post_attention_layernorm    replicated
  transformer.layers.L.mlp.fc.*               <- mlp.gate_proj (sic)         split dim 0 (column)
  transformer.layers.L.mlp.gate.*             <- mlp.up_proj (sic)           split dim 0 (column)
  transformer.layers.L.mlp.proj.weight        <- mlp.down_proj               split dim 1 (row), bias replicated
  transformer.ln_f.weight                     <- model.norm                  replicated, last pp stage only
  lm_head.weight                              <- lm_head (or embed_tokens if tied): vocab zero-padded to a
                                                 multiple of tp, split dim 0, last pp stage only

L is the layer index local to the pp stage; stages get contiguous layer ranges as
`torch.tensor_split(arange(num_layers), pp)` gives them (TRT-LLM's `Mapping.pp_layers`).
File rank{N} holds tp rank N % tp of pp stage N // tp.

Tied embeddings: `lm_head.weight` is always written on the last stage, as TRT-LLM's own Llama
converter does. TRT-LLM's loader only lets lm_head be absent when the same rank file also holds
`vocab_embedding` (pp=1), so writing it is the one choice that loads for every pp.
`tie_word_embeddings` is kept in config.json, and `merge_ranks` drops lm_head again for tied models.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch

from bpcompile.core.errors import UserError

# One-to-one tensors of a decoder layer: HF suffix -> TRT-LLM suffix. q/k/v fuse into attention.qkv.
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_layernorm.weight",
    "self_attn.o_proj.weight": "attention.dense.weight",
    "self_attn.o_proj.bias": "attention.dense.bias",
    "mlp.gate_proj.weight": "mlp.fc.weight",  # TRT-LLM's fc is HF's gate_proj ...
    "mlp.gate_proj.bias": "mlp.fc.bias",
    "mlp.up_proj.weight": "mlp.gate.weight",  # ... and its gate is HF's up_proj
    "mlp.up_proj.bias": "mlp.gate.bias",
    "mlp.down_proj.weight": "mlp.proj.weight",
    "mlp.down_proj.bias": "mlp.proj.bias",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "transformer.vocab_embedding.weight",
    "model.norm.weight": "transformer.ln_f.weight",
    "lm_head.weight": "lm_head.weight",
}
# How a TRT-LLM tensor is split over tp (by suffix); anything not listed is replicated.
SPLIT = {
    "attention.qkv.weight": "qkv",
    "attention.qkv.bias": "qkv",
    "attention.dense.weight": "row",
    "mlp.proj.weight": "row",
    "mlp.fc.weight": "col",
    "mlp.fc.bias": "col",
    "mlp.gate.weight": "col",
    "mlp.gate.bias": "col",
    "lm_head.weight": "col",
}
_LAYER_RE = re.compile(r"^transformer\.layers\.(\d+)\.(.+)$")


def hf_to_trtllm_name(hf_name: str) -> Optional[str]:
    """TRT-LLM name (global layer index) of a one-to-one HF tensor; None for q/k/v (fused) and unknowns."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf_name)
    if m and m[2] in LAYER_NAMES:
        return f"transformer.layers.{m[1]}.{LAYER_NAMES[m[2]]}"
    return None


def split_kind(trt_name: str) -> str:
    m = _LAYER_RE.match(trt_name)
    return SPLIT.get(m[2] if m else trt_name, "rep")


def pad_vocab_size(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def pp_layers(num_layers: int, pp: int, stage: int) -> range:
    """Global layer indices of a pp stage: contiguous, the first num_layers % pp stages get one more."""
    base, rem = divmod(num_layers, pp)
    start = stage * base + min(stage, rem)
    return range(start, start + base + (1 if stage < rem else 0))


def split_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int, tp: int) -> list[torch.Tensor]:
    """Per-rank [q_r; k_r; v_r] (weights [N, hidden] or biases [N]).

    With fewer KV heads than ranks, each KV head is first repeated tp/num_kv_heads times, the copies
    adjacent (TRT-LLM's dup_kv_weight), so every rank holds one KV head.
    """
    if tp > num_kv_heads:
        rep = tp // num_kv_heads
        k, v = (
            t.reshape(num_kv_heads, -1, *t.shape[1:]).repeat_interleave(rep, dim=0).reshape(-1, *t.shape[1:])
            for t in (k, v)
        )
    qs, ks, vs = (t.split(t.shape[0] // tp, dim=0) for t in (q, k, v))
    return [torch.cat([qs[r], ks[r], vs[r]], dim=0) for r in range(tp)]


def merge_qkv(pieces: list[torch.Tensor], num_heads: int, num_kv_heads: int, head_size: int) -> torch.Tensor:
    """Inverse of split_qkv: the full [q; k; v] with duplicated KV heads removed."""
    tp = len(pieces)
    hq = num_heads // tp * head_size
    hkv = max(num_kv_heads // tp, 1) * head_size
    qs, ks, vs = zip(*(p.split([hq, hkv, hkv], dim=0) for p in pieces))
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    if tp > num_kv_heads:
        rep = tp // num_kv_heads
        k, v = (t.reshape(tp, head_size, *t.shape[1:])[::rep].reshape(-1, *t.shape[1:]) for t in (k, v))
    return torch.cat([q, k, v], dim=0)


# ---------------------------------------------------------------------------------------------
# back: rank files -> full tensors


def read_trtllm_config(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise UserError("no config.json: expected a converted (TensorRT-LLM) checkpoint", file=str(ckpt_dir))
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"not valid JSON: {e}", file=str(path)) from None


def attention_shape(cfg: dict) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of a checkpoint config; KV heads default to the query heads (MHA) and
    the head size to hidden_size / heads, as TensorRT-LLM reads them."""
    heads = cfg["num_attention_heads"]
    return heads, cfg.get("num_key_value_heads") or heads, cfg.get("head_size") or cfg["hidden_size"] // heads


def merge_ranks(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of a converted checkpoint under TRT-LLM names with global layer indices.

    The exact inverse of the conversion: qkv re-fused as [q; k; v] with duplicated KV heads removed,
    vocab padding removed, lm_head absent when the embeddings are tied.
    """
    from safetensors import safe_open

    d = Path(ckpt_dir)
    cfg = read_trtllm_config(d)
    m = cfg.get("mapping", {})
    tp, pp = m.get("tp_size", 1), m.get("pp_size", 1)
    H, KV, D = attention_shape(cfg)
    out: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        layers = pp_layers(cfg["num_hidden_layers"], pp, stage)
        parts: list[dict[str, torch.Tensor]] = []
        for r in range(tp):
            path = d / f"rank{stage * tp + r}.safetensors"
            if not path.is_file():
                raise UserError(f"missing {path.name} (tp={tp}, pp={pp} need {tp * pp} rank files)", file=str(d))
            with safe_open(path, "pt") as f:
                parts.append({k: f.get_tensor(k) for k in f.keys()})
        for name in parts[0]:
            pieces = [p[name] for p in parts]
            mm = _LAYER_RE.match(name)
            if mm:
                if int(mm[1]) >= len(layers):
                    raise UserError(f"{name} in stage {stage}, which holds {len(layers)} layers", file=str(d))
                gname = f"transformer.layers.{layers[int(mm[1])]}.{mm[2]}"
            else:
                gname = name
            kind = split_kind(name)
            if kind == "qkv":
                t = merge_qkv(pieces, H, KV, D)
            elif kind == "col":
                t = torch.cat(pieces, dim=0)
            elif kind == "row":
                t = torch.cat(pieces, dim=1)
            else:
                t = pieces[0]
            if name == "lm_head.weight":
                t = t[: cfg["vocab_size"]].contiguous()
                if cfg.get("tie_word_embeddings"):
                    continue
            out[gname] = t
    return out


def load_rank(ckpt_dir: str | Path, rank: int, tp: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """One tensor-parallel rank's own tensors (TRT-LLM names, as the converter split them) and the checkpoint's
    config, for a runtime that runs at the checkpoint's tp with one process per rank (nothing merged)."""
    from safetensors import safe_open

    d = Path(ckpt_dir)
    cfg = read_trtllm_config(d)
    m = cfg.get("mapping", {})
    have_tp, pp = m.get("tp_size", 1), m.get("pp_size", 1)
    if pp != 1:
        raise UserError(
            f"the native runtime runs tensor parallelism only (this checkpoint has pp={pp}); "
            "run it at tp 1 (its ranks merged) or rebuild with parallel.pp: 1",
            file=str(d),
            key="pp",
        )
    if have_tp != tp:
        raise UserError(
            f"checkpoint converted for tp={have_tp}, asked to run at tp={tp}: run at tp {have_tp} "
            f"(or 1, merged), or rebuild with parallel.tp: {tp}",
            file=str(d),
            key="tp",
        )
    path = d / f"rank{rank}.safetensors"
    if not path.is_file():
        raise UserError(f"missing {path.name} (tp={tp} needs {tp} rank files)", file=str(d))
    with safe_open(path, "pt") as f:
        return cfg, {k: f.get_tensor(k) for k in f.keys()}
