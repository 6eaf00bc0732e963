"""Chunked prefill (runtime/chunked.py): with a per-step prompt-token budget, greedy outputs equal those of the
unchunked prefill for a float cache, a quantized plan with a recent window (its exact copies written a chunk at a
time) and a feature draft, speculation on, prefix reuse on and off; a long prompt is spread over steps while the
running sequences keep decoding, each step spending at most the budget."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import noisy_copy, one_thread, random_llama  # noqa: F401  (one_thread: fixture)
from test_prefix_reuse import CFG, PAGE, feature_draft

from bpcompile.core.errors import UserError
from bpcompile.runtime.generator import Generator, SamplingParams, TreeSpec
from bpcompile.runtime.kvcache import KVPlan, kv_store_factory

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    v = random_llama(CFG, seed=0)
    return v, noisy_copy(v, 0.3, seed=1)


def make(pair, kind: str, chunk: int, reuse: bool) -> Generator:
    kw = {}
    if kind == "int4-window":
        plan = replace(KVPlan.uniform("int4-naive", CFG.num_layers, CFG.num_kv_heads, CFG.head_size), recent_window=8)
        kw["kv_store_factory"] = kv_store_factory(plan)
    return Generator(
        pair[0],
        feature_draft(pair) if kind == "feature" else pair[1],
        TreeSpec("dynamic", nodes=5),
        max_batch_size=4,
        page_size=PAGE,
        max_seq_len=160,
        backoff=False,
        prefix_reuse=reuse,
        prefill_chunk=chunk,
        **kw,
    )


def workload(seed: int = 0) -> list[tuple[int, list[int]]]:
    """(step at which it arrives, prompt): 14 prompts of 3-110 tokens, half of them opening with the same 40-token
    system prompt (prefix reuse has pages to take), arriving while earlier ones decode."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(2, 256, (40,), generator=g).tolist()
    out = []
    for i in range(14):
        n = [3, 110, 17, 64, 9, 90, 33][i % 7]
        p = torch.randint(2, 256, (n,), generator=g).tolist()
        out.append((2 * i, (system + p)[:110] if i % 2 else p))
    return out


def run(gen: Generator, work, max_tokens: int = 8):
    """Feed the workload step by step -> (tokens per prompt, per step: (prompt tokens computed, requests that got
    tokens while some prompt was part-way))."""
    toks: dict[str, list[int]] = {}
    ids, step, trace = [], 0, []
    pending = list(work)
    while pending or gen.has_work():
        while pending and pending[0][0] <= step:
            ids.append(gen.add_request(pending.pop(0)[1], SamplingParams(max_tokens=max_tokens)))
        part = set(gen.chunks.state) if gen.chunks is not None else set()
        before = {r.id: len(r.prompt) - r.v_len for r in gen.running.values()}
        for o in gen.step():
            toks.setdefault(o.request_id, []).extend(o.new_tokens)
        trace.append((part, before))
        step += 1
    return [toks[i] for i in ids], trace


@pytest.mark.parametrize("kind", ["float", "int4-window", "feature"])
@pytest.mark.parametrize("reuse", [False, True])
def test_chunked_outputs_equal_unchunked(pair, kind, reuse):
    """Budgets of 16 and 7 tokens a step against the whole-prompt prefill: the same greedy tokens for every prompt;
    prompts longer than the budget were part-way at some step, and while one was, sequences already prefilled
    still got their tokens (the steps interleave)."""
    work = workload()
    ref, _ = run(make(pair, kind, 0, reuse), work)
    for chunk in (16, 7):
        gen = make(pair, kind, chunk, reuse)
        got, trace = run(gen, work)
        assert got == ref, (kind, reuse, chunk)
        assert any(part for part, _ in trace)
        assert not gen.chunks.state and not gen.chunks.queue and not gen.v_exec.chunks
        assert gen.vkv.held_pages() == 0 or reuse
    if reuse:  # the system prompt's pages were taken by later prompts, chunked ones among them
        assert gen.prefix_stats["reused_tokens"] >= 40 // PAGE * PAGE


def test_budget_per_step_and_interleaving(pair):
    """A 110-token prompt arriving while three sequences decode, budget 16: it takes ceil(110 / 16) = 7 steps,
    in each of which the three others got one step's tokens; the verifier computes at most 16 prompt tokens a step
    (counted by its chunk forwards)."""
    gen = make(pair, "float", 16, False)
    ids = [gen.add_request(list(range(2, 12)), SamplingParams(max_tokens=40)) for _ in range(3)]
    gen.step()  # 10 tokens of the first prompt whole, 6 of the second
    gen.step()  # the second's last 4, the third whole
    assert all(gen.running[i].v_len for i in ids)
    seen = []
    real = gen.v_exec.prefill_chunk
    gen.v_exec.prefill_chunk = lambda r, m, n, last, **kw: seen.append(n) or real(r, m, n, last, **kw)
    long_id = gen.add_request(list(range(2, 112)), SamplingParams(max_tokens=4))
    steps = 0
    while not gen.running.get(long_id) or not gen.running[long_id].v_len:
        outs = gen.step()
        steps += 1
        assert {o.request_id for o in outs if o.new_tokens} >= set(ids)  # the others decoded in the same step
    assert seen == [16] * 6 + [14] and steps == 7


def test_bad_budget(pair):
    with pytest.raises(UserError, match="prefill_chunk"):
        make(pair, "float", -1, False)


def test_context_logits_gathered_over_chunks(pair):
    """A 90-token prompt asking for every position's logits, prefilled 16 tokens a step: the logits of the whole
    prompt (to float32 rounding) and the tokens of the unchunked prefill."""
    from bpcompile.runtime.generator import SamplingParams as SP

    prompt = torch.randint(2, 256, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    outs = []
    for chunk in (0, 16):
        gen = make(pair, "float", chunk, False)
        rid = gen.add_request(prompt, SP(max_tokens=6, context_logits=True))
        got, logits = [], None
        while gen.has_work():
            for o in gen.step():
                got += o.new_tokens
                logits = o.context_logits if o.context_logits is not None else logits
        outs.append((got, logits))
        assert rid not in gen.running
    (a, la), (b, lb) = outs
    assert a == b and la.shape == lb.shape == (90, CFG.vocab_size)
    assert torch.allclose(la, lb, atol=1e-4, rtol=1e-4), (la - lb).abs().max()
