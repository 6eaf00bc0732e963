"""The in-flight batching loop: one thread owns a `Generator` (which is single-threaded) and serves requests
that arrive from other threads while it runs.

Each turn of the loop: take what was submitted into the running batch (`Generator.add_request`), cancel the
requests whose client went away (polled before every step, so a cancelled request stops costing work within
one step and frees its KV pages), run one `step()` for everything running, and hand each `StepOutput` to its
request. A request arriving mid-generation joins the batch at the next step.

A frontend (the Triton generator model, a test, an HTTP server) subclasses `InflightLoop` and says how to
answer: `on_output`, `on_rejected`, `on_cancelled`, `on_failed`, and `is_cancelled` to poll a client.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

from bpcompile.runtime.generator import Generator, SamplingParams, StepOutput

_STOP = object()


@dataclass
class LoopRequest:
    """A request as the loop tracks it; frontends subclass it to carry their own handle (a response sender)."""

    prompt: list[int]
    params: SamplingParams
    rid: str = ""  # the runtime's request id, once admitted
    out: list[int] = field(default_factory=list)  # tokens generated so far
    logprobs: list[float] = field(default_factory=list)  # of `out`, when params.logprobs
    context_logits: Optional[object] = None  # [prompt, vocab] tensor, when params.context_logits
    generation_logits: list = field(default_factory=list)  # [n, vocab] tensors covering `out`, in order
    steps: int = 0  # generator steps this request took part in
    admitted_ns: int = 0  # wall clock (time.time_ns) when the loop handed it to the runtime
    pages: int = 0  # KV pages the runtime reserved for it (per cache)


class InflightLoop:
    """Runs `gen` on its own thread; `submit` from any thread, `stop` to finish what runs and end."""

    def __init__(self, gen: Generator, *, name: str = "bpcompile-generator"):
        self.gen = gen
        self.inbox: queue.Queue = queue.Queue()
        self.running: dict[str, LoopRequest] = {}
        self.steps = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    # --- what a frontend provides ----------------------------------------------------------------------------

    def is_cancelled(self, req: LoopRequest) -> bool:
        return False

    def on_output(self, req: LoopRequest, out: StepOutput) -> None:
        """New tokens of `req` (already appended to req.out); out.finished on its last one."""

    def on_rejected(self, req: LoopRequest, error: Exception) -> None:
        """The runtime refused the request (its own limits); it never ran."""

    def on_cancelled(self, req: LoopRequest) -> None:
        """`is_cancelled` said so: the request was cancelled and its pages freed."""

    def on_step_error(self, trace: str) -> None:
        """A step raised (once per failed step, before on_failed for each running request)."""

    def on_failed(self, req: LoopRequest) -> None:
        """A step raised: every running request is cancelled and ended with this; the loop goes on."""

    def on_turn(self) -> None:
        """Called once per turn of the loop before it waits or steps (gauges, metrics)."""

    # --- control ---------------------------------------------------------------------------------------------

    def start(self) -> "InflightLoop":
        self.thread.start()
        return self

    def submit(self, req: LoopRequest) -> None:
        self.inbox.put(req)

    def stop(self) -> None:
        """Finish the running and queued requests, then end the thread."""
        self.inbox.put(_STOP)

    # --- the loop --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while True:
            self.on_turn()
            idle = not self.running
            if stopping and idle:
                return
            try:
                # block only when nothing runs; otherwise just collect what arrived during the last step
                item = self.inbox.get(timeout=None if idle and not stopping else 0)
                while True:
                    if item is _STOP:
                        stopping = True
                    else:
                        self._admit(item)
                    item = self.inbox.get_nowait()
            except queue.Empty:
                pass
            for rid, req in list(self.running.items()):
                if self.is_cancelled(req):
                    self.gen.cancel(rid)
                    del self.running[rid]
                    self.on_cancelled(req)
            if self.running:
                self._step()

    def _admit(self, req: LoopRequest) -> None:
        try:
            req.rid = self.gen.add_request(req.prompt, req.params)
            req.admitted_ns = time.time_ns()
            req.pages = self.gen.scheduler.pages_of(req.rid)
        except Exception as e:
            self.on_rejected(req, e)
            return
        self.running[req.rid] = req

    def _step(self) -> None:
        try:
            outs = self.gen.step()
        except Exception:  # a runtime failure fails the running requests, not the loop
            self.on_step_error(traceback.format_exc())
            for rid, req in list(self.running.items()):
                try:
                    self.gen.cancel(rid)
                except Exception:
                    pass
                self.on_failed(req)
            self.running.clear()
            return
        self.steps += 1
        for o in outs:
            req: Optional[LoopRequest] = self.running.get(o.request_id)
            if req is None:
                continue
            req.steps += 1
            req.out.extend(int(t) for t in o.new_tokens)
            if o.logprobs is not None:
                req.logprobs.extend(o.logprobs)
            if o.context_logits is not None:
                req.context_logits = o.context_logits
            if o.generation_logits is not None:
                req.generation_logits.append(o.generation_logits)
            if o.finished:
                del self.running[o.request_id]
            self.on_output(req, o)
