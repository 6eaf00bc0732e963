"""Reading Hugging Face checkpoints: config, safetensors headers, one tensor at a time, tokenizers.

Only safetensors is read. Pickle-based checkpoints (`pytorch_model.bin`, `*.pt`, `*.pth`) can run
arbitrary code when loaded, so they are refused with a message saying how to convert them.

Tensors are read with plain `readinto` at the offsets the header gives, not through `safe_open`'s
memory map: a map keeps every page it touched resident for as long as the file is open, which would
make a converter's RSS grow to the size of the model. `read_tensor` gives exactly what `safe_open`
would (the tests check that), and the caller holds one tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any, Optional

import torch

from bpcompile.core.errors import UserError
from bpcompile.runtime.model import is_feature_draft  # noqa: F401 (the build and `plan` ask through here)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)  # transformers 5 keeps the chat template in its own file
INPUT_GLOBS = ("config.json", "*.safetensors", "model.safetensors.index.json") + TOKENIZER_FILES  # what a build reads

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE = (None, "default", "linear", "llama3")  # what bpcompile.runtime.model.rope_inv_freq computes

# safetensors dtype names <-> torch dtypes
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
ST_ITEMSIZE = {k: v.itemsize for k, v in ST_DTYPES.items()}
# config.json dtype strings (HF `torch_dtype`/`dtype`, TRT-LLM `dtype`) <-> torch dtypes
DTYPE_NAMES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_PICKLE_HOWTO = (
    "pickle-based checkpoints can run arbitrary code when loaded and are not read. Convert it once, "
    "where you trust it: `AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir, "
    "safe_serialization=True)` (and copy the tokenizer files), then point bpcompile at out_dir"
)


# ---------------------------------------------------------------------------------------------
# config


def _check_dir(d: str | Path) -> Path:
    d = Path(d)
    if not d.exists():
        raise UserError("checkpoint directory does not exist", file=str(d))
    if not d.is_dir():
        raise UserError("expected a checkpoint directory (config.json + *.safetensors), got a file", file=str(d))
    return d


# Bound on every size in config.json: sizes index int32 tensors and kernels; anything larger is a typo,
# and num_hidden_layers is further checked against the tensors the checkpoint really holds.
MAX_DIM = 2**31 - 1


def _int(raw: dict, key: str, path: Path, default: Any = None) -> int:
    v = raw.get(key, default)
    if v is None:
        raise UserError(f"missing required key {key!r} (an integer)", file=str(path), key=key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_DIM:
        raise UserError(f"{key!r} must be a positive integer (at most {MAX_DIM}), got {v!r}", file=str(path), key=key)
    return v


def _bool(raw: dict, key: str, path: Path) -> bool:
    """A JSON boolean (absent: false). The string "false" is truthy in Python, so it is refused, not guessed."""
    v = raw.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise UserError(f"{key!r} must be true or false, got {v!r}", file=str(path), key=key)
    return v


def _float(v: Any, key: str, path: Path) -> float:
    """A finite positive number (JSON int or float; not a string, bool or NaN)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise UserError(f"{key!r} must be a finite positive number, got {v!r}", file=str(path), key=key)
    return float(v)


