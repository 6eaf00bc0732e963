"""Tensor parallelism in the native runtime: tp=2 (two processes over gloo, each loading only its own rank files)
against tp=1 (the same engine's rank files merged into one process), greedy, speculation on, the engines' own
KV plans sliced per rank. Built by the real build pipeline from real safetensors checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bpcompile.compiler.pipeline import build
from bpcompile.core.errors import UserError
from bpcompile.runtime.generator import Generator, SamplingParams
from bpcompile.runtime.kvcache import KVPlan
from tests.pairs import make_model, make_tokenizer, write_recipe

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"
N_PROMPTS, N_TOKENS = 50, 32


def _tiny_tp2(root: Path) -> Path:
    text = (REPO / "recipes" / "tiny.yaml").read_text().replace("../models/tiny", str(TINY))
    text = text.replace("parallel: {tp: 1, pp: 1}", "parallel: {tp: 2, pp: 1}")
    text = text.replace(
        "store: ../engines, triton_repo: ../triton_repo",
        f"store: {root / 'engines'}, triton_repo: {root / 'triton_repo'}",
    )
    text = text.replace("emit: true", "emit: false").replace("compile: true", "compile: false")
    (root / "tiny.yaml").write_text(text)
    return build(root / "tiny.yaml").path


@pytest.fixture(scope="module")
def tiny_tp2(tmp_path_factory):
    return _tiny_tp2(tmp_path_factory.mktemp("tp2"))


def _prompts(engine: Path, n: int) -> list[list[int]]:
    """n windows of 4..40 tokens of the pydoc topics text (the tiny pair's training domain)."""
    import pydoc_data.topics as t

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine / "tokenizer" / "tokenizer.json"))
    ids = tok.encode(" ".join(t.topics[k] for k in sorted(t.topics)[-8:])).ids
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 41, (), generator=g))
        start = int(torch.randint(0, len(ids) - length, (), generator=g))
        out.append(ids[start : start + length])
    return out


def _compare(engine: Path) -> tuple[int, dict]:
    prompts = _prompts(engine, N_PROMPTS)
    params = SamplingParams(max_tokens=N_TOKENS)
    one = Generator.from_engine(engine, tp=1)
    ref = one.generate(prompts, params)
    two = Generator.from_engine(engine)
    try:
        assert two.tp == 2 and two.draft is not None and two.tree.kind == "dynamic"
        got = two.generate(prompts, params)
    finally:
        two.close()
    same = sum(a[0] == b[0] for a, b in zip(ref, got))
    drafted = sum(s.verifier_steps for _, s in got), sum(len(t) for t, _ in got)
    return same, {"steps": drafted[0], "tokens": drafted[1]}


def test_kv_plan_shard_takes_each_ranks_heads():
    L, KV, D = 2, 4, 8
    plan = KVPlan(
        "int4-fp8-outlier",
        L,
        KV,
        D,
        8,
        [{"k": ["int4", "fp8", "int4", "int4"], "v": ["int4", "int4", "int4", "fp8"]}] * L,
        k_channel_scale=torch.arange(L * KV * D, dtype=torch.float32).view(L, KV, D) + 1,
        int4_clip=torch.rand(L, 2, KV),
        k_mean=torch.randn(L, KV, D),
    )
    r1 = plan.shard(1, 2)  # heads 2, 3
    assert r1.num_kv_heads == 2 and r1.precision[0] == {"k": ["int4", "int4"], "v": ["int4", "fp8"]}
    assert torch.equal(r1.k_channel_scale, plan.k_channel_scale[:, 2:]) and torch.equal(r1.k_mean, plan.k_mean[:, 2:])
    assert torch.equal(r1.int4_clip, plan.int4_clip[:, :, 2:])
    r5 = plan.shard(5, 8)  # tp 8 over 4 KV heads: each head on two adjacent ranks; rank 5 holds head 2
    assert r5.num_kv_heads == 1 and r5.precision[1] == {"k": ["int4"], "v": ["int4"]}
    assert torch.equal(r5.k_channel_scale, plan.k_channel_scale[:, 2:3])
    # the per-rank plans' bytes add up to the whole plan's (no unit lost or counted twice at tp <= KV)
    assert sum(plan.shard(r, 2).bytes_per_token() for r in range(2)) == plan.bytes_per_token()


def test_tp2_is_token_identical_on_the_tiny_pair(tiny_tp2):
    """The shipped tiny pair (4 / 2 heads of 64; draft 2 / 1, its KV head duplicated on both ranks), the default
    INT4 + FP8-unit plan sliced per rank, dynamic tree of 5: 50 prompts x 32 tokens."""
    assert (tiny_tp2 / "kv_plan" / "plan.json").is_file()
    same, stats = _compare(tiny_tp2)
    assert same == N_PROMPTS
    assert stats["tokens"] > stats["steps"]  # drafts were accepted: speculation ran on both ranks


