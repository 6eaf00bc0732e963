"""HF checkpoint -> TensorRT-LLM 1.2 checkpoint (`config.json` + `rank{N}.safetensors`), and back.

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

Conversion streams, and each rank file is written incrementally. The safetensors library can only
save a complete dict of tensors, so the format is written here directly: 8-byte little-endian
header length, a JSON header {name: {dtype, shape, data_offsets}} and then the raw bytes. Every rank
file's header is computed up front from the source shapes alone; the data is then written in
header order while walking the sources once. Most output tensors are runs of whole rows of a
source tensor (replicated, dim-0 splits, the per-rank q/k/v blocks, KV-head copies, lm_head and its
zero padding); without a dtype cast those bytes are copied file to file (copy_file_range, else
pread/write in 16 MiB pieces) and never held in memory. The rest (dim-1 splits of attention.dense
and mlp.proj at tp > 1, and any dtype cast) go through memory one source tensor at a time. Peak
memory is a small multiple of the largest tensor, not the model.
"""
from __future__ import annotations

import json
import os
import re
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .errors import UserError
from .hf import DTYPE_NAMES, ST_ITEMSIZE, TORCH_TO_ST, TensorReader, check_weights, list_weights, read_hf_config, weight_files

ProgressFn = Callable[[int, int], None]  # (bytes written so far, total bytes)

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
    "attention.qkv.weight": "qkv", "attention.qkv.bias": "qkv",
    "attention.dense.weight": "row", "mlp.proj.weight": "row",
    "mlp.fc.weight": "col", "mlp.fc.bias": "col", "mlp.gate.weight": "col", "mlp.gate.bias": "col",
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


# ---------------------------------------------------------------------------------------------
# fused qkv under tp


def split_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int, tp: int) -> list[torch.Tensor]:
    """Per-rank [q_r; k_r; v_r] (weights [N, hidden] or biases [N]).

    With fewer KV heads than ranks, each KV head is first repeated tp/num_kv_heads times, the copies
    adjacent (TRT-LLM's dup_kv_weight), so every rank holds one KV head.
    """
    if tp > num_kv_heads:
        rep = tp // num_kv_heads
        k, v = (t.reshape(num_kv_heads, -1, *t.shape[1:]).repeat_interleave(rep, dim=0).reshape(-1, *t.shape[1:])
                for t in (k, v))
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
# config