def _rope(raw: dict, path: Path) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling in the transformers-4 / TRT-LLM `rotary_scaling` form or None).

    transformers 4 writes `rope_theta` + `rope_scaling`; transformers 5 writes one `rope_parameters`
    dict holding `rope_theta` and the scaling keys. Both are accepted.
    """
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        params = next(iter(params.values())) if all(isinstance(v, dict) for v in params.values()) else params
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise UserError(f"rope_scaling must be an object or null, got {scaling!r}", file=str(path), key="rope_scaling")
    scaling = dict(scaling)
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        scaling = {**{k: v for k, v in params.items() if k != "rope_theta"}, **scaling}
        theta = params.get("rope_theta", theta)
    theta = _float(theta if theta is not None else 10000.0, "rope_theta", path)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in SUPPORTED_ROPE:
        raise UserError(
            f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)",
            file=str(path),
            key="rope_scaling",
        )
    if kind in (None, "default"):
        return theta, None
    need = ["factor"] + (["original_max_position_embeddings"] if kind == "llama3" else [])
    for k in need:
        if k not in scaling:
            raise UserError(f"rope scaling {kind!r} needs {k!r}", file=str(path), key=f"rope_scaling.{k}")
    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if k in scaling:
            _float(scaling[k], f"rope_scaling.{k}", path)
    if kind == "llama3" and scaling.get("low_freq_factor", 1.0) >= scaling.get("high_freq_factor", 4.0):
        raise UserError(
            "rope_scaling: low_freq_factor must be smaller than high_freq_factor (llama3 divides by their difference)",
            file=str(path),
            key="rope_scaling.low_freq_factor",
        )
    # TRT-LLM reads `type` in some releases and `rope_type` in others; write both.
    out = {"type": kind, "rope_type": kind}
    out.update({k: v for k, v in scaling.items() if k not in ("type", "rope_type")})
    return theta, out


def read_hf_config(hf_dir: str | Path) -> dict:
    """Read and validate an HF `config.json`; return a normalized description of the model.

    Keys: architecture, vocab_size, hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, hidden_act, rms_norm_eps, rope_theta,
    rope_scaling (dict or None), max_position_embeddings, tie_word_embeddings, qkv_bias, o_bias,
    mlp_bias, dtype (str or None), raw (the file's dict).
    """
    d = _check_dir(hf_dir)
    path = d / "config.json"
    if not path.is_file():
        raise UserError("no config.json: expected a Hugging Face checkpoint directory", file=str(d))
    try:
        raw = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise UserError(f"not valid JSON: {e}", file=str(path)) from None
    if not isinstance(raw, dict):
        raise UserError("expected a JSON object", file=str(path))
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch is None:  # a config without `architectures` names its family by model_type alone
        mt = raw.get("model_type")
        arch = MODEL_TYPES.get(mt) if isinstance(mt, str) else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
            file=str(path),
            key="architectures",
        )
    hidden = _int(raw, "hidden_size", path)
    heads = _int(raw, "num_attention_heads", path)
    kv = _int(raw, "num_key_value_heads", path, default=heads)
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise UserError(
                f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and no head_dim is given",
                file=str(path),
                key="head_dim",
            )
        head_dim = hidden // heads
    head_dim = _int({"head_dim": head_dim}, "head_dim", path)
    if heads % kv:
        raise UserError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
            file=str(path),
            key="num_key_value_heads",
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(
            f"hidden_act {act!r} is not supported (Llama-family models use 'silu')", file=str(path), key="hidden_act"
        )
    theta, scaling = _rope(raw, path)
    max_pos = _int(raw, "max_position_embeddings", path, default=2048)
    if arch == "MistralForCausalLM":
        sw = raw.get("sliding_window")
        if sw is not None and (isinstance(sw, bool) or not isinstance(sw, int)):
            raise UserError(
                f"sliding_window must be an integer or null, got {sw!r}", file=str(path), key="sliding_window"
            )
        if sw is not None and sw < max_pos:
            raise UserError(
                f"sliding_window {sw} < max_position_embeddings {max_pos}: sliding-window attention "
                "is not implemented by the native runtime",
                file=str(path),
                key="sliding_window",
            )
    if arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
        raise UserError(
            "use_sliding_window: sliding-window attention is not implemented by the native runtime",
            file=str(path),
            key="use_sliding_window",
        )
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    if not isinstance(dtype, str) or dtype not in DTYPE_NAMES:
        dtype = None  # e.g. "auto" or an exotic type: decided from the tensors instead
    attn_bias = _bool(raw, "attention_bias", path)
    return {
        "architecture": arch,
        "vocab_size": _int(raw, "vocab_size", path),
        "hidden_size": hidden,
        "intermediate_size": _int(raw, "intermediate_size", path),
        "num_hidden_layers": _int(raw, "num_hidden_layers", path),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_act": act,
        "rms_norm_eps": _float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", path),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": max_pos,
        # LlamaConfig, MistralConfig and Qwen2Config all default to untied when the key is absent
        "tie_word_embeddings": _bool(raw, "tie_word_embeddings", path),
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four
        "qkv_bias": True if arch == "Qwen2ForCausalLM" else attn_bias,
        "o_bias": False if arch == "Qwen2ForCausalLM" else attn_bias,
        "mlp_bias": _bool(raw, "mlp_bias", path),
        "dtype": dtype,
        "raw": raw,
    }


# ---------------------------------------------------------------------------------------------
# safetensors headers and tensor reads


ST_MAX_HEADER = 100_000_000  # the safetensors library's MAX_HEADER_SIZE


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"key {dup!r} appears twice")
    return dict(pairs)


def _uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64


def read_header(path: str | Path) -> tuple[dict, int]:
    """(header dict without __metadata__, offset where the data section starts). Reads only the header.

    Validated as strictly as the safetensors library does (its `read_metadata` and `Metadata::validate`):
    a JSON object of {name: {dtype, shape, data_offsets}}, known dtypes, non-negative integer shapes,
    [begin, end] offsets that, sorted, tile the data section exactly from 0 to its last byte (no gap, no
    overlap, nothing reversed), and end - begin == numel * itemsize for every tensor. Reads go straight to
    those offsets, so a header that breaks any of these would otherwise publish garbage weights.
    """
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise UserError(f"cannot read: {e.strerror}", file=str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError("not a regular file (a device, pipe or directory cannot be a safetensors file)", file=str(path))
    size = st.st_size
    bad = lambda why: UserError(f"not a valid safetensors file: {why}", file=str(path))  # noqa: E731
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("shorter than 8 bytes")
        (n,) = struct.unpack("<Q", head)
        if n > ST_MAX_HEADER:
            raise bad(f"header length {n} is over the {ST_MAX_HEADER}-byte limit")
        if 8 + n > size:
            raise bad(f"header length {n} does not fit the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad(f"header is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad("__metadata__ must be an object of strings")
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise bad(f"tensor {name!r} needs dtype, shape and data_offsets")
        dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dt not in ST_DTYPES:
            raise UserError(
                f"tensor {name!r} has unsupported dtype {dt!r} (supported: {', '.join(ST_DTYPES)})", file=str(path)
            )
        if not isinstance(shape, list) or not all(_uint(s) for s in shape):
            raise bad(f"tensor {name!r}: shape must be a list of non-negative integers, got {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_uint(o) for o in offs)):
            raise bad(f"tensor {name!r}: data_offsets must be [begin, end] non-negative integers, got {offs!r}")
        spans.append((offs[0], offs[1], name, ST_ITEMSIZE[dt] * math.prod(shape)))
    data_len, pos = size - 8 - n, 0
    for b, e, name, nbytes in sorted(spans):
        if b != pos or e < b:
            why = (
                "overlaps the previous tensor" if b < pos else ("leaves a gap before it" if b > pos else "is reversed")
            )
            raise bad(f"tensor {name!r}: data_offsets [{b}, {e}] {why} (tensors must tile the data section)")
        if e - b != nbytes:
            raise bad(f"tensor {name!r}: data_offsets [{b}, {e}] hold {e - b} bytes, dtype and shape need {nbytes}")
        pos = e
    if pos != data_len:
        raise bad(
            f"tensors cover {pos} bytes of a {data_len}-byte data section"
            + (" (truncated file?)" if pos > data_len else "")
        )
    return header, 8 + n


def _regular(f: Path, where: Path) -> Path:
    """f itself, if it is (or links to) a regular file: a link to /dev/zero or a FIFO would hang every read."""
    if not f.is_file():
        what = "is missing" if not os.path.lexists(f) else "is not a regular file"
        raise UserError(f"{f.name} {what}", file=str(where))
    return f


def weight_files(hf_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file or sharded with an index). Refuses pickle."""
    d = _check_dir(hf_dir)
    index = d / "model.safetensors.index.json"
    if os.path.lexists(index):
        _regular(index, d)
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"invalid index (expected {{'weight_map': {{name: file}}}}): {e}", file=str(index)
            ) from None
        if not isinstance(wm, dict) or not wm:
            raise UserError(
                f"'weight_map' must be a non-empty object {{tensor name: shard file}}, got {type(wm).__name__}",
                file=str(index),
                key="weight_map",
            )
        for name, shard in wm.items():
            # shards sit next to the index: a path elsewhere (../, /etc/...) is not part of this checkpoint
            if not isinstance(shard, str) or not shard.endswith(".safetensors") or Path(shard).name != shard:
                raise UserError(
                    f"weight_map[{name!r}] must be a *.safetensors file name in this directory, got {shard!r}",
                    file=str(index),
                    key="weight_map",
                )
        files = [d / f for f in dict.fromkeys(wm.values())]
        for f in files:
            if not f.is_file():
                what = "missing" if not os.path.lexists(f) else "not a regular file"
                raise UserError(f"shard {f.name} listed in the index is {what}", file=str(index))
        return files
    single = d / "model.safetensors"
    if os.path.lexists(single):
        return [_regular(single, d)]
    found = sorted(d.glob("*.safetensors"))
    if found:
        return [_regular(f, d) for f in found]
    pickles = sorted(p.name for pat in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in d.glob(pat))
    if pickles:
        raise UserError(f"found {', '.join(pickles)} but no *.safetensors: {_PICKLE_HOWTO}", file=str(d))
    raise UserError(
        "no weights found (expected model.safetensors or model.safetensors.index.json + shards)", file=str(d)
    )


