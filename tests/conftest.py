"""Shared fixtures: small random Hugging Face checkpoints saved the way real ones are (safetensors)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"

# Small enough for a shared 2-core CPU; GQA with 4 query heads over 2 KV heads, odd vocab.
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


def make_hf_model(path: Path, arch: str = "llama", *, seed: int = 0, init_std: float = 0.1,
                  max_shard_size: str | None = None, dtype: torch.dtype = torch.float32, **overrides) -> Path:
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
