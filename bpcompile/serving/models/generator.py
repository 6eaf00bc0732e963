"""Triton Python-backend model `tensorrt_llm` (tensorrtllm_backend's name for it): the speculative decoding loop, draft and verifier in
this one process, over bpcompile's native runtime.

Copied by bpcompile.serving.emit into tensorrt_llm/<version>/model.py; the engine version it serves is
tensorrt_llm/<version>/engine/ (a copy of engines/<name>/<version>/).

In-flight batching: `execute` only validates a request and submits it to the runtime's in-flight loop
(bpcompile/runtime/inflight.py: one thread owns the runtime, requests join the running batch at the next
step); this model is the adapter that answers through each request's response sender.

Two interfaces, told apart by their inputs:
* token ids (input_ids, request_output_len, ...; tensorrtllm_backend's names): the ensemble's step. Each
  streamed response carries the response's tokens with a few tokens of left context (see
  bpcompile/serving/protocol.py), so the stateless postprocessing model decodes it correctly on its own.
* text (text_input, max_tokens, stream, ...: the ensemble's own inputs, and its outputs text_output,
  finish_reason, ...): the same request a client sends the ensemble, tokenized and detokenized here.
Every response also carries tensorrtllm_backend's `tensorrt_llm` outputs (output_ids [batch, beam, tokens],
sequence_length, batch_index, ...), so its clients that talk to this model by that name read what they expect.

Decoupled (the default) or not, as the repository was emitted (triton.decoupled): either way each request is
answered through its response sender from the loop thread, so requests still join the running batch; not
decoupled, that is exactly one response with the whole result (a unary ModelInfer answer; a request's batch rows
and num_return_sequences all in it, see _Gather), and stream=true is refused as tensorrtllm_backend refuses it
with decoupled_mode false.

Sampling as TensorRT-LLM sets it up (its DefaultDecodingParams and setupTopKRuntimeArgs): temperature defaults
to 1.0, top_k and top_p to 0; top_k 0 with top_p 0 is greedy (its clients send temperature 1.0 and neither, or
top_k 1), top_p 0 with top_k > 0 is top-k alone. Temperature 0 is greedy too (bpcompile's, and OpenAI's, rule).

Cancellation: before every step the loop polls each request's `response_sender.is_cancelled()` and cancels
the ones set (the runtime frees their KV pages), so a cancelled or disconnected client stops costing work
within one step. tritonserver 2.51 sets that flag only on the request the client sent: when the client of an
ensemble cancels or disconnects, the ensemble cancels the steps it schedules after that (postprocessing of
later responses) but never a step already running, and the generator's step runs for the whole stream (seen:
the sender's and the request's is_cancelled() stay False and every send succeeds until max_tokens). So streaming clients that may go away
should send their request to this model (the text interface: same inputs, same outputs) rather than to the
ensemble; their cancellation and disconnects then reach this loop.

Metrics (tritonserver's /metrics): tensorrtllm_backend's nv_trt_llm_* families with its labels, token counters
and latency histograms (bpcompile/serving/generator_metrics.py); and, labelled with version and instance,
bpcompile_generator_steps_total,
bpcompile_generator_requests (in the batch or queued for it), bpcompile_generator_cancelled_total,
bpcompile_generator_kv_pages_used, bpcompile_generator_prefix_hit_rate (prompt tokens taken from the prefix
cache / prompt tokens admitted), bpcompile_generator_prefix_cached_pages (verifier pages the prefix cache holds). Each cancellation is also logged with the generator step it was seen at.
"""
import json
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from bpcompile.runtime.inflight import InflightLoop, LoopRequest
from bpcompile.serving.drain import Instance, ModelDrain
from bpcompile.serving.generator_metrics import GeneratorMetrics, StepTally
from bpcompile.serving.protocol import (DEFAULT_MAX_TOKENS, BadRequest, TextInterface, backend_options,
                                       check_sampling, context_window, delta_text, scalar, unpack_words)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass
