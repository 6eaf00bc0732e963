"""The corpus split and its token helpers, with a small real BPE tokenizer trained here (no model training)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bpcompile.compiler import corpus
from bpcompile.core.errors import UserError

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "tiny" / "verifier"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A real byte-level BPE tokenizer.json (vocab 512) on the train split; it puts `<s>` (id 1) before a text, as
    the shipped one does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.train_documents()[:10], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return d


def test_split_is_disjoint_deterministic_and_sized():
    train, held = corpus.train_text(), corpus.heldout_text()
    assert len(held) >= 30_000
    assert 0.05 < len(held) / (len(train) + len(held)) < 0.2
    # no held-out paragraph of substance is in train (the topics repeat each other verbatim)
    train_paras = {p.strip() for p in train.split("\n\n")}
    held_paras = [p.strip() for p in held.split("\n\n") if len(p.strip()) > 40]
    assert len(held_paras) > 50 and not [p for p in held_paras if p in train_paras]
    # nothing of substance lost: every long paragraph of every topic is in exactly one split
    from pydoc_data.topics import topics

    everything = {p.strip() for t in topics.values() for p in t.split("\n\n") if len(p.strip()) > 40}
    assert everything == {p for p in train_paras if len(p) > 40} | set(held_paras)
    corpus._split.cache_clear()  # recomputed from scratch: same split
    assert corpus.heldout_text() == held and corpus.train_text() == train
    assert len(corpus.fingerprint()) == 16


def test_heldout_prompts(tok_dir):
    prompts = corpus.heldout_prompts(tok_dir, 60, prompt_tokens=32, seed=0)
    assert len(prompts) == 60 and all(len(p) == 32 and p[0] == 1 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 60  # >= 50 distinct ones available
    assert corpus.heldout_prompts(tok_dir, 60, seed=0) == prompts  # deterministic
    assert corpus.heldout_prompts(tok_dir, 5, seed=0) == prompts[:5]  # first k of n
    assert corpus.heldout_prompts(tok_dir, 60, seed=1) != prompts
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    held = corpus.heldout_text()
    for p in prompts[:10]:  # decodes to held-out text (BOS dropped)
        assert tok.decode(p[1:]) in held
    # a tokenizers.Tokenizer object gives the same prompts as its file
    assert corpus.heldout_prompts(tok, 3) == prompts[:3]


def test_calibration_samples_from_train(tok_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    samples = corpus.calibration_samples(tok, 8, 64)
    assert len(samples) == 8 and all(len(s) == 64 and s[0] == 1 for s in samples)
    assert samples == corpus.calibration_samples(tok_dir, 8, 64)
    train = corpus.train_text()
    assert all(tok.decode(s[1:]) in train for s in samples)


def test_bad_requests_raise_user_error(tok_dir, tmp_path):
    with pytest.raises(UserError, match="distinct"):
        corpus.heldout_prompts(tok_dir, 100_000)
    with pytest.raises(UserError, match="length"):
        corpus.heldout_prompts(tok_dir, 1, prompt_tokens=1)
    with pytest.raises(UserError, match="tokenizer.json"):
        corpus.heldout_prompts(tmp_path, 1)


@pytest.mark.skipif(not (SHIPPED / "model.safetensors").exists(), reason="shipped tiny pair not present")
def test_shipped_pair_loads_and_generates():
    """The committed pair loads through transformers' Auto classes and continues held-out text sensibly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHIPPED)
    assert tok("a").input_ids[0] == tok.bos_token_id == 1 and tok.eos_token_id == 2
    draft_tok = AutoTokenizer.from_pretrained(SHIPPED.parent / "draft")
    text = corpus.heldout_text()[:2000]
    assert draft_tok(text).input_ids == tok(text).input_ids
    prompts = corpus.heldout_prompts(tok, 50)
    assert len({tuple(p) for p in prompts}) == 50
    model = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    cfg = model.config
    assert (
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
    ) == (4, 256, 4, 2, 64, 4096)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompts[0]]), max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id
        )
    new = out[0, len(prompts[0]) :]
    assert len(new) == 24
    # plausible: mostly distinct real word pieces, not one token repeated
    assert len(set(new.tolist())) >= 6
    assert any(c.isalpha() for c in tok.decode(new))
