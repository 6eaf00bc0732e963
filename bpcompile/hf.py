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
import os
import struct
from pathlib import Path
from typing import Any, Optional

import torch

from .errors import UserError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE = (None, "default", "linear", "llama3")  # what bpcompile.model.rope_inv_freq computes

# safetensors dtype names <-> torch dtypes
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
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


def _int(raw: dict, key: str, path: Path, default: Any = None) -> int:
    v = raw.get(key, default)
    if v is None:
        raise UserError(f"missing required key {key!r} (an integer)", file=str(path), key=key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UserError(f"{key!r} must be a positive integer, got {v!r}", file=str(path), key=key)
    return v


def _rope(raw: dict, path: Path) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling in the transformers-4 / TRT-LLM `rotary_scaling` form or None).

    transformers 4 writes `rope_theta` + `rope_scaling`; transformers 5 writes one `rope_parameters`
    dict holding `rope_theta` and the scaling keys. Both are accepted.
    """
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        params = next(iter(params.values())) if all(isinstance(v, dict) for v in params.values()) else params
    scaling = dict(raw.get("rope_scaling") or {})
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        scaling = {**{k: v for k, v in params.items() if k != "rope_theta"}, **scaling}
        theta = params.get("rope_theta", theta)
    theta = float(theta if theta is not None else 10000.0)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in SUPPORTED_ROPE:
        raise UserError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)",
                        file=str(path), key="rope_scaling")
    if kind in (None, "default"):
        return theta, None
    need = ["factor"] + (["original_max_position_embeddings"] if kind == "llama3" else [])
    for k in need:
        if k not in scaling:
            raise UserError(f"rope scaling {kind!r} needs {k!r}", file=str(path), key=f"rope_scaling.{k}")
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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"not valid JSON: {e}", file=str(path)) from None
    if not isinstance(raw, dict):
        raise UserError("expected a JSON object", file=str(path))
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
                        file=str(path), key="architectures")
    hidden = _int(raw, "hidden_size", path)
    heads = _int(raw, "num_attention_heads", path)
    kv = _int(raw, "num_key_value_heads", path, default=heads)
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise UserError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and no head_dim "
                            "is given", file=str(path), key="head_dim")
        head_dim = hidden // heads
    head_dim = _int({"head_dim": head_dim}, "head_dim", path)
    if heads % kv:
        raise UserError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                        file=str(path), key="num_key_value_heads")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"hidden_act {act!r} is not supported (Llama-family models use 'silu')",
                        file=str(path), key="hidden_act")
    theta, scaling = _rope(raw, path)
    max_pos = _int(raw, "max_position_embeddings", path, default=2048)
    if arch == "MistralForCausalLM":
        sw = raw.get("sliding_window")
        if sw is not None and sw < max_pos:
            raise UserError(f"sliding_window {sw} < max_position_embeddings {max_pos}: sliding-window attention "
                            "is not implemented by the native runtime", file=str(path), key="sliding_window")
    if arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
        raise UserError("use_sliding_window: sliding-window attention is not implemented by the native runtime",
                        file=str(path), key="use_sliding_window")
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    if dtype is not None and dtype not in DTYPE_NAMES:
        dtype = None  # e.g. "auto" or an exotic type: decided from the tensors instead
    attn_bias = bool(raw.get("attention_bias", False))
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
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": max_pos,
        # LlamaConfig, MistralConfig and Qwen2Config all default to untied when the key is absent
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four
        "qkv_bias": True if arch == "Qwen2ForCausalLM" else attn_bias,
        "o_bias": False if arch == "Qwen2ForCausalLM" else attn_bias,
        "mlp_bias": bool(raw.get("mlp_bias", False)),
        "dtype": dtype,
        "raw": raw,
    }


# ---------------------------------------------------------------------------------------------
# safetensors headers and tensor reads


def read_header(path: str | Path) -> tuple[dict, int]:
    """(header dict without __metadata__, offset where the data section starts). Reads only the header."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError("not a safetensors file (shorter than 8 bytes)", file=str(path))
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 * 2**20):
            raise UserError(f"not a safetensors file (header length {n} does not fit the file)", file=str(path))
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"not a safetensors file (header is not JSON: {e})", file=str(path)) from None
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, info in header.items():
        s, e = info["data_offsets"]
        if info["dtype"] not in ST_DTYPES:
            raise UserError(f"tensor {name!r} has unsupported dtype {info['dtype']}", file=str(path))
        if e > data_len:
            raise UserError(f"tensor {name!r} ends at byte {e} but the data section has {data_len} bytes "
                            "(truncated file?)", file=str(path))
    return header, 8 + n