class _Job(LoopRequest):
    stream: bool = False
    text: bool = False   # the text interface: answer with text_output, output_ids, ...
    sender: object = None
    sent: int = 0        # tokens of `out` already sent
    index: int = 0       # RESPONSE_INDEX of the next response
    exclude: bool = True  # exclude_input_in_output: false puts the prompt before a non-streamed output
    perf: bool = False   # return_perf_metrics: KV blocks and timestamps on every response
    arrival_ns: int = field(default_factory=time.time_ns)
    first_token_ns: int = 0
    last_token_ns: int = 0
    batch_index: int = 0  # which row of the request's batch (tensorrtllm_backend's batch_index output)
    seq_index: int = 0    # which of its num_return_sequences (sequence_index)


class _Shared:
    """One request's response sender, shared by the sequences it asks for (batch rows x num_return_sequences,
    as tensorrtllm_backend answers them: each its own responses, told apart by batch_index / sequence_index).
    A sequence's final response ends the request only when it is the last one; an error ends it at once, and the
    other sequences then see it cancelled before the next step."""

    def __init__(self, sender, n: int):
        self.sender, self.left, self.closed = sender, n, False
        self.lock = threading.Lock()

    def is_cancelled(self) -> bool:
        return self.closed or self.sender.is_cancelled()

    def send(self, response=None, flags=0):
        with self.lock:
            if self.closed:
                return
            if flags & FINAL:
                if response is not None and response.has_error():
                    self.left = 0
                else:
                    self.left -= 1
                if self.left > 0:
                    flags = 0
                else:
                    self.closed = True
            if response is None:
                self.sender.send(flags=flags)
            else:
                self.sender.send(response, flags=flags)


class _Gather(_Shared):
    """The sequences of one request to a repository emitted with decoupled false, answered in one response: each
    sequence's final tensors are held until the last one's, then merged as TensorRT-LLM answers beams (one response,
    a request's n sequences side by side): per-sequence outputs [batch rows, n, ...] (output_ids, sequence_length,
    log probs, generation logits; ids padded with -1), per-row ones [batch rows, ...] (batch_index, the prompt's
    context logits, perf metrics, token counts), and what postprocessing decodes (and the text interface's text)
    [batch rows x n, ...] in row-major order, as the backend's postprocessing lists texts."""

    PER_SEQUENCE = ("output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "generation_logits")
    PER_ROW = ("batch_index", "sequence_index", "num_input_tokens", "context_logits", "kv_cache_alloc_new_blocks",
               "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns",
               "first_token_time_ns", "last_token_time_ns")

    def __init__(self, sender, jobs: list):
        super().__init__(sender, len(jobs))
        self.jobs, self.held = jobs, {}

    def hold(self, job, tensors) -> None:
        with self.lock:
            if self.closed:
                return
            self.held[id(job)] = {t.name(): t.as_numpy() for t in tensors}
            if len(self.held) < len(self.jobs):
                return
        out = [self.held[id(j)] for j in self.jobs]
        rows = [[o for j, o in zip(self.jobs, out) if j.batch_index == r] for r in range(self.jobs[-1].batch_index + 1)]
        merged = {}
        for name in out[0]:
            if name in self.PER_SEQUENCE:
                merged[name] = _stack([_stack([o[name] for o in row], 1) for row in rows], 0)
            elif name == "num_output_tokens":  # the row's sequences together
                merged[name] = _stack([sum(o[name] for o in row) for row in rows], 0)
            elif name in self.PER_ROW:
                merged[name] = _stack([row[0][name] for row in rows], 0)
            else:
                merged[name] = _stack([o[name] for o in out], 0)
        resp = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in merged.items()])
        with self.lock:
            if not self.closed:
                self.closed = True
                self.sender.send(resp, flags=FINAL)