def check_parallel(heads: int, kv: int, intermediate: int, layers: int, tp: int, pp: int, where: str) -> None:
    for key, val in (("parallel.tp", tp), ("parallel.pp", pp)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise UserError(f"{key} must be a positive integer, got {val!r}", key=key)
    if heads % tp:
        raise UserError(f"parallel.tp = {tp} does not divide num_attention_heads = {heads} of {where}",
                        key="parallel.tp")
    if (tp > kv and tp % kv) or (tp <= kv and kv % tp):
        raise UserError(f"parallel.tp = {tp} and num_key_value_heads = {kv} of {where}: tp must divide the KV heads "
                        "or be a multiple of them (KV heads are then duplicated)", key="parallel.tp")
    if intermediate % tp:
        raise UserError(f"parallel.tp = {tp} does not divide intermediate_size = {intermediate} of {where}",
                        key="parallel.tp")
    if pp > layers:
        raise UserError(f"parallel.pp = {pp} is more than the {layers} layers of {where}", key="parallel.pp")


def trtllm_config(spec: dict, tp: int, pp: int, dtype: str) -> dict:
    """TRT-LLM 1.2 `config.json` for a Llama-family model (PretrainedConfig + LLaMAConfig fields, §1.2)."""
    heads = spec["num_attention_heads"]
    cfg = {
        "architecture": spec["architecture"],
        "dtype": dtype,
        "vocab_size": spec["vocab_size"],
        "hidden_size": spec["hidden_size"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_attention_heads": heads,
        "hidden_act": spec["hidden_act"],
        "logits_dtype": "float32",
        "norm_epsilon": spec["rms_norm_eps"],
        "runtime_defaults": None,
        "position_embedding_type": "rope_gpt_neox",
        "num_key_value_heads": spec["num_key_value_heads"],  # the model's, not the duplicated per-rank count
        "intermediate_size": spec["intermediate_size"],
        "max_position_embeddings": spec["max_position_embeddings"],
        # Only keys every Mapping.__init__ of the 1.x line accepts (it is called as Mapping(**mapping)):
        # `auto_parallel` is in older to_dict output but was dropped from the constructor later.
        "mapping": {
            "world_size": tp * pp, "gpus_per_node": 8, "cp_size": 1, "tp_size": tp, "pp_size": pp,
            "moe_tp_size": tp, "moe_cluster_size": 1, "moe_ep_size": 1, "attn_tp_size": tp, "attn_cp_size": 1,
            "cp_config": {},
        },
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "head_size": spec["head_dim"],
        "qk_layernorm": False,
        "rotary_embedding_dim": spec["head_dim"],
        # LLaMAConfig. `moe` is left out on purpose: LLaMAConfig builds its no-expert default when the key is
        # absent, and MoeConfig's field set differs between releases.
        "mlp_bias": spec["mlp_bias"],
        "attn_bias": spec["qkv_bias"],
        "rotary_base": spec["rope_theta"],
        "rotary_scaling": spec["rope_scaling"],
        "residual_mlp": False,
        "disable_weight_only_quant_plugin": False,
        "remove_duplicated_kv_heads": False,
        "fc_after_embed": False,
        "use_input_layernorm_in_first_layer": True,
        "use_last_layernorm": True,
        "layer_idx_offset": 0,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "output_multiplier_scale": 1.0,
        "tie_word_embeddings": spec["tie_word_embeddings"],
    }
    if spec["architecture"] == "Qwen2ForCausalLM":
        cfg["qwen_type"] = "qwen2"  # TRT-LLM's QWenConfig; qkv bias only (attn_bias), no dense bias
    return cfg


# ---------------------------------------------------------------------------------------------
# conversion plan: which source tensors make which rank-file tensors


# A piece of an output tensor that is a run of whole rows (dim 0) of one source tensor, or zero rows
# (vocab padding): (source name or None, first row, end row). Most outputs are such runs; for them the
# bytes are copied file to file without passing through Python (see RankWriter.copy).
Segment = tuple[Optional[str], int, int]


@dataclass
class Job:
    sources: list[str]                              # HF tensor names read for this job
    outputs: list[tuple[int, str, tuple[int, ...]]]  # (rank, TRT-LLM name, shape), aligned with fn's result
    fn: Callable[..., list[torch.Tensor]]           # source tensors -> output tensors (the general path)
    segments: Optional[list[list[Segment]]] = None  # per output, when it is plain runs of source rows


def plan(spec: dict, tp: int, pp: int) -> list[Job]:
    """Every output tensor of every rank file, in writing order, with its source and transformation."""
    H, KV, D = spec["num_attention_heads"], spec["num_key_value_heads"], spec["head_dim"]
    hid, inter, V = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
    kv_rank = max(KV // tp, 1)
    qkv_rows = (H // tp + 2 * kv_rank) * D
    jobs: list[Job] = []

    def add(srcs, name, stage, shape, fn, segs=None):
        outs = [(stage * tp + r, name, shape) for r in range(tp)]
        jobs.append(Job(srcs, outs, fn, [segs(r) for r in range(tp)] if segs else None))

    def rep(src, name, stage, rows, shape):
        add([src], name, stage, shape, lambda t: [t] * tp, lambda r: [(src, 0, rows)])

    def col(src, name, stage, rows, shape):  # rows: of the source; each rank gets rows // tp
        n = rows // tp
        add([src], name, stage, shape, lambda t: list(t.split(n, dim=0)), lambda r: [(src, r * n, (r + 1) * n)])

    def row(src, name, stage, rows, shape):  # split on dim 1; only tp=1 is a plain run of rows
        add([src], name, stage, shape, lambda t: list(t.split(t.shape[1] // tp, dim=1)),
            (lambda r: [(src, 0, rows)]) if tp == 1 else None)

    def qkv(srcs, name, stage, shape):
        q, k, v = srcs
        hq, hkv = H // tp * D, kv_rank * D
        # with KV heads duplicated (tp > KV), rank r holds KV head r // (tp // KV)
        kv0 = (lambda r: r // (tp // KV) * D) if tp > KV else (lambda r: r * hkv)
        add(srcs, name, stage, shape, lambda *t: split_qkv(*t, KV, tp),
            lambda r: [(q, r * hq, (r + 1) * hq), (k, kv0(r), kv0(r) + hkv), (v, kv0(r), kv0(r) + hkv)])

    for stage in range(pp):
        if stage == 0:
            rep("model.embed_tokens.weight", "transformer.vocab_embedding.weight", 0, V, (V, hid))
        for L, l in enumerate(pp_layers(spec["num_hidden_layers"], pp, stage)):
            p, t = f"model.layers.{l}.", f"transformer.layers.{L}."
            rep(p + "input_layernorm.weight", t + "input_layernorm.weight", stage, hid, (hid,))
            qkv([p + f"self_attn.{x}_proj.weight" for x in "qkv"], t + "attention.qkv.weight", stage, (qkv_rows, hid))
            if spec["qkv_bias"]:
                qkv([p + f"self_attn.{x}_proj.bias" for x in "qkv"], t + "attention.qkv.bias", stage, (qkv_rows,))
            row(p + "self_attn.o_proj.weight", t + "attention.dense.weight", stage, hid, (hid, H * D // tp))
            if spec["o_bias"]:
                rep(p + "self_attn.o_proj.bias", t + "attention.dense.bias", stage, hid, (hid,))
            rep(p + "post_attention_layernorm.weight", t + "post_layernorm.weight", stage, hid, (hid,))
            for hf, trt in (("gate_proj", "fc"), ("up_proj", "gate")):  # TRT-LLM fc = HF gate_proj, gate = up_proj
                col(p + f"mlp.{hf}.weight", t + f"mlp.{trt}.weight", stage, inter, (inter // tp, hid))
                if spec["mlp_bias"]:
                    col(p + f"mlp.{hf}.bias", t + f"mlp.{trt}.bias", stage, inter, (inter // tp,))
            row(p + "mlp.down_proj.weight", t + "mlp.proj.weight", stage, hid, (hid, inter // tp))
            if spec["mlp_bias"]:
                rep(p + "mlp.down_proj.bias", t + "mlp.proj.bias", stage, hid, (hid,))
        if stage == pp - 1:
            rep("model.norm.weight", "transformer.ln_f.weight", stage, hid, (hid,))
            Vp = pad_vocab_size(V, tp)
            n = Vp // tp
            src = "model.embed_tokens.weight" if spec["tie_word_embeddings"] else "lm_head.weight"
            pad = lambda w: list(torch.nn.functional.pad(w, (0, 0, 0, Vp - V)).split(n, dim=0))
            segs = lambda r: [(src, min(r * n, V), min((r + 1) * n, V)), (None, 0, max((r + 1) * n - V, 0) - max(r * n - V, 0))]
            add([src], "lm_head.weight", stage, (n, hid), pad, segs)
    return jobs


# ---------------------------------------------------------------------------------------------
# streaming safetensors writer


_CHUNK = 16 * 2**20
FILE_TO_FILE = hasattr(os, "copy_file_range")  # Linux: the kernel copies byte ranges between files


def _write_all(fd: int, data) -> None:
    mv = memoryview(data).cast("B")
    for i in range(0, len(mv), _CHUNK):  # bounded writes: one huge write() stalls in dirty-page throttling
        chunk = mv[i:i + _CHUNK]
        while chunk:
            chunk = chunk[os.write(fd, chunk):]


class RankWriter:
    """Writes one safetensors file whose header is fixed up front; tensors must come in header order."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        header, off = {}, 0
        self.expect: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        for name, dt, shape in entries:
            n = dt.itemsize
            for s in shape:
                n *= s
            header[name] = {"dtype": TORCH_TO_ST[dt], "shape": list(shape), "data_offsets": [off, off + n]}
            self.expect.append((name, dt, tuple(shape), n))
            off += n
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors' own writer does
        self.path, self.size = path, 8 + len(raw) + off
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _write_all(self.fd, struct.pack("<Q", len(raw)) + raw)
        self.i = 0

    def _next(self, name: str, dtype: torch.dtype, shape: tuple) -> int:
        ename, edt, eshape, n = self.expect[self.i]
        if (name, dtype, tuple(shape)) != (ename, edt, eshape):  # a plan bug, not user input
            raise AssertionError(f"{self.path.name}: got {name} {dtype} {list(shape)}, header says "
                                 f"{ename} {edt} {list(eshape)}")
        self.i += 1
        return n

    def write(self, name: str, t: torch.Tensor) -> int:
        n = self._next(name, t.dtype, t.shape)
        _write_all(self.fd, t.contiguous().reshape(-1).view(torch.uint8).numpy())
        return n

    def copy(self, name: str, dtype: torch.dtype, shape: tuple, segments: list[Segment], reader: TensorReader) -> int:
        """Write a tensor made of runs of source rows, copying file to file (no Python buffers)."""
        n = self._next(name, dtype, shape)
        written = 0
        for src, r0, r1 in segments:
            if r1 <= r0:
                continue
            if src is None:  # zero rows (vocab padding)
                length = (r1 - r0) * n // shape[0]
                _write_all(self.fd, bytes(length))
                written += length
                continue
            path, info, start = reader.where[src]
            row = ST_ITEMSIZE[info["dtype"]]
            for s in info["shape"][1:]:
                row *= s
            off, length = start + info["data_offsets"][0] + r0 * row, (r1 - r0) * row
            _copy_range(reader.fd(path), self.fd, off, length)
            written += length
        if written != n:
            raise AssertionError(f"{self.path.name}: {name} got {written} bytes, header says {n}")
        return n

    def close(self, check: bool = True) -> None:
        os.close(self.fd)
        if check and self.i != len(self.expect):
            raise AssertionError(f"{self.path.name}: wrote {self.i} of {len(self.expect)} tensors")


def _copy_range(src_fd: int, dst_fd: int, off: int, length: int) -> None:
    """Append src[off:off+length] to dst: copy_file_range where the kernel can, else pread + write."""
    global FILE_TO_FILE
    while length and FILE_TO_FILE:
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(length, 1 << 30), off)
        except OSError:  # e.g. EXDEV across file systems on some kernels: use pread + write from then on
            FILE_TO_FILE = False
            break
        if n == 0:
            raise UserError("unexpected end of file reading tensor data")
        off, length = off + n, length - n
    while length:
        data = os.pread(src_fd, min(length, _CHUNK), off)
        if not data:
            raise UserError("unexpected end of file reading tensor data")
        _write_all(dst_fd, data)
        off, length = off + len(data), length - len(data)


def convert_checkpoint(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1,
                       dtype: Optional[str] = None, progress: Optional[ProgressFn] = None) -> dict:
    """Convert an HF Llama-family checkpoint into a TensorRT-LLM checkpoint in out_dir.

    dtype: "float32" | "float16" | "bfloat16"; None keeps the checkpoint's (config dtype, else the
    embedding's). Returns {"files", "bytes", "seconds", "tensors", "tp", "pp", "dtype"}.
    """
    t0 = time.perf_counter()
    if sys.byteorder != "little":  # safetensors data is little-endian; tensors are written as they sit in memory
        raise UserError("conversion needs a little-endian machine")
    spec = read_hf_config(hf_dir)
    weights = list_weights(hf_dir)
    check_weights(hf_dir, spec, weights)
    check_parallel(spec["num_attention_heads"], spec["num_key_value_heads"], spec["intermediate_size"],
                   spec["num_hidden_layers"], tp, pp, str(hf_dir))
    if dtype is None:
        dtype = spec["dtype"] or str(weights["model.embed_tokens.weight"][1]).removeprefix("torch.")
    if dtype not in DTYPE_NAMES:
        raise UserError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}", key="dtype")
    tdt = DTYPE_NAMES[dtype]

    jobs = plan(spec, tp, pp)
    for j in jobs:
        for s in j.sources:
            if weights[s][1] not in DTYPE_NAMES.values():
                raise UserError(f"tensor {s!r} is {weights[s][1]}: quantized checkpoints are not supported, "
                                "give float16/bfloat16/float32 weights", file=str(weights[s][0]))
    entries: dict[int, list] = {r: [] for r in range(tp * pp)}
    for j in jobs:
        for rank, name, shape in j.outputs:
            entries[rank].append((name, tdt, shape))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = TensorReader(weight_files(hf_dir))
    writers = {r: RankWriter(out / f"rank{r}.safetensors", e) for r, e in entries.items()}
    total = sum(w.size for w in writers.values())
    done, ok = 0, False
    try:
        for j in jobs:
            if j.segments is not None and all(weights[s][1] == tdt for s in j.sources):
                for (rank, name, shape), segs in zip(j.outputs, j.segments, strict=True):
                    done += writers[rank].copy(name, tdt, shape, segs, reader)
            else:  # dtype cast or a dim-1 split: through memory, one job's tensors at a time
                srcs = [reader.get(s).to(tdt) for s in j.sources]
                for (rank, name, _), t in zip(j.outputs, j.fn(*srcs), strict=True):
                    done += writers[rank].write(name, t)
                del srcs
            if progress:
                progress(done, total)
        ok = True
    finally:
        reader.close()
        for w in writers.values():
            w.close(check=ok)
    cfg = trtllm_config(spec, tp, pp, dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")
    files = ["config.json"] + [f"rank{r}.safetensors" for r in range(tp * pp)]
    return {
        "files": files,
        "bytes": sum((out / f).stat().st_size for f in files),
        "seconds": time.perf_counter() - t0,
        "tensors": sum(len(e) for e in entries.values()),
        "tp": tp, "pp": pp, "dtype": dtype,
    }


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
    H, KV = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    D = cfg.get("head_size") or cfg["hidden_size"] // H
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


# ---------------------------------------------------------------------------------------------
# full-tensor renames (no sharding): what merge_ranks should give, and its way back to HF names


def hf_to_trtllm(hf: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """HF state dict -> full tensors under TRT-LLM names (merge_ranks' output form). cfg: TRT-LLM config."""
    out = {}
    for name, t in hf.items():
        trt = hf_to_trtllm_name(name)
        if trt is not None and not (trt == "lm_head.weight" and cfg.get("tie_word_embeddings")):
            out[trt] = t
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}.self_attn."
        for kind in ("weight", "bias"):
            if p + f"q_proj.{kind}" in hf:
                out[f"transformer.layers.{l}.attention.qkv.{kind}"] = torch.cat([hf[p + f"{x}_proj.{kind}"] for x in "qkv"])
    return out


def trtllm_to_hf(trt: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """Inverse of hf_to_trtllm: full TRT-LLM tensors -> HF state dict (q/k/v unfused)."""
    H, KV = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    D = cfg.get("head_size") or cfg["hidden_size"] // H
    back = {v: k for k, v in GLOBAL_NAMES.items()}
    back_layer = {v: k for k, v in LAYER_NAMES.items()}
    out = {}
    for name, t in trt.items():
        m = _LAYER_RE.match(name)
        if name in back:
            out[back[name]] = t
        elif m and m[2].startswith("attention.qkv."):
            kind = m[2].rsplit(".", 1)[1]
            for x, part in zip("qkv", t.split([H * D, KV * D, KV * D])):
                out[f"model.layers.{m[1]}.self_attn.{x}_proj.{kind}"] = part
        elif m and m[2] in back_layer:
            out[f"model.layers.{m[1]}.{back_layer[m[2]]}"] = t
        else:
            raise KeyError(f"no HF name for {name}")
    return out
