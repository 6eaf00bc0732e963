"""Tensor parallelism for the native runtime: one process per rank over a private torch.distributed group.

Rank 0 is the engine the caller holds: its scheduler, speculative step and sampler run there alone. Its
executors do the host bookkeeping (pages, slots, padding) and, before each computation, broadcast that call's
tensors to the other ranks (`Peers.run`). Every other rank is a worker process (`python -m
bpcompile.runtime.tp_worker`) that holds its own shard of each model (its rank file only: runtime/model.py
`Llama.from_rank`) and its share of each KV cache (`KVPlan.shard`) and runs the same `Executor.run_*` calls in
the same order; the models' row-split linears all-reduce and their heads all-gather, so every rank ends each
forward with the whole logits and rank 0 samples from them.

One code path for both backends: `group` builds gloo between CPU ranks and NCCL between CUDA ranks (rank r on
cuda:<first + r>), and the channel, the hand-shake and the model's collectives are the same calls on either.

Why nobody else can join or read the group:
- rendezvous: a torch.distributed FileStore in a fresh 0700 directory of rank 0's user (tempfile.mkdtemp).
  Its path, this run's secret and the timeouts reach a worker as the first line on its stdin, a pipe from rank
  0; nothing of them is on a command line (world-readable in /proc) or in the environment. NCCL's unique id
  (with its random bootstrap magic) goes through that store.
- gloo's own data sockets listen on loopback while the group forms; a process that raced into a free slot
  would not hold the secret: right after forming, every rank proves it holds it (an HMAC of a fresh nonce and
  its rank, all-gathered and checked by every rank) before anything else is sent. After that the group is a
  fixed set of connected sockets.
- no pickle: a call is a header of int64s (the call, the role, then each argument's kind, dtype and shape)
  and the tensors' bytes; the worker builds only tensors, ints, bools, None, tuples/lists and AttnBatch from
  it (`encode` / `decode`).

Bounded waits: forming the group and loading the shards may take BPCOMPILE_TP_START_TIMEOUT seconds (600);
each call's collectives BPCOMPILE_TP_TIMEOUT seconds (120) - a rank that does not answer fails that call with
an error naming the rank and stops the workers. An idle worker waits without a deadline for the next call: the
wait is a read of its stdin (one byte per call), not a collective; its stdin closing (rank 0 gone, or
`Peers.close`) ends it, so a dead rank 0 leaves no orphans.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from bpcompile.core.errors import RunFailure, UserError
from bpcompile.runtime.paged_kv import AttnBatch

START_TIMEOUT_ENV, TIMEOUT_ENV = "BPCOMPILE_TP_START_TIMEOUT", "BPCOMPILE_TP_TIMEOUT"
DEFAULT_START_TIMEOUT, DEFAULT_TIMEOUT = 600.0, 120.0


class TPError(RunFailure):
    """A tensor-parallel rank failed, did not answer in time, or sent what the channel does not carry."""


def timeouts() -> tuple[float, float]:
    """(start-up, per-call) timeouts in seconds, from BPCOMPILE_TP_START_TIMEOUT / BPCOMPILE_TP_TIMEOUT."""
    out = []
    for name, default in ((START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT), (TIMEOUT_ENV, DEFAULT_TIMEOUT)):
        raw = os.environ.get(name)
        try:
            value = default if raw is None else float(raw)
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            raise UserError(f"{name}={raw!r}: expected a positive number of seconds", key=name)
        out.append(value)
    return out[0], out[1]


def rank_devices(device: str, tp: int) -> list[str]:
    """Each rank's torch device: cpu for all, or consecutive CUDA devices from the requested one (cuda = cuda:0)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return ["cpu"] * tp
    if dev.type != "cuda":
        raise UserError(f"tensor parallelism runs on cpu or cuda devices, not {device!r}", key="device")
    first = dev.index or 0
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if first + tp > have:
        raise UserError(
            f"no CUDA device cuda:{first + tp - 1} for tensor-parallel rank {tp - 1} of device {device!r} at tp {tp} "
            f"(ranks take cuda:{first}..cuda:{first + tp - 1}; torch sees {have} CUDA device(s))",
            key="device",
        )
    return [f"cuda:{first + r}" for r in range(tp)]


