"""A tensor-parallel worker rank (ranks 1..tp-1): `python -m bpcompile.runtime.tp_worker ARGS_JSON`, started by
bpcompile.runtime.tp.launch. It loads its shard of the engine and runs the executor calls rank 0 broadcasts until
told to stop or until rank 0 goes away."""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading

import torch

from bpcompile.runtime.generator import Generator, TreeSpec
from bpcompile.runtime.tp import broadcast_bytes, connect


def _watch_parent() -> None:
    """Exit when rank 0 goes away (its end of our stdin closes)."""

    def run():
        try:
            while sys.stdin.buffer.read(1):
                pass
        finally:
            os._exit(0)

    threading.Thread(target=run, daemon=True).start()


def worker(arg: dict) -> None:
    _watch_parent()
    torch.set_num_threads(arg["threads"])
    group = connect(arg["port"], arg["rank"], arg["tp"])
    spec = dict(arg["spec"], tree=TreeSpec(**arg["spec"]["tree"]))
    gen = Generator.from_engine(arg["engine"], tp=arg["tp"], _rank=arg["rank"], _group=group, **spec)
    executors = {"verifier": gen.v_exec, "draft": gen.d_exec}
    with torch.inference_mode():
        while True:
            role, name, args = pickle.loads(broadcast_bytes(group, None))
            if name == "stop":
                return
            if not name.startswith("run_"):
                raise RuntimeError(f"unexpected command {name!r}")
            getattr(executors[role], name)(*args)


if __name__ == "__main__":
    try:
        worker(json.loads(sys.argv[1]))
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)
