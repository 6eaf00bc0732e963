"""The runtime's kernel path: generation through the Triton kernels (quantize-append, paged tree attention,
compaction move) gives the same greedy tokens as the PyTorch reference path, on a mixed INT4/FP8 cache and on a
cache shaped like the default plan (KLT6 / KLT5 keys before RoPE, INT3 and INT4 values, Hadamard rotation, an
exact FP16 window): the kernels run it with no fallback.

Runs in subprocesses because Triton's interpreter must be chosen before triton is imported; on a GPU the
same code runs compiled (BPCOMPILE_KERNELS=auto picks the kernels on CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, "tests")
from conftest import noisy_copy, random_llama
from bpcompile.runtime.model import ModelConfig, rope_inv_freq
from bpcompile.runtime.kvcache import KVPlan, kv_store_factory
from bpcompile.runtime.generator import Generator, SamplingParams
from bpcompile.runtime.speculative import TreeSpec
from bpcompile.runtime.paged_kv import kernels_for

head = 128 if sys.argv[3] == "70b" else 32  # the 70B's head size
cfg = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=head,
                  intermediate_size=128)
v = random_llama(cfg, seed=0)
d = noisy_copy(v, 0.3, seed=1)
L, KV, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_size
if sys.argv[3] == "mixed":
    plan = KVPlan.uniform("int4-fp8-outlier", L, KV, D, group_size=32)
    plan.precision[1]["k"][0] = "fp8"  # mixed units: one FP8 outlier unit among INT4 ones
    plan = KVPlan(**{**plan.__dict__})
else:  # the default plan's kinds of units, with tables shaped as calibration makes them; "70b": recipes/70b.yaml's
    # (the default at G = D = 128, one scale per token and unit, page 64, window 10), an INT4 key unit among them
    from bpcompile.compiler.calibrate import water_filling_bits

    g = torch.Generator().manual_seed(0)
    prec = [{"k": ["klt6", "klt6"], "v": ["int3", "int3"]}, {"k": ["klt5", "klt5"], "v": ["int4", "int3"]}]
    if sys.argv[3] == "70b":
        prec[1]["k"][1] = "int4"
    lam = torch.logspace(0, -3, D)
    klt = {"mean": torch.randn(L, KV, D, generator=g) * 0.1, "weight": torch.rand(L, KV, D, generator=g) + 0.5,
           "bits": torch.zeros(L, KV, D, dtype=torch.int8), "step": torch.zeros(L, KV, D),
           "level": torch.zeros(L, KV, D), "basis": torch.zeros(L, KV, D, D, dtype=torch.float16),
           "inv_freq": rope_inv_freq(cfg).float()}
    for layer, p in enumerate(prec):
        for h, x in enumerate(p["k"]):
            if x == "int4":
                continue
            b = water_filling_bits(lam, int(x[3]) * D)
            klt["basis"][layer, h] = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0].half()
            klt["bits"][layer, h], klt["step"][layer, h] = b.to(torch.int8), lam.sqrt() / 2.0 ** b.float()
            klt["level"][layer, h] = torch.where(b == 1, lam.sqrt() * 0.8, 0.0)
    big = sys.argv[3] == "70b"
    plan = KVPlan("int4-fp8-outlier", L, KV, D, 128 if big else 32, prec,
                  k_channel_scale=torch.rand(L, KV, D, generator=g) + 0.5, int4_clip=torch.ones(L, 2, KV),
                  rotation="hadamard", k_mean=torch.randn(L, KV, D, generator=g) * 0.1,
                  recent_window=10 if big else 4, klt=klt)
page = 64 if sys.argv[3] == "70b" else 8
gen = Generator(v, d, TreeSpec(sys.argv[1], nodes=4, length=3), max_batch_size=2, max_seq_len=64, page_size=page,
                kv_store_factory=kv_store_factory(plan))
out = gen.generate([[5, 17, 9, 100, 3, 4, 8, 9, 10], [7, 7, 7]], SamplingParams(max_tokens=int(sys.argv[2])))
print(json.dumps({"tokens": [t for t, _ in out], "kernels": gen.vkv.kern is not None}))
"""


def run(mode: str, tree: str, n: int, plan: str = "mixed") -> list[list[int]]:
    env = dict(os.environ, BPCOMPILE_KERNELS=mode, OMP_NUM_THREADS="1")
    if mode == "triton":
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, tree, str(n), plan],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "using the PyTorch path" not in r.stderr, r.stderr[-3000:]  # no fallback
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["kernels"] == (mode == "triton")
    return out["tokens"]


@pytest.mark.parametrize("tree", ["dynamic", "none"])
def test_kernel_path_matches_reference(tree):
    n = 12
    ref = run("torch", tree, n)
    assert all(len(t) == n for t in ref)
    assert run("triton", tree, n) == ref


def test_kernel_path_reads_the_default_plans_units():
    """KLT6 / KLT5 keys, INT3 values and an exact window through the kernels (tree verification, the accepted
    path's move, the window's copies): the torch executor's tokens."""
    n = 6
    ref = run("torch", "dynamic", n, "default")
    assert all(len(t) == n for t in ref)
    assert run("triton", "dynamic", n, "default") == ref


def test_kernel_path_reads_the_70b_recipes_plan():
    """recipes/70b.yaml's plan (the default: KLT6 / KLT5 keys, INT3 / INT4 values, a window of 10; one scale per
    token and head of 128, pages of 64) on a small random model with the 70B's head size, through the kernels: the
    torch executor's tokens."""
    n = 6
    ref = run("torch", "dynamic", n, "70b")
    assert run("triton", "dynamic", n, "70b") == ref
