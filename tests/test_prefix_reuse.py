"""Prefix reuse over the paged KV cache: multi-turn conversations give the same greedy tokens with reuse on and
off (speculation on; float caches, a feature draft), a prefix shared by concurrent conversations is held once,
and a pool too small for every conversation evicts cached pages and recomputes them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import noisy_copy, one_thread, random_llama  # noqa: F401  (one_thread: fixture)

from bpcompile.runtime.generator import Generator, SamplingParams, TreeSpec
from bpcompile.runtime.model import FeatureDraft, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ModelConfig(
    vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=16, intermediate_size=128
)
PAGE = 4


@pytest.fixture(scope="module")
def pair():
    v = random_llama(CFG, seed=0)
    return v, noisy_copy(v, 0.3, seed=1)


def conversations(n: int, system_len: int, seed: int = 0) -> tuple[list[int], list[list[list[int]]]]:
    """A system prompt and n conversations' three user turns (2-8 tokens each)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(2, 256, (system_len,), generator=g).tolist()
    users = [
        [torch.randint(2, 256, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(3)]
        for _ in range(n)
    ]
    return system, users


def chat(gen: Generator, system: list[int], users, max_tokens: int = 8):
    """Every conversation's turns, each turn's prompt the previous prompt + its answer + the next user turn; all
    conversations' turn t submitted together. -> (answers per turn, stats per turn)."""
    hist = [list(system) for _ in users]
    answers, stats = [], []
    for t in range(3):
        prompts = [h + u[t] for h, u in zip(hist, users)]
        res = gen.generate(prompts, SamplingParams(max_tokens=max_tokens))
        answers.append([toks for toks, _ in res])
        stats.append([s for _, s in res])
        hist = [p + toks for p, (toks, _) in zip(prompts, res)]
    return answers, stats


def make(pair, draft=None, **kw) -> Generator:
    return Generator(
        pair[0],
        pair[1] if draft is None else draft,
        TreeSpec("dynamic", nodes=5),
        max_batch_size=8,
        page_size=PAGE,
        max_seq_len=160,
        backoff=False,
        **kw,
    )


def feature_draft(pair) -> FeatureDraft:
    H = CFG.hidden_size
    w = {k: x for k, x in pair[1].w.items() if k.startswith("transformer.layers.0.")}
    w.update({"fc.weight": torch.randn(H, 2 * H, generator=torch.Generator().manual_seed(3)) / H**0.5})
    w["fc.bias"] = torch.zeros(H)
    return FeatureDraft(replace(CFG, num_layers=1), w, pair[0])


@pytest.mark.parametrize("draft", ["llama", "feature"])
def test_multi_turn_outputs_identical(pair, draft):
    """50 conversations x 3 turns (a shared 37-token system prompt, speculation on): greedy answers with reuse on
    equal those with reuse off; turns after the first reuse their previous prompt's pages (counted per request),
    the first turn the system prompt's; the hit rate is what the requests report; every page is back at the end
    (cached pages are evictable, none referenced)."""
    system, users = conversations(50, 37)
    d = feature_draft(pair) if draft == "feature" else None
    off, off_stats = chat(make(pair, d, prefix_reuse=False), system, users)
    gen = make(pair, d)
    assert gen.prefix_reuse  # float caches: on by default
    on, on_stats = chat(gen, system, users)
    assert on == off
    assert all(s.reused_tokens == 0 for turn in off_stats for s in turn)
    # turn 1: every conversation but the first admitted takes the system prompt's 9 full pages (36 tokens)
    assert sorted(s.reused_tokens for s in on_stats[0]) == [0] + [36] * 49
    for t in (1, 2):  # the previous turn's prompt, in full pages, at least
        assert all(s.reused_tokens >= 36 and s.reused_blocks == s.reused_tokens // PAGE for s in on_stats[t])
    reused = sum(s.reused_tokens for turn in on_stats for s in turn)
    assert gen.prefix_stats["reused_tokens"] == reused and gen.prefix_stats["requests"] == 150
    for kv in (gen.vkv, gen.dkv):
        assert kv.held_pages() == 0 and kv.available() == kv.capacity and kv.lru


def test_shared_system_prompt_held_once(pair):
    """16 concurrent conversations sharing a system prompt, admitted in one step: its pages are computed once and
    held once (the tables' first pages are the same pages), the rest of each prompt in pages of its own."""
    system, users = conversations(16, 100, seed=1)
    gen = Generator(pair[0], pair[1], TreeSpec("dynamic", nodes=5), max_batch_size=16, page_size=PAGE, max_seq_len=160)
    ids = [gen.add_request(system + u[0], SamplingParams(max_tokens=4)) for u in users]
    gen.step()  # admission and prefill of all 16
    shared = len(system) // PAGE  # 25 full pages
    for kv in (gen.vkv, gen.dkv):
        firsts = {tuple(kv.tables[i][:shared]) for i in ids}
        assert len(firsts) == 1  # one copy of the system prompt
        own = [set(kv.tables[i][shared:]) for i in ids]
        assert sum(map(len, own)) == len(set().union(*own))  # nothing else shared
        assert kv.held_pages() == shared + sum(map(len, own))
    assert sum(gen.running[i].stats.reused_tokens for i in ids) == 15 * len(system)
    while gen.has_work():
        gen.step()


def test_memory_pressure_evicts_and_recomputes(pair):
    """A pool a third of what the conversations' pages total: requests complete, cached pages are evicted and
    recomputed where a later prompt needs them (it reuses less than with a pool that keeps everything), and the
    answers equal those of reuse off."""
    system, users = conversations(20, 37, seed=2)
    ref, _ = chat(make(pair, None, prefix_reuse=False), system, users)
    _, roomy = chat(make(pair, None), system, users)
    gen = make(pair, None, num_pages=60)
    on, tight = chat(gen, system, users)
    assert on == ref
    assert gen.vkv.evicted > 0 and gen.dkv.evicted > 0
    pairs = [(a.reused_tokens, b.reused_tokens) for ta, tb in zip(tight, roomy) for a, b in zip(ta, tb)]
    assert all(a <= b for a, b in pairs) and any(a < b for a, b in pairs) and any(a > 0 for a, _ in pairs[20:])


def test_quantized_plan_with_a_recent_window(pair):
    """An INT4 plan with an 8-token exact window: off by default (outputs could differ); turned on, every prompt
    computes at least its last 8 tokens (their exact copies are its own) and reuses whole pages before them, the
    conversations complete, and every page comes back."""
    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory

    plan = replace(KVPlan.uniform("int4-naive", CFG.num_layers, CFG.num_kv_heads, CFG.head_size), recent_window=8)
    assert not make(pair, None, kv_store_factory=kv_store_factory(plan)).prefix_reuse
    gen = make(pair, None, kv_store_factory=kv_store_factory(plan), prefix_reuse=True)
    system, users = conversations(8, 37, seed=3)
    answers, stats = chat(gen, system, users)
    hist, bound = [list(system) for _ in users], 0
    for t in range(3):
        for c, s in enumerate(stats[t]):
            n = len(hist[c]) + len(users[c][t])
            limit = (n - 8) // PAGE * PAGE
            assert s.reused_tokens <= limit and s.reused_tokens % PAGE == 0
            bound += 0 < s.reused_tokens == limit < 36  # the window, not the cache, stopped it
            hist[c] = hist[c] + users[c][t] + answers[t][c]
    assert bound and all(s.reused_tokens >= 36 for s in stats[2])
    assert gen.vkv.held_pages() == 0 and gen.vkv.available() == gen.vkv.capacity


def test_identical_prompts_admitted_together_take_one_extra_round(pair):
    """Eight copies of a 40-token prompt admitted in one step: the first computes it, the other seven take its
    first 9 pages (the last page holds the last token, which is always computed) in one second round (one batched
    prefill, not one each), all with the same answer."""
    system, _ = conversations(1, 40, seed=4)
    gen = make(pair, None)
    calls = []
    real = gen.v_exec.prefill_cached
    gen.v_exec.prefill_cached = lambda reqs, *a, **kw: calls.append(len(reqs)) or real(reqs, *a, **kw)
    res = gen.generate([system] * 8, SamplingParams(max_tokens=6))
    assert calls == [7] and len({tuple(t) for t, _ in res}) == 1
    assert [s.reused_tokens for _, s in res] == [0] + [36] * 7
