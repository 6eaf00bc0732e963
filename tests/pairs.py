"""Small real HF checkpoints for build/recipe/CLI tests: random LlamaForCausalLM weights saved with
safetensors, and a byte-level BPE tokenizer trained on a few pydoc topics (seconds, deterministic)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_tokenizer(out: Path, vocab: int = 300, text_keys: int = 6) -> None:
    import pydoc_data.topics as t

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    keys = sorted(t.topics)[:text_keys]
    tok.train_from_iterator([t.topics[k] for k in keys], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )


def make_model(out: Path, vocab: int = 300, seed: int = 0, **cfg) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    base = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
    )
    base.update(cfg)
    model = LlamaForCausalLM(LlamaConfig(**base)).float()
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_pair(root: Path, vocab: int = 300) -> tuple[Path, Path]:
    v = make_model(root / "verifier", vocab=vocab, seed=0)
    d = make_model(
        root / "draft",
        vocab=vocab,
        seed=1,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    for m in (v, d):
        make_tokenizer(m, vocab=vocab)
    return v, d


def write_recipe(path: Path, verifier: Path, draft: Path, extra: str = "", name: str = "t") -> Path:
    path.write_text(f"""name: {name}
models:
  verifier: {{path: {verifier}, dtype: float32}}
  draft: {{path: {draft}, dtype: float32}}
parallel: {{tp: 1, pp: 1}}
limits: {{max_batch_size: 4, max_input_len: 64, max_seq_len: 128}}
kv_cache: {{format: fp16}}
output: {{store: {path.parent / "engines"}, triton_repo: {path.parent / "triton_repo"}}}
triton: {{emit: false}}
kernels: {{compile: false}}
{extra}""")
    return path
