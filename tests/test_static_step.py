"""The static-buffer step (bpcompile/runtime/static_step.py): decode, draft and tree-verify steps from per-bucket
buffers give the executor's own step's tokens (speculation on, batch 1 and 4, a Llama draft and a feature draft,
the PyTorch attention and the Triton kernels in the interpreter), padded batch rows included; the switch
(runtime.cuda_graphs, --cuda-graphs) and its refusals. On CPU the step runs eagerly; CUDA capture is not run here.
benchmarks/check_static_step.py runs the 50 x 32 comparison on SmolLM2 (docs/GPU.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import TINY, one_thread, random_llama, tiny_models  # noqa: F401  (one_thread: fixture)

from bpcompile.core.errors import UserError
from bpcompile.runtime.generator import Generator, SamplingParams, TreeSpec
from bpcompile.runtime.model import ModelConfig
from bpcompile.runtime.paged_kv import float_store_factory

pytestmark = pytest.mark.usefixtures("one_thread")
needs_tiny = pytest.mark.skipif(not (TINY / "verifier" / "config.json").is_file(), reason="models/tiny not built")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from bpcompile.compiler.corpus import heldout_prompts

    return *tiny_models(tmp_path_factory.mktemp("tiny")), heldout_prompts(TINY / "verifier", 50, 32)


def generate(pair, prompts, batch: int, mode: str, tokens: int = 32, **kw) -> tuple[list[list[int]], Generator]:
    gen = Generator(
        pair[0],
        pair[1],
        TreeSpec("dynamic", nodes=5),
        max_batch_size=batch,
        max_seq_len=128,
        page_size=16,
        cuda_graphs=mode,
        backoff=False,  # speculation in every step (back-off decides from timings: runs would differ)
        **kw,
    )
    return [t for t, _ in gen.generate(prompts, SamplingParams(max_tokens=tokens))], gen


@needs_tiny
@pytest.mark.parametrize("batch, n", [(4, 16), (1, 6)])
def test_tiny_pair_static_step_is_token_identical(tiny, batch, n):
    """The shipped tiny pair, dynamic trees (speculation in every step): n held-out prompts x 32 tokens from the
    static step equal the engine's own step (its default dense view, the executor's CPU kernels); batch 4 has
    steps of 1-3 sequences in the bucket of 4 (padded rows), and trees of every size up to 6 rows."""
    ref, _ = generate(tiny, tiny[2][:n], batch, "off")
    out, gen = generate(tiny, tiny[2][:n], batch, "on")
    st = gen.v_exec.static
    assert st is not None and gen.d_exec.static is not None and gen.vkv.dense is None
    assert out == ref
    shapes = set(st.buckets)
    assert {b for b, *_ in shapes} <= {1, 2, 4} and max(t for _, t, *_ in shapes) == 6
    if batch == 4:
        assert st.padded > 0  # steps with fewer sequences than their bucket ran, and changed nothing above


def test_feature_draft_static_step_is_token_identical():
    """A feature draft (its catch-up reads the verifier's features and one logits row per sequence) over FP16
    caches: the static step's tokens equal the executor's at batch 4."""
    from dataclasses import replace

    from conftest import noisy_copy

    from bpcompile.runtime.model import FeatureDraft

    cfg = ModelConfig(
        vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=16, intermediate_size=128
    )
    v = random_llama(cfg, seed=0)
    w = {k: x for k, x in noisy_copy(v, 0.3, seed=1).w.items() if k.startswith("transformer.layers.0.")}
    w["fc.weight"] = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) / 8
    w["fc.bias"] = torch.zeros(64)
    fd = FeatureDraft(replace(cfg, num_layers=1), w, v)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (10,), generator=g)]
    fp16 = dict(kv_store_factory=float_store_factory(torch.float16))
    ref, _ = generate((v, fd), prompts, 4, "off", 24, **fp16)
    out, gen = generate((v, fd), prompts, 4, "on", 24, **fp16)
    assert gen.d_exec.static is not None and out == ref
    assert any(k[3] for k in gen.d_exec.static.buckets)  # the catch-up's one-row logits ran from its buffers


def _static_runs_through_the_kernels(kv: str) -> list[dict]:
    """benchmarks/check_static_step.py on the tiny pair with `kv`, 2 prompts x 8 tokens at batch 2, under
    BPCOMPILE_KERNELS=triton (Triton's interpreter, chosen before triton is imported: a subprocess): its report's
    static-step (cuda_graphs on) runs, after checking every one ran through the kernels with the eager step's tokens."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, BPCOMPILE_KERNELS="triton", TRITON_INTERPRET="1")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "check_static_step.py"
    cmd = [sys.executable, str(script), "--pair", "tiny", "--kv", kv, "--prompts", "2", "--tokens", "8"]
    r = subprocess.run(cmd + ["--batch", "2"], capture_output=True, text=True, env=env, timeout=540)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    on = [x for x in rep["runs"] if x["cuda_graphs"] == "on"]
    assert rep["ok"] and on and all(x["kernels"] and x["static_step"] and x["identical"] for x in on), rep
    return on


@needs_tiny
@pytest.mark.timeout(600)
def test_static_step_through_the_triton_kernels():
    """An INT4 plan's steps through the kernels from the static buffers (full-width block tables) give the kernels'
    own eager step's tokens, 2 prompts x 8 tokens at batch 2."""
    _static_runs_through_the_kernels("int4")


@needs_tiny
@pytest.mark.timeout(600)
def test_static_step_with_exact_entries_through_the_triton_kernels():
    """As above for a plan with exact entries (the verifier's: a sink and a recent window; the draft's: a window):
    the copies are written with fixed shapes and read by the kernels from the static buffers; tokens equal the
    kernels' own eager step's, and the exact copies of both runs end bitwise equal (a write the static step drops
    or misplaces, padding's included, shows there even where the tokens do not move)."""
    on = _static_runs_through_the_kernels("int4-exact")
    assert all(x["exact_copies_equal"] for x in on), on


def exact_plan(m, fmt: str, sink: int, window: int):
    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory

    c = m.cfg
    plan = KVPlan.uniform(fmt, c.num_layers, c.num_kv_heads, c.head_size)
    plan.sink_tokens, plan.recent_window = sink, window
    return kv_store_factory(plan)


@needs_tiny
def test_static_step_with_exact_entries_through_the_pytorch_reference(tiny):
    """Without the kernels the static step reads a plan's exact entries through the reference attention (no
    dense view): INT4 with a sink and a window, 12 prompts x 32 tokens at batch 2, the executor's own step's
    tokens. The plan's copies matter here: the same static run without them differs on several prompts."""
    kw = dict(kv_store_factory=exact_plan(tiny[0], "int4-naive", 4, 8))
    kw["draft_kv_store_factory"] = exact_plan(tiny[1], "int4-naive", 0, 3)
    ref, _ = generate(tiny, tiny[2][:12], 2, "off", **kw)
    out, gen = generate(tiny, tiny[2][:12], 2, "on", **kw)
    assert gen.v_exec.static is not None and gen.vkv.dense is None and gen.vkv.kern is None
    assert gen.vkv.recent is not None and gen.dkv.recent is not None
    assert out == ref
    kw["kv_store_factory"] = exact_plan(tiny[0], "int4-naive", 0, 0)
    assert generate(tiny, tiny[2][:12], 2, "on", **kw)[0] != ref


def test_fixed_write_of_exact_copies_equals_the_selecting_write():
    """RecentKV.write_fixed (the static step's: fixed shapes, no host sync) leaves the copies as `write` does:
    real entries land at their columns (sink and ring), padding rows (index >= rows) change nothing, whether they
    come before, between or after the real entries, or are all the call has."""
    from bpcompile.runtime.kvcache import FloatKVStore
    from bpcompile.runtime.paged_kv import RecentKV

    store = FloatKVStore(2, 2, 8, 4, 16, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    pad = 3  # RecentKV.rows: the padding marker
    calls = [
        ([pad, 0, 0, pad, 2, 2, 2, pad], [0, 5, 6, 0, 0, 2, 3, 0]),  # padding first, between, last (row 2's place)
        ([1, 1, 1, 0], [20, 21, 22, 9]),  # ring columns wrap (sink 2 + ring 7), no padding
        ([pad, pad], [0, 4]),  # padding only
        ([0, pad, pad, 1], [3, 0, 0, 40]),
    ]
    a, b = (RecentKV(store, pad, 2, 4, 3, "cpu") for _ in range(2))
    for x in (a, b):
        for t in (x.k, x.v):
            t.copy_(torch.randn(t.shape, generator=g).half())
    b.k.copy_(a.k), b.v.copy_(a.v)
    for rows, idx in calls:
        rows, idx = torch.tensor(rows), torch.tensor(idx)
        k, v = torch.randn(2, len(rows), 2, 8, generator=g)
        for layer in (0, 1):
            before = a.k.clone()
            a.write(layer, rows, idx, k, v)
            b.write_fixed(layer, rows, idx, k, v)
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
            assert not torch.equal(a.k, before) or bool((rows >= pad).all())  # the call wrote something real
    assert a.nbytes() == 2 * 2 * pad * 2 * (2 + 4 + 3) * 8 * 2  # no scratch row: the rows of record only


def test_the_switch_and_its_refusals(tmp_path):
    """auto is off on CPU (the executor's step attends over real lengths: faster there); on runs the static step;
    a value outside auto / on / off, and on where it cannot run (the onnxruntime executor), are UserErrors naming
    runtime.cuda_graphs; a plan with exact entries runs it; the recipe key and the flag are typed."""
    from bpcompile.core.engine import Runtime
    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory

    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_size=16, intermediate_size=64
    )
    v = random_llama(cfg, seed=0)
    assert Generator(v, None, None, cuda_graphs="auto").v_exec.static is None
    assert Generator(v, None, None, cuda_graphs="on").v_exec.static is not None
    with pytest.raises(UserError, match="cuda_graphs") as e:
        Generator(v, None, None, cuda_graphs="sometimes")
    assert e.value.key == "runtime.cuda_graphs"
    plan = KVPlan.uniform("int8", 1, 1, 16)
    plan.recent_window = 4  # exact entries: static on CPU too (the reference attention reads the copies)
    assert Generator(v, None, None, cuda_graphs="on", kv_store_factory=kv_store_factory(plan)).v_exec.static
    assert Generator(v, None, None, kv_store_factory=kv_store_factory(plan)).v_exec.static is None  # auto: off
    with pytest.raises(UserError, match="onnxruntime executor runs its exported graphs") as e:
        Generator(v, None, None, cuda_graphs="on", executor="onnxruntime", graphs=tmp_path)
    assert e.value.key == "runtime.cuda_graphs"
    assert Runtime().cuda_graphs == "auto"
    with pytest.raises(ValueError):
        Runtime(cuda_graphs="always")

    from click.testing import CliRunner

    from bpcompile.cli import main

    res = CliRunner().invoke(main, ["generate", str(tmp_path), "--cuda-graphs", "sometimes", "--prompt", "x"])
    assert res.exit_code == 2 and "--cuda-graphs" in res.output
    os.environ.pop("BPCOMPILE_CUDA_GRAPHS", None)


def test_static_step_module_is_used_on_cuda_only_by_auto():
    """wants_static: auto picks the static step for CUDA devices only; on / off regardless of the device."""
    from bpcompile.runtime.static_step import buckets, wants_static

    assert wants_static("auto", torch.device("cuda")) and not wants_static("auto", torch.device("cpu"))
    assert wants_static("on", torch.device("cpu")) and not wants_static("off", torch.device("cuda"))
    assert buckets(8) == [1, 2, 4, 8] and buckets(6) == [1, 2, 4, 6] and buckets(1) == [1]
