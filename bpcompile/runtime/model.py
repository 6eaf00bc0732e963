"""A small, readable PyTorch Llama that runs a *converted* (TensorRT-LLM format) checkpoint.

It is the seed of the native runtime and the executable proof that conversion is right: tests
compare its logits with `transformers` on the original HF checkpoint.

Attention is a seam: `Llama.forward` computes q/k/v (RoPE applied) and hands them to an
`attend(layer, q, k, v)` callback. Without one it does plain causal attention over the tokens it
was given; the runtime passes a callback that appends k/v to its paged (possibly quantized) cache
and attends over committed context plus a speculation tree. Custom kernels slot in there.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from bpcompile.core.checkpoint import attention_shape, load_rank, merge_ranks
from bpcompile.kernels import cpu_rows

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
        heads, kv_heads, head_size = attention_shape(cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_size=head_size,
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

    def shard(self, tp: int) -> "ModelConfig":
        """One tensor-parallel rank's share, as the converter splits it: query heads and the MLP's intermediate
        size divided by tp, KV heads too (one, duplicated, when tp exceeds them). vocab_size stays the model's."""
        return replace(
            self,
            num_heads=self.num_heads // tp,
            num_kv_heads=max(self.num_kv_heads // tp, 1),
            intermediate_size=self.intermediate_size // tp,
        )


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
    """GPT-NeoX style rotation (rotate_half), as HF Llama and TRT-LLM's rope_gpt_neox do. x: [B,T,N,D].
    `sin` has its first half negated (Llama.rope's tables), so rotate_half(x) * sin is roll(x, D/2) * sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalize in float32, cast back, then scale. Computed as the layer norm of [x, -x], whose
    mean is 0 and variance mean(x^2), so it divides x by exactly the RMS (to float32 rounding): on CPU that is one
    fused kernel, where torch's rms_norm runs ~6 small ops (60 norms a SmolLM2 decode step: 0.7 ms of 32 at 2
    threads)."""
    xf = x.float()
    if torch.jit.is_tracing():  # ONNX export: the same arithmetic in ops every opset has
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    n = x.shape[-1]
    return w * F.layer_norm(torch.cat((xf, -xf), -1), (2 * n,), eps=eps)[..., :n].to(x.dtype)


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal GQA attention over the given tokens. q: [B,T,H,D], k/v: [B,T,KV,D]."""
    rep = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return out.transpose(1, 2)


class Linear(torch.nn.Module):
    """y = x W^T + b with W kept transposed ([in, out], contiguous) as a buffer: on CPU a one-token x @ W^T
    is a faster GEMV than F.linear over W [out, in] (an earlier profile found up to 1.4x for a large LM head).
    Inference only; moved by `.to()` like any module state."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.register_buffer("wt", weight.t().contiguous())
        self.register_buffer("bias", bias)

    @property
    def weight(self) -> torch.Tensor:
        return self.wt.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.wt
        return y if self.bias is None else y + self.bias


class PackedLinear(torch.nn.Module):
    """A `Linear` whose weight oneDNN has reordered into its blocked layout (CPU), multiplied by oneDNN's own
    kernel. Why: a tree verify multiplies 2-12 rows at a time, and for those PyTorch's BLAS path over a plain
    layout was slow (on an AMD EPYC VM at 2 threads: the 576 x 3072 MLP matrix 1.1 ms for 6 rows against 0.17 ms
    for one; the 49152-row head 29 ms against 6 ms; packed 0.24 ms and 9 ms; on an Intel Xeon with AMX all of
    SmolLM2's matrices, as a decode step streams them, 28 ms packed against 39 ms plain for 6 rows).

    keep_plain (float32): also keep the plain layout and multiply a single row with it, as `Linear` does: for one
    row the packed kernel was slower on the Intel Xeon (37 ms against 27 ms for a SmolLM2 forward), no faster on
    the AMD EPYC. It costs a second copy of the weight. The packed tensor is opaque: `weight` returns a dense copy,
    so editing it does not edit the model.

    dtype bfloat16 stores the weight in bfloat16 and multiplies bfloat16-rounded inputs, returning float32 (the
    bias is added in float32): half the bytes to read, for a draft, whose rounding changes only what it proposes."""

    def __init__(self, lin: Linear, dtype: torch.dtype = torch.float32, keep_plain: bool = False):
        super().__init__()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(lin.weight.to(dtype).contiguous(), None))
        self.register_buffer("bias", lin.bias)
        self.register_buffer("wt", lin.wt if keep_plain and dtype == torch.float32 else None)
        self.low = dtype != torch.float32

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wt is not None and x.numel() == x.shape[-1]:  # one row: the plain product
            y = x @ self.wt
            return y if self.bias is None else y + self.bias
        if not self.low:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(
            x.to(self.packed.dtype).contiguous(), self.packed, None, "none", [], ""
        ).to(x.dtype)
        return y if self.bias is None else y + self.bias


