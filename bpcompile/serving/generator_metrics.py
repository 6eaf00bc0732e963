"""The generating model's metrics on tritonserver's metrics port, under the names and labels a Prometheus scrape
of tensorrtllm_backend's `tensorrt_llm` model finds (its Python model's `create_metrics`: gauges labelled
model, version and one category label each), so dashboards, autoscalers and the Gateway API inference
extension's endpoint picker (which reads request_type="waiting" / "scheduled" and kv_cache_block_type="fraction" /
"tokens_per" / "max") work with no code of ours. Plus bpcompile's own: token counters and per-request latency
histograms, and the generator counters earlier releases exported.

What each value means here (one generator instance; `snapshot` computes them, the model sends them):

* nv_trt_llm_request_metrics: active = requests the instance holds (in its batch or queued for it); max = the
  batch's size limit; scheduled = requests in the running batch; waiting = active - scheduled (as the backend
  computes it); context = requests whose prompt the last step processed (their first step).
* nv_trt_llm_kv_cache_block_metrics (the verifier's paged cache; a block is a page): max = pages in the cache;
  free = pages a new request can take (prefix-cache pages nobody references included, as the backend counts its
  reusable blocks); used = max - free; tokens_per = tokens per page; fraction = used / max.
* nv_trt_llm_inflight_batcher_metrics: total_context_tokens = prompt tokens computed in the last step (prefix
  cache hits excluded); generation_requests = requests that generated in the last step past their prompt;
  micro_batch_id 0 and paused_requests 0 (no pipeline micro-batches; nothing is ever paused or preempted: a
  request's pages are reserved when it is admitted).
* nv_trt_llm_runtime_memory_metrics: cpu = the model process's resident memory; gpu = what torch allocated on
  the generator's CUDA device (0 on CPU); pinned = 0 (none is used). Bytes.
* nv_trt_llm_general_metrics: iteration_counter = generator steps; timestamp = seconds since the epoch of this
  snapshot.
* nv_llm_input_token_len / nv_llm_output_token_len: histograms of each finished request's prompt and output
  lengths (the backend's buckets, 1-2-5 up to 1000).
* bpcompile_generator_prompt_tokens_total, bpcompile_generator_generation_tokens_total: counters (prompt tokens
  of admitted requests, tokens generated).
* bpcompile_generator_time_to_first_token_seconds (the generator's receipt of the request to its first token),
  bpcompile_generator_inter_token_latency_seconds ((last token - first token) / (tokens - 1) of each finished
  request with two tokens or more: genai-perf's definition), bpcompile_generator_request_latency_seconds (receipt
  to the last token): histograms, one observation per finished request.

Per-step values and the gauges are sent at most every `period` seconds while requests run, and always when the
generator goes idle, so a scrape of an idle server reads the final state. Several instances of the model add an
`instance` label (their gauges would otherwise overwrite each other's).
"""

from __future__ import annotations

import os
import time
from typing import Optional

TOKEN_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0]
TTFT_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0]
LATENCY_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0]

# family -> (description, category label, the category values); all gauges
GAUGES = {
    "nv_trt_llm_request_metrics": (
        "TRT LLM request metrics",
        "request_type",
        ("active", "max", "scheduled", "context", "waiting"),
    ),
    "nv_trt_llm_runtime_memory_metrics": ("TRT LLM runtime memory metrics", "memory_type", ("cpu", "gpu", "pinned")),
    "nv_trt_llm_kv_cache_block_metrics": (
        "TRT LLM KV cache block metrics",
        "kv_cache_block_type",
        ("max", "free", "used", "tokens_per", "fraction"),
    ),
    "nv_trt_llm_inflight_batcher_metrics": (
        "TRT LLM inflight_batcher-specific metrics",
        "inflight_batcher_specific_metric",
        ("total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests"),
    ),
    "nv_trt_llm_general_metrics": ("General TRT LLM metrics", "general_type", ("timestamp", "iteration_counter")),
}
# family -> (description, response_metric_type, buckets); one observation per finished request
TOKEN_HISTOGRAMS = {
    "nv_llm_input_token_len": ("TRT LLM response metrics", "total_input_tokens"),
    "nv_llm_output_token_len": ("TRT LLM response metrics", "total_output_tokens"),
}
HISTOGRAMS = {
    "bpcompile_generator_time_to_first_token_seconds": (
        "time from the generator's receipt of a request to its first token",
        TTFT_BUCKETS,
    ),
    "bpcompile_generator_inter_token_latency_seconds": (
        "per request: (last token - first token) / (tokens - 1)",
        ITL_BUCKETS,
    ),
    "bpcompile_generator_request_latency_seconds": (
        "time from the generator's receipt of a request to its last token",
        LATENCY_BUCKETS,
    ),
}
COUNTERS = {
    "bpcompile_generator_prompt_tokens_total": "prompt tokens of the requests admitted",
    "bpcompile_generator_generation_tokens_total": "tokens generated",
}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class StepTally:
    """What the last generator step did, from its outputs (the loop's on_output)."""

    def __init__(self):
        self.context = self.context_tokens = self.generation = 0
        self.new_tokens = self.prompt_tokens = 0

    def output(self, first: bool, prompt_len: int, reused: int, new_tokens: int) -> None:
        if first:
            self.context += 1
            self.context_tokens += prompt_len - reused
            self.prompt_tokens += prompt_len
        else:
            self.generation += 1
        self.new_tokens += new_tokens


