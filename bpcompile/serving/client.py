"""Clients for a served repository: one generation (streamed or not), and a load generator with latency stats.

gRPC uses tritonclient's bidirectional stream (a decoupled ensemble is reachable only through it; unary
ModelInfer refuses decoupled models). HTTP uses Triton's generate extension: /v2/models/<m>/generate and,
streamed, /generate_stream (server-sent events); HTTP /infer also refuses decoupled models.

Responses are reassembled by `response_index`, so text stays right even if a transport reordered them;
`out_of_order` counts the responses that arrived after a later one (0 is what the repository guarantees).

model="tensorrt_llm" sends the same request to the generator model (tensorrt_llm) itself (native target), which answers it with
the same outputs. Prefer it for streams that may be abandoned: cancelling (or losing the connection) stops
the generation there within one step, while through the ensemble tritonserver 2.51 lets it run to max_tokens
(see bpcompile/serving/models/generator.py).
"""

from __future__ import annotations

import json
import queue
import statistics
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Callable, Optional

import numpy as np

from bpcompile.core.errors import UserError


class RemoteError(RuntimeError):
    """The server answered the request with an error (message as the server wrote it)."""


def _request_fields(prompt, max_tokens, stream, temperature, top_k, top_p, seed, end_id, stop_words) -> dict:
    # temperature and top_p always: the server follows TensorRT-LLM, where a request without them is greedy
    # (temperature 1.0, top_k 0 and top_p 0 by default); here temperature > 0 alone samples from the whole distribution
    d = {"text_input": prompt, "max_tokens": int(max_tokens), "stream": bool(stream)}
    d["temperature"] = float(temperature or 0.0)
    if top_k:
        d["top_k"] = int(top_k)
    d["top_p"] = 1.0 if top_p is None else float(top_p)
    if seed is not None:
        d["seed"] = int(seed)
    if end_id is not None:
        d["end_id"] = int(end_id)
    if stop_words:
        d["stop_words"] = list(stop_words)
    return d


_DTYPES = {
    "text_input": ("BYTES", object),
    "max_tokens": ("INT32", np.int32),
    "stream": ("BOOL", np.bool_),
    "temperature": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "top_p": ("FP32", np.float32),
    "seed": ("UINT64", np.uint64),
    "end_id": ("INT32", np.int32),
    "stop_words": ("BYTES", object),
}


