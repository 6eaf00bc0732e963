"""A small, readable PyTorch Llama that runs a *converted* (TensorRT-LLM format) checkpoint.

It is the seed of the native runtime and the executable proof that conversion is right: tests
compare its logits with `transformers` on the original HF checkpoint.

Attention is a seam: `Llama.forward` computes q/k/v (RoPE applied) and hands them to an
`attend(layer, q, k, v)` callback. Without one it does plain causal attention over the tokens it
was given; the runtime passes a callback that appends k/v to its paged (possibly quantized) cache
and attends over committed context plus a speculation tree. Custom kernels slot in there.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# attend(layer, q[B,T,H,D], k[B,T,KV,D], v[B,T,KV,D]) -> out[B,T,H,D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attn_bias: bool = False
    mlp_bias: bool = False
    dtype: str = "float32"

    @classmethod
    def from_trtllm(cls, cfg: dict) -> "ModelConfig":
        """From a TensorRT-LLM checkpoint config.json (the `config.json` next to its rank{N}.safetensors files)."""
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_size=cfg.get("head_size") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("norm_epsilon", 1e-5),
            rope_theta=cfg.get("rotary_base", 10000.0),
            rope_scaling=cfg.get("rotary_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings") or 2048,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_bias=bool(cfg.get("attn_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            dtype=cfg.get("dtype", "float32"),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies for rotary embeddings, with Llama-3 ("llama3") scaling as HF computes it."""
    d = cfg.head_size
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "llama3":
        factor = sc["factor"]
        lo, hi = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old_ctx = sc["original_max_position_embeddings"]
        low_wl, high_wl = old_ctx / lo, old_ctx / hi
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (old_ctx / wl - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wl >= high_wl) & (wl <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv = inv / sc["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv.to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX style rotation (rotate_half), as HF Llama and TRT-LLM's rope_gpt_neox do. x: [B,T,N,D]."""
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return x * cos + rot * sin


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal GQA attention over the given tokens. q: [B,T,H,D], k/v: [B,T,KV,D]."""
    rep = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return out.transpose(1, 2)


class Llama(torch.nn.Module):
    """Holds full (unsharded) weights under TensorRT-LLM tensor names."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.w = {k: v.to(dtype) for k, v in weights.items()}
        if "lm_head.weight" not in self.w:  # tied embeddings
            self.w["lm_head.weight"] = self.w["transformer.vocab_embedding.weight"]
        # lm_head may be vocab-padded for tp; logits beyond vocab_size are dropped.
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, dtype: torch.dtype = torch.float32) -> "Llama":
        """Load a converted TRT-LLM checkpoint (any tp/pp split): merge its rank files back into full tensors."""
        from .convert import merge_ranks

        ckpt_dir = Path(ckpt_dir)
        cfg = ModelConfig.from_trtllm(json.loads((ckpt_dir / "config.json").read_text()))
        return cls(cfg, merge_ranks(ckpt_dir), dtype)

    def to(self, *args, **kwargs):  # move the weight dict too
        super().to(*args, **kwargs)
        self.w = {k: v.to(*args, **kwargs) for k, v in self.w.items()}
        return self

    @property
    def device(self) -> torch.device:
        return self.w["transformer.vocab_embedding.weight"].device

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [B,T] -> each [B,T,1,D]."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                attend: Optional[AttendFn] = None, last_only: bool = False) -> torch.Tensor:
        """tokens, positions: [B,T] int64 -> logits [B,T,vocab] (float32)."""
        c = self.cfg
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        cos, sin = self.rope(positions)
        h = F.embedding(tokens, self.w["transformer.vocab_embedding.weight"])
        nq, nkv, d = c.num_heads * c.head_size, c.num_kv_heads * c.head_size, c.head_size
        for i in range(c.num_layers):
            p = f"transformer.layers.{i}."
            x = rms_norm(h, self.w[p + "input_layernorm.weight"], c.norm_eps)
            qkv = self.linear(x, p + "attention.qkv")
            q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
            q = apply_rope(q.view(B, T, c.num_heads, d), cos, sin)
            k = apply_rope(k.view(B, T, c.num_kv_heads, d), cos, sin)
            v = v.view(B, T, c.num_kv_heads, d)
            o = attend(i, q, k, v) if attend is not None else causal_attend(q, k, v)
            h = h + self.linear(o.reshape(B, T, nq), p + "attention.dense")
            x = rms_norm(h, self.w[p + "post_layernorm.weight"], c.norm_eps)
            # TRT-LLM naming: mlp.fc = HF gate_proj, mlp.gate = HF up_proj
            h = h + self.linear(F.silu(self.linear(x, p + "mlp.fc")) * self.linear(x, p + "mlp.gate"), p + "mlp.proj")
        if last_only:
            h = h[:, -1:]
        h = rms_norm(h, self.w["transformer.ln_f.weight"], c.norm_eps)
        logits = F.linear(h, self.w["lm_head.weight"])
        return logits[..., : c.vocab_size].float()
