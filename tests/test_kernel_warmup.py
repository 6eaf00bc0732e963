"""On CUDA the native runtime compiles its kernels when the engine loads (`Executor.warm_kernels`), not ahead of
time: Triton's JIT specializes each kernel on its run-time arguments as well as its constexprs, so only the
process that runs it knows what it will look up. Checked here without a GPU: every launch of a real generation
(prompts of several lengths, batching, tree speculation; a plain INT4 plan and one with exact entries) has a
specialization the warm-up launched, as Triton's own JIT binder computes it for an sm_90 target from the very
arguments of each launch. The kernels run in Triton's interpreter; its launch hook sees the same arguments."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors run interpreted

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import random_llama  # noqa: E402

from bpcompile.kernels import paged as K  # noqa: E402
from bpcompile.runtime.generator import Generator, SamplingParams, TreeSpec  # noqa: E402
from bpcompile.runtime.kvcache import KVPlan, kv_store_factory  # noqa: E402
from bpcompile.runtime.model import ModelConfig  # noqa: E402

KERNELS = (K._quantize_append_kernel, K._paged_attention_kernel, K._combine_splits_kernel, K._copy_rows_kernel)
# tile sizes the entry points choose per device: fixed on CUDA (16), fitted to the call in the interpreter
CPU_TILES = ("BLOCK_T", "BLOCK_R")


class Specializations:
    """The JIT key (argument types, alignment and ==1 specializations, constexprs) of every launch, per kernel,
    computed by Triton's binder for a CUDA sm_90 backend from each interpreted launch's arguments."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        backend = make_backend(GPUTarget("cuda", 90, 32))
        self.seen: set[tuple] = set()
        self.on = False
        for kern in KERNELS:
            if type(kern).__name__ != "InterpretedFunction":
                pytest.skip("triton was imported before TRITON_INTERPRET was set")
            flags = {a: kern.kwargs.get(a) for a in ("do_not_specialize", "do_not_specialize_on_alignment")}
            jit = JITFunction(kern.fn, **flags)
            binder = create_function_from_signature(jit.signature, jit.params, backend)
            names = jit.arg_names

            def hook(*args, _binder=binder, _names=names, _name=kern.fn.__name__, **kwargs):
                if self.on:
                    _, spec, _ = _binder(*args, **{k: v for k, v in kwargs.items() if k in _names})
                    key = tuple((n, s) for n, s in zip(_names, spec) if n not in CPU_TILES)
                    self.seen.add((_name, repr(key)))

            kern.add_pre_run_hook(hook)

    def record(self, fn) -> set:
        self.seen, self.on = set(), True
        try:
            fn()
        finally:
            self.on = False
        return self.seen


@pytest.fixture(scope="module")
def specs():
    return Specializations()


@pytest.mark.parametrize("exact", [False, True], ids=["int4", "int4+sink+window"])
def test_warm_up_launches_every_specialization_a_generation_uses(specs, monkeypatch, exact):
    monkeypatch.setenv("BPCOMPILE_KERNELS", "triton")
    cfg = ModelConfig(
        vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=32, intermediate_size=64
    )
    dcfg = ModelConfig(**{**cfg.__dict__, "num_layers": 1})
    plan, dplan = KVPlan.uniform("int4-naive", 2, 2, 32), KVPlan.uniform("int4-naive", 1, 2, 32)
    if exact:
        plan.sink_tokens, plan.recent_window = 2, 4
    gen = Generator(
        random_llama(cfg, seed=1),
        random_llama(dcfg, seed=2),
        TreeSpec("dynamic", nodes=6),
        max_batch_size=2,
        max_seq_len=64,
        kv_store_factory=kv_store_factory(plan),
        draft_kv_store_factory=kv_store_factory(dplan),
        backoff=False,
    )
    assert gen.vkv.kern is K and gen.dkv.kern is K and (gen.vkv.recent is not None) == exact

    def warm():
        for ex in (gen.v_exec, gen.d_exec):
            assert ex.warm_kernels() >= 0

    def run():
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (1, 17)]
        gen.generate(prompts, SamplingParams(max_tokens=4))

    warmed = specs.record(warm)
    used = specs.record(run)
    kernels = {name for name, _ in used}
    assert {"_quantize_append_kernel", "_paged_attention_kernel"} <= kernels, kernels
    assert used - warmed == set(), f"{len(used - warmed)} of {len(used)} specializations not warmed up"
