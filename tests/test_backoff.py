"""Back-off on a slowed machine: the shipped tiny pair (models/tiny, a trained verifier and draft) with every model
forward stretched in time decides as on the unslowed machine: the same tau to within 5%."""

from __future__ import annotations

import random
import time

import pytest
from conftest import TINY, one_thread, tiny_models  # noqa: F401  (one_thread: fixture)

from bpcompile.runtime.generator import Generator, SamplingParams, TreeSpec

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not (TINY / "draft" / "config.json").is_file(), reason="the shipped tiny pair is not here"),
]

# The tiny models cost about the same per forward (both are mostly Python overhead), so speculation would not pay
# with them as they are: each forward also spends this much CPU time, as SmolLM2's 30-layer verifier and one-layer
# feature draft do (about 10:1 with the draft's overhead), a pair where speculation pays.
COST_S = {"verifier": 0.040, "draft": 0.001}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from bpcompile.compiler.corpus import heldout_prompts

    return list(tiny_models(tmp_path_factory.mktemp("tiny"))), heldout_prompts(TINY / "verifier", 3, 32)


def spin(cpu_seconds: float) -> None:
    """Compute for this much of this thread's CPU time: on a busy machine it takes longer, as a model's work does."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def stretch(gen: Generator, factor) -> None:
    """Every model forward of `gen`'s decode steps computes `factor()` times as long as it did plus its COST_S (CPU
    time, see spin), factor() drawn once per step: the whole machine slowed alike within a step."""
    now = {"f": 1.0}
    for ex in (gen.v_exec, gen.d_exec):

        def forward(*args, _run=ex.forward, _cost=COST_S[ex.role], **kw):
            t = time.thread_time()
            out = _run(*args, **kw)
            ran = time.thread_time() - t
            spin(now["f"] * (ran + _cost) - ran)
            return out

        ex.forward = forward
    step = gen.spec.run

    def run(reqs):
        now["f"] = factor()
        return step(reqs)

    gen.spec.run = run


def tau_on(tiny, factor, max_tokens: int = 32) -> tuple[list[list[int]], float, int]:
    """Dynamic tree of 5, back-off on, batch 1, the machine stretched by `factor`: tokens, tau, back-offs."""
    (v, d), prompts = tiny
    gen = Generator(v, d, TreeSpec("dynamic", nodes=5), max_batch_size=1, page_size=16)
    stretch(gen, factor)
    out = gen.generate(prompts, SamplingParams(max_tokens=max_tokens))
    tau = sum(s.committed for _, s in out) / sum(s.verifier_steps for _, s in out)
    return [t for t, _ in out], tau, gen.spec.backoff.backoffs


@pytest.mark.timeout(180)
def test_backoff_decides_the_same_on_a_slowed_machine(tiny):
    """On the machine as it is (forwards made costly, see COST_S), with every forward twice as slow,
    and with the load varying from step to step (each step 1-3x slower, at random), tau is within 5% of the
    unslowed run's, drafting stays on (tau well above 1) and greedy output is the verifier's own each time."""
    (v, _), prompts = tiny
    gen = Generator(v, None, TreeSpec("none"), max_batch_size=len(prompts), page_size=16)
    ref = [t for t, _ in gen.generate(prompts, SamplingParams(max_tokens=32))]
    toks, tau, _ = tau_on(tiny, lambda: 1.0)
    assert toks == ref and tau > 2.0, tau
    rng = random.Random(1)
    for name, factor in (("2x", lambda: 2.0), ("1-3x a step", lambda: rng.uniform(1.0, 3.0))):
        toks, slowed, backoffs = tau_on(tiny, factor)
        assert toks == ref, name
        assert abs(slowed / tau - 1) <= 0.05, (name, tau, slowed, backoffs)