def _stack(arrays: list, axis: int):
    """Concatenated along `axis`, the other dimensions padded to the largest (ids with -1, as TensorRT-LLM pads
    beams; numbers with 0, text with b"")."""
    arrays = [np.asarray(a) for a in arrays]
    if len(arrays) == 1:
        return arrays[0]
    ndim = max(a.ndim for a in arrays)
    arrays = [a.reshape(a.shape + (1,) * (ndim - a.ndim)) for a in arrays]
    width = [max(a.shape[d] for a in arrays) for d in range(ndim)]
    fill = b"" if arrays[0].dtype == np.object_ else -1 if arrays[0].dtype.kind == "i" else 0
    padded = []
    for a in arrays:
        pad = [(0, 0 if d == axis else width[d] - a.shape[d]) for d in range(ndim)]
        padded.append(np.pad(a, pad, constant_values=fill) if any(p for _, p in pad) else a)
    return np.concatenate(padded, axis=axis)


class _TritonLoop(InflightLoop):
    """The runtime's in-flight loop, answering through each request's Triton response sender."""

    def __init__(self, model: "TritonPythonModel"):
        super().__init__(model.gen)
        self.model, self.counted = model, 0
        self.tally = StepTally()  # what the last step did, for the TensorRT-LLM metrics

    def is_cancelled(self, job: _Job) -> bool:
        return job.sender.is_cancelled()

    def on_turn(self) -> None:
        m = self.model.metrics
        m.add("steps", self.steps - self.counted)
        self.counted = self.steps
        m.set("requests", len(self.running))
        m.set("kv_pages", self.gen.vkv.held_pages())
        ps = self.gen.prefix_stats
        m.set("prefix_hit_rate", ps["reused_tokens"] / ps["prompt_tokens"] if ps["prompt_tokens"] else 0.0)
        m.set("prefix_pages", len(self.gen.vkv.hash_of))
        active = len(self.running) + self.inbox.qsize()
        self.model.trt_metrics.turn(self.gen, active, self.steps, self.tally, idle=not self.running)
        self.tally = StepTally()

    def on_output(self, job: _Job, o) -> None:
        reused = int(getattr(o.stats, "reused_tokens", 0) or 0) if job.steps == 1 else 0
        self.tally.output(job.steps == 1, len(job.prompt), reused, len(o.new_tokens))
        if o.new_tokens:
            job.last_token_ns = time.time_ns()
            job.first_token_ns = job.first_token_ns or job.last_token_ns
        if o.finished:
            self.model.trt_metrics.finished(len(job.prompt), len(job.out), job.arrival_ns, job.first_token_ns,
                                            job.last_token_ns)
        if job.stream and (len(job.out) > job.sent or o.finished):
            self.model._send(job, job.sent, o)
        elif o.finished:
            self.model._send(job, 0, o)

    def on_rejected(self, job: _Job, error: Exception) -> None:  # the runtime's own checks
        job.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
            f"request rejected: {error}", pb_utils.TritonError.INVALID_ARG)), flags=FINAL)

    def on_cancelled(self, job: _Job) -> None:
        self.model.metrics.add("cancelled")
        self.model.logger.log_info(f"generator: cancelled request {job.rid} after {len(job.out)} tokens "
                                   f"({job.steps} steps; generator step {self.steps})")
        self.model._close(job, pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED))

    def on_step_error(self, trace: str) -> None:
        self.model.logger.log_error(f"generator step failed: {trace}")

    def on_failed(self, job: _Job) -> None:
        peers = self.model.gen.peers  # a tensor-parallel rank that died or hung: say which
        lost = peers.summary if peers is not None and peers.summary else None
        if lost:  # the workers are stopped, so every later request would fail too: serve restarts the server
            self.model.alive.fail(f"{lost} (its workers were stopped)")
        job.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
            f"generation failed: {lost} (restart the server)" if lost else
            "generation failed (an internal error; the server log has the details)",
            pb_utils.TritonError.INTERNAL)), flags=FINAL)


