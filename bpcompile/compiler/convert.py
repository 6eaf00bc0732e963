"""HF checkpoint -> the engine checkpoint (TensorRT-LLM 1.2's format; names and splits in bpcompile.core.checkpoint).

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
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from bpcompile.compiler.hf import (
    DTYPE_NAMES,
    ST_ITEMSIZE,
    TORCH_TO_ST,
    TensorReader,
    check_weights,
    list_weights,
    read_hf_config,
    weight_files,
)
from bpcompile.core.checkpoint import pad_vocab_size, pp_layers, split_qkv
from bpcompile.core.errors import UserError

ProgressFn = Callable[[int, int], None]  # (bytes written so far, total bytes)


# ---------------------------------------------------------------------------------------------
# config


def check_parallel(heads: int, kv: int, intermediate: int, layers: int, tp: int, pp: int, where: str) -> None:
    for key, val in (("parallel.tp", tp), ("parallel.pp", pp)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise UserError(f"{key} must be a positive integer, got {val!r}", key=key)
    if heads % tp:
        raise UserError(
            f"parallel.tp = {tp} does not divide num_attention_heads = {heads} of {where}", key="parallel.tp"
        )
    if (tp > kv and tp % kv) or (tp <= kv and kv % tp):
        raise UserError(
            f"parallel.tp = {tp} and num_key_value_heads = {kv} of {where}: tp must divide the KV heads "
            "or be a multiple of them (KV heads are then duplicated)",
            key="parallel.tp",
        )
    if intermediate % tp:
        raise UserError(
            f"parallel.tp = {tp} does not divide intermediate_size = {intermediate} of {where}", key="parallel.tp"
        )
    if pp > layers:
        raise UserError(f"parallel.pp = {pp} is more than the {layers} layers of {where}", key="parallel.pp")


def trtllm_config(spec: dict, tp: int, pp: int, dtype: str) -> dict:
    """TRT-LLM 1.2 `config.json` for a Llama-family model (its PretrainedConfig and LLaMAConfig fields)."""
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
            "world_size": tp * pp,
            "gpus_per_node": 8,
            "cp_size": 1,
            "tp_size": tp,
            "pp_size": pp,
            "moe_tp_size": tp,
            "moe_cluster_size": 1,
            "moe_ep_size": 1,
            "attn_tp_size": tp,
            "attn_cp_size": 1,
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
    sources: list[str]  # HF tensor names read for this job
    outputs: list[tuple[int, str, tuple[int, ...]]]  # (rank, TRT-LLM name, shape), aligned with fn's result
    fn: Callable[..., list[torch.Tensor]]  # source tensors -> output tensors (the general path)
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
        add(
            [src],
            name,
            stage,
            shape,
            lambda t: list(t.split(t.shape[1] // tp, dim=1)),
            (lambda r: [(src, 0, rows)]) if tp == 1 else None,
        )

    def qkv(srcs, name, stage, shape):
        q, k, v = srcs
        hq, hkv = H // tp * D, kv_rank * D
        # with KV heads duplicated (tp > KV), rank r holds KV head r // (tp // KV)
        kv0 = (lambda r: r // (tp // KV) * D) if tp > KV else (lambda r: r * hkv)
        add(
            srcs,
            name,
            stage,
            shape,
            lambda *t: split_qkv(*t, KV, tp),
            lambda r: [(q, r * hq, (r + 1) * hq), (k, kv0(r), kv0(r) + hkv), (v, kv0(r), kv0(r) + hkv)],
        )

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
            segs = lambda r: [
                (src, min(r * n, V), min((r + 1) * n, V)),
                (None, 0, max((r + 1) * n - V, 0) - max(r * n - V, 0)),
            ]
            add([src], "lm_head.weight", stage, (n, hid), pad, segs)
    return jobs


# ---------------------------------------------------------------------------------------------
# streaming safetensors writer


_CHUNK = 16 * 2**20
FILE_TO_FILE = hasattr(os, "copy_file_range")  # Linux: the kernel copies byte ranges between files


def _write_all(fd: int, data) -> None:
    mv = memoryview(data).cast("B")
    for i in range(0, len(mv), _CHUNK):  # bounded writes: one huge write() stalls in dirty-page throttling
        chunk = mv[i : i + _CHUNK]
        while chunk:
            chunk = chunk[os.write(fd, chunk) :]


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
            raise AssertionError(
                f"{self.path.name}: got {name} {dtype} {list(shape)}, header says {ename} {edt} {list(eshape)}"
            )
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


def convert_checkpoint(
    hf_dir: str | Path,
    out_dir: str | Path,
    tp: int = 1,
    pp: int = 1,
    dtype: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
) -> dict:
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
    check_parallel(
        spec["num_attention_heads"],
        spec["num_key_value_heads"],
        spec["intermediate_size"],
        spec["num_hidden_layers"],
        tp,
        pp,
        str(hf_dir),
    )
    if dtype is None:
        dtype = spec["dtype"] or str(weights["model.embed_tokens.weight"][1]).removeprefix("torch.")
    if dtype not in DTYPE_NAMES:
        raise UserError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}", key="dtype")
    tdt = DTYPE_NAMES[dtype]

    jobs = plan(spec, tp, pp)
    for j in jobs:
        for s in j.sources:
            if weights[s][1] not in DTYPE_NAMES.values():
                raise UserError(
                    f"tensor {s!r} is {weights[s][1]}: quantized checkpoints are not supported, "
                    "give float16/bfloat16/float32 weights",
                    file=str(weights[s][0]),
                )
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
        "tp": tp,
        "pp": pp,
        "dtype": dtype,
    }