def test_tp2_is_token_identical_on_a_gqa_pair_with_head_size_24(tmp_path):
    """Random Llamas with head size 24 (not a power of two): verifier 6 query / 2 KV heads, draft 2 / 1."""
    v = make_model(
        tmp_path / "verifier",
        vocab=300,
        seed=0,
        hidden_size=144,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=192,
        num_hidden_layers=2,
    )
    d = make_model(
        tmp_path / "draft",
        vocab=300,
        seed=0,
        hidden_size=48,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=96,
        num_hidden_layers=1,
    )
    for m in (v, d):
        make_tokenizer(m, vocab=300)
    recipe = write_recipe(tmp_path / "r.yaml", v, d, extra="speculative: {tree: dynamic, nodes: 4, backoff: false}\n")
    recipe.write_text(
        recipe.read_text()
        .replace("parallel: {tp: 1, pp: 1}", "parallel: {tp: 2, pp: 1}")
        .replace("max_batch_size: 4,", "max_batch_size: 16,")
        .replace("kv_cache: {format: fp16}", "kv_cache: {format: int4-fp8-outlier, group_size: 24, page_size: 8}")
        + "calibration: {source: 'builtin:pydoc-topics', samples: 4, length: 64}\n"
    )
    engine = build(recipe).path
    cfg = json.loads((engine / "verifier" / "config.json").read_text())
    assert cfg["mapping"]["tp_size"] == 2 and cfg["head_size"] == 24
    same, _ = _compare(engine)
    assert same == N_PROMPTS


def test_tp_refusals_and_cli(tiny_tp2):
    with pytest.raises(UserError, match="converted for tp=2"):
        Generator.from_engine(tiny_tp2, tp=4)
    with pytest.raises(UserError, match="torch executor"):
        Generator.from_engine(tiny_tp2, executor="onnxruntime")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bpcompile.cli",
            "generate",
            str(tiny_tp2),
            "--prompt",
            "Lists are",
            "--raw",
            "--max-tokens",
            "12",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    two = json.loads(r.stdout)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bpcompile.cli",
            "generate",
            str(tiny_tp2),
            "--prompt",
            "Lists are",
            "--raw",
            "--max-tokens",
            "12",
            "--json",
            "--tp",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    one = json.loads(r.stdout)
    assert (two["tp"], one["tp"]) == (2, 1) and two["tokens"] == one["tokens"] and len(one["tokens"]) == 12
    r = subprocess.run(
        [sys.executable, "-m", "bpcompile.cli", "generate", str(tiny_tp2), "--prompt", "x", "--tp", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "converted for tp=2" in r.stderr


def test_a_dead_worker_is_reported_not_waited_on(tiny_tp2):
    gen = Generator.from_engine(tiny_tp2)
    try:
        gen.peers.procs[0].kill()
        gen.peers.procs[0].wait()
        with pytest.raises(RuntimeError, match="worker process"):
            gen.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    finally:
        gen.close()


@pytest.mark.server
def test_tritonserver_runs_a_tp2_generator(tiny_tp2, tmp_path):
    """The emitted repository of the tp=2 engine through a real tritonserver: the generator model instance starts
    its rank-1 worker and stops it on unload; greedy output equals the in-process tp=1 engine's for the same 50
    prompts x 32 tokens (8 concurrent clients, so requests share the tp=2 batch), and streamed for a few."""
    pytest.importorskip("tritonclient.grpc")
    pytest.importorskip("pytriton")
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer

    from bpcompile.serving.client import generate_remote
    from bpcompile.serving.emit import emit_repository
    from bpcompile.serving.serve import ServerProcess

    tok = Tokenizer.from_file(str(tiny_tp2 / "tokenizer" / "tokenizer.json"))
    texts = [tok.decode(p) for p in _prompts(tiny_tp2, N_PROMPTS)]
    one = Generator.from_engine(tiny_tp2, tp=1)
    ref = [
        t
        for t, _ in one.generate(
            [tok.encode(x).ids for x in texts], SamplingParams(max_tokens=N_TOKENS, end_id=tok.token_to_id("</s>"))
        )
    ]
    repo = tmp_path / "repo"
    emit_repository([(1, tiny_tp2)], repo)
    workers = lambda: subprocess.run(
        ["pgrep", "-f", f"bpcompile.runtime.tp_worker .*{repo}"],  # noqa: E731
        capture_output=True,
        text=True,
    ).stdout.split()
    with ServerProcess(repo, log_file=tmp_path / "server.log", startup_timeout=240) as s:
        assert len(workers()) == 1  # rank 1 of the generator's engine
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda x: generate_remote(s.grpc_url, x, N_TOKENS, stream=False)["token_ids"], texts))
        assert sum(g == r for g, r in zip(got, ref)) == N_PROMPTS
        for x, r in list(zip(texts, ref))[:3]:
            assert generate_remote(s.grpc_url, x, N_TOKENS, stream=True)["token_ids"] == r
        assert "tp 2" in (tmp_path / "server.log").read_text()
    assert s.proc.returncode == 0 and workers() == []
