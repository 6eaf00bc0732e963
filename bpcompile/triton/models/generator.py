"""Triton Python-backend model `generator` (decoupled): the speculative decoding loop, draft and verifier in
this one process, over bpcompile's native runtime.

Copied by bpcompile.triton.emit into generator/<version>/model.py; the engine version it serves is
generator/<version>/engine/ (a copy of engines/<name>/<version>/).

In-flight batching: `execute` only validates a request and queues it; ONE background thread owns the
runtime (which is single-threaded) and loops: take queued requests into the running batch
(`add_request`), run one `step()` for everything running, route each StepOutput to its request's response
sender. A request arriving mid-generation joins the batch at the next step. Cancellation: the loop polls
each running request's `response_sender.is_cancelled()` and calls `cancel()`.

Each streamed response carries the response's tokens with a few tokens of left context (see
bpcompile/triton/protocol.py), so the stateless postprocessing model decodes it correctly on its own.
"""
import json
import queue
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

from bpcompile.triton.protocol import context_window, unpack_words

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_STOP = object()


class BadRequest(Exception):
    pass


@dataclass
class _Job:
    sender: object
    prompt: list
    params: object
    stream: bool
    rid: str = ""
    out: list = field(default_factory=list)
    sent: int = 0        # tokens of `out` already sent
    index: int = 0       # RESPONSE_INDEX of the next response


