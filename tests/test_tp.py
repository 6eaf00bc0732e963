"""Tensor parallelism in the native runtime: tp=2 (two processes over gloo, each loading only its own rank files)
against tp=1 (the same engine's rank files merged into one process), greedy, speculation on, the engines' own
KV plans sliced per rank. Built by the real build pipeline from real safetensors checkpoints."""

from __future__ import annotations

import json
import os
import signal
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


def _tiny_tp2(root: Path, default_kv: bool = False) -> Path:
    """recipes/tiny.yaml built at tp 2 (its INT4 + FP8-unit plan; default_kv: the default plan, its explicit KV
    settings other than format, group and page size dropped)."""
    text = (REPO / "recipes" / "tiny.yaml").read_text().replace("../models/tiny", str(TINY))
    if default_kv:
        drop = ("  outlier_fraction:", "  sink_tokens:", "  recent_window:")
        text = "".join(line for line in text.splitlines(True) if not line.startswith(drop))
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


@pytest.fixture(scope="module")
def tiny_tp2_default(tmp_path_factory):
    return _tiny_tp2(tmp_path_factory.mktemp("tp2default"), default_kv=True)


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
    # each records its first KV head and the model's, which number its units for the KLT dither
    assert [(p.first_kv_head, p.total_kv_heads) for p in (plan, r1, r5)] == [(0, 4), (2, 4), (2, 4)]
    # the per-rank plans' bytes add up to the whole plan's (no unit lost or counted twice at tp <= KV)
    assert sum(plan.shard(r, 2).bytes_per_token() for r in range(2)) == plan.bytes_per_token()
    # KLT key units: each rank takes its heads' tables (the frequencies are every head's)
    basis = torch.linalg.qr(torch.randn(L, KV, D, D))[0].half()
    klt = {n: torch.rand(L, KV, D) for n in ("mean", "weight", "step", "level")}
    klt |= {"basis": basis, "bits": torch.full((L, KV, D), 4, dtype=torch.int8), "inv_freq": torch.rand(D // 2)}
    keys = {"k": ["klt4", "int4", "int4", "klt4"], "v": ["int4"] * 4}
    kp = KVPlan("int4-fp8-outlier", L, KV, D, 8, [keys] * L, klt=klt)
    k1 = kp.shard(1, 2)
    assert k1.precision[0]["k"] == ["int4", "klt4"] and k1.has_klt
    assert all(torch.equal(k1.klt[n], klt[n][:, 2:]) for n in klt if n != "inv_freq")
    assert torch.equal(k1.klt["inv_freq"], klt["inv_freq"]) and not kp.shard(1, 4).has_klt
    assert torch.equal(kp.shard(7, 8).klt["basis"], basis[:, 3:])


def test_tp2_is_token_identical_on_the_tiny_pair(tiny_tp2):
    """The shipped tiny pair (4 / 2 heads of 64; draft 2 / 1, its KV head duplicated on both ranks), the default
    INT4 + FP8-unit plan sliced per rank, dynamic tree of 5: 50 prompts x 32 tokens."""
    assert (tiny_tp2 / "kv_plan" / "plan.json").is_file()
    same, stats = _compare(tiny_tp2)
    assert same == N_PROMPTS
    assert stats["tokens"] > stats["steps"]  # drafts were accepted: speculation ran on both ranks


def test_tp2_default_plan_is_token_identical_to_tp1(tiny_tp2_default):
    """The default KV plan at tp 2 (the tiny pair's 4 layers: keys KLT6 in layer 0, KLT5 in 1-2, INT4 in 3; INT3 /
    INT4 values; a recent window of 10 exact entries): each rank its KV head's units and KLT tables; 8 prompts x 16
    tokens, dynamic tree of 5, the tokens of tp 1 with the same plan (each rank keys the KLT dither by the model's
    unit ids, so it codes its head as tp 1 does: tests/test_kernels.py compares a shard's codes with the whole
    store's bit for bit; wrong tables would depart at once)."""
    cfg = json.loads((tiny_tp2_default / "engine.json").read_text())["kv_cache"]
    assert (cfg["key_transform"], cfg["int6_keys"], cfg["int5_keys"], cfg["recent_window"]) == (
        "klt",
        "early",
        "middle",
        10,
    )
    plan = KVPlan.load(tiny_tp2_default / "kv_plan")
    assert [p["k"] for p in plan.precision] == [["klt6"] * 2, ["klt5"] * 2, ["klt5"] * 2, ["int4"] * 2]
    assert "int3" in {x for p in plan.precision for x in p["v"]}
    prompts = _prompts(tiny_tp2_default, 8)
    params = SamplingParams(max_tokens=16)
    ref = [t for t, _ in Generator.from_engine(tiny_tp2_default, tp=1).generate(prompts, params)]
    two = Generator.from_engine(tiny_tp2_default)
    try:
        assert two.tp == 2 and two.tree.kind == "dynamic"
        got = two.generate(prompts, params)
    finally:
        two.close()
    assert [t for t, _ in got] == ref
    assert sum(s.verifier_steps for _, s in got) < 8 * 16  # drafts were accepted


def test_tp2_is_token_identical_on_a_gqa_pair_with_head_size_24(tmp_path):
    """Random Llamas with head size 24 (not a power of two): verifier 6 query / 2 KV heads, draft 2 / 1; the default
    KV plan (KLT6 keys in layer 0, a window of 10). Each rank numbers its KLT units as the whole model does for their
    dither, so rank 1 rounds its head as tp 1 does (keyed by a rank's own unit ids, one prompt of 50 departed)."""
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
    assert KVPlan.load(engine / "kv_plan").precision[0]["k"] == ["klt6", "klt6"]
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
def test_tritonserver_runs_a_tp2_generator(tiny_tp2, tmp_path, monkeypatch):
    """The emitted repository of the tp=2 engine through a real tritonserver: the generator model instance starts
    its rank-1 worker and stops it on unload; greedy output equals the in-process tp=1 engine's for the same 50
    prompts x 32 tokens (8 concurrent clients, so requests share the tp=2 batch), and streamed for a few. Then
    the worker is stopped (SIGSTOP): the next request fails, naming rank 1, once the collective timeout passes,
    and the server's health says the generator failed."""
    pytest.importorskip("tritonclient.grpc")
    pytest.importorskip("pytriton")
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer

    from bpcompile.serving.client import RemoteError, generate_remote
    from bpcompile.serving.emit import emit_repository
    from bpcompile.serving.serve import Health, ServerProcess

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
    monkeypatch.setenv("BPCOMPILE_TP_TIMEOUT", "20")  # the server's workers inherit it
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
        (worker,) = workers()
        os.kill(int(worker), signal.SIGSTOP)
        with pytest.raises(RemoteError, match=r"tensor-parallel rank 1 is stopped"):
            generate_remote(s.grpc_url, texts[0], 4, stream=False)
        # the generator says it cannot serve any more: what `bpcompile serve` reports on /health (503) and takes
        # as the server having failed (it stops tritonserver and exits 1), its main loop asking the same question
        health = Health(s)
        health.started = True
        assert s.failed_instances() and health.problem().startswith("model tensorrt_llm (pid ")
        assert "failed: tensor-parallel rank 1 is stopped" in health.problem()
    assert s.proc.returncode == 0 and workers() == []


# --- the worker channel: private, pickle-free, bounded -------------------------------------------------------


def test_no_pickle_crosses_between_ranks(tiny_tp2, monkeypatch):
    """A tp=2 generate (speculation on) with pickle and torch.save/load made to fail in rank 0, where every call
    to the workers is encoded; every broadcast is recorded: each call is a MAGIC preamble and a buffer that is
    not a pickle stream."""
    import pickle

    from bpcompile.runtime import tp

    def refuse(*a, **k):
        raise AssertionError("pickle used on the tensor-parallel path")

    gen = Generator.from_engine(tiny_tp2)
    sent: list[bytes] = []
    broadcast = tp._broadcast
    monkeypatch.setattr(tp, "_broadcast", lambda pg, t: (broadcast(pg, t), sent.append(t.numpy().tobytes())))
    for mod, names in ((pickle, ("dumps", "dump", "loads", "load", "Pickler", "Unpickler")), (torch, ("save", "load"))):
        for name in names:
            monkeypatch.setattr(mod, name, refuse)
    try:
        out = gen.generate(_prompts(tiny_tp2, 4), SamplingParams(max_tokens=8))
    finally:
        monkeypatch.undo()
        gen.close()
    assert all(len(t) == 8 for t, _ in out) and sum(s.verifier_steps for _, s in out) < 32  # drafts accepted
    assert len(sent) >= 2 * 8 and len(sent) % 2 == 0
    for pre, buf in zip(sent[::2], sent[1::2]):
        magic, n_head, n_bytes = torch.frombuffer(bytearray(pre), dtype=torch.int64).tolist()
        assert magic == tp.MAGIC and n_bytes == len(buf) and n_bytes >= 8 * n_head
        assert not buf.startswith(b"\x80") and b"\x80\x04\x95" not in buf[: 8 * n_head]  # no pickle stream


def _listening_ports(pid: int) -> list[int]:
    """TCP ports process pid listens on (what another user learns from /proc/net/tcp, here tied to the pid)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


ATTACKER = r"""
import json, os, pickle, re, socket, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
worker, marker, extra_ports = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
cmdline = open(f"/proc/{worker}/cmdline").read().split("\0")
named = sorted({int(n) for a in cmdline for n in re.findall(r"\d+", a) if 1024 <= int(n) < 65536})
paths = [a for a in cmdline if os.path.exists(a)]
class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))
joined, answered = [], []
def join(port):  # the reported attack: join rank 0's store, then the group as rank 1
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=2))
    dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=2))
    joined.append(port)
