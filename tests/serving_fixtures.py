"""Engine versions for the serving tests: real converted checkpoints in an engine version directory.

Source of the models, first that exists:
1. $BPCOMPILE_TEST_ENGINE: an engine version directory (e.g. engines/tiny/1 from `bpcompile build recipes/tiny.yaml`),
2. the shipped tiny pair: `bpcompile build` of recipes/tiny.yaml (outputs redirected to a temporary store),
3. small random Llamas with the tiny tokenizer (the draft a copy of the verifier, so drafts are accepted).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from conftest import update_engine_config, write_engine_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"

RECIPE = {
    "name": "tiny",
    "limits": {"max_batch_size": 16, "max_input_len": 384, "max_seq_len": 512},
    "kv_cache": {"format": "fp16", "page_size": 16},
    "speculative": {"tree": "dynamic", "nodes": 5},
    "target": "native",
    "triton": {"emit": True, "version_policy": "latest", "generator_instances": 1},
}


def _hf_pair(root: Path) -> tuple[Path, Path]:
    if (TINY / "verifier" / "config.json").is_file() and (TINY / "draft" / "config.json").is_file():
        return TINY / "verifier", TINY / "draft"
    from tests.pairs import make_model

    v = root / "hf-verifier"
    if not (v / "config.json").is_file():
        make_model(v, vocab=4096, seed=0, hidden_size=64, num_hidden_layers=2, intermediate_size=128)
        shutil.copy2(TINY / "verifier" / "tokenizer.json", v)
        shutil.copy2(TINY / "verifier" / "tokenizer_config.json", v)
    return v, v


def make_engine(dst: Path, version: int = 1, *, recipe_overrides: dict | None = None) -> Path:
    """An engine version directory at dst (verifier/, draft/, tokenizer/, engine.json, manifest.json)."""
    src = os.environ.get("BPCOMPILE_TEST_ENGINE")
    dst = Path(dst)
    if src:
        shutil.copytree(src, dst)
        if recipe_overrides:
            update_engine_config(dst, **recipe_overrides)
        m = json.loads((dst / "manifest.json").read_text())
        m["version"] = version
        (dst / "manifest.json").write_text(json.dumps(m))
        return dst
    if (TINY / "verifier" / "config.json").is_file() and (TINY / "draft" / "config.json").is_file():
        return _built(dst, version, recipe_overrides)
    from bpcompile.compiler.convert import convert_checkpoint
    from bpcompile.core.store import artifact_hashes

    v, d = _hf_pair(dst.parent)
    dst.mkdir(parents=True)
    convert_checkpoint(v, dst / "verifier")
    convert_checkpoint(d, dst / "draft")
    (dst / "tokenizer").mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(v / f, dst / "tokenizer" / f)
    write_engine_config(dst, **{**RECIPE, **(recipe_overrides or {})})
    (dst / "manifest.json").write_text(
        json.dumps(
            {
                "name": "tiny",
                "version": version,
                "build_id": f"test-{version}-{v.name}",
                "artifacts": artifact_hashes(dst),
            }
        )
    )
    return dst


def _built(dst: Path, version: int, recipe_overrides: dict | None) -> Path:
    """Version `version` of recipes/tiny.yaml built by the real build pipeline (--force for later versions),
    copied to dst."""
    from bpcompile.compiler.pipeline import build

    store = dst.parent / "_store"
    store.mkdir(parents=True, exist_ok=True)
    text = (REPO / "recipes" / "tiny.yaml").read_text().replace("../models/tiny", str(TINY))
    text = text.replace("store: ../engines", f"store: {store / 'engines'}").replace(
        "triton_repo: ../triton_repo", f"triton_repo: {store / 'triton_repo'}"
    )
    recipe = store / "tiny.yaml"
    recipe.write_text(text)
    res = build(recipe, force=version > 1)
    shutil.copytree(res.path, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["version"] = version
    (dst / "manifest.json").write_text(json.dumps(m))
    if recipe_overrides:
        update_engine_config(dst, **recipe_overrides)
    return dst