class RowsLinear(torch.nn.Module):
    """A float32 `Linear` on CPU with its weight in the plain [out, in] layout, multiplied by bpcompile's kernel
    for a few rows (`kernels/cpu_rows.c`: up to 16, a tree verify or a batch of them) and by PyTorch beyond (a
    prompt). On an Intel Xeon with AMX at 2 threads, all of SmolLM2's matrices as a decode step streams them:
    24.8 ms for six rows (oneDNN packed 32.8, PyTorch plain 41.8), 30.3 for twelve (43.0 / 62.7), 20.0 for one
    (PyTorch's GEMV over the transposed layout 19.4). A row's result does not depend on how many rows (up to 16)
    are multiplied with it.

    keep_plain: also keep the transposed copy `wt` that `Linear` multiplies one row with (PyTorch's GEMV, the
    ~3% faster single row above), at the cost of a second copy of the weight."""

    def __init__(self, lin: Linear, keep_plain: bool = False):
        super().__init__()
        self.register_buffer("w", lin.weight.contiguous())
        self.register_buffer("wt", lin.wt if keep_plain else None)
        self.register_buffer("bias", lin.bias)

    @property
    def weight(self) -> torch.Tensor:
        return self.w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows == 1 and self.wt is not None:
            y = x @ self.wt
        elif 0 < rows <= cpu_rows.MAX_ROWS and not torch.jit.is_tracing():
            y = cpu_rows.rows_matmul(x.reshape(rows, x.shape[-1]).contiguous(), self.w).view(*x.shape[:-1], -1)
        else:
            y = F.linear(x, self.w)
        return y if self.bias is None else y + self.bias


CPU_LAYOUTS = ("auto", "both", "rows", "packed", "plain")


@functools.cache
def cpu_packing_works(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build has oneDNN's packed linear for weights of `dtype` and it agrees with a plain
    product (a CPU build without oneDNN, or another CPU architecture, keeps plain weights)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 16, generator=g), torch.randn(3, 16, generator=g)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return torch.allclose(PackedLinear(Linear(w), dtype)(x), x @ w.t(), rtol=tol, atol=tol)
    except (RuntimeError, AttributeError):
        return False


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): elsewhere oneDNN emulates it, slower
    than float32. Read from /proc/cpuinfo (Linux); False where that is absent."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


class RowParallel(torch.nn.Module):
    """A linear whose input features are split over the ranks of `group`: each rank multiplies its slice, the
    partial products are summed over the ranks (one all-reduce), the bias is added once, after."""

    def __init__(self, lin: Linear, group):
        super().__init__()
        self.register_buffer("bias", lin.bias)  # added once, after the sum: the slice's product has none
        lin.bias = None
        self.mm = lin
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        return self.mm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mm(x)
        self.group.allreduce([y]).wait()
        return y if self.bias is None else y + self.bias