class _Metrics:
    """This instance's counters and gauges on tritonserver's metrics endpoint; no-ops where metrics are off."""

    SPEC = {"steps": ("bpcompile_generator_steps_total", "generation steps run (one batched draft+verify each)"),
            "cancelled": ("bpcompile_generator_cancelled_total", "requests cancelled by their client"),
            "requests": ("bpcompile_generator_requests", "requests in the generator's batch or queued for it"),
            "kv_pages": ("bpcompile_generator_kv_pages_used", "verifier KV cache pages held by requests"),
            "prefix_hit_rate": ("bpcompile_generator_prefix_hit_rate",
                                "share of the prompt tokens admitted whose KV came from the prefix cache"),
            "prefix_pages": ("bpcompile_generator_prefix_cached_pages",
                             "verifier KV pages the prefix cache holds (shared by requests or kept for later ones)")}

    def __init__(self, labels: dict):
        self.families, self.metrics, self.last = [], {}, {}
        try:
            for key, (name, help_) in self.SPEC.items():
                kind = pb_utils.MetricFamily.COUNTER if name.endswith("_total") else pb_utils.MetricFamily.GAUGE
                fam = pb_utils.MetricFamily(name=name, description=help_, kind=kind)
                self.families.append(fam)
                self.metrics[key] = fam.Metric(labels=labels)
        except Exception as e:  # tritonserver started with --allow-metrics=false
            pb_utils.Logger.log_warn(f"generator: no metrics ({e})")
            self.metrics = {}

    def add(self, key: str, n: int = 1) -> None:
        if n and key in self.metrics:
            self.metrics[key].increment(n)

    def set(self, key: str, value: int) -> None:
        if key in self.metrics and self.last.get(key) != value:  # each update is a message to tritonserver
            self.metrics[key].set(value)
            self.last[key] = value