def weight_files(hf_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file or sharded with an index). Refuses pickle."""
    d = _check_dir(hf_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"invalid index (expected {{'weight_map': {{name: file}}}}): {e}", file=str(index)) from None
        files = [d / f for f in dict.fromkeys(wm.values())]
        for f in files:
            if not f.is_file():
                raise UserError(f"shard {f.name} listed in the index is missing", file=str(index))
        return files
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(d.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p.name for pat in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in d.glob(pat))
    if pickles:
        raise UserError(f"found {', '.join(pickles)} but no *.safetensors: {_PICKLE_HOWTO}", file=str(d))
    raise UserError("no weights found (expected model.safetensors or model.safetensors.index.json + shards)",
                    file=str(d))


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
        out[p + "self_attn.q_proj.weight"] = (nq, h)
        out[p + "self_attn.k_proj.weight"] = (nkv, h)
        out[p + "self_attn.v_proj.weight"] = (nkv, h)
        out[p + "self_attn.o_proj.weight"] = (h, nq)
        if spec["qkv_bias"]:
            out[p + "self_attn.q_proj.bias"] = (nq,)
            out[p + "self_attn.k_proj.bias"] = (nkv,)
            out[p + "self_attn.v_proj.bias"] = (nkv,)
        if spec["o_bias"]:
            out[p + "self_attn.o_proj.bias"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (i, h)
        out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
        if spec["mlp_bias"]:
            out[p + "mlp.gate_proj.bias"] = (i,)
            out[p + "mlp.up_proj.bias"] = (i,)
            out[p + "mlp.down_proj.bias"] = (h,)
    return out


def check_weights(hf_dir: str | Path, spec: dict, weights: dict) -> None:
    """UserError unless every expected tensor is present with the shape the config implies."""
    for name, shape in hf_weight_shapes(spec).items():
        if name not in weights:
            hint = " (config says tie_word_embeddings=false)" if name == "lm_head.weight" else ""
            raise UserError(f"missing tensor {name!r}{hint}", file=str(hf_dir))
        f, _, got = weights[name]
        if tuple(got) != shape:
            raise UserError(f"tensor {name!r} has shape {list(got)}, config.json implies {list(shape)}", file=str(f))


def param_count(hf_dir: str | Path) -> int:
    """Parameters of the model as the config defines it (tied embeddings counted once)."""
    spec = read_hf_config(hf_dir)
    return sum(_numel(s) for s in hf_weight_shapes(spec).values())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def summarize(hf_dir: str | Path) -> dict:
    """What `bpcompile inspect` shows: architecture, shape of the model, parameters, bytes, dtypes, files."""
    spec = read_hf_config(hf_dir)
    weights = list_weights(hf_dir)
    check_weights(hf_dir, spec, weights)
    files = weight_files(hf_dir)
    return {
        "dir": str(hf_dir),
        "architecture": spec["architecture"],
        "layers": spec["num_hidden_layers"],
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "heads": spec["num_attention_heads"],
        "kv_heads": spec["num_key_value_heads"],
        "head_dim": spec["head_dim"],
        "vocab_size": spec["vocab_size"],
        "max_position_embeddings": spec["max_position_embeddings"],
        "rope_theta": spec["rope_theta"],
        "rope_scaling": spec["rope_scaling"],
        "tie_word_embeddings": spec["tie_word_embeddings"],
        "params": sum(_numel(s) for s in hf_weight_shapes(spec).values()),
        "tensor_dtypes": sorted({str(dt).removeprefix("torch.") for _, dt, _ in weights.values()}),
        "config_dtype": spec["dtype"],
        "files": [f.name for f in files],
        "bytes": sum(f.stat().st_size for f in files),
    }


# ---------------------------------------------------------------------------------------------
# tokenizers


def _tokenizer_json(d: Path) -> Optional[dict]:
    p = d / "tokenizer.json"
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"not valid JSON: {e}", file=str(p)) from None


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
