"""Shared fixtures: small random Hugging Face checkpoints saved the way real ones are (safetensors)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"

# Small enough for a shared 2-core CPU; GQA with 4 query heads over 2 KV heads, odd vocab.
SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def make_hf_model(
    path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    init_std: float = 0.1,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> Path:
    """Save a random transformers model (llama | mistral | qwen2) with safetensors into `path`; return it.

    Every parameter is random, norm weights included (around 1), so swapped or misplaced tensors
    change the logits. `max_shard_size` (e.g. "20KB") writes a sharded checkpoint with an index.
    """
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    kw = {**SMALL, **overrides}
    if arch == "mistral":
        kw.setdefault("sliding_window", None)
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**kw)).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, init_std)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def make_hf_llama(path: Path, **overrides) -> Path:
    return make_hf_model(path, "llama", **overrides)


@pytest.fixture
def hf_llama(tmp_path):
    """A small random GQA Llama checkpoint directory."""
    return make_hf_llama(tmp_path / "hf")


def write_engine_config(engine_dir: Path, **sections) -> Path:
    """engine.json for a hand-made engine version: EngineConfig's defaults (name 'tiny'), the given sections
    over them (a section given as a dict replaces the whole section)."""
    from bpcompile.core.engine import EngineConfig

    EngineConfig.model_validate({"name": "tiny", **sections}).save(engine_dir)
    return engine_dir


def update_engine_config(engine_dir: Path, **sections) -> None:
    """Replace top-level sections of an existing engine version's engine.json (and its manifest's record of it, so
    the version still verifies)."""
    import json

    f = Path(engine_dir) / "engine.json"
    write_engine_config(engine_dir, **{**json.loads(f.read_text()), **sections})
    rerecord(engine_dir, "engine.json")


def rerecord(engine_dir: Path, rel: str) -> None:
    """Record a file a test changed on purpose in the version's manifest, as a rebuild would, so the version still
    verifies at load."""
    import json

    from bpcompile.core.store import MANIFEST, sha256_file

    f, m = Path(engine_dir) / rel, Path(engine_dir) / MANIFEST
    if m.is_file() and rel in json.loads(m.read_text()).get("artifacts", {}):
        man = json.loads(m.read_text())
        man["artifacts"][rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
        m.write_text(json.dumps(man))


# full-tensor renames (no sharding), an independent statement of what merge_ranks should give and its way back


def hf_to_trtllm(hf: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """HF state dict -> full tensors under TRT-LLM names (merge_ranks' output form). cfg: TRT-LLM config."""
    from bpcompile.core.checkpoint import hf_to_trtllm_name

    out = {}
    for name, t in hf.items():
        trt = hf_to_trtllm_name(name)
        if trt is not None and not (trt == "lm_head.weight" and cfg.get("tie_word_embeddings")):
            out[trt] = t
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}.self_attn."
        for kind in ("weight", "bias"):
            if p + f"q_proj.{kind}" in hf:
                out[f"transformer.layers.{l}.attention.qkv.{kind}"] = torch.cat(
                    [hf[p + f"{x}_proj.{kind}"] for x in "qkv"]
                )
    return out


