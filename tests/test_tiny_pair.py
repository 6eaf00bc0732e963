"""The shipped tiny pair is what docs/BENCHMARKS.md says it is: the verifier clearly the better model on
held-out text, the draft agreeing with it often enough to speculate, and models/tiny/metrics.json true.

Recomputed here through transformers (as any consumer loads them), independently of the training
script: the held-out split of bpcompile.compiler.corpus, cut into windows of <s> + 255 tokens.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY

from bpcompile.compiler import corpus

SEQ = 256


@pytest.fixture(scope="module")
def heldout():
    if not (TINY / "verifier" / "model.safetensors").is_file():
        pytest.skip("models/tiny not present")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY / "verifier")
    ids: list[int] = []
    for doc in corpus.heldout_documents():
        ids += tok.encode(doc, add_special_tokens=False) + [tok.eos_token_id]
    body = SEQ - 1
    rows = [ids[s : s + body] for s in range(0, len(ids) - body + 1, body)]
    x = torch.tensor([[tok.bos_token_id] + r for r in rows])
    logits = {}
    with torch.no_grad():
        for kind in ("verifier", "draft"):
            m = AutoModelForCausalLM.from_pretrained(TINY / kind, dtype=torch.float32).eval()
            logits[kind] = torch.cat([m(input_ids=x[i : i + 8]).logits.float() for i in range(0, len(x), 8)])
    return x, logits


def _ppl(x, logits):
    return math.exp(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item())


def test_verifier_clearly_better_and_draft_agrees(heldout):
    x, logits = heldout
    ver, dr = _ppl(x, logits["verifier"]), _ppl(x, logits["draft"])
    assert ver < 0.85 * dr, f"verifier ppl {ver:.2f} is not clearly below the draft's {dr:.2f}"
    agree = (logits["verifier"].argmax(-1) == logits["draft"].argmax(-1)).float().mean().item()
    assert agree > 0.4, f"draft agrees with the verifier on only {agree:.1%} of held-out positions"


def test_metrics_json_is_true(heldout):
    x, logits = heldout
    m = json.loads((TINY / "metrics.json").read_text())
    if m["corpus"]["fingerprint"] != corpus.fingerprint():
        pytest.skip("metrics.json was measured on another Python's pydoc_data.topics")
    for kind in ("verifier", "draft"):
        assert _ppl(x, logits[kind]) == pytest.approx(m["heldout_perplexity"][kind], rel=1e-3)
    agree = (logits["verifier"].argmax(-1) == logits["draft"].argmax(-1)).float().mean().item()
    assert agree == pytest.approx(m["teacher_forced_top1_agreement"], abs=1e-3)
