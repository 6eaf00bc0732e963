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


def smollm2_like_plan(cfg: ModelConfig, window: int, sink: int = 0, group: int = 16):
    """A KV plan with the kinds of units SmolLM2's default plan has (KLT6 / KLT5 keys before RoPE, INT3 and INT4
    values, Hadamard rotation, an exact FP16 recent window), its tables shaped as calibration makes them."""
    from bpcompile.compiler.calibrate import water_filling_bits
    from bpcompile.runtime.kvcache import KVPlan
    from bpcompile.runtime.model import rope_inv_freq

    L, KV, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_size
    g = torch.Generator().manual_seed(0)
    prec = [{"k": ["klt6"] * KV, "v": ["int3"] * KV}, {"k": ["klt5"] * KV, "v": ["int4", "int3"][:KV]}][:L]
    lam = torch.logspace(0, -3, D)
    klt = {
        "mean": torch.randn(L, KV, D, generator=g) * 0.1,
        "weight": torch.rand(L, KV, D, generator=g) + 0.5,
        "bits": torch.zeros(L, KV, D, dtype=torch.int8),
        "step": torch.zeros(L, KV, D),
        "level": torch.zeros(L, KV, D),
        "basis": torch.zeros(L, KV, D, D, dtype=torch.float16),
        "inv_freq": rope_inv_freq(cfg).float(),
    }
    for layer, p in enumerate(prec):
        for h, x in enumerate(p["k"]):
            b = water_filling_bits(lam, int(x[3]) * D)
            klt["basis"][layer, h] = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0].half()
            klt["bits"][layer, h], klt["step"][layer, h] = b.to(torch.int8), lam.sqrt() / 2.0 ** b.float()
            klt["level"][layer, h] = torch.where(b == 1, lam.sqrt() * 0.8, 0.0)
    return KVPlan(
        "int4-fp8-outlier",
        L,
        KV,
        D,
        group,
        prec,
        k_channel_scale=torch.rand(L, KV, D, generator=g) + 0.5,
        int4_clip=torch.ones(L, 2, KV),
        rotation="hadamard",
        k_mean=torch.randn(L, KV, D, generator=g) * 0.1,
        sink_tokens=sink,
        recent_window=window,
        klt=klt,
    )