for port in named:
    threading.Thread(target=join, args=(port,), daemon=True).start()
time.sleep(5)
for port in sorted(set(named) | set(extra_ports)):
    for data in (pickle.dumps(Payload()), bytes(8) + pickle.dumps(Payload())):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(data)
                s.settimeout(1)
                if s.recv(1 << 16):
                    answered.append(port)
        except OSError:
            pass
print(json.dumps({"cmdline": cmdline, "named": named, "paths": paths, "joined": joined, "answered": answered}))
"""


def test_another_user_cannot_join_or_read_the_workers(tiny_tp2, tmp_path):
    """The reported attack against a running tp=2 engine: a second process reads the worker's command line and
    tries to join as a rank through any port it names, and sends a pickle to every port the ranks listen on
    (given to it here: another user sees them in /proc/net/tcp). Nothing joins, nothing answers, the pickle
    does not run, and the engine keeps generating what tp 1 does."""
    gen = Generator.from_engine(tiny_tp2)
    prompts, params = _prompts(tiny_tp2, 3), SamplingParams(max_tokens=12)
    try:
        worker = gen.peers.procs[0].pid
        ports = _listening_ports(worker) + _listening_ports(os.getpid())
        marker = tmp_path / "pwned"
        r = subprocess.run(
            [sys.executable, "-c", ATTACKER, str(worker), str(marker), json.dumps(ports)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        seen = json.loads(r.stdout)
        # the command line names the engine and the rank, no rendezvous: no port, no store path, no secret
        assert seen["cmdline"][-3:] == [str(tiny_tp2), "--rank=1", ""] and seen["paths"][-1] == str(tiny_tp2)
        private = Path(gen.peers.private)
        assert str(private) not in "".join(seen["cmdline"]) and (private.stat().st_mode & 0o777) == 0o700
        assert str(private).encode() not in Path(f"/proc/{worker}/environ").read_bytes()
        assert seen["named"] == [] and seen["joined"] == [] and seen["answered"] == [] and not marker.exists()
        got = gen.generate(prompts, params)
    finally:
        gen.close()
    ref = Generator.from_engine(tiny_tp2, tp=1).generate(prompts, params)
    assert [t for t, _ in got] == [t for t, _ in ref]


def test_a_group_member_without_the_secret_is_refused(tmp_path):
    """Whoever got into the group without being started by rank 0 (no secret) fails the hand-shake, on both
    sides, before any call is sent."""
    from concurrent.futures import ThreadPoolExecutor

    from bpcompile.runtime import tp

    store = torch.distributed.FileStore(str(tmp_path / "store"), 2)

    def rank(r: int, secret: bytes):
        try:
            tp.group(store, r, 2, "cpu", 60, 60, secret)
        except tp.TPError as e:
            return str(e)

    with ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(rank, (0, 1), (b"a" * 32, b"b" * 32)))
    assert all(e and "did not prove it holds this run's secret" in e for e in errors)


def test_a_stopped_worker_fails_the_call_in_bounded_time(tiny_tp2, monkeypatch):
    """SIGSTOP rank 1 of an idle engine (waiting without a deadline is fine), then generate: the call fails once
    the collective timeout passes, naming the rank, and the workers are stopped; the next call says so."""
    import time

    from bpcompile.runtime.tp import TPError

    monkeypatch.setenv("BPCOMPILE_TP_TIMEOUT", "3")
    gen = Generator.from_engine(tiny_tp2)
    try:
        proc = gen.peers.procs[0]
        time.sleep(4)  # idle longer than the collective timeout: the worker waits on its stdin, not a collective
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TPError, match=rf"rank 1 \(pid {proc.pid}\) is stopped.*BPCOMPILE_TP_TIMEOUT"):
            gen.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
        assert time.monotonic() - t0 < 30 and proc.poll() is not None
        with pytest.raises(TPError, match="restart the engine"):
            gen.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    finally:
        gen.close()


def test_channel_messages_and_devices():
    """What a call encodes to, decoded on the other side; malformed headers are refused, not guessed at; CUDA
    ranks take consecutive devices, and there must be enough of them."""
    from bpcompile.runtime.paged_kv import AttnBatch
    from bpcompile.runtime.tp import TPError, decode, encode, rank_devices

    batch = AttnBatch(torch.arange(6, dtype=torch.int32).view(2, 3), torch.tensor([1, 2]), torch.tensor([3, 4]),
                      torch.tensor([1, 1]), None, 8)  # fmt: skip
    args = (torch.tensor([[1, 2]]), ("dense", (torch.tensor([True, False]), [3, 4]), None, 7), batch, False, -5)
    head, tensors = encode("draft", "run_forward", args)
    payload = b"".join(t.contiguous().numpy().tobytes().ljust(-(-t.nbytes // 8) * 8, b"\0") for t in tensors)
    role, name, got = decode(head, torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    assert (role, name, got[0].tolist(), got[1][0], got[1][1][0].tolist(), got[1][1][1], got[1][2:]) == (
        "draft", "run_forward", [[1, 2]], "dense", [True, False], [3, 4], (None, 7)
    )  # fmt: skip
    assert got[2].block_tables.tolist() == [[0, 1, 2], [3, 4, 5]] and got[2].page_size == 8 and got[3:] == (False, -5)
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    for bad in (head[:-1], head + [0], [99] + head[1:], head[:2] + [99] + head[3:]):
        with pytest.raises(TPError):
            decode(bad, buf)
    with pytest.raises(TPError, match="does not carry"):
        encode("verifier", "run_move", (object(),))
    with pytest.raises(TPError):
        encode("verifier", "__reduce__", ())
    from bpcompile.runtime import tp
    from bpcompile.runtime.executor import Executor

    assert {n for n in dir(Executor) if n.startswith("run_")} <= set(tp._CALLS)  # every call has a code
    assert rank_devices("cpu", 2) == ["cpu", "cpu"]
    with pytest.raises(UserError, match=r"no CUDA device cuda:2 .* device 'cuda:1'"):
        rank_devices("cuda:1", 2)


def test_a_failed_rank_is_an_error_with_exit_1_not_an_internal_error():
    """The CLI reports a rank that died or hung as what it is (exit 1, so a supervisor restarts), not as a bug."""
    import click
    from click.testing import CliRunner

    from bpcompile.cli import _Group
    from bpcompile.runtime.tp import TPError

    @click.group(cls=_Group)
    def cli():
        pass

    @cli.command()
    def run():
        raise TPError("tensor-parallel rank 1 (pid 4242) is stopped")

    res = CliRunner().invoke(cli, ["run"])
    assert res.exit_code == 1, res.output
    assert "rank 1 (pid 4242) is stopped" in res.output and "internal error" not in res.output


def test_tp2_chunked_prefill_equals_unchunked(tiny_tp2):
    """Prompts of 4-40 tokens prefilled 8 tokens a step at tp 2 (each rank keeps its heads' copy of the prompt's
    K/V, the calls through the tensor-parallel channel): the tokens of tp 1 without chunking."""
    prompts = _prompts(tiny_tp2, 12)
    params = SamplingParams(max_tokens=8)
    ref = [t for t, _ in Generator.from_engine(tiny_tp2, tp=1, prefill_chunk=0).generate(prompts, params)]
    two = Generator.from_engine(tiny_tp2, prefill_chunk=8)
    try:
        assert two.tp == 2 and two.chunks is not None
        got = [t for t, _ in two.generate(prompts, params)]
    finally:
        two.close()
    assert got == ref


def test_tp2_static_step_equals_tp1(tiny_tp2):
    """runtime.cuda_graphs on at tp 2: rank 0 sends each step's inputs over the tensor channel and every rank runs
    it from its own static buckets (eagerly on CPU), its row-split linears all-reducing inside; tokens equal tp 1
    with the executor's own step, for 2 prompts at once and then 3 (the bucket of 4 with a padding row), the
    engine's INT4 + FP8-unit plan sliced per rank, speculation in every step. A worker without the static step
    would fail the call (it gets run_static), so equal tokens mean both ranks ran it."""
    prompts = _prompts(tiny_tp2, 5)
    params = SamplingParams(max_tokens=8)
    batches = (prompts[:2], prompts[2:])
    one = Generator.from_engine(tiny_tp2, tp=1, cuda_graphs="off")
    ref = [[t for t, _ in one.generate(b, params)] for b in batches]
    two = Generator.from_engine(tiny_tp2, cuda_graphs="on")
    try:
        assert two.tp == 2 and two.v_exec.static is not None and two.d_exec.static is not None
        res = [two.generate(b, params) for b in batches]
    finally:
        two.close()
    assert [[t for t, _ in r] for r in res] == ref
    assert sum(s.verifier_steps for r in res for _, s in r) < 5 * 8  # drafts were accepted
    assert {b for b, *_ in two.v_exec.static.buckets} >= {2, 4} and two.v_exec.static.padded > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_plan_counts_what_the_runtime_allocates_on_the_tiny_pair(tiny_tp2, tp):
    """recipes/tiny.yaml as built (INT4 + FP8 units, dynamic tree): `bpcompile plan`'s runtime_bytes against what
    the engine holds merged at tp 1 and on rank 0 at tp 2 (tests/test_plan.py assert_plan_matches; rank 0's pools
    within 3% of the plan's per-rank average: its share of the FP8 units)."""
    from test_plan import assert_plan_matches, compare_with_runtime

    planned, held = compare_with_runtime(tiny_tp2, tp)
    assert_plan_matches(planned, held, pools=0.01 if tp == 1 else 0.03)
    assert held["dense"] > 0 and held["chunk"] == 0  # max_input_len 384 never exceeds the 512-token chunk


def test_plan_counts_the_default_plans_tables_per_rank(tiny_tp2_default):
    """The default plan at tp 2: rank 0's pools, exact copies and KLT tables (its KV head's) against the plan's
    runtime_bytes (within 1%: rank 0's share of the INT3 value units against the plan's per-rank average)."""
    from test_plan import assert_plan_matches, compare_with_runtime

    planned, held = compare_with_runtime(tiny_tp2_default, 2)
    assert_plan_matches(planned, held)


def test_plan_counts_no_dense_copy_under_the_static_step(tiny_tp2_default):
    """runtime.cuda_graphs on (on CPU the static step runs eagerly) at tp 2 with the default plan's exact entries:
    neither cache has a dense copy, in the plan as in rank 0's runtime; pools and weights as without it."""
    from test_plan import assert_plan_matches, compare_with_runtime

    planned, held = compare_with_runtime(tiny_tp2_default, 2, cuda_graphs="on")
    assert_plan_matches(planned, held)
    assert held["dense"] == 0 and planned["total"] > 0


def test_tp2_prefix_reuse_equals_tp1_without_it(tiny_tp2):
    """8 conversations x 3 turns sharing a 40-token system prompt at tp 2 with prefix reuse (rank 0 picks the pages,
    every rank fills its heads' dense view and exact copies from its own copies of them, over the tensor channel;
    the engine's quantized plan sliced per rank): the tokens of tp 1 without reuse, and prompts did reuse."""
    text = _prompts(tiny_tp2, 30)
    system = [t for p in text[:6] for t in p][:40]
    users = [[text[6 + 3 * c + t][:6] for t in range(3)] for c in range(8)]
    params = SamplingParams(max_tokens=6)

    def chat(gen):
        hist, out, reused = [list(system) for _ in users], [], []
        for t in range(3):
            prompts = [h + u[t] for h, u in zip(hist, users)]
            res = gen.generate(prompts, params)
            out.append([toks for toks, _ in res])
            reused += [s.reused_tokens for _, s in res]
            hist = [p + toks for p, (toks, _) in zip(prompts, res)]
        return out, reused

    # back-off off: it drafts by measured step times, so tree shapes (and float rounding) could vary between runs
    one = Generator.from_engine(tiny_tp2, tp=1, prefix_reuse=False)
    one.spec.backoff = None
    ref, none = chat(one)
    two = Generator.from_engine(tiny_tp2, prefix_reuse=True)
    two.spec.backoff = None
    try:
        assert two.tp == 2 and two.prefix_reuse
        got, reused = chat(two)
    finally:
        two.close()
    assert got == ref
    assert not any(none) and sum(n > 0 for n in reused) >= 20