def _scalar(request, name, default=None, kind=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy().reshape(-1)
    if a.size != 1:
        raise BadRequest(f"{name} must hold one value, got {a.size}")
    return kind(a[0]) if kind else a[0]


class TritonPythonModel:
    def initialize(self, args):
        from bpcompile.runtime import Generator, TreeSpec  # the runtime is only needed by this model

        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("generator must be decoupled (model_transaction_policy)")
        params = {k: v["string_value"] for k, v in self.model_config.get("parameters", {}).items()}
        engine_dir = Path(args["model_repository"]) / args["model_version"] / "engine"
        self.engine_version = int(args["model_version"])
        tree = json.loads(params["tree"]) if params.get("tree") else None
        self.gen = Generator.from_engine(engine_dir, tree=TreeSpec(**tree) if tree else None,
                                         device=params.get("device", "cpu"))
        limits = (yaml.safe_load((engine_dir / "recipe.yaml").read_text()) or {}).get("limits", {})
        self.max_seq_len = int(getattr(self.gen, "max_seq_len", None) or limits.get("max_seq_len", 512))
        self.max_input_len = int(limits.get("max_input_len", self.max_seq_len - 1))
        self.logger = pb_utils.Logger
        import torch

        self.logger.log_info(f"generator: engine version {self.engine_version} from {engine_dir}, tree "
                             f"{self.gen.tree.kind}, device {params.get('device', 'cpu')}, torch threads "
                             f"{torch.get_num_threads()}, max_seq_len {self.max_seq_len}")
        self.inbox = queue.Queue()
        self.running = {}
        self.thread = threading.Thread(target=self._loop, name="bpcompile-generator", daemon=True)
        self.thread.start()

    # --- request intake (Triton's thread) ---------------------------------------------------------------

    def _parse(self, request):
        from bpcompile.runtime import SamplingParams

        ids_t = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids_t is None:
            raise BadRequest("input_ids is missing")
        prompt = [int(i) for i in ids_t.as_numpy().reshape(-1)]
        if not prompt:
            raise BadRequest("the prompt has no tokens")
        if len(prompt) > self.max_input_len:
            raise BadRequest(f"the prompt has {len(prompt)} tokens; this engine takes at most "
                             f"{self.max_input_len} (limits.max_input_len)")
        max_tokens = _scalar(request, "request_output_len", 64, int)
        room = self.max_seq_len - len(prompt)
        if max_tokens <= 0:
            raise BadRequest(f"max_tokens must be > 0 (got {max_tokens})")
        if max_tokens > room:
            raise BadRequest(f"max_tokens {max_tokens} is above this engine's limit: prompt ({len(prompt)} tokens)"
                             f" + max_tokens must be <= max_seq_len {self.max_seq_len}, so at most {room}")
        bad = pb_utils.get_input_tensor_by_name(request, "bad_words_list")
        if bad is not None and unpack_words(bad.as_numpy()):
            raise BadRequest("bad_words is not supported by the native runtime (send it empty)")
        stop = pb_utils.get_input_tensor_by_name(request, "stop_words_list")
        temperature = _scalar(request, "temperature", 0.0, float)
        top_k = _scalar(request, "runtime_top_k", 0, int)
        top_p = _scalar(request, "runtime_top_p", 1.0, float)
        if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
            raise BadRequest(f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1 "
                             f"(got {temperature}, {top_k}, {top_p})")
        seed = _scalar(request, "seed", None, int)
        end_id = _scalar(request, "end_id", None, int)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed, end_id=None if end_id is None or end_id < 0 else end_id,
                                stop_words=unpack_words(stop.as_numpy()) if stop is not None else [])
        return _Job(None, prompt, params, bool(_scalar(request, "streaming", False, bool)))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._parse(request)
            except BadRequest as e:
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)), flags=FINAL)
                continue
            job.sender = sender
            self.inbox.put(job)
        return None  # decoupled: responses go through the senders, from the loop thread

    # --- the loop (one thread owns the runtime) ---------------------------------------------------------

    def _loop(self):
        stopping = False
        while True:
            idle = not self.running
            if stopping and idle:
                return
            try:
                # block only when nothing is running; otherwise just collect what arrived during the last step
                item = self.inbox.get(timeout=None if idle and not stopping else 0)
                while True:
                    if item is _STOP:
                        stopping = True
                    else:
                        self._admit(item)
                    item = self.inbox.get_nowait()
            except queue.Empty:
                pass
            for rid, job in list(self.running.items()):
                if job.sender.is_cancelled():
                    self.gen.cancel(rid)
                    del self.running[rid]
                    self.logger.log_info(f"generator: cancelled request {rid} after {len(job.out)} tokens")
                    self._close(job, pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED))
            if not self.running:
                continue
            try:
                outs = self.gen.step()
            except Exception as e:  # a runtime failure fails the running requests, not the server
                self.logger.log_error(f"generator step failed: {traceback.format_exc()}")
                for rid, job in list(self.running.items()):
                    try:
                        self.gen.cancel(rid)
                    except Exception:
                        pass
                    job.sender.send(pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"generation failed: {e}", pb_utils.TritonError.INTERNAL)),
                        flags=FINAL)
                self.running.clear()
                continue
            for o in outs:
                job = self.running.get(o.request_id)
                if job is None:
                    continue
                job.out.extend(int(t) for t in o.new_tokens)
                if o.finished:
                    del self.running[o.request_id]
                if job.stream and (len(job.out) > job.sent or o.finished):
                    self._send(job, job.sent, o)
                elif o.finished:
                    self._send(job, 0, o)

    def _admit(self, job):
        try:
            job.rid = self.gen.add_request(job.prompt, job.params)
        except Exception as e:  # the runtime's own checks (e.g. a limit this model did not know about)
            job.sender.send(pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"request rejected: {e}", pb_utils.TritonError.INVALID_ARG)), flags=FINAL)
            return
        self.running[job.rid] = job

    def _send(self, job, start, o):
        ctx, read = context_window(job.out, start, len(job.out))
        s = o.stats
        accepted = int(sum(getattr(s, "accepted_per_depth", None) or []))
        drafted = int(sum(getattr(s, "proposed_per_depth", None) or []))
        steps = int(getattr(s, "verifier_steps", 0) or 0)
        tau = float(getattr(s, "tau", 0.0) or (len(job.out) / steps if steps else 0.0))

        def t(name, value, dtype):
            return pb_utils.Tensor(name, np.array([value], dtype=dtype))

        resp = pb_utils.InferenceResponse(output_tensors=[
            t("CONTEXT_IDS", ctx, np.int32), t("READ_OFFSET", [read], np.int32),
            t("IS_FINAL", [o.finished], np.bool_), t("RESPONSE_INDEX", [job.index], np.int32),
            t("FINISH_REASON", [(o.finish_reason or "") if o.finished else ""], np.object_),
            t("acceptance_rate", [accepted / drafted if drafted else 0.0], np.float32),
            t("total_accepted_draft_tokens", [accepted], np.int32),
            t("total_draft_tokens", [drafted], np.int32),
            t("tokens_per_step", [tau], np.float32),
            t("verifier_steps", [steps], np.int32),
            t("engine_version", [self.engine_version], np.int32),
        ])
        job.index += 1
        job.sent = len(job.out)
        job.sender.send(resp, flags=FINAL if o.finished else 0)

    def _close(self, job, error):
        # The request is complete only once its final flag is sent: without it, a cancelled request keeps the
        # model version alive (seen: tritonserver 2.51 then cannot unload it and exits 1 on SIGTERM).
        try:
            job.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        except Exception:
            try:
                job.sender.send(flags=FINAL)
            except Exception as e:
                self.logger.log_warn(f"generator: could not close request {job.rid}: {e}")

    def finalize(self):
        # Unloading (a new version loaded, or an explicit unload): requests already running finish first.
        self.inbox.put(_STOP)
        self.thread.join(timeout=300)
