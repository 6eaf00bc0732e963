"""A tensor-parallel worker rank (ranks 1..tp-1): `python -m bpcompile.runtime.tp_worker ENGINE --rank=R`, started
by bpcompile.runtime.tp.launch. Its configuration (the private store's path, this run's secret, the timeouts) is
the first line on its stdin, never on its command line. It joins the group, proves it holds the secret, loads its
shard of the engine and runs the executor calls rank 0 sends, until its stdin closes."""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from bpcompile.runtime.generator import Generator, TreeSpec
from bpcompile.runtime.tp import TPError, group, receive


def _doorbell() -> queue.SimpleQueue:
    """One item per call rank 0 sends (a byte on stdin). The wait for it has no deadline (an idle server); a
    closed stdin (rank 0 stopped us, or is gone) ends the process."""
    calls: queue.SimpleQueue = queue.SimpleQueue()

    def run():
        try:
            while sys.stdin.buffer.read(1):
                calls.put(True)
        finally:
            os._exit(0)

    threading.Thread(target=run, daemon=True).start()
    return calls


def worker(config: dict) -> None:
    rank, tp, device = config["rank"], config["tp"], config["device"]
    calls = _doorbell()
    torch.set_num_threads(config["threads"])
    store = dist.FileStore(config["store"], tp)
    store.set_timeout(timedelta(seconds=config["start_timeout"]))
    pg = group(store, rank, tp, device, config["start_timeout"], config["timeout"], bytes.fromhex(config["secret"]))
    spec = dict(config["spec"], tree=TreeSpec(**config["spec"]["tree"]))
    gen = Generator.from_engine(config["engine"], tp=tp, _rank=rank, _group=pg, **spec)
    executors = {"verifier": gen.v_exec, "draft": gen.d_exec}
    store.set(f"ready/{rank}", "1")
    with torch.inference_mode():
        while True:
            calls.get()
            role, name, args = receive(pg, device)
            if executors[role] is None:
                raise TPError(f"rank 0 sent {name} to the {role}, which this engine does not have")
            getattr(executors[role], name)(*args)


if __name__ == "__main__":
    try:
        worker(json.loads(sys.stdin.buffer.readline()))
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)