def snapshot(gen, active: int, steps: int, tally: Optional[StepTally], idle: bool) -> dict:
    """{(family, category value): value} for the gauges, from the generator (read on the thread that owns it)."""
    kv = gen.vkv
    cap = kv.capacity
    free = kv.available()
    scheduled = len(gen.scheduler.running)
    last = StepTally() if idle or tally is None else tally
    gpu = 0
    if getattr(gen.device, "type", str(gen.device)) == "cuda":
        import torch

        gpu = torch.cuda.memory_allocated(gen.device)
    return {
        ("nv_trt_llm_request_metrics", "active"): active,
        ("nv_trt_llm_request_metrics", "max"): gen.max_batch_size,
        ("nv_trt_llm_request_metrics", "scheduled"): scheduled,
        ("nv_trt_llm_request_metrics", "context"): last.context,
        ("nv_trt_llm_request_metrics", "waiting"): active - scheduled,
        ("nv_trt_llm_runtime_memory_metrics", "cpu"): _rss_bytes(),
        ("nv_trt_llm_runtime_memory_metrics", "gpu"): gpu,
        ("nv_trt_llm_runtime_memory_metrics", "pinned"): 0,
        ("nv_trt_llm_kv_cache_block_metrics", "max"): cap,
        ("nv_trt_llm_kv_cache_block_metrics", "free"): free,
        ("nv_trt_llm_kv_cache_block_metrics", "used"): cap - free,
        ("nv_trt_llm_kv_cache_block_metrics", "tokens_per"): gen.page_size,
        ("nv_trt_llm_kv_cache_block_metrics", "fraction"): (cap - free) / cap if cap else 0.0,
        ("nv_trt_llm_inflight_batcher_metrics", "total_context_tokens"): last.context_tokens,
        ("nv_trt_llm_inflight_batcher_metrics", "generation_requests"): last.generation,
        ("nv_trt_llm_inflight_batcher_metrics", "micro_batch_id"): 0,
        ("nv_trt_llm_inflight_batcher_metrics", "paused_requests"): 0,
        ("nv_trt_llm_general_metrics", "timestamp"): int(time.time()),
        ("nv_trt_llm_general_metrics", "iteration_counter"): steps,
    }


class GeneratorMetrics:
    """The families above, created through the Python backend's `pb_utils.MetricFamily`; every method is a
    no-op when tritonserver runs without metrics."""

    def __init__(self, pb_utils, model: str, version: str, instance: Optional[str] = None, period: float = 0.1):
        self.period, self.sent_at, self.last = period, 0.0, {}
        self.pending = {k: 0 for k in COUNTERS}
        self.families, self.gauges, self.counters, self.histograms = [], {}, {}, {}
        labels = {"model": model, "version": version, **({"instance": instance} if instance else {})}
        K = pb_utils.MetricFamily
        try:
            for name, (desc, category, values) in GAUGES.items():
                fam = K(name=name, description=desc, kind=K.GAUGE)
                self.families.append(fam)
                for v in values:
                    self.gauges[(name, v)] = fam.Metric(labels={category: v, **labels})
            for name, (desc, kind) in TOKEN_HISTOGRAMS.items():
                fam = K(name=name, description=desc, kind=K.HISTOGRAM)
                self.families.append(fam)
                self.histograms[name] = fam.Metric(
                    labels={"response_metric_type": kind, **labels}, buckets=TOKEN_BUCKETS
                )
            for name, (desc, buckets) in HISTOGRAMS.items():
                fam = K(name=name, description=desc, kind=K.HISTOGRAM)
                self.families.append(fam)
                self.histograms[name] = fam.Metric(labels=labels, buckets=buckets)
            for name, desc in COUNTERS.items():
                fam = K(name=name, description=desc, kind=K.COUNTER)
                self.families.append(fam)
                self.counters[name] = fam.Metric(labels=labels)
        except Exception as e:  # tritonserver started with --allow-metrics=false
            pb_utils.Logger.log_warn(f"generator: no TensorRT-LLM metrics ({e})")
            self.gauges, self.counters, self.histograms = {}, {}, {}

    def turn(self, gen, active: int, steps: int, tally: Optional[StepTally], idle: bool) -> None:
        """Once per loop turn: the last step's tokens into the counters, and the gauges when due (or idle)."""
        if tally is not None:
            self.pending["bpcompile_generator_prompt_tokens_total"] += tally.prompt_tokens
            self.pending["bpcompile_generator_generation_tokens_total"] += tally.new_tokens
        now = time.monotonic()
        if not self.gauges or (not idle and now - self.sent_at < self.period):
            return
        self.sent_at = now
        for name, n in self.pending.items():
            if n and name in self.counters:
                self.counters[name].increment(n)
            self.pending[name] = 0
        for key, value in snapshot(gen, active, steps, tally, idle).items():
            if self.last.get(key) != value:  # each update is a message to tritonserver
                self.gauges[key].set(value)
                self.last[key] = value

    def finished(self, prompt_len: int, tokens: int, arrival_ns: int, first_ns: int, last_ns: int) -> None:
        """A request finished normally (not cancelled): its lengths and latencies."""
        if not self.histograms:
            return
        h = self.histograms
        h["nv_llm_input_token_len"].observe(prompt_len)
        h["nv_llm_output_token_len"].observe(tokens)
        if first_ns:
            h["bpcompile_generator_time_to_first_token_seconds"].observe((first_ns - arrival_ns) / 1e9)
            h["bpcompile_generator_request_latency_seconds"].observe((last_ns - arrival_ns) / 1e9)
        if tokens >= 2 and last_ns > first_ns:
            h["bpcompile_generator_inter_token_latency_seconds"].observe((last_ns - first_ns) / 1e9 / (tokens - 1))