def group(store, rank: int, tp: int, device: str, start: float, timeout: float, secret: bytes):
    """This rank's process group, hand-shake checked: NCCL between CUDA devices, gloo (on loopback) between CPU
    processes; both carry the same broadcast / allreduce / allgather calls. start: how long forming it may take
    (the ranks start at different times); timeout: how long each collective may wait after that."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        # Peers.run's own bounded wait fires first and names the rank; NCCL's watchdog is the backstop
        opts._timeout = timedelta(seconds=max(start, timeout) + 60)
        pg = dist.ProcessGroupNCCL(store, rank, tp, opts)
        handshake(pg, secret, rank, tp, device)
        return pg
    opts = dist.ProcessGroupGloo._Options()
    # loopback only, and every pair connected now (not on first use): the hand-shake then covers every socket
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=False)]
    opts._timeout = timedelta(seconds=start)
    pg = dist.ProcessGroupGloo(store, rank, tp, opts)
    handshake(pg, secret, rank, tp, device)
    pg.set_timeout(timedelta(seconds=timeout))
    return pg


def _bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


def _tensor(data: bytes, device: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _mac(secret: bytes, nonce: bytes, rank: int) -> bytes:
    return hmac.new(secret, b"bpcompile-tp\0" + nonce + rank.to_bytes(4, "big"), hashlib.sha256).digest()


def handshake(pg, secret: bytes, rank: int, tp: int, device: str) -> None:
    """Every rank proves it holds this run's secret: rank 0 broadcasts a fresh nonce, each rank all-gathers
    HMAC(secret, nonce, its rank) and checks everyone's. A process that got into the group without being started
    by rank 0 cannot answer, and nothing else has been sent by then."""
    nonce = _tensor(secrets.token_bytes(32), device) if rank == 0 else torch.empty(32, dtype=torch.uint8, device=device)
    pg.broadcast(nonce, 0).wait()
    n = _bytes(nonce)
    parts = [torch.empty(32, dtype=torch.uint8, device=device) for _ in range(tp)]
    pg.allgather([parts], [_tensor(_mac(secret, n, rank), device)]).wait()
    for r, p in enumerate(parts):
        if not hmac.compare_digest(_bytes(p), _mac(secret, n, r)):
            raise TPError(
                f"tensor-parallel rank {r} of the group did not prove it holds this run's secret: a process that "
                "rank 0 did not start is in the group; refusing to run"
            )


# ---------------------------------------------------------------------------------------------- the channel
# A call is broadcast from rank 0 as two tensors: [MAGIC, header length, buffer bytes] (int64), then one uint8
# buffer: the header (int64s) followed by each argument tensor's bytes, 8-byte aligned. The header holds the
# call and the role (indices into the tables below), then the arguments as a tree in prefix order: a kind, and
# for INT the value, for TENSOR the dtype index, ndim and shape, for TUPLE/LIST the length then the items, for
# WORD an index into _WORDS, for ATTN the AttnBatch fields as items.

MAGIC = 0x62705F74705F3031  # "bp_tp_01"
_CALLS = (
    "run_prefill",
    "run_forward",
    "run_move",
    "run_prefill_cached",
    "run_adopt",
    "run_publish",
    "run_chunk_begin",
    "run_prefill_chunk",
    "run_chunk_end",
    "run_static",
)
_ROLES = ("verifier", "draft")
_WORDS = ("dense", "paged")
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_ATTN = ("block_tables", "context_lens", "tree_lens", "q_lens", "tree_mask", "page_size")
NONE, FALSE, TRUE, INT, TENSOR, TUPLE, LIST, WORD, ATTN = range(9)
MAX_DEPTH, MAX_NDIM, MAX_HEADER, MAX_BYTES = 8, 8, 1 << 20, 1 << 36


def encode(role: str, name: str, args: tuple) -> tuple[list[int], list[torch.Tensor]]:
    """(header int64s, tensors) of one executor call."""
    if name not in _CALLS or role not in _ROLES:
        raise TPError(f"the tensor-parallel channel carries {_CALLS} of {_ROLES}, not {name!r} of {role!r}")
    head, tensors = [_CALLS.index(name), _ROLES.index(role)], []

    def put(x, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise TPError(f"argument of {name} nests deeper than {MAX_DEPTH}")
        if x is None:
            head.append(NONE)
        elif isinstance(x, bool):
            head.append(TRUE if x else FALSE)
        elif isinstance(x, int):
            head.extend((INT, x))
        elif isinstance(x, torch.Tensor):
            if x.dtype not in _DTYPES:
                raise TPError(f"argument of {name}: dtype {x.dtype} is not one the channel carries")
            head.extend((TENSOR, _DTYPES.index(x.dtype), x.dim(), *x.shape))
            tensors.append(x)
        elif isinstance(x, str) and x in _WORDS:
            head.extend((WORD, _WORDS.index(x)))
        elif isinstance(x, AttnBatch):
            head.append(ATTN)
            for f in _ATTN:
                put(getattr(x, f), depth + 1)
        elif isinstance(x, (tuple, list)):
            head.extend((TUPLE if isinstance(x, tuple) else LIST, len(x)))
            for item in x:
                put(item, depth + 1)
        else:
            raise TPError(f"argument of {name}: the channel does not carry {type(x).__name__} {x!r:.40}")

    put(tuple(args), 0)
    return head, tensors


def decode(head: list[int], payload: torch.Tensor) -> tuple[str, str, tuple]:
    """(role, call, args) from a header and the buffer of tensor bytes; TPError on anything malformed."""
    pos, off = 0, 0

    def take() -> int:
        nonlocal pos
        if pos >= len(head):
            raise TPError("tensor-parallel message: header ends early")
        pos += 1
        return head[pos - 1]

    def index(table: tuple, what: str):
        i = take()
        if not 0 <= i < len(table):
            raise TPError(f"tensor-parallel message: unknown {what} {i}")
        return table[i]

    def get(depth: int):
        nonlocal off
        if depth > MAX_DEPTH:
            raise TPError("tensor-parallel message: nests too deep")
        kind = take()
        if kind == NONE:
            return None
        if kind in (FALSE, TRUE):
            return kind == TRUE
        if kind == INT:
            return take()
        if kind == WORD:
            return index(_WORDS, "word")
        if kind == TENSOR:
            dtype, ndim = index(_DTYPES, "dtype"), take()
            if not 0 <= ndim <= MAX_NDIM:
                raise TPError(f"tensor-parallel message: {ndim} dimensions")
            shape = [take() for _ in range(ndim)]
            if any(s < 0 for s in shape):
                raise TPError(f"tensor-parallel message: shape {shape}")
            n = math.prod(shape) * dtype.itemsize
            if off + n > payload.numel():
                raise TPError("tensor-parallel message: tensors overrun the buffer")
            t = payload[off : off + n].view(dtype).view(shape)
            off += n + (-n % 8)
            return t
        if kind in (TUPLE, LIST):
            n = take()
            if not 0 <= n <= len(head):
                raise TPError(f"tensor-parallel message: {n} items")
            items = [get(depth + 1) for _ in range(n)]
            return tuple(items) if kind == TUPLE else items
        if kind == ATTN:
            return AttnBatch(*(get(depth + 1) for _ in _ATTN))
        raise TPError(f"tensor-parallel message: unknown kind {kind}")

    name, role = index(_CALLS, "call"), index(_ROLES, "role")
    args = get(0)
    if not isinstance(args, tuple) or pos != len(head) or off != payload.numel():
        raise TPError("tensor-parallel message: header and buffer do not match")
    return role, name, args


def _broadcast(pg, t: torch.Tensor) -> None:
    pg.broadcast(t, 0).wait()


def send(pg, head: list[int], tensors: list[torch.Tensor], device: str) -> None:
    parts = [torch.tensor(head, dtype=torch.int64).view(torch.uint8).to(device)]
    for t in tensors:
        b = t.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        parts += [b, torch.zeros(-b.numel() % 8, dtype=torch.uint8, device=device)]
    buf = torch.cat(parts)
    _broadcast(pg, torch.tensor([MAGIC, len(head), buf.numel()], dtype=torch.int64, device=device))
    _broadcast(pg, buf)


def receive(pg, device: str) -> tuple[str, str, tuple]:
    pre = torch.empty(3, dtype=torch.int64, device=device)
    _broadcast(pg, pre)
    magic, n_head, n_bytes = pre.tolist()
    if magic != MAGIC or not 2 <= n_head <= MAX_HEADER or not 8 * n_head <= n_bytes <= MAX_BYTES:
        raise TPError(f"tensor-parallel message: bad preamble {[magic, n_head, n_bytes]}")
    buf = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    _broadcast(pg, buf)
    head = buf[: 8 * n_head].cpu().view(torch.int64).tolist()
    return decode(head, buf[8 * n_head :])


# ---------------------------------------------------------------------------------------------- rank 0


def _python() -> str:
    """The interpreter for workers: this one, unless this process is an embedded one (Triton's Python backend
    stub), whose environment puts the right python first on PATH."""
    exe = Path(sys.executable)
    if exe.name.startswith("python"):
        return str(exe)
    return shutil.which("python3") or "python3"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


class Peers:
    """Rank 0's handle on the worker ranks: runs each executor call on every rank, stops them."""

    def __init__(self, pg, procs: list[subprocess.Popen], store, private: str, device: str, start: float, step: float):
        self.group, self.procs, self.store, self.private = pg, procs, store, private
        self.device, self.start_timeout, self.timeout = device, start, step
        self.cuda = torch.device(device).type == "cuda"
        self.failed: Optional[str] = None  # why the group broke: no call runs after it
        self.summary: Optional[str] = None  # the same, one line naming the rank(s)
        self.closed = False

    def _blamed(self) -> list[str]:
        """The workers that exited or are stopped."""
        bad = []
        for rank, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                bad.append(f"rank {rank} (pid {p.pid}) exited with code {p.returncode}")
            elif _state(p.pid) in ("T", "t"):
                bad.append(f"rank {rank} (pid {p.pid}) is stopped")
        return bad

    def _who(self) -> str:
        """The ranks to blame: those that exited or are stopped, else all workers."""
        bad = self._blamed()
        if bad:
            return "tensor-parallel " + ", ".join(bad)
        ranks = ", ".join(f"{r} (pid {p.pid})" for r, p in enumerate(self.procs, 1))
        return f"tensor-parallel rank {ranks}" if len(self.procs) == 1 else f"tensor-parallel ranks {ranks}"

    def _fail(self, why: str) -> TPError:
        who = self._who()
        self.failed = f"{who}: {why}; the workers were stopped, restart the engine"
        # for a server's clients: which rank, without the backend's details (those go to the server log)
        self.summary = re.sub(r" \(pid \d+\)", "", who)
        self._stop(kill=True)
        return TPError(self.failed)

    def run(self, executor, name: str, args: tuple):
        """executor.name(*args) on every rank: the call to the workers, then rank 0's own (its collectives
        meet the workers'). TPError naming the rank when a worker is gone or does not answer in time."""
        if self.failed:
            raise TPError(self.failed)
        if self.closed:
            raise TPError("the tensor-parallel workers were stopped")
        if any(p.poll() is not None for p in self.procs):
            raise self._fail("a worker process exited (see its error output)")
        head, tensors = encode(executor.role, name, args)
        try:
            for p in self.procs:  # the doorbell: an idle worker waits on its stdin, not on a collective
                p.stdin.write(b"\1")
                p.stdin.flush()
        except OSError as e:
            raise self._fail(f"could not reach it ({e})") from None
        try:
            send(self.group, head, tensors, self.device)
            out = getattr(executor, name)(*args)
            if self.cuda:  # NCCL queues the collectives: wait for them here, bounded, so a hang names the rank
                done = torch.cuda.Event()
                done.record()
                deadline = time.monotonic() + self.timeout
                while not done.query():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no answer within {self.timeout:g} s ({TIMEOUT_ENV})")
                    time.sleep(1e-4)
        except (RuntimeError, TimeoutError) as e:
            # gloo reports a peer that timed out or closed its sockets as a plain RuntimeError from its sources;
            # anything else (a bug on rank 0 with every worker well) propagates as it is
            backend = isinstance(e, (dist.DistError, TimeoutError)) or any(s in str(e) for s in ("gloo", "NCCL"))
            if not (backend or self._blamed()):
                raise
            raise self._fail(f"{e} (collective timeout {self.timeout:g} s, {TIMEOUT_ENV})") from None
        return out

    def wait_ready(self) -> None:
        """Wait (BPCOMPILE_TP_START_TIMEOUT) until every worker has loaded its shards."""
        deadline = time.monotonic() + self.start_timeout
        keys = [f"ready/{r}" for r in range(1, len(self.procs) + 1)]
        while not self.store.check(keys):
            dead = [(r, p) for r, p in enumerate(self.procs, 1) if p.poll() is not None]
            if dead:
                self._stop(kill=True)
                r, p = dead[0]
                raise UserError(
                    f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.returncode} while loading; "
                    "its error is above",
                    key="tp",
                )
            if time.monotonic() > deadline:
                raise self._fail(f"did not finish loading within {self.start_timeout:g} s ({START_TIMEOUT_ENV})")
            time.sleep(0.05)

    def _stop(self, kill: bool, timeout: float = 30.0) -> None:
        self.closed = True
        for p in self.procs:
            try:
                if kill:
                    p.send_signal(signal.SIGKILL)
                p.stdin.close()  # a worker exits when its stdin closes
            except OSError:
                pass
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.private, ignore_errors=True)

    def kill(self) -> None:
        self._stop(kill=True)

    def close(self, timeout: float = 30.0) -> None:
        if not self.closed:
            self._stop(kill=False, timeout=timeout)


