"""Graceful drain of a served repository: `bpcompile serve` on one side, the generator model on the other.

tritonserver's own drain (on SIGTERM: refuse new requests, wait for in-flight ones) cannot finish an ensemble
stream: every generator response becomes a new request to postprocessing, which an exiting server refuses,
so each stream stalls without a final response until the exit timeout (seen with tritonserver 2.51). So the
drain happens before tritonserver is signalled, while it still runs the ensemble's internal requests:

1. serve creates RUN_DIR/draining (RUN_DIR: a private per-run directory, passed to the models in $ENV);
2. each generator instance refuses new requests, lets its running ones finish (each stream ends with its
   final response) and then removes its registration RUN_DIR/generators/<pid>.<n>;
3. serve waits until no registration of a live process is left (or its drain timeout passes), then sends
   tritonserver SIGTERM, which now has nothing in flight.

The same directory carries each model instance's liveness: every Python-backend model instance registers
RUN_DIR/instances/<model>.<pid>.<n> once initialized and removes it in finalize (an unload, or tritonserver's
shutdown). A registration whose process is gone is an instance that died without being unloaded (killed,
crashed): tritonserver 2.51 keeps reporting such a model ready while every request to it hangs, so serve takes
a dead instance as the server having failed (see serve.py). An instance that lives on but cannot serve any more
(a generator whose tensor-parallel worker rank died) writes why into its registration: serve takes that as a
failure too, since tritonserver would go on answering every request with an error.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

ENV = "BPCOMPILE_SERVE_RUN_DIR"
POLL_S = 0.1
_seq = itertools.count()


class ModelDrain:
    """Inside a generator model instance. Without $ENV (tritonserver started by hand) it never drains."""

    def __init__(self, loop: threading.Thread, stop_loop: Callable[[], None]):
        self.loop, self.stop_loop = loop, stop_loop
        self.lock = threading.Lock()
        self.draining = self.closed = False
        run = os.environ.get(ENV)
        self.flag = Path(run) / "draining" if run else None
        self.reg: Optional[Path] = None
        if self.flag is None:
            return
        regs = self.flag.parent / "generators"
        regs.mkdir(exist_ok=True)
        self.reg = regs / f"{os.getpid()}.{next(_seq)}"
        self.reg.touch()
        threading.Thread(target=self._watch, name="bpcompile-drain", daemon=True).start()

    def submit(self, put: Callable[[object], None], job) -> bool:
        """put(job) unless draining; False when refused. Under the lock, so no job lands behind the loop's
        stop marker (the loop would never take it)."""
        with self.lock:
            if self.draining:
                return False
            put(job)
            return True

    def _watch(self):
        while not self.closed and not self.flag.exists():
            time.sleep(POLL_S)
        if self.closed:
            return
        with self.lock:
            self.draining = True
            self.stop_loop()  # the loop finishes what it runs, then returns
        self.loop.join()
        self.close()

    def close(self):
        self.closed = True
        if self.reg is not None:
            self.reg.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed stub stays a zombie until tritonserver reaps it, which it may never do
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: signal 0 is all we can tell
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class Instance:
    """A model instance's liveness registration (module doc); nothing without $ENV."""

    def __init__(self, model: str):
        run = os.environ.get(ENV)
        self.path = Path(run) / "instances" / f"{model}.{os.getpid()}.{next(_seq)}" if run else None
        if self.path is not None:
            self.path.parent.mkdir(exist_ok=True)
            self.path.touch()

    def close(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def fail(self, why: str) -> None:
        """This instance cannot serve any more (module doc); `why` is what serve reports."""
        if self.path is not None and self.path.exists():
            self.path.write_text(why.strip() or "failed")


def dead_instances(run_dir: Path) -> list[tuple[str, int]]:
    """(model, pid) of every registered instance whose process is gone without having unregistered."""
    regs = Path(run_dir) / "instances"
    out = []
    for p in regs.iterdir() if regs.is_dir() else ():
        model, _, rest = p.name.rpartition(".")[0].rpartition(".")
        pid = rest if model else ""
        if pid.isdigit() and not _alive(int(pid)) and p.exists():  # exists: not unloaded meanwhile
            out.append((model, int(pid)))
    return out


def failed_instances(run_dir: Path) -> list[tuple[str, int, str]]:
    """(model, pid, why) of every registered instance that said it cannot serve any more (Instance.fail)."""
    regs = Path(run_dir) / "instances"
    out = []
    for p in regs.iterdir() if regs.is_dir() else ():
        model, _, rest = p.name.rpartition(".")[0].rpartition(".")
        try:
            why = p.read_text().strip()
        except OSError:  # unloaded meanwhile
            continue
        if why and model and rest.isdigit():
            out.append((model, int(rest), why))
    return out


def busy_generators(run_dir: Path) -> list[str]:
    """Registrations of generator instances that are alive and not yet drained."""
    regs = Path(run_dir) / "generators"
    names = [p.name for p in regs.iterdir()] if regs.is_dir() else []
    return [n for n in names if n.split(".")[0].isdigit() and _alive(int(n.split(".")[0]))]


def drain(run_dir: Path, timeout: float, stop_waiting: Callable[[], bool] = lambda: False) -> bool:
    """Ask the generators to drain and wait up to `timeout` s; True when all are idle."""
    (Path(run_dir) / "draining").touch()
    deadline = time.monotonic() + timeout
    while busy_generators(run_dir):
        if time.monotonic() >= deadline or stop_waiting():
            return False
        time.sleep(POLL_S)
    return True