def list_weights(hf_dir: str | Path) -> dict[str, tuple[Path, torch.dtype, tuple[int, ...]]]:
    """{tensor name: (file, torch dtype, shape)} from the safetensors headers only."""
    out: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]] = {}
    for f in weight_files(hf_dir):
        header, _ = read_header(f)
        for name, info in header.items():
            if name in out:
                raise UserError(f"tensor {name!r} appears in both {out[name][0].name} and {f.name}", file=str(f))
            out[name] = (f, ST_DTYPES[info["dtype"]], tuple(info["shape"]))
    return out


class TensorReader:
    """Reads tensors one at a time from a set of safetensors files (headers parsed once, no mmap)."""

    def __init__(self, files: list[Path]):
        self.where: dict[str, tuple[Path, dict, int]] = {}
        self._fds: dict[Path, int] = {}
        for f in files:
            header, start = read_header(f)
            for name, info in header.items():
                self.where[name] = (f, info, start)

    @classmethod
    def for_dir(cls, hf_dir: str | Path) -> "TensorReader":
        return cls(weight_files(hf_dir))

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        f, info, start = self.where[name]
        return read_tensor(f, info, start)

    def fd(self, path: Path) -> int:
        """A read-only descriptor of one of the files (kept open until close), for byte-range copies."""
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def read_tensor(path: Path, info: dict, data_start: int) -> torch.Tensor:
    s, e = info["data_offsets"]
    buf = torch.empty(e - s, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as fh:
        fh.seek(data_start + s)
        view, got = memoryview(buf.numpy()), 0
        while got < e - s:  # readinto may return short counts on large reads
            n = fh.readinto(view[got:])
            if not n:
                raise UserError("unexpected end of file reading tensor data", file=str(path))
            got += n
    return buf.view(ST_DTYPES[info["dtype"]]).reshape(info["shape"])


# ---------------------------------------------------------------------------------------------
# expected tensors, parameter counts


def hf_weight_shapes(spec: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config must hold, with its shape (lm_head only if untied)."""
    h, i, v = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
    nq = spec["num_attention_heads"] * spec["head_dim"]
    nkv = spec["num_key_value_heads"] * spec["head_dim"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not spec["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, h)
    for l in range(spec["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        # (module, [out, in], has a bias): each linear's weight, and its bias where the config says so
        for mod, shape, bias in (
            ("self_attn.q_proj", (nq, h), spec["qkv_bias"]),
            ("self_attn.k_proj", (nkv, h), spec["qkv_bias"]),
            ("self_attn.v_proj", (nkv, h), spec["qkv_bias"]),
            ("self_attn.o_proj", (h, nq), spec["o_bias"]),
            ("mlp.gate_proj", (i, h), spec["mlp_bias"]),
            ("mlp.up_proj", (i, h), spec["mlp_bias"]),
            ("mlp.down_proj", (h, i), spec["mlp_bias"]),
        ):
            out[p + mod + ".weight"] = shape
            if bias:
                out[p + mod + ".bias"] = shape[:1]
    return out


def check_weights(hf_dir: str | Path, spec: dict, weights: dict) -> None:
    """UserError unless every expected tensor is present with the shape the config implies."""
    # The layer count comes first and from the tensors themselves: a config claiming 10**8 layers must
    # not make anything (this check included) enumerate them.
    held = {int(m[1]) for n in weights if (m := re.match(r"^model\.layers\.(\d+)\.", n))}
    L = spec["num_hidden_layers"]
    if max(held, default=-1) + 1 != L:
        raise UserError(
            f"num_hidden_layers is {L} but the checkpoint's tensors are for {max(held, default=-1) + 1} layers",
            file=str(Path(hf_dir) / "config.json"),
            key="num_hidden_layers",
        )
    for name, shape in hf_weight_shapes(spec).items():
        if name not in weights:
            hint = " (config says tie_word_embeddings=false)" if name == "lm_head.weight" else ""
            raise UserError(f"missing tensor {name!r}{hint}", file=str(hf_dir))
        f, _, got = weights[name]
        if tuple(got) != shape:
            raise UserError(f"tensor {name!r} has shape {list(got)}, config.json implies {list(shape)}", file=str(f))


def read_feature_draft(d: str | Path, verifier: dict) -> dict:
    """Validate a FeatureDraft directory against the verifier's normalized config (read_hf_config) from its
    config.json and safetensors headers; return a normalized config in read_hf_config's keys (the verifier's
    shape with the draft's layers and intermediate size; the embedding and head are the verifier's)."""
    d = _check_dir(d)
    path = d / "config.json"
    raw = json.loads(path.read_text())
    layers, inter = _int(raw, "num_layers", path), _int(raw, "intermediate_size", path)
    if layers > 64:
        raise UserError(f"num_layers {layers}: a feature draft has a few layers", file=str(path), key="num_layers")
    spec = dict(
        verifier,
        architecture="FeatureDraft",
        num_hidden_layers=layers,
        intermediate_size=inter,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        raw=raw,
        head_rows=0,
    )
    h, D = verifier["hidden_size"], verifier["head_dim"]
    nq, nkv = verifier["num_attention_heads"] * D, verifier["num_key_value_heads"] * D
    want = {"fc.weight": (h, 2 * h), "fc.bias": (h,)}
    for i in range(layers):
        p = f"transformer.layers.{i}."
        want.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_layernorm.weight": (h,),
                p + "attention.qkv.weight": (nq + 2 * nkv, h),
                p + "attention.dense.weight": (h, nq),
                p + "mlp.fc.weight": (inter, h),
                p + "mlp.gate.weight": (inter, h),
                p + "mlp.proj.weight": (h, inter),
            }
        )
    have = list_weights(d)
    for name, shape in want.items():
        if name not in have:
            raise UserError(f"missing tensor {name!r} (a FeatureDraft for a verifier of hidden size {h})", file=str(d))
        if tuple(have[name][2]) != shape:
            raise UserError(
                f"tensor {name!r} has shape {list(have[name][2])}, the verifier implies {list(shape)}",
                file=str(have[name][0]),
            )
    if "vocab_subset" in have:  # the token ids it may propose (FeatureDraft checks their values at load)
        f, dt, shape = have.pop("vocab_subset")
        if dt != torch.int64 or len(shape) != 1 or not 0 < shape[0] <= verifier["vocab_size"]:
            raise UserError(
                f"tensor 'vocab_subset' must be int64 [N] with 0 < N <= {verifier['vocab_size']}, got "
                f"{dt} {list(shape)}",
                file=str(f),
            )
        spec["head_rows"] = shape[0]  # its own head: the verifier's rows for these ids
    extra = sorted(set(have) - set(want))
    if extra:
        raise UserError(f"unexpected tensors {extra[:3]} in a FeatureDraft with {layers} layers", file=str(d))
    return spec


def check_tokenizer(d: str | Path) -> None:
    """UserError unless d/tokenizer.json is a regular file that the `tokenizers` library loads (serving
    tokenizes with it; a JSON file of some other kind would otherwise fail only at serve time)."""
    from tokenizers import Tokenizer

    p = Path(d) / "tokenizer.json"
    if not p.is_file():
        what = (
            "is not a regular file" if os.path.lexists(p) else "is missing (a fast tokenizer file is needed to serve)"
        )
        raise UserError(f"tokenizer.json {what}", file=str(d))
    try:
        Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 - the library raises plain Exception subclasses for bad files
        raise UserError(f"not a tokenizer the `tokenizers` library can load: {e}", file=str(p)) from None


def _tokenizer_json(d: Path) -> Optional[dict]:
    p = d / "tokenizer.json"
    if not p.is_file():
        return None
    try:
        t = json.loads(p.read_text())
    except (ValueError, RecursionError) as e:
        raise UserError(f"not valid JSON: {e}", file=str(p)) from None
    if not isinstance(t, dict) or not isinstance(t.get("model") or {}, dict):
        raise UserError("not a tokenizer (expected a JSON object with a 'model' object)", file=str(p))
    return t


def _merges(model: dict) -> list[tuple[str, str]]:
    # tokenizers < 0.20 writes merges as "a b" strings, later versions as [a, b] pairs
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]


def _vocab(model: dict) -> dict:
    v = model.get("vocab")
    if isinstance(v, list):  # Unigram: [[piece, score], ...] -> piece -> (id, score)
        return {p[0]: (i, p[1]) for i, p in enumerate(v)}
    return dict(v or {})


def tokenizers_equal(dir_a: str | Path, dir_b: str | Path) -> tuple[bool, str]:
    """Whether two checkpoints' tokenizers map text to the same ids and ids to the same tokens.

    Speculative decoding feeds the draft's token ids to the verifier, so the vocabularies (every
    token -> id, added and special tokens included) must be identical, and so must everything that
    decides how text is split (normalizer, pre-tokenizer, BPE merges). Sizes alone are not enough:
    two BPE vocabularies of the same size can assign different ids.
    """
    a, b = Path(dir_a), Path(dir_b)
    ta, tb = _tokenizer_json(a), _tokenizer_json(b)
    if ta is None or tb is None:
        missing = [str(d) for d, t in ((a, ta), (b, tb)) if t is None]
        sp_a, sp_b = a / "tokenizer.model", b / "tokenizer.model"
        if ta is None and tb is None and sp_a.is_file() and sp_b.is_file():
            same = sp_a.read_bytes() == sp_b.read_bytes()
            return same, "identical tokenizer.model" if same else "tokenizer.model files differ"
        return False, f"no tokenizer.json in {', '.join(missing)}"
    ma, mb = ta.get("model") or {}, tb.get("model") or {}
    if ma.get("type") != mb.get("type"):
        return False, f"tokenizer model types differ: {ma.get('type')} vs {mb.get('type')}"
    va, vb = _vocab(ma), _vocab(mb)
    if va != vb:
        if len(va) != len(vb):
            return False, f"vocab sizes differ: {len(va)} vs {len(vb)}"
        diff = sorted(k for k in va.keys() | vb.keys() if va.get(k) != vb.get(k))
        return False, f"vocabularies differ in {len(diff)} tokens (e.g. {diff[:3]!r})"
    if _merges(ma) != _merges(mb):
        return False, "BPE merges differ"
    for key in ("unk_token", "byte_fallback", "continuing_subword_prefix", "end_of_word_suffix"):
        if ma.get(key) != mb.get(key):
            return False, f"model.{key} differs: {ma.get(key)!r} vs {mb.get(key)!r}"
    added = lambda t: {x["content"]: (x["id"], bool(x.get("special"))) for x in t.get("added_tokens") or []}
    aa, ab = added(ta), added(tb)
    if aa != ab:
        diff = sorted(k for k in aa.keys() | ab.keys() if aa.get(k) != ab.get(k))
        return False, f"added/special tokens differ (e.g. {diff[:3]!r})"
    for key in ("normalizer", "pre_tokenizer"):
        if ta.get(key) != tb.get(key):
            return False, f"{key} differs"
    return True, "same vocabulary, added tokens, merges, normalizer and pre-tokenizer"
