"""The one boundary to TensorRT and TensorRT-LLM (target: tensorrt-llm).

Everything here that can be checked without TensorRT is a pure function (the `trtllm-build`
command lines, the engine layout); the stage itself refuses to run, with a clear message, where
TensorRT-LLM 1.2.x is absent. It never pretends to have built an engine.

Pinned to TensorRT-LLM 1.2.x (or <= 1.3.0rc20): later releases removed `trtllm-build` and the
TensorRT engine flow.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from bpcompile.compiler.recipe import Recipe
from bpcompile.core.errors import MissingDependency

SUPPORTED = "TensorRT-LLM 1.2.x (or 1.3.0rc1-rc20)"
HOWTO = (
    "build inside a TensorRT-LLM 1.2 container (for example nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 "
    "with tensorrt_llm 1.2.x), or set `target: native` in the recipe"
)


def trtllm_version() -> Optional[str]:
    """Version of the importable tensorrt_llm package, or None. Imported in a subprocess: importing
    tensorrt_llm initialises CUDA and can take tens of seconds or abort where no GPU exists."""
    if shutil.which("trtllm-build") is None:
        return None
    try:
        out = subprocess.run(
            ["python3", "-c", "import tensorrt_llm; print(tensorrt_llm.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def version_supported(v: str) -> bool:
    if v.startswith("1.2."):
        return True
    m = re.match(r"1\.3\.0rc(\d+)", v)
    return bool(m and int(m.group(1)) <= 20)


def require_trtllm() -> str:
    v = trtllm_version()
    if v is None:
        raise MissingDependency(
            f"target 'tensorrt-llm' needs {SUPPORTED} with `trtllm-build` on PATH; "
            f"none was found on this machine. The converted checkpoints bpcompile writes are "
            f"valid trtllm-build input: {HOWTO}.",
            key="target",
        )
    if not version_supported(v):
        raise MissingDependency(
            f"found tensorrt_llm {v}, but bpcompile targets {SUPPORTED}: later releases removed "
            f"trtllm-build and the TensorRT engine flow; {HOWTO}.",
            key="target",
        )
    return v


def build_commands(recipe: Recipe, version_dir: Path) -> dict[str, list[str]]:
    """The trtllm-build command lines for the verifier and the draft engine (pure; tested without TensorRT).

    The verifier is built to accept externally drafted tokens (`draft_tokens_external`) with room for the
    whole tree (`max_draft_len` = node budget); the tree mask and the INT4/FP8 KV cache are provided by
    bpcompile's plugin library (plugins/trt), loaded before build and deserialization.
    """
    lim, spec = recipe.limits, recipe.speculative
    draft_len = {"dynamic": spec.nodes, "chain": spec.length, "none": 0, "static": len(spec.choices or [])}[spec.tree]
    common = [
        "--max_batch_size",
        str(lim.max_batch_size),
        "--max_input_len",
        str(lim.max_input_len),
        "--max_seq_len",
        str(lim.max_seq_len),
        "--kv_cache_type",
        "paged",
        "--gpt_attention_plugin",
        "auto",
        "--gemm_plugin",
        "auto",
        "--remove_input_padding",
        "enable",
        "--context_fmha",
        "enable",
        "--tokens_per_block",
        str(recipe.kv_cache.page_size),
    ]
    out = version_dir / "trtllm"
    verifier = [
        "trtllm-build",
        "--checkpoint_dir",
        str(version_dir / "verifier"),
        "--output_dir",
        str(out / "verifier"),
        *common,
    ]
    if draft_len:
        verifier += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(draft_len)]
    draft = [
        "trtllm-build",
        "--checkpoint_dir",
        str(version_dir / "draft"),
        "--output_dir",
        str(out / "draft"),
        *common,
        "--gather_generation_logits",
    ]
    return {"verifier": verifier, "draft": draft}


def trtllm_stage(stage: Path, recipe: Recipe) -> dict:
    require_trtllm()
    cmds = build_commands(recipe, stage)
    (stage / "trtllm").mkdir(exist_ok=True)
    (stage / "trtllm" / "build.sh").write_text(
        "#!/usr/bin/env bash\nset -euo pipefail\n" + "\n".join(shlex.join(c) for c in cmds.values()) + "\n"
    )
    for cmd in cmds.values():
        subprocess.run(cmd, check=True)
    return {"detail": "engines: " + ", ".join(cmds)}


# --- FP8 / INT8 KV cache for TensorRT-LLM: per-layer scaling factors from calibration ------------------------

KV_QUANT_ALGO = {"fp8": "FP8", "int8": "INT8"}  # config.json quantization.kv_cache_quant_algo
KV_QMAX = {"fp8": 448.0, "int8": 127.0}  # the largest magnitude of each format (E4M3; symmetric INT8)
SCALE_NAME = "transformer.layers.{}.attention.kv_cache_scaling_factor"  # [1] float32 per layer


def kv_cache_scales(verifier, samples: list[list[int]], fmt: str):
    """[num_layers] float32: per layer, the largest |K| or |V| over the calibration samples (keys after RoPE, as
    the cache stores them) divided by the format's largest value. TensorRT-LLM's attention stores x / s and reads
    back code * s, one scale per layer for K and V together (what its own checkpoint converters write)."""
    import torch

    from bpcompile.compiler.calibrate import capture_qkv

    amax = torch.zeros(verifier.cfg.num_layers, dtype=torch.float32)
    for layer, _, k, v in capture_qkv(verifier, samples):
        amax[layer] = torch.maximum(k.abs().max(), v.abs().max())
    return (amax / KV_QMAX[fmt]).clamp(min=torch.finfo(torch.float32).tiny)


def write_kv_cache_scales(ckpt_dir: Path, scales, fmt: str) -> dict:
    """Put each layer's scale into every rank file of the pp stage that holds the layer (replicated over tp, under
    the stage's local layer index) and set config.json's kv_cache_quant_algo. Each file is replaced atomically."""
    import json
    import os

    from safetensors import safe_open
    from safetensors.torch import save_file

    from bpcompile.core.checkpoint import pp_layers, read_trtllm_config
    from bpcompile.core.store import write_atomic

    ckpt_dir = Path(ckpt_dir)
    cfg = read_trtllm_config(ckpt_dir)
    m = cfg.get("mapping", {})
    tp, pp = m.get("tp_size", 1), m.get("pp_size", 1)
    if len(scales) != cfg["num_hidden_layers"]:
        raise ValueError(f"{len(scales)} scales for {cfg['num_hidden_layers']} layers")
    files = []
    for stage in range(pp):
        layers = pp_layers(cfg["num_hidden_layers"], pp, stage)
        for r in range(tp):
            path = ckpt_dir / f"rank{stage * tp + r}.safetensors"
            with safe_open(path, "pt") as f:
                tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
            for local, layer in enumerate(layers):
                tensors[SCALE_NAME.format(local)] = scales[layer : layer + 1].clone().float()
            tmp = path.with_name(f".{path.name}.tmp")
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)
            files.append(path.name)
    cfg.setdefault("quantization", {})["kv_cache_quant_algo"] = KV_QUANT_ALGO[fmt]
    write_atomic(ckpt_dir / "config.json", json.dumps(cfg, indent=2) + "\n")
    return {"files": files, "kv_cache_quant_algo": KV_QUANT_ALGO[fmt]}


def kv_scales_stage(ckpt_dir: Path, tokenizer_dir: Path, fmt: str, calibration: dict, calibration_file=None) -> dict:
    """Build stage (target tensorrt-llm, kv_cache.format fp8 or int8): calibrate and write the scales."""
    from bpcompile.compiler.calibrate import recipe_samples
    from bpcompile.runtime.model import Llama

    samples = recipe_samples(tokenizer_dir, calibration, calibration_file)
    scales = kv_cache_scales(Llama.from_checkpoint(ckpt_dir, dtype=None), samples, fmt)
    out = write_kv_cache_scales(ckpt_dir, scales, fmt)
    return {
        "detail": f"kv_cache_quant_algo {out['kv_cache_quant_algo']}, {len(scales)} per-layer scales "
        f"({float(scales.min()):.3g}..{float(scales.max()):.3g}) in {len(out['files'])} rank file(s)"
    }
