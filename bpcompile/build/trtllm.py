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

from bpcompile.core.errors import MissingDependency
from bpcompile.build.recipe import Recipe

SUPPORTED = "TensorRT-LLM 1.2.x (or 1.3.0rc1-rc20)"
HOWTO = ("build inside a TensorRT-LLM 1.2 container (for example nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 "
         "with tensorrt_llm 1.2.x), or set `target: native` in the recipe")


def trtllm_version() -> Optional[str]:
    """Version of the importable tensorrt_llm package, or None. Imported in a subprocess: importing
    tensorrt_llm initialises CUDA and can take tens of seconds or abort where no GPU exists."""
    if shutil.which("trtllm-build") is None:
        return None
    try:
        out = subprocess.run(["python3", "-c", "import tensorrt_llm; print(tensorrt_llm.__version__)"],
                             capture_output=True, text=True, timeout=300)
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
        raise MissingDependency(f"target 'tensorrt-llm' needs {SUPPORTED} with `trtllm-build` on PATH; "
                                f"none was found on this machine. The converted checkpoints bpcompile writes are "
                                f"valid trtllm-build input: {HOWTO}.", key="target")
    if not version_supported(v):
        raise MissingDependency(f"found tensorrt_llm {v}, but bpcompile targets {SUPPORTED}: later releases removed "
                                f"trtllm-build and the TensorRT engine flow; {HOWTO}.", key="target")
    return v


def build_commands(recipe: Recipe, version_dir: Path) -> dict[str, list[str]]:
    """The trtllm-build command lines for the verifier and the draft engine (pure; tested without TensorRT).

    The verifier is built to accept externally drafted tokens (`draft_tokens_external`) with room for the
    whole tree (`max_draft_len` = node budget); the tree mask and the INT4/FP8 KV cache are provided by
    bpcompile's plugin library (bpcompile/plugins/trt), loaded before build and deserialization.
    """
    lim, spec = recipe.limits, recipe.speculative
    draft_len = {"dynamic": spec.nodes, "chain": spec.length, "none": 0,
                 "static": len(spec.choices or [])}[spec.tree]
    common = ["--max_batch_size", str(lim.max_batch_size), "--max_input_len", str(lim.max_input_len),
              "--max_seq_len", str(lim.max_seq_len), "--kv_cache_type", "paged",
              "--gpt_attention_plugin", "auto", "--gemm_plugin", "auto", "--remove_input_padding", "enable",
              "--context_fmha", "enable", "--tokens_per_block", str(recipe.kv_cache.page_size)]
    out = version_dir / "trtllm"
    verifier = ["trtllm-build", "--checkpoint_dir", str(version_dir / "verifier"), "--output_dir", str(out / "verifier"),
                *common]
    if draft_len:
        verifier += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(draft_len)]
    draft = ["trtllm-build", "--checkpoint_dir", str(version_dir / "draft"), "--output_dir", str(out / "draft"),
             *common, "--gather_generation_logits"]
    return {"verifier": verifier, "draft": draft}


def trtllm_stage(stage: Path, recipe: Recipe) -> dict:
    require_trtllm()
    cmds = build_commands(recipe, stage)
    (stage / "trtllm").mkdir(exist_ok=True)
    (stage / "trtllm" / "build.sh").write_text(
        "#!/usr/bin/env bash\nset -euo pipefail\n" + "\n".join(shlex.join(c) for c in cmds.values()) + "\n")
    for name, cmd in cmds.items():
        subprocess.run(cmd, check=True)
    return {"detail": "engines: " + ", ".join(cmds)}
