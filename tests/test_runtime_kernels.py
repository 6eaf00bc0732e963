"""The runtime's kernel path: generation through the Triton kernels (quantize-append, paged tree attention,
compaction move) gives the same greedy tokens as the PyTorch reference path, on a mixed INT4/FP8 cache.

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
from bpcompile.runtime.model import ModelConfig
from bpcompile.runtime.kvcache import KVPlan, kv_store_factory
from bpcompile.runtime.generator import Generator, SamplingParams
from bpcompile.runtime.speculative import TreeSpec

cfg = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=32,
                  intermediate_size=128)
v = random_llama(cfg, seed=0)
d = noisy_copy(v, 0.3, seed=1)
plan = KVPlan.uniform("int4-fp8-outlier", cfg.num_layers, cfg.num_kv_heads, cfg.head_size, group_size=32)
plan.precision[1]["k"][0] = "fp8"  # mixed units: one FP8 outlier unit among INT4 ones
plan = KVPlan(**{**plan.__dict__})
gen = Generator(v, d, TreeSpec(sys.argv[1], nodes=4, length=3), max_batch_size=2, max_seq_len=64, page_size=8,
                kv_store_factory=kv_store_factory(plan))
out = gen.generate([[5, 17, 9, 100, 3, 4, 8, 9, 10], [7, 7, 7]], SamplingParams(max_tokens=int(sys.argv[2])))
print(json.dumps([t for t, _ in out]))
"""


def run(mode: str, tree: str, n: int) -> list[list[int]]:
    env = dict(os.environ, BPCOMPILE_KERNELS=mode, OMP_NUM_THREADS="1")
    if mode == "triton":
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, tree, str(n)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tree", ["dynamic", "none"])
def test_kernel_path_matches_reference(tree):
    n = 12
    ref = run("torch", tree, n)
    assert all(len(t) == n for t in ref)
    assert run("triton", tree, n) == ref