class VocabParallelHead(torch.nn.Module):
    """The output head split over the vocabulary (rows zero-padded to a multiple of tp): each rank computes its
    slice of the logits, one all-gather puts them side by side."""

    def __init__(self, lin: Linear, group, tp: int):
        super().__init__()
        self.mm = lin
        self.group, self.tp = group, tp

    @property
    def weight(self) -> torch.Tensor:
        return self.mm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mm(x).contiguous()
        parts = [torch.empty_like(y) for _ in range(self.tp)]
        self.group.allgather([parts], [y]).wait()
        return torch.cat(parts, dim=-1)


class Block(torch.nn.Module):
    """One decoder layer. gate and up projections are fused into one matrix at load time (one GEMM)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], p: str):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("attn_norm", w[p + "input_layernorm.weight"])
        self.register_buffer("mlp_norm", w[p + "post_layernorm.weight"])
        self.qkv = Linear(w[p + "attention.qkv.weight"], w.get(p + "attention.qkv.bias"))
        self.o = Linear(w[p + "attention.dense.weight"], w.get(p + "attention.dense.bias"))
        # TRT-LLM naming: mlp.fc = HF gate_proj, mlp.gate = HF up_proj
        fc_b, up_b = w.get(p + "mlp.fc.bias"), w.get(p + "mlp.gate.bias")
        self.gate_up = Linear(
            torch.cat((w[p + "mlp.fc.weight"], w[p + "mlp.gate.weight"])),
            torch.cat((fc_b, up_b)) if fc_b is not None else None,
        )
        self.down = Linear(w[p + "mlp.proj.weight"], w.get(p + "mlp.proj.bias"))

    def weights(self, p: str) -> dict[str, torch.Tensor]:
        """This layer's tensors under TensorRT-LLM names (gate/up as views of the fused matrix)."""
        inter = self.cfg.intermediate_size
        out = {p + "input_layernorm.weight": self.attn_norm, p + "post_layernorm.weight": self.mlp_norm}
        for name, lin in (("attention.qkv", self.qkv), ("attention.dense", self.o), ("mlp.proj", self.down)):
            out[p + name + ".weight"] = lin.weight
            if lin.bias is not None:
                out[p + name + ".bias"] = lin.bias
        for name, part in (("mlp.fc", slice(0, inter)), ("mlp.gate", slice(inter, 2 * inter))):
            out[p + name + ".weight"] = self.gate_up.weight[part]
            if self.gate_up.bias is not None:
                out[p + name + ".bias"] = self.gate_up.bias[part]
        return out

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, attend: Optional[AttendFn]
    ) -> torch.Tensor:
        c = self.cfg
        B, T, _ = h.shape
        H, KV, D = c.num_heads, c.num_kv_heads, c.head_size
        qkv = self.qkv(rms_norm(h, self.attn_norm, c.norm_eps))
        qk = apply_rope(qkv[..., : (H + KV) * D].view(B, T, H + KV, D), cos, sin)  # q and k heads in one go
        q, k = qk[:, :, :H], qk[:, :, H:]
        v = qkv[..., (H + KV) * D :].view(B, T, KV, D)
        o = attend(layer, q, k, v) if attend is not None else causal_attend(q, k, v)
        h = h + self.o(o.reshape(B, T, H * D))
        gate, up = self.gate_up(rms_norm(h, self.mlp_norm, c.norm_eps)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


def cpu_layout(model: torch.nn.Module) -> str:
    """How `model`'s linears are laid out (pack_for_cpu), read from its head: both / rows (the few-row kernel),
    both-packed / packed (oneDNN), plain; another head type (a tensor-parallel one) by its class name."""
    head = getattr(model, "head", None)
    kind = type(head).__name__
    if kind == "RowsLinear":
        return "both" if head.wt is not None else "rows"
    if kind == "PackedLinear":
        return "both-packed" if head.wt is not None else "packed"
    return "plain" if kind == "Linear" else kind


def _swap_linears(module: torch.nn.Module, make: Callable[[Linear], torch.nn.Module]) -> list[torch.nn.Module]:
    """Replace every plain linear of `module` with make(linear); returns the new modules in forward order."""
    new = set()
    for mod in list(module.modules()):
        for name, child in list(mod.named_children()):
            if type(child) is Linear:
                setattr(mod, name, make(child))
                new.add(id(getattr(mod, name)))
    return [m for m in module.modules() if id(m) in new]


def _one_buffer(lins: list, attr: str) -> None:
    """Move the plain weights (`attr`) of `lins`, in the order a forward reads them, into one buffer, each start
    4 KiB aligned. Why: a one-token decode step streams every weight once, and read as one run the CPU's
    prefetchers cross from one matrix to the next (a SmolLM2 decode step 2.5% faster on an Intel Xeon at 2
    threads)."""
    if not lins:
        return
    t = getattr(lins[0], attr)
    align = 4096 // t.element_size()
    sizes = [-(-getattr(lin, attr).numel() // align) * align for lin in lins]
    flat = torch.empty(sum(sizes) + align, dtype=t.dtype, device=t.device)
    off = (-flat.data_ptr() // t.element_size()) % align
    for lin, n in zip(lins, sizes):
        w = getattr(lin, attr)
        setattr(lin, attr, flat[off : off + w.numel()].view(w.shape).copy_(w))
        off += n


def _to_cpu_layout(module: torch.nn.Module, layout: str, dtype: torch.dtype = torch.float32) -> list:
    """Swap `module`'s plain linears for the CPU `layout` (CPU_LAYOUTS): rows and both use the few-row kernel
    (`RowsLinear`) where it is available and oneDNN's packed kernel (`PackedLinear`) where not (rows then keeps
    the plain copy as both does), packed layouts fall back to plain where oneDNN's packed kernel is missing.
    Returns the new modules (none where nothing changed), each kind of their plain weights in one buffer."""
    if layout not in CPU_LAYOUTS:
        raise ValueError(f"CPU weight layout {layout!r}: one of {', '.join(CPU_LAYOUTS)}")
    if layout == "auto":  # one copy of the weights (docs/CPU.md: the second costs their size, for ~3% at best)
        layout = "rows" if dtype == torch.float32 and cpu_rows.available() else "plain"
    if layout in ("rows", "both") and dtype == torch.float32 and cpu_rows.available():
        lins = _swap_linears(module, lambda lin: RowsLinear(lin, keep_plain=layout == "both"))
        _one_buffer(lins, "w")
        if layout == "both":
            _one_buffer(lins, "wt")
    else:
        layout = "both" if layout == "rows" else layout
        if layout == "plain" or not cpu_packing_works(dtype):
            return []
        lins = _swap_linears(module, lambda lin: PackedLinear(lin, dtype, keep_plain=layout == "both"))
        _one_buffer([m for m in lins if m.wt is not None], "wt")
    return lins


class Llama(torch.nn.Module):
    """A module tree (embedding, decoder blocks, final norm, head) built from full (unsharded) weights under
    TensorRT-LLM tensor names. `w` gives them back under those names."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        *,
        consume: bool = False,
    ):
        """consume: `weights` was read for this model alone: it is emptied, and each layer's source tensors are
        released once its modules have their own (transposed, fused) copies, so loading peaks at about one copy
        of the weights rather than two (a 1.5B float32 verifier: 7 GB, not 14)."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        w = {k: v.to(dtype) for k, v in weights.items()}
        given = {t.data_ptr() for t in w.values()}
        if consume:
            weights.clear()
        layers = []
        for i in range(cfg.num_layers):
            p = f"transformer.layers.{i}."
            layers.append(Block(cfg, w, p))
            if consume:
                for k in [k for k in w if k.startswith(p)]:
                    del w[k]
        self.layers = torch.nn.ModuleList(layers)
        self.register_buffer("norm", w["transformer.ln_f.weight"])
        # lm_head may be vocab-padded for tp; logits beyond vocab_size are dropped. Tied embeddings are one
        # matrix: the head holds it, the embedding is a view of it.
        emb = w["transformer.vocab_embedding.weight"]
        self.tied = "lm_head.weight" not in w
        self.head = Linear(emb if self.tied else w["lm_head.weight"])
        self.register_buffer("embedding", None if self.tied else emb)
        if consume:
            # The tensors kept as given (norms, biases, an untied embedding) may be views of the checkpoint file's
            # memory map (safetensors maps it), and one view keeps the whole file mapped: its pages stay resident
            # beside the model's own copies (a 1.5B float32 verifier: 7 GB more). Own copies release the map.
            for mod in self.modules():
                for name, b in mod.named_buffers(recurse=False):
                    if b is not None and b.data_ptr() in given:
                        setattr(mod, name, b.clone())
        self._rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # cos, sin tables [n, D] (sin sign-folded)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, dtype: Optional[torch.dtype] = torch.float32) -> "Llama":
        """Load a converted TRT-LLM checkpoint (any tp/pp split): merge its rank files back into full tensors.
        dtype None: the checkpoint's own dtype (its config's `dtype`)."""
        ckpt_dir = Path(ckpt_dir)
        cfg = ModelConfig.from_trtllm(json.loads((ckpt_dir / "config.json").read_text()))
        if dtype is None:
            dtype = getattr(torch, cfg.dtype)
        return cls(cfg, merge_ranks(ckpt_dir), dtype, consume=True)

    @classmethod
    def from_rank(
        cls, ckpt_dir: str | Path, rank: int, tp: int, group, dtype: Optional[torch.dtype] = torch.float32
    ) -> "Llama":
        """Tensor-parallel rank `rank` of a checkpoint converted for tp: only its own rank file is read; the
        row-split linears sum their partial products over `group` (a torch.distributed process group) and the
        vocab-split head gathers its logits, so every rank's forward returns the whole model's logits."""
        raw, w = load_rank(ckpt_dir, rank, tp)
        full = ModelConfig.from_trtllm(raw)
        model = cls(full.shard(tp), w, getattr(torch, full.dtype) if dtype is None else dtype, consume=True)
        for blk in model.layers:
            blk.o, blk.down = RowParallel(blk.o, group), RowParallel(blk.down, group)
        model.head = VocabParallelHead(model.head, group, tp)
        return model

    def _apply(self, fn, *args, **kwargs):  # a dtype/device move invalidates the rotary tables
        self._rope = None
        out = super()._apply(fn, *args, **kwargs)
        self.dtype = self.norm.dtype
        return out

    def pack_for_cpu(self, layout: str = "auto") -> bool:
        """Lay the linears (the head included) out for a float32 model on CPU; same results to float32 rounding.
        layout (CPU_LAYOUTS): auto = one copy of the weights: rows where the few-row kernel builds, else plain;
        both = the plain layout for single rows (a decode step without a tree) plus a copy for
        products of several rows (a tree verify, a prompt): bpcompile's few-row kernel's (`RowsLinear`) where it
        builds, else oneDNN-packed (`PackedLinear`, which says why); rows = one copy, the few-row kernel for single
        rows too (both where it cannot be built); packed = oneDNN-packed only; plain = unchanged. True
        when it changed the model (False for another dtype or device, or where no kernel is there); a
        tensor-parallel rank lays out its own slices. After it the model stays on CPU; a tied embedding reads
        the head's plain weight, or without one (packed) keeps its own dense copy (the packed weight is opaque):
        one more vocab x hidden matrix."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return False
        dense = self.head.weight.contiguous() if self.embedding is None and layout == "packed" else None
        lins = _to_cpu_layout(self, layout)
        if self.tied and type(self.head) is RowsLinear:
            self.embedding = self.head.w
        elif self.tied and type(self.head) is PackedLinear:
            # packed keeps no plain copy: the embedding then reads a dense copy of the packed weight
            self.embedding = (
                self.head.wt.t() if self.head.wt is not None else dense if dense is not None else self.head.weight
            )
        return bool(lins)

    @property
    def w(self) -> dict[str, torch.Tensor]:
        """All weights under TensorRT-LLM names (views: modifying them modifies the model; packed linears give
        copies)."""
        out = {
            "transformer.vocab_embedding.weight": self.embed,
            "transformer.ln_f.weight": self.norm,
            "lm_head.weight": self.lm_head,
        }
        for i, blk in enumerate(self.layers):
            out.update(blk.weights(f"transformer.layers.{i}."))
        return out

    @property
    def lm_head(self) -> torch.Tensor:
        return self.head.weight

    @property
    def embed(self) -> torch.Tensor:
        return self.head.weight if self.embedding is None else self.embedding

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [B,T] -> each [B,T,1,D], looked up in tables computed once (as HF computes them:
        float32 position * inv_freq, cos/sin, cast to the compute dtype). sin's first half is negated so that
        apply_rope needs no negation."""
        need = self.cfg.max_position_embeddings
        if positions.device.type == "cpu" and positions.numel():
            need = max(need, int(positions.max()) + 1)  # a cheap host read: positions past the config still work
        cos, sin = self.rope_tables(need)
        return cos[positions][:, :, None], sin[positions][:, :, None]

    def rope_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables [>= n, D] (sin sign-folded), grown when a longer one is needed."""
        if self._rope is None or self._rope[0].shape[0] < n:
            pos = torch.arange(n, device=self.device, dtype=torch.float32)
            freqs = pos[:, None] * rope_inv_freq(self.cfg).to(self.device)
            half = freqs.shape[-1]
            emb = torch.cat((freqs, freqs), dim=-1)
            sign = torch.cat((-torch.ones(half, device=pos.device), torch.ones(half, device=pos.device)))
            self._rope = (emb.cos().to(self.dtype), (emb.sin() * sign).to(self.dtype))
        return self._rope

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        attend: Optional[AttendFn] = None,
        last_only: bool = False,
        return_hidden: bool = False,
    ):
        """tokens, positions: [B,T] int64 -> logits [B,T,vocab] (float32); with return_hidden also the final
        hidden states [B,T,hidden] (after the final norm, every position even when last_only): the features a
        FeatureDraft reads."""
        c = self.cfg
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        cos, sin = self.rope(positions)
        h = F.embedding(tokens, self.embed)
        for i, blk in enumerate(self.layers):
            h = blk(h, cos, sin, i, attend)
        hn = rms_norm(h if return_hidden or not last_only else h[:, -1:], self.norm, c.norm_eps)
        logits = self.head(hn[:, -1:] if last_only else hn)[..., : c.vocab_size].float()
        return (logits, hn) if return_hidden else logits


def is_feature_draft(d: str | Path) -> bool:
    """d/config.json names the FeatureDraft architecture (an unreadable or non-object config is not one)."""
    try:
        raw = json.loads((Path(d) / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and raw.get("architecture") == "FeatureDraft"


class FeatureDraft(torch.nn.Module):
    """A draft that reads the verifier's features (the EAGLE idea): the row of token x_i at position i gets
    fc([embedding(x_i), f_{i-1}]), where f_{i-1} is the verifier's final hidden state (after its norm) at
    position i-1, through a few decoder layers; the output predicts f_i, and the verifier's own head turns it
    into logits for x_{i+1}. Deeper tree nodes read the draft's own predicted feature of their parent. It
    shares the verifier's embedding, head and rotary tables (kept as a plain reference, not a submodule: moving
    or packing the verifier covers them), so it costs a few layers plus the verifier's head per row.

    On disk (`tools/train_smollm2_feature_draft.py` writes it): `config.json` ({"architecture":
    "FeatureDraft", "num_layers", "intermediate_size"}; the rest is the verifier's) and `model.safetensors`
    (`fc.weight` [hidden, 2*hidden], `fc.bias`, `transformer.layers.{i}.*` under TensorRT-LLM names, and
    optionally `vocab_subset` [N] int64: the token ids it may propose).

    With a vocab_subset its logits are over those ids only ([..., N], column j scores token `proposable[j]`):
    spreading them over the full vocabulary would cost more than the layer's own arithmetic per draft round
    (a 49152-wide fill, scatter, softmax and top-k)."""

    reads_features = True

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor], verifier: Llama, dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        w = {k: v.to(dtype) for k, v in weights.items()}
        self.fc = Linear(w["fc.weight"], w.get("fc.bias"))
        self.layers = torch.nn.ModuleList(Block(cfg, w, f"transformer.layers.{i}.") for i in range(cfg.num_layers))
        object.__setattr__(self, "verifier", verifier)
        # vocab_subset: the draft proposes only these token ids (the verifier's head rows for them, copied): a
        # 49152-wide head would cost more than the layer; the verifier still checks every token exactly
        ids = weights.get("vocab_subset")
        if ids is not None:
            ids = ids.to(torch.int64)
            if (
                ids.dim() != 1
                or not len(ids)
                or int(ids.min()) < 0
                or int(ids.max()) >= cfg.vocab_size
                or len(ids.unique()) != len(ids)
            ):
                raise ValueError(f"vocab_subset must be distinct token ids in [0, {cfg.vocab_size})")
            self.register_buffer("vocab_subset", ids)
            self.sub_head = Linear(verifier.lm_head[: cfg.vocab_size][ids].to(dtype))
        else:
            self.vocab_subset = self.sub_head = None

    @property
    def proposable(self) -> Optional[torch.Tensor]:
        """The token id of each logits column, or None: the columns are the whole vocabulary."""
        return self.vocab_subset

    @classmethod
    def from_dir(cls, path: str | Path, verifier: Llama) -> "FeatureDraft":
        from safetensors.torch import load_file  # the library's own header and offset checks

        p = Path(path)
        meta = json.loads((p / "config.json").read_text())
        if meta.get("architecture") != "FeatureDraft":
            raise ValueError(f"{p / 'config.json'}: architecture {meta.get('architecture')!r}, expected FeatureDraft")
        cfg = replace(
            verifier.cfg, num_layers=int(meta["num_layers"]), intermediate_size=int(meta["intermediate_size"])
        )
        return cls(cfg, load_file(p / "model.safetensors"), verifier, verifier.dtype)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.dtype = self.layers[0].attn_norm.dtype  # a buffer packing leaves alone (as Llama reads its norm)
        return out

    @property
    def device(self) -> torch.device:
        return self.layers[0].attn_norm.device

    def pack_for_cpu(self, layout: str = "auto", bf16: Optional[bool] = None) -> bool:
        """As Llama.pack_for_cpu, for the draft's own linears (the head is the verifier's). bf16 (default: where
        the CPU multiplies bfloat16 natively) packs them in bfloat16 whatever the layout: a draft round reads half
        the bytes (on SmolLM2 at 2 threads its forwards took 4.5 -> 4.0 ms a step, tau unchanged); the draft only
        proposes, so the output stays the verifier's."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return False
        if bf16 is None:
            bf16 = cpu_has_bf16_dot()
        if bf16 and layout != "plain" and cpu_packing_works(torch.bfloat16):
            return bool(_to_cpu_layout(self, "packed", torch.bfloat16))
        return bool(_to_cpu_layout(self, layout))

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        attend: Optional[AttendFn] = None,
        last_only: bool = False,
        feats: Optional[torch.Tensor] = None,
        rows: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions [B,T], feats [B,T,hidden] (the feature before each token) -> (logits float32
        [B,T,vocab], or [B,T,N] over `proposable`; predicted features [B,T,hidden])."""
        v = self.verifier
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        cos, sin = v.rope(positions)
        h = self.fc(torch.cat((F.embedding(tokens, v.embed), feats.to(self.dtype)), -1))
        for i, blk in enumerate(self.layers):
            h = blk(h, cos, sin, i, attend)
        x = h[:, -1:] if last_only else h
        if rows is not None:  # only these rows' logits: [B] row index per sequence -> logits [B, 1, V]
            x = h[torch.arange(B, device=h.device), rows][:, None]
        if self.sub_head is None:
            return v.head(x)[..., : self.cfg.vocab_size].float(), h
        return self.sub_head(x).float(), h