def launch(engine_dir: Path, tp: int, spec: dict, device: str) -> Peers:
    """Start ranks 1..tp-1 as worker processes for engine_dir, form the group with them as rank 0 and check the
    hand-shake. spec: the Generator.from_engine keywords every rank builds its engine with (plain data).
    The caller loads rank 0's shards, then calls `wait_ready()`."""
    start, step = timeouts()
    devices = rank_devices(device, tp)
    private = tempfile.mkdtemp(prefix="bpcompile-tp-")  # mode 0700: only this user can open the store in it
    secret = secrets.token_bytes(32)
    threads = max(1, (os.cpu_count() or 1) // tp)
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(1, tp):
            # the command line names only the engine and the rank (for ps); the rest comes on stdin
            p = subprocess.Popen(
                [_python(), "-m", "bpcompile.runtime.tp_worker", str(engine_dir), f"--rank={rank}"],
                stdin=subprocess.PIPE,
                env=os.environ.copy(),
            )
            procs.append(p)
            config = {
                "engine": str(engine_dir),
                "rank": rank,
                "tp": tp,
                "store": os.path.join(private, "store"),
                "secret": secret.hex(),
                "device": devices[rank],
                "threads": threads,
                "start_timeout": start,
                "timeout": step,
                "spec": dict(spec, device=devices[rank]),
            }
            p.stdin.write(json.dumps(config).encode() + b"\n")
            p.stdin.flush()
        store = dist.FileStore(os.path.join(private, "store"), tp)
        store.set_timeout(timedelta(seconds=start))
        box: dict = {}

        def join():
            try:
                box["group"] = group(store, 0, tp, devices[0], start, step, secret)
            except Exception as e:  # noqa: BLE001 - reported below
                box["error"] = e

        t = threading.Thread(target=join, daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            failed = [(r, p) for r, p in enumerate(procs, 1) if p.poll() is not None]
            if failed:
                r, p = failed[0]
                raise UserError(
                    f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.returncode} before joining; "
                    "its error is above",
                    key="tp",
                )
        if "error" in box:
            raise TPError(f"tensor-parallel ranks did not connect within {start:g} s: {box['error']}")
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(private, ignore_errors=True)
        raise
    return Peers(box["group"], procs, store, private, devices[0], start, step)
