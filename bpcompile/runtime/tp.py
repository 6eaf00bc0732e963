"""Tensor parallelism for the native runtime: one process per rank over a torch.distributed (gloo) group.

Rank 0 is the engine the caller holds: its scheduler, speculative step and sampler run there alone. Its
executors do the host bookkeeping (pages, slots, padding) and, before each computation, broadcast that call's
tensors to the other ranks (`Peers.send`). Every other rank is a worker process (`python -m
bpcompile.runtime.tp_worker`) that holds its own shard of each model (its rank file only: runtime/model.py
`Llama.from_rank`) and its share of each KV cache (`KVPlan.shard`) and runs the same `Executor.run_*` calls in
the same order; the models' row-split linears all-reduce and their heads all-gather, so every rank ends each
forward with the whole logits and rank 0 samples from them.

The process group is built from a TCPStore on a free loopback port rather than the global default group, so
one process can hold several tensor-parallel engines (tests compare tp 1 and tp 2 side by side). A worker
exits when rank 0 sends "stop" or when its stdin (a pipe from rank 0) closes: a dead rank 0 leaves no orphans.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from bpcompile.core.errors import UserError

CONNECT_TIMEOUT = timedelta(seconds=300)  # workers import torch and load their shards before joining
# A collective waits this long; an idle server keeps its workers waiting on the next command, so it is long.
# A rank that dies closes its sockets, which fails the others' pending collectives at once.
OP_TIMEOUT = timedelta(days=30)


def connect(port: int, rank: int, world: int):
    """A worker rank joins rank 0's store on the loopback port."""
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=CONNECT_TIMEOUT)
    return dist.ProcessGroupGloo(store, rank, world, OP_TIMEOUT)


def broadcast_bytes(group, data: Optional[bytes]) -> bytes:
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    group.broadcast(n, 0).wait()
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data is not None
        else torch.empty(int(n), dtype=torch.uint8)
    )
    group.broadcast(buf, 0).wait()
    return data if data is not None else buf.numpy().tobytes()


def _python() -> str:
    """The interpreter for workers: this one, unless this process is an embedded one (Triton's Python backend
    stub), whose environment puts the right python first on PATH."""
    exe = Path(sys.executable)
    if exe.name.startswith("python"):
        return str(exe)
    return shutil.which("python3") or "python3"


class Peers:
    """Rank 0's handle on the worker ranks: sends each executor call, stops them."""

    def __init__(self, group, procs: list[subprocess.Popen]):
        self.group, self.procs = group, procs
        self.closed = False

    def send(self, role: str, name: str, args: tuple) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel workers were stopped")
        dead = [p.pid for p in self.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(
                f"tensor-parallel worker process(es) {dead} exited (see their error output); restart the engine"
            )
        broadcast_bytes(self.group, pickle.dumps((role, name, args)))

    def close(self, timeout: float = 30.0) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.poll() is None for p in self.procs):
                broadcast_bytes(self.group, pickle.dumps((None, "stop", ())))
        finally:
            for p in self.procs:
                try:
                    p.stdin.close()
                    p.wait(timeout)
                except (OSError, subprocess.TimeoutExpired):
                    p.kill()
                    p.wait()


def launch(engine_dir: Path, tp: int, spec: dict) -> tuple[object, list[subprocess.Popen]]:
    """Start ranks 1..tp-1 as worker processes for engine_dir and join them as rank 0 -> (group, processes).
    spec: what every rank builds its engine with (Generator.from_engine keywords that are plain data)."""
    # rank 0's store binds a free port itself (port 0): no window in which another process could take it
    store = dist.TCPStore("127.0.0.1", 0, tp, True, timeout=CONNECT_TIMEOUT, wait_for_workers=False)
    port = store.port
    threads = max(1, (os.cpu_count() or 1) // tp)
    procs = []
    for rank in range(1, tp):
        arg = json.dumps(
            {"engine": str(engine_dir), "rank": rank, "tp": tp, "port": port, "threads": threads, "spec": spec}
        )
        procs.append(
            subprocess.Popen(
                [_python(), "-m", "bpcompile.runtime.tp_worker", arg], stdin=subprocess.PIPE, env=os.environ.copy()
            )
        )
    box: dict = {}

    def join():
        try:
            box["group"] = dist.ProcessGroupGloo(store, 0, tp, OP_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - reported below
            box["error"] = e

    t = threading.Thread(target=join, daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
        failed = [p for p in procs if p.poll() is not None]
        if failed:
            for p in procs:
                p.kill()
            raise UserError(
                f"tensor-parallel worker (pid {failed[0].pid}) exited with code {failed[0].returncode} "
                "before joining; its error is above",
                key="tp",
            )
    if "error" in box:
        for p in procs:
            p.kill()
        raise UserError(f"tensor-parallel ranks did not connect: {box['error']}", key="tp")
    return box["group"], procs