def trtllm_to_hf(trt: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """Inverse of hf_to_trtllm: full TRT-LLM tensors -> HF state dict (q/k/v unfused)."""
    H, KV = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    D = cfg.get("head_size") or cfg["hidden_size"] // H
    from bpcompile.core.checkpoint import _LAYER_RE, GLOBAL_NAMES, LAYER_NAMES

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


@pytest.fixture
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is ~10x faster than two contending ones."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_models(tmp: Path):
    """The shipped tiny pair (models/tiny) converted under tmp and loaded: (verifier, draft) Llama modules."""
    from bpcompile.compiler.convert import convert_checkpoint
    from bpcompile.runtime.model import Llama

    models = []
    for name in ("verifier", "draft"):
        convert_checkpoint(TINY / name, tmp / name)
        models.append(Llama.from_checkpoint(tmp / name))
    return models[0], models[1]


def random_llama(cfg, seed: int, scale: float = 1.0):
    """A Llama (bpcompile.runtime.model) with random weights under TensorRT-LLM names; `scale` sharpens the
    output distribution."""
    from bpcompile.runtime.model import Llama

    g = torch.Generator().manual_seed(seed)

    def r(*shape, std):
        return torch.randn(*shape, generator=g) * std

    h, d, inter = cfg.hidden_size, cfg.head_size, cfg.intermediate_size
    w = {
        "transformer.vocab_embedding.weight": r(cfg.vocab_size, h, std=1.0),
        "transformer.ln_f.weight": 1 + r(h, std=0.1),
        "lm_head.weight": r(cfg.vocab_size, h, std=scale * 3 / math.sqrt(h)),
    }
    for i in range(cfg.num_layers):
        p = f"transformer.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + r(h, std=0.1)
        w[p + "post_layernorm.weight"] = 1 + r(h, std=0.1)
        w[p + "attention.qkv.weight"] = r((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h, std=h**-0.5)
        w[p + "attention.dense.weight"] = r(h, cfg.num_heads * d, std=(cfg.num_heads * d) ** -0.5)
        w[p + "mlp.fc.weight"] = r(inter, h, std=h**-0.5)
        w[p + "mlp.gate.weight"] = r(inter, h, std=h**-0.5)
        w[p + "mlp.proj.weight"] = r(h, inter, std=inter**-0.5)
    return Llama(cfg, w)


def noisy_copy(model, noise: float, seed: int):
    """A draft that mostly agrees with the verifier: its weights plus relative Gaussian noise."""
    from bpcompile.runtime.model import Llama

    g = torch.Generator().manual_seed(seed)
    return Llama(model.cfg, {k: v + noise * v.std() * torch.randn(v.shape, generator=g) for k, v in model.w.items()})


# Per-test timeouts (`@pytest.mark.timeout(N)`) are there to catch hangs, not slow machines: each N was set on a
# quiet 2-core machine, and on a busy or slower one a healthy test can take several times as long. So every
# timeout is scaled by how much slower than that machine this one runs at the start of the session (a short
# single-threaded calibration, or the load average per core if that is higher), times 2 for drift during the run.
# TIMEOUT_FACTOR=<x> sets the factor instead.
CALIBRATION_REFERENCE_S = 0.15  # the calibration's time on the reference machine (2-core Xeon VM, load ~2)


def _calibration_s() -> float:
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = math.inf
        for _ in range(3):
            t = time.perf_counter()
            a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
            for _ in range(200):
                a = torch.tanh(a @ a * 0.01)
            s = 0
            for i in range(300_000):
                s += i * i
            best = min(best, time.perf_counter() - t)
        return best
    finally:
        torch.set_num_threads(threads)


def timeout_factor() -> float:
    import os

    if os.environ.get("TIMEOUT_FACTOR"):
        return float(os.environ["TIMEOUT_FACTOR"])
    load = os.getloadavg()[0] / (os.cpu_count() or 1) if hasattr(os, "getloadavg") else 0.0
    return 2.0 * min(10.0, max(1.0, _calibration_s() / CALIBRATION_REFERENCE_S, load))


def pytest_collection_modifyitems(config, items):
    marked = [(item, item.get_closest_marker("timeout")) for item in items]
    marked = [(item, m) for item, m in marked if m is not None and (m.args or "timeout" in m.kwargs)]
    if not marked:
        return
    factor = timeout_factor()
    config.timeout_factor = factor
    for item, m in marked:
        kwargs = dict(m.kwargs)
        seconds = kwargs.pop("timeout") if "timeout" in kwargs else m.args[0]
        item.add_marker(pytest.mark.timeout(seconds * factor, *m.args[1:], **kwargs), append=False)


@pytest.fixture(autouse=True)
def _restore_switches():
    """The commands' switch flags (--kernels, --cpu-kernels, --kv-memory-limit) set environment variables so that
    the processes a command starts inherit them; a command run in-process by a test must not leave them set for
    the tests after it."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("BPCOMPILE_")}
    yield
    for k in [k for k in os.environ if k.startswith("BPCOMPILE_") and k not in saved]:
        del os.environ[k]
    os.environ.update(saved)
