"""Draft trees, TensorRT-LLM's packed tree mask, and the losslessness of speculative sampling."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from conftest import one_thread, random_llama  # noqa: F401  (one_thread: fixture)

from bpcompile.core.errors import UserError
from bpcompile.kernels.tree_mask import pack_tree_mask, unpack_tree_mask
from bpcompile.runtime.generator import Generator, SamplingParams
from bpcompile.runtime.model import ModelConfig
from bpcompile.runtime.speculative import (
    AcceptanceCalibration,
    DraftTree,
    DynamicBuilder,
    Sampling,
    StaticBuilder,
    TreeSpec,
    parse_tree_spec,
    probs_from_logits,
    residual_rule,
    sort_choices,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------ packed mask


def _brute_mask(parents):
    """Independent construction: dense bool G x G by walking up the parents, packed bit by bit with numpy."""
    import numpy as np

    g = len(parents)
    dense = np.zeros((g, g), dtype=bool)
    for i in range(g):
        j = i
        while j >= 0:
            dense[i, j] = True
            j = parents[j]
    words = (g + 31) // 32
    out = np.zeros((g, words), dtype=np.uint32)
    for i, j in zip(*np.nonzero(dense)):
        out[i, j // 32] |= np.uint32(1) << np.uint32(j % 32)
    return torch.from_numpy(out.view(np.int32).copy())


def test_packed_mask_documented_examples():
    # TensorRT-LLM's packed tree mask: row 0 (the true token) is 1; row i sets bit j%32 of word j//32 for itself, its
    # ancestors and node 0; bit 31 makes a negative int32.
    assert pack_tree_mask([-1]).tolist() == [[1]]
    # Medusa choices [[0], [1], [0, 0]] -> nodes 0 (true), 1 = [0], 2 = [1], 3 = [0, 0]
    assert pack_tree_mask([-1, 0, 0, 1]).tolist() == [[0b1], [0b11], [0b101], [0b1011]]
    chain = pack_tree_mask(list(range(-1, 32)))  # 33 nodes in a chain: 2 words per row
    assert chain.shape == (33, 2) and chain.dtype == torch.int32
    assert chain[30].tolist() == [2**31 - 1, 0]
    assert chain[31].tolist() == [-1, 0]  # all 32 bits: two's complement -1
    assert chain[32].tolist() == [-1, 1]


def test_packed_mask_matches_brute_force_and_unpacks():
    rng = random.Random(0)
    for g in (1, 2, 5, 31, 32, 33, 64, 70):
        for _ in range(5):
            parents = [-1] + [rng.randrange(i) for i in range(1, g)]
            packed = pack_tree_mask(parents)
            assert torch.equal(packed, _brute_mask(parents)), parents
            dense = unpack_tree_mask(packed, g)
            assert dense.shape == (g, g) and bool(dense.diagonal().all()) and bool(dense[:, 0].all())


def test_static_tree_follows_trtllm_node_order():
    """A static tree's nodes, positions and mask match TRT-LLM's Medusa setup for the same choices: nodes in
    (depth, lexicographic) order, node i sees node j iff j's path is a prefix of i's."""
    choices = [[1, 0], [0], [0, 0, 0], [1], [0, 1], [0, 0], [2]]
    order = sort_choices(choices)
    assert order == [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    tree = DraftTree([7])
    b = StaticBuilder(tree, Sampling(), 10, choices)
    todo = b.expand({0: torch.arange(10.0)})  # top-k of arange: index k -> token 9 - k
    while todo:
        todo = b.expand({n: torch.arange(10.0) for n in todo})
    paths = [()] + order
    expect = torch.tensor([[pi[: len(pj)] == pj for pj in paths] for pi in paths])
    assert torch.equal(unpack_tree_mask(tree.packed_mask(), len(paths)), expect)
    assert tree.depths == [len(p) for p in paths]  # position offsets
    assert tree.tokens[1:] == [9 - p[-1] for p in order]


def test_dynamic_greedy_is_best_first():
    """With a fixed draft, the greedy dynamic tree holds the `budget` paths of highest cumulative probability."""
    V, budget = 4, 7
    gen = torch.Generator().manual_seed(3)
    table = {}

    def logits(path):  # a deterministic "draft": logits as a function of the path
        if path not in table:
            table[path] = torch.randn(V, generator=gen) * 2
        return table[path]

    tree = DraftTree([0])
    b = DynamicBuilder(tree, Sampling(), 10, budget)
    path_of = {0: ()}
    todo = b.expand({0: logits(())})
    while todo:
        for n in todo:
            path_of[n] = path_of[tree.parents[n]] + (tree.tokens[n],)
        todo = b.expand({n: logits(path_of[n]) for n in todo})
    for n in range(1, len(tree)):
        path_of[n] = path_of[tree.parents[n]] + (tree.tokens[n],)
    got = {path_of[n] for n in range(1, len(tree))}
    scores = {}
    for d in range(1, budget + 1):
        for p in itertools.product(range(V), repeat=d):
            scores[p] = math.prod(torch.softmax(logits(p[:k]), -1)[p[k]].item() for k in range(d))
    best = set(sorted(scores, key=scores.get, reverse=True)[:budget])
    assert len(tree) == budget + 1 and got == best


def test_acceptance_calibration_learns_and_shapes_the_tree():
    """Greedy dynamic trees score candidates by observed acceptance: a draft whose top-1 (q = 0.4) is always
    accepted grows a chain; with the raw draft probability the same budget goes to siblings."""
    cal = AcceptanceCalibration()
    assert cal(0.4, True) == pytest.approx(0.4)  # the prior: raw draft confidence
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))

    def grow(calib):
        tree = DraftTree([0])
        b = DynamicBuilder(tree, Sampling(), 10, 4, calib)
        todo = b.expand({0: row})
        while todo:
            todo = b.expand({n: row for n in todo})
        return tree

    assert grow(None).depths == [0, 1, 1, 1, 2]  # raw q: 0.4, 0.3, 0.2 at depth 1, then 0.4 * 0.4 = 0.16
    for _ in range(50):  # observed: top-1 candidates accepted, the others never
        tree = grow(cal)
        chain = [0]
        while (c := next((c for c in tree.draws.get(chain[-1], []) if tree.conf[c][1]), None)) is not None:
            chain.append(c)
        cal.update(tree, chain)
    assert cal(0.4, True) > 0.9 and cal(0.3, False) < 0.3  # siblings stop being proposed once they lose
    assert grow(cal).depths == [0, 1, 2, 3, 4]


def test_tree_spec_parsing_and_errors():
    assert parse_tree_spec("chain:3") == TreeSpec("chain", length=3)
    assert parse_tree_spec("dynamic:7").nodes == 7
    assert parse_tree_spec("static:[[0],[1],[0,0]]").choices == [[0], [1], [0, 0]]
    assert TreeSpec("static", choices=[[0], [1], [0, 0]]).draft_tokens == 3
    for bad in ("chain:x", "static:[[0,0]]", "static:[[-1]]", "beam:4", "static:"):
        with pytest.raises(UserError):
            parse_tree_spec(bad)
    with pytest.raises(UserError):
        TreeSpec("dynamic", nodes=0)


def test_probs_from_logits_top_k_top_p():
    x = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.allclose(probs_from_logits(x, 1.0), torch.softmax(x.double(), 0))
    p = probs_from_logits(x, 1.0, top_k=2)
    assert p[2] == 0 and p[3] == 0 and abs(float(p.sum()) - 1) < 1e-12
    full = torch.softmax(x.double(), 0)  # 0.644, 0.237, 0.087, 0.032
    p = probs_from_logits(x, 1.0, top_p=0.7)  # smallest prefix reaching 0.7: two tokens
    assert (p > 0).tolist() == [True, True, False, False]
    assert torch.allclose(p[:2], full[:2] / full[:2].sum())


# ----------------------------------------------------------------------------- losslessness (stats)

VOCAB = 8
CFG = ModelConfig(
    vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_size=16, intermediate_size=64
)
PROMPT = [1, 2, 3]
SAMPLING = dict(temperature=0.9, top_k=7)


def _exact_t2_t3(verifier):
    """P(t2, t3) of plain sampling from the verifier: enumerate t1 and t2 (8 + 64 contexts)."""

    def dist(ctxs):
        lg = verifier(torch.tensor(ctxs))[:, -1]
        return torch.stack([probs_from_logits(row, **SAMPLING) for row in lg])

    p1 = dist([PROMPT])[0]
    p2 = dist([PROMPT + [a] for a in range(VOCAB)])  # [t1, t2]
    p3 = dist([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    joint = p1[:, None, None] * p2[:, :, None] * p3  # [t1, t2, t3]
    return joint.sum(0)


def _chi2(counts, probs, n):
    """Pearson chi-square over cells with expected count >= 5 (the rest pooled) and its 0.1% critical value."""
    exp = probs * n
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_c = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp_c > 0
    stat = float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.0902  # one-sided 0.1% normal quantile; Wilson-Hilferty approximation of the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def _subset_feature_draft(verifier, ids):
    """A FeatureDraft (random layer and fc) that may propose only token ids `ids`: its logits have one column
    per id, and speculative sampling must widen its q to the whole vocabulary."""
    from dataclasses import replace

    from bpcompile.runtime.model import FeatureDraft

    g = torch.Generator().manual_seed(5)
    w = {k: v for k, v in random_llama(CFG, seed=2, scale=0.3).w.items() if k.startswith("transformer.layers.0.")}
    H = CFG.hidden_size
    w.update(
        {
            "fc.weight": torch.randn(H, 2 * H, generator=g) / H**0.5,
            "fc.bias": torch.zeros(H),
            "vocab_subset": torch.tensor(ids),
        }
    )
    return FeatureDraft(replace(CFG, num_layers=1), w, verifier)


def _run(tree, n, rule=None, subset=None):
    """n independent requests (own seeds) through speculative sampling -> counts of (t2, t3). subset: the draft is
    a FeatureDraft proposing only those token ids."""
    verifier = random_llama(CFG, seed=0, scale=0.3)
    draft = random_llama(CFG, seed=1, scale=0.3)  # unrelated weights: q differs a lot from p
    if subset is not None:
        draft = _subset_feature_draft(verifier, subset)
    # backoff off: a draft this costly would (rightly) be switched off, and this test is about the acceptance rule
    gen = Generator(verifier, draft, tree, max_batch_size=1000, max_seq_len=16, page_size=4, backoff=False)
    if rule is not None:
        gen.spec.accept_rule = rule
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    toks, accepted = {}, 0
    for i in range(n):  # max_tokens 4: t2 and t3 come from a tree of depth 2 (t1 is the prefill's own sample)
        toks[gen.add_request(PROMPT, SamplingParams(max_tokens=4, seed=i, **SAMPLING))] = []
    while gen.has_work():
        for o in gen.step():
            toks[o.request_id] += o.new_tokens
            if o.finished:
                t = toks[o.request_id]
                counts[t[1], t[2]] += 1
                accepted += sum(o.stats.accepted_per_depth)
    return verifier, counts, accepted


def broken_rule(p, q, token, u):
    """A classic bug: accept with min(1, p/q) but on rejection keep p instead of the residual."""
    return (u * float(q[token]) < float(p[token])), p


TREES = {
    "chain": TreeSpec("chain", length=2),
    "static": TreeSpec("static", choices=[[0], [1], [0, 0], [1, 0]]),
    "dynamic": TreeSpec("dynamic", nodes=4),
}
N_SAMPLES = 6000


@pytest.mark.parametrize("kind", list(TREES))
def test_speculative_sampling_is_lossless(kind):
    verifier, counts, accepted = _run(TREES[kind], N_SAMPLES)
    exact = _exact_t2_t3(verifier)
    stat, crit = _chi2(counts.flatten(), exact.flatten(), N_SAMPLES)
    tv = 0.5 * float((counts / N_SAMPLES - exact).abs().sum())
    assert accepted > N_SAMPLES * 0.2, "drafts are (almost) never accepted: the test would not exercise them"
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (TV {tv:.3f}): output differs from the verifier's"


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_speculative_sampling_with_a_draft_of_some_token_ids_is_lossless(kind):
    """The draft scores 5 of the 8 token ids (its logits have 5 columns): the output is still the verifier's law,
    tokens it cannot propose included."""
    verifier, counts, accepted = _run(TREES[kind], N_SAMPLES, subset=[0, 2, 3, 5, 6])
    exact = _exact_t2_t3(verifier)
    stat, crit = _chi2(counts.flatten(), exact.flatten(), N_SAMPLES)
    assert accepted > N_SAMPLES * 0.1, "drafts are (almost) never accepted: the test would not exercise them"
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}: output differs from the verifier's"
    assert exact[:, [1, 4, 7]].sum() > 0.2  # tokens outside the subset carry real mass in what was checked


@pytest.mark.parametrize("kind", ["chain", "dynamic"])
def test_broken_acceptance_rule_is_caught(kind):
    n = 2000  # the broken rule's bias is large (TV ~0.15-0.3): fewer samples catch it many times over
    verifier, counts, _ = _run(TREES[kind], n, rule=broken_rule)
    exact = _exact_t2_t3(verifier)
    stat, crit = _chi2(counts.flatten(), exact.flatten(), n)
    assert stat > crit, f"the test did not detect a rule without residual (chi2 {stat:.1f} < {crit:.1f})"


def test_residual_rule_two_candidates_exact():
    """One node, two candidates drawn from q, the law computed exactly: it equals p (the rule's algebra)."""
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    out = torch.zeros(4, dtype=torch.float64)
    for c1, c2 in itertools.product(range(4), repeat=2):
        w = float(q[c1] * q[c2])
        a1 = min(1.0, float(p[c1] / q[c1]))
        _, r = residual_rule(p, q, c1, 1.0)  # u = 1 rejects whenever rejection is possible
        a2 = min(1.0, float(r[c2] / q[c2]))
        _, r2 = residual_rule(r, q, c2, 1.0)
        out[c1] += w * a1
        out[c2] += w * (1 - a1) * a2
        out += w * (1 - a1) * (1 - a2) * r2
    assert torch.allclose(out, p, atol=1e-12), out
    _, keep = broken_rule(p, q, 3, 1.0)
    assert torch.equal(keep, p)


def test_backoff_stops_drafting_that_does_not_pay_and_probes_again():
    """BackOff against made-up step timings: a probe (2 steps here) that yields less than plain decoding in its time
    switches drafting off for `wait` steps, a failed probe doubles the wait, a good one turns drafting on, which then
    stays on inside the hysteresis band and goes off below it; the tree shrinks to about twice the accepted length.
    The cost of a drafting step is read from ratios (its time over its own verify, and its verify over the plain
    step next to it), so the same steps on a machine twice as slow decide the same."""
    from bpcompile.runtime.speculative import BackOff

    def feed(scale):
        b = BackOff(TreeSpec("dynamic", nodes=8), first_wait=2, max_wait=8, decay=1.0, margin=0.1, probe=2)
        kinds = []

        def step(accepted, seconds=0.030, verify=0.012):  # as the runtime runs a step: ask for a tree, report it
            spec = b.next_spec()
            kinds.append("-" if spec.kind == "none" else spec.nodes)
            if spec.kind == "none":  # a plain step: 10 ms, 9 of them the verify
                b.update(False, 0.0, scale * 0.010, scale * 0.009)
            else:
                b.update(True, accepted, scale * seconds, scale * verify)

        step(0.0)  # 30 ms for 1 token: 2.5x its verify, which is 1.2x a plain step (known after 3 pairs)
        assert b.gain is None and b.next_spec().nodes == 8  # a probe runs the recipe's whole tree
        step(0.0)  # g = 1 / 2.5 (r = 1 until three pairs are seen): off, and the probe will measure afresh
        assert b.backoffs == 1 and b.gain is None
        for _ in range(4):  # two plain steps (the wait), then a probe that fails (1.25 tokens per 2.5 plain steps)
            step(0.25)
        assert b.backoffs == 2 and b.wait == 8 and len(b.pairs) == 2
        for _ in range(6):  # four plain steps, then a probe: 4 tokens per 3 plain steps (r = 1.2 now): on
            step(3.0)
        assert b.wait == 2 and b.backoffs == 2 and b.gain == pytest.approx(4 / 3) and b.next_spec().nodes == 7
        step(2.6)  # g = 3.6 / 3 = 1.2: stays on
        step(1.9)  # g = 2.9 / 3: inside the band (0.9-1.1), stays on
        assert b.backoffs == 2 and b.next_spec().kind == "dynamic"
        step(1.0, seconds=0.027)  # g = 2 / 2.7: off
        assert b.backoffs == 3
        for _ in range(20):  # a draft that never pays: the wait is capped
            step(0.0)
        assert b.wait == 8
        return kinds, b.backoffs, b.plain_steps

    kinds, backoffs, plain = feed(1.0)
    assert kinds[:14] == [8, 8, "-", "-", 8, 8, "-", "-", "-", "-", 8, 8, 7, 6] and plain >= 8
    assert feed(2.0) == (kinds, backoffs, plain)  # a uniformly slower machine: the same decisions


def test_backoff_reads_cost_from_adjacent_steps_under_varying_load():
    """The machine's load changes (each step slowed as a whole: 2x throughout, 1x / 2x / 4x in bursts of 5-15
    steps, or 1-1.5x at random every step) and back-off still decides as on an idle machine: its cost ratios come
    from a step's own parts and from the plain step next to a drafting one, medians over a window. Drafting here
    pays (1 + 1.2 tokens for 1.5x a plain step's time: g = 1.47) and back-off keeps it on, refreshing the
    verify-vs-plain ratio with an occasional plain step, the same steps at every load; a draft that does not pay
    (1.2 tokens for 1.5x: g = 0.8) is switched off, the same steps at every load."""
    from bpcompile.runtime.speculative import BackOff

    def run(load, accepted):
        b = BackOff(TreeSpec("chain", length=4))
        kinds = []
        for _ in range(300):
            spec = b.next_spec()
            f = load()
            if spec.kind == "none":  # verify 9 ms + 1 ms bookkeeping
                b.update(False, 0.0, f * 0.010, f * 0.009)
            else:  # draft 3 ms, verify 11 ms, bookkeeping 1 ms
                b.update(True, accepted, f * 0.015, f * 0.011)
            kinds.append(spec.kind)
        return kinds, b.backoffs

    def bursts(rng):
        state = {"left": 0, "f": 1.0}

        def load():
            if state["left"] == 0:
                state["left"], state["f"] = rng.randint(5, 15), rng.choice([1.0, 2.0, 4.0])
            state["left"] -= 1
            return state["f"]

        return load

    rng = random.Random(0)
    for accepted, pays in ((1.2, True), (0.2, False)):
        idle = run(lambda: 1.0, accepted)
        assert (idle[1] == 0) == pays and (idle[0].count("none") < 15) == pays, (accepted, idle[0].count("none"))
        for load in (lambda: 2.0, bursts(rng), lambda: rng.uniform(1.0, 1.5)):
            assert run(load, accepted) == idle