class TritonPythonModel:
    def initialize(self, args):
        from bpcompile.runtime.generator import Generator, TreeSpec  # the runtime is only needed by this model

        self.model_config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        params = {k: v["string_value"] for k, v in self.model_config.get("parameters", {}).items()}
        engine_dir = Path(args["model_repository"]) / args["model_version"] / "engine"
        self.engine_version = int(args["model_version"])
        tree = json.loads(params["tree"]) if params.get("tree") else None
        device = params.get("device", "cpu")  # cpu, cuda or auto (the recipe's runtime.device)
        if args.get("model_instance_kind") == "GPU" and device != "cpu":  # a KIND_GPU instance: Triton's GPU
            device = f"cuda:{args['model_instance_device_id']}"
        # tensorrtllm_backend's switch, enable_kv_cache_reuse (true / false) among the model's parameters; serve's
        # --prefix-reuse (in the environment) comes first, and without either the engine's runtime.prefix_reuse
        from bpcompile.core.switches import prefix_reuse_override

        reuse = {"true": True, "false": False}.get(params.get("enable_kv_cache_reuse", "").strip().lower())
        self.gen = Generator.from_engine(engine_dir, tree=TreeSpec(**tree) if tree else None, device=device,
                                         prefix_reuse=reuse if prefix_reuse_override() is None else None)
        self.max_seq_len, self.max_input_len = self.gen.max_seq_len, self.gen.max_input_len
        self.max_sequences = max(1, int(self.model_config.get("max_batch_size", 1)))
        # a token request's default (the backend's parameter, false unless set); text requests exclude by default
        self.exclude_default = params.get("exclude_input_in_output", "false").strip().lower() in ("true", "1", "yes")
        self.text = TextInterface(engine_dir / "tokenizer", self.max_input_len)
        self.logger = pb_utils.Logger
        self.metrics = _Metrics({"version": str(self.engine_version),
                                 "instance": args.get("model_instance_name", "")})
        instances = sum(int(g.get("count", 1)) for g in self.model_config.get("instance_group", [])) or 1
        self.trt_metrics = GeneratorMetrics(pb_utils, args["model_name"], args["model_version"],
                                            args.get("model_instance_name") if instances > 1 else None)
        import torch

        self.logger.log_info(f"generator: engine version {self.engine_version} from {engine_dir}, tree "
                             f"{self.gen.tree.kind}, executor {self.gen.executor}, tp {self.gen.tp}, device "
                             f"{self.gen.device}, torch threads "
                             f"{torch.get_num_threads()}, max_seq_len {self.max_seq_len}")
        self.loop = _TritonLoop(self).start()
        # `bpcompile serve` drains before stopping tritonserver: new requests refused, running ones finish
        self.drain = ModelDrain(self.loop.thread, self.loop.stop)
        # last, once initialized: serve tells an unloaded instance from one that died (drain.py)
        self.alive = Instance(args["model_name"])

    # --- request intake (Triton's thread) ---------------------------------------------------------------

    def _parse(self, request) -> list:
        """The request's jobs: one per row of its batch (--batch-inputs of tensorrtllm_backend's clients) and per
        sequence it asks for (num_return_sequences; sequence s samples with seed + s)."""

        def get(name):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        first = get("input_ids")
        first = get("text_input") if first is None else first
        rows = int(np.asarray(first).shape[0]) if first is not None and np.asarray(first).ndim > 1 else 1

        def row(i):
            def g(name):
                a = get(name)
                if a is None or rows == 1:
                    return a
                a = np.asarray(a)
                return a[i:i + 1] if a.ndim and a.shape[0] == rows else a
            return g

        jobs = []
        for i in range(rows):
            n = scalar(row(i), "num_return_sequences", 1, int)
            if not 1 <= n <= self.max_sequences:
                raise BadRequest(f"num_return_sequences must be in [1, {self.max_sequences}] (the model's "
                                 f"max_batch_size), got {n}")
            for s in range(n):
                job = self._parse_one(row(i))
                job.batch_index, job.seq_index = i, s
                if s and job.params.seed is not None:
                    job.params.seed = (job.params.seed + s) & 0xFFFFFFFFFFFFFFFF
                jobs.append(job)
        if len(jobs) > self.max_sequences and not self.decoupled:  # one response holds them all (_Gather)
            raise BadRequest(f"this request asks for {len(jobs)} sequences (batch rows x num_return_sequences); a "
                             "repository emitted with triton.decoupled false answers them in one response, at most "
                             f"{self.max_sequences} (max_batch_size): send fewer, or emit with --decoupled")
        return jobs

    def _parse_one(self, get):
        from bpcompile.runtime.generator import SamplingParams

        # first: a request of a kind bpcompile does not serve (a stop request carries no prompt) is refused by name
        ids = get("input_ids")
        exclude = backend_options(get, self.exclude_default if ids is not None else True)
        text = ids is None
        if text:  # the ensemble's interface (module doc); sizes are checked before tokenizing
            prompt = self.text.prompt(get("text_input"))
            max_tokens = scalar(get, "max_tokens", DEFAULT_MAX_TOKENS, int)
            stop = self.text.words(get("stop_words"), "stop_words")
            bad = self.text.words(get("bad_words"), "bad_words")
            top_k, top_p = scalar(get, "top_k", 0, int), scalar(get, "top_p", 0.0, float)
            stream = scalar(get, "stream", False, bool)
            default_end = self.text.eos
        else:
            ids = np.asarray(ids).reshape(-1)
            n = scalar(get, "input_lengths", None, int)
            if n is not None:  # tensorrtllm_backend's semantics: the first input_lengths ids are the prompt, the
                if not 1 <= n <= ids.size:  # rest padding
                    raise BadRequest(f"input_lengths {n} is outside [1, {ids.size}] (input_ids holds {ids.size} "
                                     "tokens)")
                ids = ids[:n]
            if ids.size > self.max_input_len:
                raise BadRequest(f"the prompt has {ids.size} tokens; this engine takes at most "
                                 f"{self.max_input_len} (limits.max_input_len)")
            prompt = [int(i) for i in ids.reshape(-1)]
            max_tokens = scalar(get, "request_output_len", DEFAULT_MAX_TOKENS, int)
            stop, bad = self._word_list(get, "stop_words_list"), self._word_list(get, "bad_words_list")
            top_k, top_p = scalar(get, "runtime_top_k", 0, int), scalar(get, "runtime_top_p", 0.0, float)
            stream = scalar(get, "streaming", False, bool)
            default_end = None
        if stream and not self.decoupled:
            raise BadRequest("streaming needs a decoupled repository: this one answers unary infer (emitted with "
                             "triton.decoupled false); send stream=false, or emit with --decoupled")
        if not prompt:
            raise BadRequest("the prompt has no tokens")
        if len(prompt) > self.max_input_len:
            raise BadRequest(f"the prompt has {len(prompt)} tokens; this engine takes at most "
                             f"{self.max_input_len} (limits.max_input_len)")
        room = self.max_seq_len - len(prompt)
        if max_tokens <= 0:
            raise BadRequest(f"max_tokens must be > 0 (got {max_tokens})")
        if max_tokens > room:
            raise BadRequest(f"max_tokens {max_tokens} is above this engine's limit: prompt ({len(prompt)} tokens)"
                             f" + max_tokens must be <= max_seq_len {self.max_seq_len}, so at most {room}")
        if bad:
            raise BadRequest("bad_words is not supported by the native runtime (send it empty)")
        temperature = scalar(get, "temperature", 1.0, float)
        check_sampling(temperature, top_k, top_p)
        if top_k == 0 and top_p == 0.0:  # TensorRT-LLM: greedy (module doc)
            temperature = 0.0
        top_p = top_p or 1.0  # with top_k > 0: top-k alone
        seed = scalar(get, "seed", None, int)
        end_id = scalar(get, "end_id", default_end, int)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed, end_id=None if end_id is None or end_id < 0 else end_id,
                                end_ids=self.text.ends(end_id),
                                stop_words=stop, logprobs=scalar(get, "return_log_probs", False, bool),
                                repetition_penalty=scalar(get, "repetition_penalty", 1.0, float),
                                presence_penalty=scalar(get, "presence_penalty", 0.0, float),
                                frequency_penalty=scalar(get, "frequency_penalty", 0.0, float),
                                penalties_over_output=scalar(get, "penalties_over_output", False, bool),
                                min_tokens=scalar(get, "min_tokens", 0, int),
                                context_logits=scalar(get, "return_context_logits", False, bool),
                                generation_logits=scalar(get, "return_generation_logits", False, bool))
        return _Job(prompt, params, stream=stream, text=text, exclude=exclude,
                    perf=scalar(get, "return_perf_metrics", False, bool))

    @staticmethod
    def _word_list(get, name):
        a = get(name)
        try:
            return [] if a is None else unpack_words(a)
        except ValueError as e:
            raise BadRequest(f"{name}: {e}") from None

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                jobs = self._parse(request)
            except BadRequest as e:
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)), flags=FINAL)
                continue
            except Exception:  # details (paths, code) go to the server log, not to the client
                self.logger.log_error(f"generator: could not read a request: {traceback.format_exc()}")
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "the generator could not read the request (an internal error; the server log has the "
                    "details)", pb_utils.TritonError.INTERNAL)), flags=FINAL)
                continue
            shared = _Shared(sender, len(jobs)) if self.decoupled or len(jobs) == 1 else _Gather(sender, jobs)
            for job in jobs:
                job.sender = shared
                if not self.drain.submit(self.loop.submit, job):
                    shared.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "the server is shutting down", pb_utils.TritonError.UNAVAILABLE)), flags=FINAL)
                    break
        return None  # decoupled or not, responses go through the senders, from the loop thread

    def _send(self, job, start, o):
        ctx, read = context_window(job.out, start, len(job.out))
        if not job.exclude and not job.stream and job.index == 0:  # as TensorRT-LLM: the prompt's tokens lead a
            # non-streamed output (a streamed one carries the generated tokens only)
            ctx, read = list(job.prompt) + list(ctx), 0
        s = o.stats
        accepted = int(sum(getattr(s, "accepted_per_depth", None) or []))
        drafted = int(sum(getattr(s, "proposed_per_depth", None) or []))
        steps = int(getattr(s, "verifier_steps", 0) or 0)
        tau = float(getattr(s, "tau", 0.0) or (len(job.out) / steps if steps else 0.0))

        def t(name, value, dtype):
            return pb_utils.Tensor(name, np.array([value], dtype=dtype))

        reason = (o.finish_reason or "") if o.finished else ""
        if job.text:  # what postprocessing makes of the token response below, with the ensemble's names
            piece = delta_text(self.text.decode, ctx, read, o.finished)
            outs = [pb_utils.Tensor("text_output", np.array([piece.encode("utf-8")], dtype=np.object_)),  # [batch]
                    t("response_index", [job.index], np.int32), t("finish_reason", [reason], np.object_)]
        else:
            outs = [t("CONTEXT_IDS", ctx, np.int32), t("READ_OFFSET", [read], np.int32),
                    t("IS_FINAL", [o.finished], np.bool_), t("RESPONSE_INDEX", [job.index], np.int32),
                    t("FINISH_REASON", [reason], np.object_)]
        # tensorrtllm_backend's outputs: this response's tokens as [batch, beam, tokens] with one beam (the prompt
        # first in a non-streamed response when exclude_input_in_output is false), their count per beam
        new = ctx[read:]
        # log probabilities of this response's generated tokens and their running sum (zeros unless
        # return_log_probs: the ensemble maps these outputs, so every response carries them)
        lps = job.logprobs[start:len(job.out)] if job.params.logprobs else [0.0] * (len(job.out) - start)
        outs += [t("cum_log_probs", [float(sum(job.logprobs)) if job.params.logprobs else 0.0], np.float32),
                 t("output_log_probs", [lps], np.float32)]
        # [batch, prompt, vocab], on the first response and on the final one: tensorrtllm_backend's clients keep the
        # last response's (inflight_batcher_llm_client.py --streaming); not on every one, which would multiply
        # prompt x vocabulary floats by the number of responses
        if job.context_logits is not None and (job.index == 0 or o.finished):
            outs.append(pb_utils.Tensor("context_logits", job.context_logits.numpy()[None]))
        if job.params.generation_logits and len(job.out) > start:  # [batch, beam, tokens, vocab]
            import torch

            rows = torch.cat(job.generation_logits)[start:len(job.out)]
            outs.append(pb_utils.Tensor("generation_logits", rows.numpy()[None, None]))
        if job.perf:  # reused: prompt pages taken from the prefix cache; new: the rest of the reservation
            reused = int(getattr(s, "reused_blocks", 0) or 0)
            outs += [t("kv_cache_alloc_new_blocks", [job.pages - reused], np.int32),
                     t("kv_cache_reused_blocks", [reused], np.int32),
                     t("kv_cache_alloc_total_blocks", [job.pages], np.int32),
                     t("arrival_time_ns", [job.arrival_ns], np.int64),
                     t("first_scheduled_time_ns", [job.admitted_ns], np.int64),
                     t("first_token_time_ns", [job.first_token_ns], np.int64),
                     t("last_token_time_ns", [job.last_token_ns], np.int64)]
        outs += [t("output_ids", [new], np.int32), t("sequence_length", [len(new)], np.int32),
                 t("batch_index", [job.batch_index], np.int32), t("sequence_index", [job.seq_index], np.int32),
                 t("num_input_tokens", [len(job.prompt)], np.int32), t("num_output_tokens", [len(job.out)], np.int32)]
        outs += [
            t("acceptance_rate", [accepted / drafted if drafted else 0.0], np.float32),
            t("total_accepted_draft_tokens", [accepted], np.int32),
            t("total_draft_tokens", [drafted], np.int32),
            t("tokens_per_step", [tau], np.float32),
            t("verifier_steps", [steps], np.int32),
            t("engine_version", [self.engine_version], np.int32),
            t("cached_tokens", [int(getattr(s, "reused_tokens", 0) or 0)], np.int32),
        ]
        job.index += 1
        job.sent = len(job.out)
        if isinstance(job.sender, _Gather):  # a unary request's sequences: one response holds them all
            job.sender.hold(job, outs)
            return
        job.sender.send(pb_utils.InferenceResponse(output_tensors=outs), flags=FINAL if o.finished else 0)

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
        self.alive.close()
        self.drain.close()
        self.loop.stop()
        self.loop.thread.join(timeout=300)
        self.gen.close()  # tensor-parallel worker processes, if any