@pytest.mark.parametrize("window,sink,n", [(10, 0, 50), (6, 4, 16)])
def test_quantized_plan_outputs_identical(pair, window, sink, n):
    """SmolLM2's kinds of KV units (KLT keys, INT3 / INT4 values) with an exact recent window (and sink tokens):
    on by default; 50 (16) conversations x 3 turns give the same greedy answers with reuse on and off, and a prompt
    takes every full page before its last token, the recent window's included (the page's raw copies give the
    rest of the prompt what a full prefill attends to, and the window's exact copies what it writes)."""
    from bpcompile.runtime.kvcache import kv_store_factory

    factory = kv_store_factory(smollm2_like_plan(CFG, window, sink))
    system, users = conversations(n, 37, seed=3)
    off, _ = chat(make(pair, None, kv_store_factory=factory, prefix_reuse=False), system, users)
    gen = make(pair, None, kv_store_factory=factory)
    assert gen.prefix_reuse and gen.vkv.shadow and gen.vkv.recent is not None
    on, stats = chat(gen, system, users)
    assert on == off
    # turn 1: the system prompt's 9 pages although the window reaches into them (its last 2-8 user tokens);
    # later turns: the full pages of the previous turn's prompt that the pool still holds (50 conversations'
    # pages do not fit: the least recently used are evicted)
    assert sorted(s.reused_tokens for s in stats[0]) == [0] + [36] * (n - 1)
    prompt = [len(system) + len(u[0]) for u in users]
    for t in (1, 2):
        got, full = [s.reused_tokens for s in stats[t]], [n // PAGE * PAGE for n in prompt]
        assert all(36 <= a <= b for a, b in zip(got, full)) and any(a == b for a, b in zip(got, full))
        prompt = [n + len(a) + len(u[t]) for n, a, u in zip(prompt, on[t - 1], users)]
    assert gen.vkv.held_pages() == 0 and gen.vkv.available() == gen.vkv.capacity
    assert gen.vkv.evicted > 0 or n < 50  # 50 conversations' pages overflow the pool: evicted, recomputed, same


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


KERNEL_SCRIPT = r"""
import json, sys
sys.path.insert(0, "tests")
import torch
from conftest import noisy_copy, random_llama
from test_prefix_reuse import chat, conversations, make, smollm2_like_plan
from bpcompile.runtime.kvcache import kv_store_factory
from bpcompile.runtime.model import ModelConfig

torch.set_num_threads(1)
cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=32,
                  intermediate_size=128)
v = random_llama(cfg, seed=0)
pair = (v, noisy_copy(v, 0.3, seed=1))
factory = kv_store_factory(smollm2_like_plan(cfg, 6, sink=2, group=32))
system, users = conversations(2, 21, seed=5)
off, _ = chat(make(pair, None, kv_store_factory=factory, prefix_reuse=False), system, users, max_tokens=3)
gen = make(pair, None, kv_store_factory=factory)
on, stats = chat(gen, system, users, max_tokens=3)
print(json.dumps({"on": on, "off": off, "kernels": gen.vkv.kern is not None and gen.vkv.dense is None,
                  "reused": [[s.reused_tokens for s in turn] for turn in stats]}))
"""


def test_quantized_plan_through_the_kernels():
    """The same through the Triton kernels (Triton's interpreter on CPU; compiled on a GPU): a reused prompt's rest
    attends to its prefix as computed, its exact copies (sink tokens, recent window) are written in the kernels'
    rows, and greedy answers equal reuse off."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, BPCOMPILE_KERNELS="triton", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-c", KERNEL_SCRIPT], capture_output=True, text=True, env=env, timeout=600, cwd=root
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "using the PyTorch path" not in r.stderr, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["kernels"]
    assert out["on"] == out["off"]
    assert sorted(out["reused"][0]) == [0, 20] and all(n >= 20 for n in out["reused"][1] + out["reused"][2])


def test_the_switch_precedence(monkeypatch):
    """A caller's setting, then --prefix-reuse ($BPCOMPILE_PREFIX_REUSE), then the recipe's (auto: the default, on);
    a bad value names the variable (exit 2)."""
    from bpcompile.core.errors import UserError
    from bpcompile.runtime.generator import _prefix_reuse

    monkeypatch.delenv("BPCOMPILE_PREFIX_REUSE", raising=False)
    assert _prefix_reuse(None, "auto") is None and _prefix_reuse(None, False) is False
    monkeypatch.setenv("BPCOMPILE_PREFIX_REUSE", "off")
    assert _prefix_reuse(None, True) is False and _prefix_reuse(True, False) is True
    monkeypatch.setenv("BPCOMPILE_PREFIX_REUSE", "on")
    assert _prefix_reuse(None, False) is True
    monkeypatch.setenv("BPCOMPILE_PREFIX_REUSE", "yes")
    with pytest.raises(UserError, match="BPCOMPILE_PREFIX_REUSE"):
        _prefix_reuse(None, "auto")


def test_chunked_prompts_sharing_a_prefix_compute_it_once(pair):
    """Prompts longer than the prefill budget (chunked prefill) sharing a 40-token system prompt, submitted together:
    the first computes it, the others wait for its pages instead of computing them again; answers == reuse off."""
    system, users = conversations(4, 40, seed=6)
    prompts = [system + u[0] for u in users]
    off = [t for t, _ in make(pair, None, prefix_reuse=False).generate(prompts, SamplingParams(max_tokens=4))]
    res = make(pair, None, prefill_chunk=8).generate(prompts, SamplingParams(max_tokens=4))
    assert [t for t, _ in res] == off
    assert [s.reused_tokens for _, s in res] == [0, 40, 40, 40]
