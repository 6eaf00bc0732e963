"""What is in a directory: an engine version, a converted (TensorRT-LLM) checkpoint, or an HF checkpoint.

Reads only JSON and safetensors headers, never tensor data, so it is instant even on a 70B checkpoint; except that
an engine version's files are checked against the sizes and sha256 its manifest records (every byte read: about
1-2 s per GB; verify=False skips it).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections import Counter
from math import prod
from pathlib import Path

from bpcompile.compiler.hf import read_header
from bpcompile.core.errors import UserError
from bpcompile.core.store import MANIFEST, dir_size, verify_version


def machine() -> str:
    """One line naming the CPU, its cores, torch's threads and the load average: what a benchmark figure ran on."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln
        )
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, load average {load}"


def shards_summary(d: Path) -> dict:
    shards, params, dtypes = [], 0, Counter()
    for f in sorted(d.glob("*.safetensors")):
        h, _ = read_header(f)  # validated header, no tensor data
        n = sum(prod(t["shape"]) for t in h.values())
        params += n
        dtypes.update({t["dtype"]: prod(t["shape"]) for t in h.values()})
        shards.append({"file": f.name, "bytes": f.stat().st_size, "tensors": len(h), "params": n})
    return {"shards": shards, "parameters": params, "dtypes": dict(dtypes), "bytes": sum(s["bytes"] for s in shards)}


def checkpoint_info(d: Path) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("architecture") == "FeatureDraft":  # a draft on the verifier's features (runtime/model.py)
        info = {
            "kind": "feature-draft",
            "architecture": "FeatureDraft",
            "layers": cfg.get("num_layers"),
            "intermediate": cfg.get("intermediate_size"),
        }
    elif "architecture" in cfg:  # TensorRT-LLM checkpoint
        m = cfg.get("mapping", {})
        info = {
            "kind": "trtllm-checkpoint",
            "architecture": cfg["architecture"],
            "dtype": cfg.get("dtype"),
            "tp": m.get("tp_size", 1),
            "pp": m.get("pp_size", 1),
            "layers": cfg.get("num_hidden_layers"),
            "hidden": cfg.get("hidden_size"),
            "heads": cfg.get("num_attention_heads"),
            "kv_heads": cfg.get("num_key_value_heads"),
            "head_size": cfg.get("head_size"),
            "vocab": cfg.get("vocab_size"),
        }
    else:
        info = {
            "kind": "hf-checkpoint",
            "architecture": (cfg.get("architectures") or ["?"])[0],
            "dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
            "layers": cfg.get("num_hidden_layers"),
            "hidden": cfg.get("hidden_size"),
            "heads": cfg.get("num_attention_heads"),
            "kv_heads": cfg.get("num_key_value_heads"),
            "head_size": cfg.get("head_dim"),
            "vocab": cfg.get("vocab_size"),
        }
    info.update(shards_summary(d))
    info["path"] = str(d)
    return info


def verification(d: Path) -> dict:
    """{"ok", "problem" (what differs from the manifest, naming the file), "seconds"}."""
    t0 = time.perf_counter()
    try:
        verify_version(d)
        problem = None
    except UserError as e:
        problem = str(e)
    return {"ok": problem is None, "problem": problem, "seconds": round(time.perf_counter() - t0, 3)}


def inspect_path(path: str | Path, verify: bool = True) -> dict:
    """What PATH is. An engine version's result has "verified" (see `verification`; None when not asked)."""
    d = Path(path)
    if not d.is_dir():
        raise UserError(
            "not a directory (expected an engine version, a converted checkpoint or an HF checkpoint)", file=str(d)
        )
    if (d / MANIFEST).is_file():
        m = json.loads((d / MANIFEST).read_text())
        parts = {}
        for sub in sorted(p for p in d.iterdir() if p.is_dir()):
            parts[sub.name] = checkpoint_info(sub) if (sub / "config.json").is_file() else {"bytes": dir_size(sub)}
        return {
            "kind": "engine-version",
            "path": str(d),
            "name": m.get("name"),
            "version": m.get("version"),
            "build_id": m.get("build_id"),
            "published": m.get("published"),
            "bytes": dir_size(d),
            "stages": m.get("stages", []),
            "tools": m.get("tools", {}),
            "contents": parts,
            "verified": verification(d) if verify else None,
        }
    if (d / "config.json").is_file():
        return checkpoint_info(d)
    raise UserError("no manifest.json or config.json here: not an engine version or a checkpoint", file=str(d))