def _grpc_inputs(fields: dict):
    import tritonclient.grpc as grpcclient

    out = []
    for k, v in fields.items():
        dt, np_t = _DTYPES[k]
        vals = v if isinstance(v, list) else [v]
        if np_t is object:
            vals = [s.encode("utf-8") if isinstance(s, str) else s for s in vals]
        arr = np.array([vals], dtype=np_t)  # [batch=1, n]
        t = grpcclient.InferInput(k, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


class _Collector:
    """Accumulates one request's responses: text in response order, timings, the last statistics."""

    STATS = (
        "acceptance_rate",
        "total_accepted_draft_tokens",
        "total_draft_tokens",
        "tokens_per_step",
        "verifier_steps",
        "engine_version",
        "cached_tokens",
        "finish_reason",
    )

    def __init__(self, on_text: Optional[Callable[[str], None]] = None):
        self.t0 = time.perf_counter()
        self.parts: dict[int, tuple[str, list[int]]] = {}
        self.arrivals: list[tuple[float, int]] = []  # (time since t0, tokens in the response)
        self.stats: dict = {}
        self.max_index = -1
        self.out_of_order = 0
        self.on_text = on_text

    def add(self, index: Optional[int], text: str, ids: list[int], stats: dict) -> None:
        now = time.perf_counter() - self.t0
        index = len(self.parts) if index is None else index
        if index < self.max_index:
            self.out_of_order += 1
        self.max_index = max(self.max_index, index)
        self.parts[index] = (text, ids)
        if ids:
            self.arrivals.append((now, len(ids)))
        self.stats.update({k: v for k, v in stats.items() if v is not None})
        if self.on_text and text:
            self.on_text(text)

    def _tpot(self, n: int) -> Optional[float]:
        """Time per output token after the first response (speculation commits several tokens per response)."""
        if not self.arrivals or n <= self.arrivals[0][1]:
            return None
        return (self.arrivals[-1][0] - self.arrivals[0][0]) / (n - self.arrivals[0][1])

    def result(self) -> dict:
        order = sorted(self.parts)
        ids = [t for i in order for t in self.parts[i][1]]
        n = len(ids)
        e2e = time.perf_counter() - self.t0
        ttft = self.arrivals[0][0] if self.arrivals else None
        gaps = [b[0] - a[0] for a, b in zip(self.arrivals, self.arrivals[1:])]
        return {
            "text": "".join(self.parts[i][0] for i in order),
            "token_ids": ids,
            "tokens": n,
            "responses": len(order),
            "out_of_order": self.out_of_order,
            "ttft_s": ttft,
            "latency_s": e2e,
            "tpot_s": self._tpot(n),
            # genai-perf's definitions: the second response's arrival after the first's (a response may carry
            # several tokens), and (last token - first token) / (tokens - 1)
            "ttst_s": gaps[0] if gaps else None,
            "itl_s": (self.arrivals[-1][0] - ttft) / (n - 1) if n > 1 and len(self.arrivals) > 1 else None,
            "response_gaps_s": gaps,
            **self.stats,
        }


def _np_scalar(v):
    if v is None:
        return None
    v = np.asarray(v).reshape(-1)
    if v.size == 0:
        return None
    x = v[0]
    if isinstance(x, bytes):
        return x.decode("utf-8", errors="replace")
    return x.item() if hasattr(x, "item") else x


def _grpc_one(client, model: str, fields: dict, collector: _Collector, timeout: float) -> dict:
    """One request over a client from _grpc_client (its stream's callback feeds client._bp_queue)."""
    rid = uuid.uuid4().hex
    q: queue.Queue = client._bp_queue
    client.async_stream_infer(model, _grpc_inputs(fields), request_id=rid, enable_empty_final_response=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            result, error = q.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"no final response within {timeout:.0f}s") from None
        if error is not None:
            raise RemoteError(str(error.message() if hasattr(error, "message") else error))
        resp = result.get_response()
        final = (
            resp.parameters["triton_final_response"].bool_param if "triton_final_response" in resp.parameters else False
        )
        names = {o.name for o in resp.outputs}
        if "text_output" in names:
            text = b"".join(result.as_numpy("text_output").reshape(-1)).decode("utf-8")
            ids = [int(i) for i in result.as_numpy("output_ids").reshape(-1)]
            stats = {k: _np_scalar(result.as_numpy(k)) for k in _Collector.STATS if k in names}
            idx = _np_scalar(result.as_numpy("response_index")) if "response_index" in names else None
            collector.add(idx, text, ids, stats)
        if final:
            return collector.result()


def _grpc_client(url: str):
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(url)
    c._bp_queue = queue.Queue()  # one request at a time per client/stream
    c.start_stream(callback=lambda result, error: c._bp_queue.put((result, error)))
    return c


def _http_one(url: str, model: str, fields: dict, collector: _Collector, timeout: float) -> dict:
    base = url if url.startswith("http") else f"http://{url}"
    path = "generate_stream" if fields.get("stream") else "generate"
    req = urllib.request.Request(
        f"{base}/v2/models/{model}/{path}",
        data=json.dumps(fields).encode(),
        headers={"Content-Type": "application/json"},
    )

    def take(d: dict):
        if "error" in d:
            raise RemoteError(d["error"])
        ids = np.asarray(d.get("output_ids", []), dtype=np.int64).reshape(-1).tolist()  # a scalar when one token
        ids = ids if isinstance(ids, list) else [ids]
        collector.add(
            d.get("response_index"),
            d.get("text_output", ""),
            [int(i) for i in ids],
            {k: d.get(k) for k in _Collector.STATS},
        )

    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if path == "generate":
                take(json.loads(r.read()))
            else:
                for line in r:  # server-sent events: "data: {...}" lines
                    line = line.strip()
                    if line.startswith(b"data:"):
                        take(json.loads(line[5:]))
    except urllib.error.HTTPError as e:
        body = e.read().decode("utf-8", errors="replace")
        try:
            body = json.loads(body).get("error", body)
        except ValueError:
            pass
        raise RemoteError(body) from None
    return collector.result()


def _openai_one(url: str, model: str, fields: dict, collector: _Collector, timeout: float) -> dict:
    """One streamed /v1/completions request to an OpenAI-compatible endpoint (url: its base, ending in /v1).
    The API reports no token ids per chunk: each content chunk counts as one arrival, and the token total comes
    from the final usage (so time per output token spreads the stream's duration over every token after the
    first chunk)."""
    body = {
        "model": model,
        "prompt": fields["text_input"],
        "max_tokens": fields["max_tokens"],
        "stream": True,
        "temperature": fields.get("temperature", 0.0),
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url.rstrip("/") + "/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    usage = None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                d = json.loads(line[5:])
                if "error" in d:
                    raise RemoteError(d["error"].get("message", str(d["error"])))
                usage = d.get("usage") or usage
                for c in d.get("choices", []):
                    if c.get("text"):
                        collector.add(None, c["text"], [0], {"finish_reason": c.get("finish_reason")})
                    elif c.get("finish_reason"):
                        collector.stats["finish_reason"] = c["finish_reason"]
    except urllib.error.HTTPError as e:
        raise RemoteError(e.read().decode("utf-8", errors="replace")) from None
    res = collector.result()
    n = (usage or {}).get("completion_tokens", res["tokens"])
    first = collector.arrivals[0][0] if collector.arrivals else None
    last = collector.arrivals[-1][0] if collector.arrivals else None
    res.update(tokens=n, token_ids=[], tpot_s=(last - first) / (n - 1) if first is not None and n > 1 else None)
    return res


def openai_model(url: str, timeout: float = 30.0) -> str:
    """The id of the one model an OpenAI-compatible endpoint serves (GET /v1/models)."""
    with urllib.request.urlopen(url.rstrip("/") + "/models", timeout=timeout) as r:
        return json.loads(r.read())["data"][0]["id"]


def generate_remote(
    url: str,
    prompt: str,
    max_tokens: int = 64,
    stream: bool = True,
    protocol: str = "grpc",
    *,
    model: str = "ensemble",
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    end_id: Optional[int] = None,
    stop_words: Optional[list[str]] = None,
    on_text: Optional[Callable[[str], None]] = None,
    timeout: float = 300.0,
) -> dict:
    """Generate from a served repository. url: 'host:port' of the gRPC (protocol='grpc') or HTTP endpoint.

    Returns {text, token_ids, tokens, responses, out_of_order, ttft_s, latency_s, tpot_s, acceptance_rate,
    total_accepted_draft_tokens, total_draft_tokens, tokens_per_step, verifier_steps, engine_version,
    finish_reason}. on_text(piece) is called as text arrives. Server-side errors raise RemoteError."""
    fields = _request_fields(prompt, max_tokens, stream, temperature, top_k, top_p, seed, end_id, stop_words)
    col = _Collector(on_text)
    if protocol == "http":
        return _http_one(url, model, fields, col, timeout)
    if protocol == "openai":
        return _openai_one(url, openai_model(url) if model == "ensemble" else model, fields, col, timeout)
    if protocol != "grpc":
        raise UserError(f"protocol must be grpc, http or openai, got {protocol!r}")
    c = _grpc_client(url)
    done = False
    try:
        r = _grpc_one(c, model, fields, col, timeout)
        done = True
        return r
    except RemoteError:
        done = True  # the server failed the request itself: there is nothing left to cancel
        raise
    finally:
        # Cancel only what is unfinished (a timeout, an interrupt): a cancellation racing a request's completion,
        # an error response's included, can leave the ensemble request behind in tritonserver 2.51 (seen: the
        # server then cannot unload the ensemble at exit and exits 1). Without cancelling, closing the stream
        # waits for the server to end it.
        c.stop_stream(cancel_requests=not done)
        c.close()


def _pct(xs: list, p: float):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _summary(xs: list) -> dict:
    mean = statistics.fmean([x for x in xs if x is not None]) if any(x is not None for x in xs) else None
    return {"p50": _pct(xs, 50), "p90": _pct(xs, 90), "p99": _pct(xs, 99), "mean": mean, "avg": mean}


def bench_remote(
    url: str,
    prompts: list[str],
    n: Optional[int] = None,
    concurrency: int = 1,
    max_tokens: int = 64,
    protocol: str = "grpc",
    *,
    model: str = "ensemble",
    stream: bool = True,
    warmup: int = 1,
    temperature: float = 0.0,
    timeout: float = 600.0,
) -> dict:
    """Closed-loop load: `concurrency` clients, each sending its next request when the previous one finished,
    n requests in all (prompts reused round-robin). Latencies in seconds; JSON-ready."""
    if concurrency < 1 or not prompts:
        raise UserError("bench needs at least one prompt and concurrency >= 1")
    n = n or len(prompts)
    if protocol == "openai" and model == "ensemble":
        model = openai_model(url)
    for i in range(warmup):  # first requests pay one-time costs (allocations, lazy imports)
        generate_remote(
            url,
            prompts[i % len(prompts)],
            max_tokens=max_tokens,
            stream=stream,
            protocol=protocol,
            model=model,
            temperature=temperature,
            timeout=timeout,
        )
    jobs: queue.Queue = queue.Queue()
    for i in range(n):
        jobs.put(prompts[i % len(prompts)])
    results, errors, lock = [], [], threading.Lock()

    def worker():
        c = _grpc_client(url) if protocol == "grpc" else None
        try:
            while True:
                try:
                    p = jobs.get_nowait()
                except queue.Empty:
                    return
                fields = _request_fields(p, max_tokens, stream, temperature, 0, 1.0, None, None, None)
                try:
                    one = {"grpc": None, "http": _http_one, "openai": _openai_one}[protocol]
                    r = (
                        _grpc_one(c, model, fields, _Collector(), timeout)
                        if c is not None
                        else one(url, model, fields, _Collector(), timeout)
                    )
                    with lock:
                        results.append(r)
                except Exception as e:  # counted, not fatal: a benchmark reports failures
                    with lock:
                        errors.append(str(e))
        finally:
            if c is not None:
                c.stop_stream()
                c.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in results)
    steps = sum(r.get("verifier_steps") or 0 for r in results)
    committed = sum((r.get("tokens_per_step") or 0) * (r.get("verifier_steps") or 0) for r in results)
    acc = sum(r.get("total_accepted_draft_tokens") or 0 for r in results)
    drafted = sum(r.get("total_draft_tokens") or 0 for r in results)
    return {
        "protocol": protocol,
        "stream": stream,
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(errors),
        "error_samples": errors[:3],
        "max_tokens": max_tokens,
        "wall_s": wall,
        "output_tokens": toks,
        "output_tokens_per_s": toks / wall if wall > 0 else None,
        "requests_per_s": len(results) / wall if wall > 0 else None,
        "ttft_s": _summary([r["ttft_s"] for r in results]),
        "tpot_s": _summary([r["tpot_s"] for r in results]),
        "inter_response_s": _summary([g for r in results for g in r["response_gaps_s"]]),
        "latency_s": _summary([r["latency_s"] for r in results]),
        # what genai-perf prints, under its names (per request, then over the run)
        "time_to_first_token_s": _summary([r["ttft_s"] for r in results]),
        "time_to_second_token_s": _summary([r["ttst_s"] for r in results]),
        "inter_token_latency_s": _summary([r["itl_s"] for r in results]),
        "request_latency_s": _summary([r["latency_s"] for r in results]),
        "output_token_throughput_per_user": _summary([1 / r["itl_s"] if r["itl_s"] else None for r in results]),
        "output_token_throughput": toks / wall if wall > 0 else None,
        "request_throughput": len(results) / wall if wall > 0 else None,
        # tokens committed per verifier step over all requests (the runtime's tau, step-weighted)
        "tokens_per_step": committed / steps if steps else None,
        "acceptance_rate": acc / drafted if drafted else None,
        "out_of_order_responses": sum(r["out_of_order"] for r in results),
    }


# --- model control (explicit mode): plain HTTP, usable from any thread -----------------------------------


def _post(url: str, path: str, body: Optional[dict] = None, timeout: float = 600.0, token: Optional[str] = None):
    """token: what `bpcompile serve` asks of the repository API (default: $BPCOMPILE_REPOSITORY_TOKEN)."""
    import os

    from bpcompile.serving.protocol import REPOSITORY_HEADER, TOKEN_ENV

    base = url if url.startswith("http") else f"http://{url}"
    headers = {"Content-Type": "application/json"}
    token = token or os.environ.get(TOKEN_ENV)
    if token:
        headers[REPOSITORY_HEADER] = token
    req = urllib.request.Request(f"{base}{path}", data=json.dumps(body or {}).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read()
            return json.loads(data) if data else None
    except urllib.error.HTTPError as e:
        raise RemoteError(e.read().decode("utf-8", errors="replace")) from None


def load_model(url: str, name: str, token: Optional[str] = None) -> None:
    """(Re)load a model from the repository (its version policy decides which versions); blocks until done.
    Triton loads the new versions before unloading the old ones, whose in-flight requests finish first."""
    _post(url, f"/v2/repository/models/{name}/load", token=token)


def unload_model(url: str, name: str, unload_dependents: bool = False, token: Optional[str] = None) -> None:
    _post(
        url,
        f"/v2/repository/models/{name}/unload",
        {"parameters": {"unload_dependents": unload_dependents}} if unload_dependents else None,
        token=token,
    )


def repository_index(url: str, token: Optional[str] = None) -> list[dict]:
    return _post(url, "/v2/repository/index", token=token) or []


def load_version(
    url: str, models=("preprocessing", "postprocessing", "tensorrt_llm"), token: Optional[str] = None
) -> None:
    """Make the server serve what the repository's version policy now names (after add_version or
    set_version_policy). The three versioned models are reloaded; the ensemble follows (steps use version -1)."""
    for m in models:
        load_model(url, m, token)


DEFAULT_PROMPTS = [
    "The quick brown fox",
    "def main():",
    "Lists are mutable sequences",
    "import os",
    "class Foo:",
    "Error handling with try",
    "for i in range(10):",
    "The with statement",
]


def generate_remote_cli(
    url: str,
    prompt: str,
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: Optional[int] = None,
    protocol: str = "grpc",
    json_out: bool = False,
) -> dict:
    """`bpcompile generate --url`: stream text to stdout as it arrives, statistics at the end (or --json)."""
    import sys

    on_text = None if json_out else (lambda t: (sys.stdout.write(t), sys.stdout.flush()))
    try:
        r = generate_remote(
            url,
            prompt,
            max_tokens=max_tokens,
            stream=True,
            protocol=protocol,
            temperature=temperature,
            seed=seed,
            on_text=on_text,
        )
    except RemoteError as e:
        raise UserError(f"the server rejected the request: {e}") from None
    except Exception as e:  # connection refused and the like: the user's URL, most likely
        if "UNAVAILABLE" in str(e) or "refused" in str(e).lower():
            raise UserError(f"no server answering at {url} ({protocol}): {e}") from None
        raise
    r = {k: v for k, v in r.items() if k != "response_gaps_s"}
    if json_out:
        print(json.dumps(r, indent=2))
    else:
        sys.stdout.write("\n")
        print(
            f"[{r['tokens']} tokens, {r['latency_s']:.2f}s, first after {r['ttft_s'] or 0:.3f}s; "
            f"tokens/step {r.get('tokens_per_step') or 0:.2f}, acceptance {r.get('acceptance_rate') or 0:.2f}; "
            f"engine version {r.get('engine_version')}]",
            file=sys.stderr,
        )
    return r
