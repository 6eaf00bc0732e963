"""A real tritonserver (the binary bundled in nvidia-pytriton) serving an emitted repository; real clients.

One server for the module (explicit model control, so the last test can load a new engine version).
Reference outputs come from the in-process runtime (`Generator.from_engine`) on the same engine version.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("pytriton")

from tokenizers import Tokenizer  # noqa: E402

from bpcompile.serving.client import (  # noqa: E402
    RemoteError,
    _grpc_client,
    bench_remote,
    generate_remote,
    load_model,
    load_version,
    repository_index,
    unload_model,
)
from bpcompile.serving.emit import add_version, emit_repository, set_version_policy  # noqa: E402
from bpcompile.serving.serve import ServerProcess  # noqa: E402
from tests.serving_fixtures import make_engine  # noqa: E402

pytestmark = pytest.mark.server

PROMPTS = [
    "The quick brown fox",
    "def main():",
    "Unicode: 日本語 and € and 😀",
    "Lists are mutable sequences",
    "import os",
    "class Foo:",
    "Error handling with try",
    "for i in range(10):",
    "Numbers: 3.14159",
    "Hello, world!",
    "The with statement",
    "yield from",
    "lambda x: x",
    "a = [1, 2, 3]",
    "Strings are immutable",
    "async def f():",
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    return {1: make_engine(root / "1", 1), 2: make_engine(root / "2", 2)}


@pytest.fixture(scope="module")
def tokenizer(engines):
    return Tokenizer.from_file(str(engines[1] / "tokenizer" / "tokenizer.json"))


@pytest.fixture(scope="module")
def server(engines, tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton") / "repo"
    emit_repository([(1, engines[1])], repo)
    s = ServerProcess(repo, model_control="explicit", log_file=repo.parent / "server.log", startup_timeout=240)
    with s:
        s.repo, s.engines = repo, engines
        yield s
    assert s.proc.returncode == 0, (s.proc.returncode, s.log_tail())  # SIGTERM -> clean shutdown


@pytest.fixture(scope="module")
def reference(engines, tokenizer):
    """Greedy outputs of the in-process runtime for PROMPTS, with the end id the server uses."""
    from bpcompile.runtime.generator import Generator, SamplingParams

    gen = Generator.from_engine(engines[1])
    eos = tokenizer.token_to_id("</s>")
    ids = [tokenizer.encode(p).ids for p in PROMPTS]
    out = gen.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, end_id=eos))
    return {p: toks for p, (toks, _) in zip(PROMPTS, out)}


def test_prompt_size_is_checked_before_tokenizing(engines):
    """The byte bound (limits.max_input_len times the longest vocabulary entry) refuses no prompt that fits:
    max_input_len of the longest tokens pass; one byte over the bound is refused on its size alone."""
    from bpcompile.serving.protocol import BadRequest, TextInterface

    t = TextInterface(engines[1] / "tokenizer", 384)
    vocab = t.tokenizer.get_vocab()
    longest = max((w for w in vocab if t.decode([vocab[w]]).strip()), key=lambda w: len(w.encode()))
    text = t.tokenizer.decode([vocab[longest]] * 383).encode()  # + the BOS the tokenizer adds
    assert len(text) <= t.max_bytes and len(t.prompt(np.array([text], dtype=object))) <= 384
    assert t.prompt(np.array([b"a" * t.max_bytes], dtype=object))
    with pytest.raises(BadRequest, match=f"text_input is {t.max_bytes + 1} bytes"):
        t.prompt(np.array([b"a" * (t.max_bytes + 1)], dtype=object))


def test_http_generate_matches_runtime(server, reference, tokenizer):
    for p in PROMPTS[:3]:
        r = generate_remote(server.http_url, p, MAX_TOKENS, stream=False, protocol="http")
        assert r["token_ids"] == reference[p]
        assert r["text"] == tokenizer.decode(reference[p])
        assert r["engine_version"] == 1 and r["finish_reason"] in ("length", "stop")


def test_http_generate_endpoint_raw(server, reference, tokenizer):
    """Plain JSON as tensorrtllm_backend's README sends it; streamed as server-sent events."""
    p = PROMPTS[0]
    body = json.dumps({"text_input": p, "max_tokens": MAX_TOKENS}).encode()
    with urllib.request.urlopen(
        urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate", data=body), timeout=60
    ) as r:
        d = json.loads(r.read())
    assert d["text_output"] == tokenizer.decode(reference[p])
    assert 0.0 <= d["acceptance_rate"] <= 1.0 and d["total_draft_tokens"] >= d["total_accepted_draft_tokens"]
    s = generate_remote(server.http_url, p, MAX_TOKENS, stream=True, protocol="http")
    assert s["responses"] > 1 and s["text"] == d["text_output"] and s["token_ids"] == reference[p]


def test_grpc_streaming_is_incremental_and_matches(server, reference, tokenizer):
    for p in PROMPTS[:4]:
        pieces, times = [], []
        r = generate_remote(
            server.grpc_url,
            p,
            MAX_TOKENS,
            stream=True,
            on_text=lambda t: (pieces.append(t), times.append(time.perf_counter())),
        )
        whole = generate_remote(server.grpc_url, p, MAX_TOKENS, stream=False)
        assert r["token_ids"] == whole["token_ids"] == reference[p]
        assert "".join(pieces) == r["text"] == whole["text"] == tokenizer.decode(reference[p])
        assert whole["responses"] == 1 and r["responses"] > 1 and r["out_of_order"] == 0
        assert r["ttft_s"] < r["latency_s"] and times[0] < times[-1]  # text arrived in pieces, over time
        assert r["verifier_steps"] >= 1 and r["tokens_per_step"] >= 1.0 and r["total_draft_tokens"] > 0


def stream_request(url, model, inputs: dict, outputs=None, request_id="") -> list:
    """One gRPC stream carrying one request of numpy `inputs` to `model`, as tensorrtllm_backend's clients send
    it; the responses in arrival order, or RemoteError with the server's error."""
    import queue as q

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for k, v in inputs.items():
        t = grpcclient.InferInput(k, list(v.shape), np_to_triton_dtype(v.dtype))
        t.set_data_from_numpy(v)
        tensors.append(t)
    done: q.Queue = q.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: done.put(error or result))
    client.async_stream_infer(
        model,
        tensors,
        request_id=request_id,
        outputs=[grpcclient.InferRequestedOutput(o) for o in outputs] if outputs else None,
    )
    client.stop_stream()  # waits for the server to end the stream
    client.close()
    out = []
    while not done.empty():
        r = done.get()
        if isinstance(r, Exception):
            raise RemoteError(str(r))
        out.append(r)
    return out


def backend_client_request(url, prompt, n, *, stream, exclude, **extra):
    """A request shaped as tensorrtllm_backend's end_to_end_grpc_client shapes it (its prepare_inputs: [1, 1]
    arrays, beam_width, exclude_input_in_output, num_return_sequences and pad_id/end_id as its flags send them; one
    gRPC stream; only text_output requested), temperature 0 for a greedy reference. Returns the text as that client
    assembles it (streamed pieces appended), or raises with the server's error."""
    inputs = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones([1, 1], np.int32) * n,
        "stream": np.array([[stream]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[0.0]], dtype=np.float32),
        "num_return_sequences": np.array([[1]], np.int32),
        "exclude_input_in_output": np.array([[exclude]], dtype=bool),
        "pad_id": np.array([[2]], np.int32),
        **extra,
    }
    text = ""
    for r in stream_request(url, "ensemble", inputs, outputs=["text_output"]):
        piece = r.as_numpy("text_output")
        if piece is not None:
            text = text + piece[0].decode() if stream else piece[0].decode()
    return text


def test_tensorrtllm_backend_client_requests(server, reference, tokenizer):
    """Its default inputs work (beam_width 1, pad_id, exclude_input_in_output false puts the prompt before a
    non-streamed output, as TensorRT-LLM does); what bpcompile cannot do is refused by name, per request."""
    url = server.grpc_url
    for p in PROMPTS[:2]:
        want = tokenizer.decode(reference[p])
        assert backend_client_request(url, p, MAX_TOKENS, stream=False, exclude=False) == p + want
        assert backend_client_request(url, p, MAX_TOKENS, stream=False, exclude=True) == want
        assert backend_client_request(url, p, MAX_TOKENS, stream=True, exclude=False) == want
    refused = {
        "beam_width": np.array([[2]], np.int32),
        "prompt_vocab_size": np.array([[5]], np.int32),
        "lora_task_id": np.array([[7]], np.uint64),
    }
    for name, value in refused.items():
        with pytest.raises(RemoteError, match=name):
            backend_client_request(url, PROMPTS[0], 4, stream=False, exclude=True, **{name: value})
    assert generate_remote(url, PROMPTS[0], MAX_TOKENS)["token_ids"] == reference[PROMPTS[0]]  # still serving


def inflight_client_request(url, ids, n, *, stream, raw=False, **extra):
    """A request shaped as tensorrtllm_backend's inflight_batcher_llm_client.py shapes it: to the model named
    tensorrt_llm, its prepare_inputs' ten default inputs as [1, N] / [1, 1] arrays (temperature 1.0 and top-k 1 as
    its flags default, end_id -1 = none, pad_id 50256) and exclude_input_in_output true (its
    --exclude-input-in-output; exclude_input_in_output=None sends none), all outputs. Returns its callback's view:
    per response output_ids[0][0] and sequence_length[0][0]."""
    extra.setdefault("exclude_input_in_output", np.array([[True]]))
    inputs = {
        "input_ids": np.array([ids], np.int32),
        "input_lengths": np.array([[len(ids)]], np.int32),
        "request_output_len": np.array([[n]], np.int32),
        "beam_width": np.array([[1]], np.int32),
        "temperature": np.array([[1.0]], np.float32),
        "streaming": np.array([[stream]], dtype=bool),
        "end_id": np.array([[-1]], np.int32),
        "pad_id": np.array([[50256]], np.int32),
        "runtime_top_k": np.array([[1]], np.int32),
        "runtime_top_p": np.array([[0.0]], np.float32),
        **{k: v for k, v in extra.items() if v is not None},
    }
    responses = stream_request(url, "tensorrt_llm", inputs, request_id="1")
    if raw:
        return responses
    out = []
    for r in responses:
        ids_, lens = r.as_numpy("output_ids"), r.as_numpy("sequence_length")
        assert ids_.shape[:2] == (1, 1) and lens.shape == (1, 1) and r.as_numpy("batch_index")[0][0] == 0
        if "return_log_probs" in extra:
            out.append(
                (list(ids_[0][0]), list(r.as_numpy("output_log_probs")[0][0]), float(r.as_numpy("cum_log_probs")[0][0]))
            )
        else:
            out.append((list(ids_[0][0]), int(lens[0][0])))
    return out


def test_inflight_batcher_llm_client_requests(server, tokenizer):
    """tensorrtllm_backend's own low-level client talks token ids to `tensorrt_llm`: non-streamed, one response
    with the prompt then the generated tokens (exclude_input_in_output false, or not sent: the backend's default)
    or the generated ones only;
    streamed, the generated tokens over several responses. top-k 1 = the runtime's greedy output. Log probs on
    request (return_log_probs)."""
    from bpcompile.runtime.generator import Generator, SamplingParams

    gen = Generator.from_engine(server.engines[1])
    prompts = [tokenizer.encode(p).ids for p in PROMPTS[:3]]
    want_tokens = [t for t, _ in gen.generate(prompts, SamplingParams(max_tokens=16))]
    for ids, w in zip(prompts, want_tokens):
        ((got, n),) = inflight_client_request(server.grpc_url, ids, 16, stream=False)
        assert got == w and n == 16
        for flag in (np.array([[False]]), None):
            ((got, n),) = inflight_client_request(server.grpc_url, ids, 16, stream=False, exclude_input_in_output=flag)
            assert got == ids + w and n == len(ids) + 16
        parts = inflight_client_request(server.grpc_url, ids, 16, stream=True)
        assert len(parts) > 1 and [t for p, _ in parts for t in p] == w and all(len(p) == k for p, k in parts)
    w0 = want_tokens[0]
    # return_log_probs: the runtime's log probability of each generated token (tests/test_runtime.py checks those
    # against transformers), per response, and their running sum
    ref = Generator.from_engine(server.engines[1])
    rid = ref.add_request(prompts[0], SamplingParams(max_tokens=16, logprobs=True))
    want = []
    while ref.has_work():
        want += [lp for o in ref.step() if o.request_id == rid for lp in o.logprobs]
    # (greedy: the client's default top-k 1 makes every token's probability 1 under the distribution it samples)
    flag = {"return_log_probs": np.array([[True]]), "temperature": np.array([[0.0]], np.float32)}
    ((got, lps, cum),) = inflight_client_request(server.grpc_url, prompts[0], 16, stream=False, **flag)
    # (to float32 rounding: see the logits below)
    assert got == w0 and len(lps) == 16 and np.allclose(lps, want, atol=1e-4)
    assert abs(cum - sum(want)) < 1e-3
    parts = inflight_client_request(server.grpc_url, prompts[0], 16, stream=True, **flag)
    assert np.allclose([x for _, p, _ in parts for x in p], want, atol=1e-4) and abs(parts[-1][2] - sum(want)) < 1e-3
    # return_context_logits / return_generation_logits: the verifier's logits over the prompt (first response) and
    # for each generated token, [batch, prompt, vocab] and [batch, beam, tokens, vocab]
    ref = Generator.from_engine(server.engines[1])
    rid = ref.add_request(prompts[1], SamplingParams(max_tokens=8, context_logits=True, generation_logits=True))
    ctx, rows = None, []
    while ref.has_work():
        for o in ref.step():
            ctx = o.context_logits if o.context_logits is not None else ctx
            rows += [o.generation_logits] if o.new_tokens else []
    results = inflight_client_request(
        server.grpc_url,
        prompts[1],
        8,
        stream=False,
        raw=True,
        return_context_logits=np.array([[True]]),
        return_generation_logits=np.array([[True]]),
    )
    c, g = results[0].as_numpy("context_logits"), results[0].as_numpy("generation_logits")
    assert c.shape == (1, len(prompts[1]), ctx.shape[1]) and g.shape == (1, 1, 8, ctx.shape[1])
    # to float32 rounding: a step may multiply a token's row alone (the plain layout on CPU) or with a tree's rows
    # (the packed one), and which depends on the server's back-off state
    assert np.allclose(c[0], ctx.numpy(), atol=1e-4) and np.allclose(
        g[0, 0], np.concatenate(rows), rtol=1e-4, atol=1e-3
    )
    # penalties and min_tokens: what the runtime does with them (tests/test_runtime.py checks the runtime's
    # repetition penalty against transformers' generate)
    pen = dict(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1)
    ref = Generator.from_engine(server.engines[1])
    ((want_pen, _),) = ref.generate([prompts[2]], SamplingParams(max_tokens=16, **pen))
    ((got, n),) = inflight_client_request(
        server.grpc_url,
        prompts[2],
        16,
        stream=False,
        temperature=np.array([[0.0]], np.float32),
        **{k: np.array([[v]], np.float32) for k, v in pen.items()},
    )
    assert got == want_pen != want_tokens[2]
    # return_perf_metrics: the request's KV blocks (its whole reservation, none reused) and its timestamps in order
    (r,) = inflight_client_request(
        server.grpc_url, prompts[0], 8, stream=False, raw=True, return_perf_metrics=np.array([[True]])
    )
    m = {
        k: int(r.as_numpy(k)[0][0])
        for k in (
            "kv_cache_alloc_new_blocks",
            "kv_cache_reused_blocks",
            "kv_cache_alloc_total_blocks",
            "arrival_time_ns",
            "first_scheduled_time_ns",
            "first_token_time_ns",
            "last_token_time_ns",
        )
    }
    assert m["kv_cache_alloc_total_blocks"] == m["kv_cache_alloc_new_blocks"] >= -(-(len(prompts[0]) + 8) // 16)
    assert m["kv_cache_reused_blocks"] == 0
    assert (
        0 < m["arrival_time_ns"] <= m["first_scheduled_time_ns"] <= m["first_token_time_ns"] <= m["last_token_time_ns"]
    )
    for name, value in {
        "draft_input_ids": np.array([[5, 6]], np.int32),
        "stop": np.array([[True]]),
        "runtime_top_p_decay": np.array([[0.5]], np.float32),
    }.items():
        with pytest.raises(RemoteError, match=name):
            inflight_client_request(server.grpc_url, prompts[0], 4, stream=False, **{name: value})


def test_backend_clients_sequences_batches_perf_and_logits(server, reference, tokenizer):
    """The requests end_to_end_grpc_client.py sends with -n 2, --batch-inputs and --return-perf-metrics, and
    inflight_batcher_llm_client.py with --streaming --return-context-logits: each sequence and each batch row is
    answered by responses that name it (sequence_index, batch_index), every response carries the perf outputs
    requested, and the last streamed response carries the context logits (the client keeps the last one's). The
    clients' default sampling inputs (temperature 1.0, no top_k / top_p) are greedy, as TensorRT-LLM makes them."""
    p0, p1 = PROMPTS[:2]
    want = {p: tokenizer.decode(reference[p]) for p in (p0, p1)}

    def texts(inputs, outputs):
        """The responses, and the text of each (batch_index, sequence_index) as the client assembles it."""
        got: dict = {}
        rs = stream_request(server.grpc_url, "ensemble", inputs, outputs=outputs)
        for r in rs:
            b = r.as_numpy("batch_index") if "batch_index" in outputs else None
            s = r.as_numpy("sequence_index") if "sequence_index" in outputs else None
            key = (0 if b is None else int(b[0][0]), 0 if s is None else int(s[0][0]))
            got[key] = got.get(key, "") + r.as_numpy("text_output")[0].decode()
        return rs, got

    base = {
        "max_tokens": np.array([[MAX_TOKENS]], np.int32),
        "stream": np.array([[True]]),
        "beam_width": np.array([[1]], np.int32),
        "temperature": np.array([[1.0]], np.float32),
    }
    # -n 2: two sequences, each greedy here (the client's default inputs)
    one = {"text_input": np.array([[p0]], dtype=object), "num_return_sequences": np.array([[2]], np.int32), **base}
    assert texts(one, ["text_output", "sequence_index"])[1] == {(0, 0): want[p0], (0, 1): want[p0]}
    # --batch-inputs: the client stacks its per-prompt inputs into one [2, 1] request
    batch = {k: np.concatenate([v, v]) for k, v in base.items()}
    batch["text_input"] = np.array([[p0], [p1]], dtype=object)
    assert texts(batch, ["text_output", "batch_index"])[1] == {(0, 0): want[p0], (1, 0): want[p1]}
    # --return-perf-metrics: the KV blocks, timestamps and speculation statistics in every response
    perf = ["kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns"]
    perf += ["first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate"]
    perf += ["total_accepted_draft_tokens", "total_draft_tokens"]
    req = {"text_input": np.array([[p0]], dtype=object), "return_perf_metrics": np.array([[True]]), **base}
    rs, got = texts(req, ["text_output"] + perf)
    assert len(rs) > 1 and got == {(0, 0): want[p0]}
    for r in rs:
        m = {k: r.as_numpy(k)[0][0] for k in perf}
        assert 0 < m["arrival_time_ns"] <= m["first_scheduled_time_ns"] <= m["first_token_time_ns"]
        assert m["kv_cache_alloc_total_blocks"] >= 1 and m["total_draft_tokens"] >= m["total_accepted_draft_tokens"]
    # --streaming --return-context-logits to tensorrt_llm: the last response's context logits are the prompt's
    ids = tokenizer.encode(p1).ids
    rs = inflight_client_request(
        server.grpc_url, ids, 8, stream=True, raw=True, return_context_logits=np.array([[True]])
    )
    first, last = rs[0].as_numpy("context_logits"), rs[-1].as_numpy("context_logits")
    assert len(rs) > 1 and first.shape[:2] == (1, len(ids)) and np.array_equal(first, last)


def test_stop_requests_and_sampling_defaults(server, tokenizer):
    """A stop request (inflight_batcher_llm_client.py --stop-after-ms without --stop-via-request-cancel: input_ids
    [1, 1], input_lengths 0, request_output_len 0, stop true) is refused as what it is. TensorRT-LLM's sampling
    setup: top_k 0 with top_p 0 (or neither sent) is greedy whatever the temperature; top_p 0 with top_k > 0 is
    top-k alone; top_p 1 with top_k 0 samples."""
    from bpcompile.runtime.generator import Generator, SamplingParams

    stop = {
        "input_ids": np.empty([1, 1], np.int32),
        "input_lengths": np.zeros([1, 1], np.int32),
        "request_output_len": np.array([[0]], np.int32),
        "stop": np.array([[True]]),
    }
    with pytest.raises(RemoteError, match="stop=true .* is not supported: cancel the request"):
        stream_request(server.grpc_url, "tensorrt_llm", stop)
    ids = tokenizer.encode(PROMPTS[3]).ids
    ((greedy, _),) = Generator.from_engine(server.engines[1]).generate([ids], SamplingParams(max_tokens=16))
    hot = {"temperature": np.array([[1.5]], np.float32)}
    bare = {  # neither top_k nor top_p
        "input_ids": np.array([ids], np.int32),
        "input_lengths": np.array([[len(ids)]], np.int32),
        "request_output_len": np.array([[16]], np.int32),
        **hot,
    }
    (r,) = stream_request(server.grpc_url, "tensorrt_llm", bare)
    assert list(r.as_numpy("output_ids")[0][0]) == ids + greedy  # exclude_input_in_output not sent: prompt first
    for k, p in ((0, 0.0), (1, 0.0)):
        extra = dict(hot, runtime_top_k=np.array([[k]], np.int32), runtime_top_p=np.array([[p]], np.float32))
        (r,) = inflight_client_request(server.grpc_url, ids, 16, stream=False, raw=True, **extra)
        assert list(r.as_numpy("output_ids")[0][0]) == greedy, (k, p)
    sampled = []
    for seed in range(4):
        extra = dict(hot, runtime_top_k=np.array([[0]], np.int32), runtime_top_p=np.array([[1.0]], np.float32))
        extra["seed"] = np.array([[seed]], np.uint64)
        (r,) = inflight_client_request(server.grpc_url, ids, 16, stream=False, raw=True, **extra)
        sampled.append(list(r.as_numpy("output_ids")[0][0]))
    assert any(s != greedy for s in sampled)


@pytest.fixture(scope="module")
def unary_server(engines, tmp_path_factory):
    """The same engine version in a repository emitted with triton.decoupled false."""
    repo = tmp_path_factory.mktemp("triton-unary") / "repo"
    emit_repository([(1, engines[1])], repo, decoupled=False)
    with ServerProcess(repo, log_file=repo.parent / "server.log", startup_timeout=240) as s:
        yield s


def test_unary_infer_against_a_non_decoupled_repository(unary_server, reference, tokenizer):
    """gRPC ModelInfer and HTTP /infer (tritonclient's infer: what inflight_batcher_llm_client.py does without
    --streaming, and perf_analyzer without --streaming) get one response with the whole result, from the ensemble
    (end_to_end_grpc_client.py's inputs: temperature 1.0, so greedy) and from tensorrt_llm (token ids); a request's
    batch rows and num_return_sequences come in that one response (as TensorRT-LLM answers beams: output_ids
    [rows, n, tokens] padded with -1, the texts row-major); streaming, and more sequences than max_batch_size, are
    refused by name."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    p = PROMPTS[0]
    ens = {
        "text_input": np.array([[p]], dtype=object),
        "max_tokens": np.array([[MAX_TOKENS]], np.int32),
        "temperature": np.array([[1.0]], np.float32),
    }
    ids = tokenizer.encode(p).ids
    gen = {
        "input_ids": np.array([ids], np.int32),
        "input_lengths": np.array([[len(ids)]], np.int32),
        "request_output_len": np.array([[MAX_TOKENS]], np.int32),
        "temperature": np.array([[1.0]], np.float32),
        "runtime_top_k": np.array([[1]], np.int32),
        "end_id": np.array([[tokenizer.token_to_id("</s>")]], np.int32),  # as the reference
    }
    for mod, url in ((grpcclient, unary_server.grpc_url), (httpclient, unary_server.http_url)):
        c = mod.InferenceServerClient(url)

        def infer(model, inputs):
            ts = []
            for k, v in inputs.items():
                t = mod.InferInput(k, list(v.shape), np_to_triton_dtype(v.dtype))
                t.set_data_from_numpy(v)
                ts.append(t)
            return c.infer(model, ts)

        # exclude_input_in_output not sent: the ensemble answers the generated text only, tensorrt_llm the prompt
        # then the generated tokens (the backend's default, which inflight_batcher_llm_client.py expects)
        assert infer("ensemble", ens).as_numpy("text_output")[0].decode() == tokenizer.decode(reference[p])
        r = infer("tensorrt_llm", gen)
        assert list(r.as_numpy("output_ids")[0][0]) == ids + reference[p]
        assert r.as_numpy("sequence_length")[0][0] == len(ids) + len(reference[p])
        full = tokenizer.decode(ids + reference[p])
        assert (
            infer("ensemble", dict(ens, exclude_input_in_output=np.array([[False]])))
            .as_numpy("text_output")[0]
            .decode()
            == full
        )
        with pytest.raises(InferenceServerException, match="streaming needs a decoupled repository"):
            infer("ensemble", dict(ens, stream=np.array([[True]])))
        # several sequences: -n 2 (greedy, so both are the reference), --batch-inputs, and both at once
        r = infer("ensemble", dict(ens, num_return_sequences=np.array([[2]], np.int32)))
        assert [t.decode() for t in r.as_numpy("text_output")] == [tokenizer.decode(reference[p])] * 2
        q = PROMPTS[1]
        two = {
            "text_input": np.array([[p], [q]], dtype=object),
            "max_tokens": np.array([[MAX_TOKENS]] * 2, np.int32),
            "temperature": np.array([[1.0]] * 2, np.float32),
        }
        r = infer("ensemble", two)
        assert [t.decode() for t in r.as_numpy("text_output")] == [tokenizer.decode(reference[x]) for x in (p, q)]
        assert r.as_numpy("batch_index").tolist() == [[0], [1]]
        qi = tokenizer.encode(q).ids
        width = max(len(ids), len(qi))
        rows = {
            "input_ids": np.array([x + [0] * (width - len(x)) for x in (ids, qi)], np.int32),
            "input_lengths": np.array([[len(ids)], [len(qi)]], np.int32),
            "request_output_len": np.array([[MAX_TOKENS]] * 2, np.int32),
            "runtime_top_k": np.array([[1]] * 2, np.int32),
            "num_return_sequences": np.array([[2]] * 2, np.int32),
            "exclude_input_in_output": np.array([[True]] * 2),
        }
        r = infer("tensorrt_llm", rows)
        out, lens = r.as_numpy("output_ids"), r.as_numpy("sequence_length")
        longest = max(len(reference[p]), len(reference[q]))
        assert out.shape == (2, 2, longest) and lens.tolist() == [[len(reference[x])] * 2 for x in (p, q)]
        for i, x in enumerate((p, q)):
            assert out[i].tolist() == [reference[x] + [-1] * (longest - len(reference[x]))] * 2
        with pytest.raises(InferenceServerException, match="asks for 18 sequences.*at most 16"):
            infer("ensemble", dict(two, num_return_sequences=np.array([[9]] * 2, np.int32)))
        c.close()


def test_sixteen_concurrent_clients(server, reference):
    results, errors = {}, []

    def one(p):
        try:
            results[p] = generate_remote(server.grpc_url, p, MAX_TOKENS, stream=True)
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 16
    for p in PROMPTS:
        assert results[p]["token_ids"] == reference[p], p
        assert results[p]["out_of_order"] == 0


def _grpc_raw(server, inputs, model="ensemble"):
    """Send raw tensors [(name, array, triton dtype)] over a stream; return the error text (or None)."""
    import tritonclient.grpc as g

    c = _grpc_client(server.grpc_url)
    try:
        ins = []
        for name, arr, dt in inputs:
            t = g.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            ins.append(t)
        c.async_stream_infer(model, ins, request_id="bad", enable_empty_final_response=True)
        while True:
            result, error = c._bp_queue.get(timeout=60)
            if error is not None:
                return str(error)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return None
    finally:
        c.stop_stream()
        c.close()


def test_malformed_requests_get_clear_errors(server):
    text = lambda s: ("text_input", np.array([[s]], dtype=object), "BYTES")  # noqa: E731
    cases = {
        "missing text_input": ([("max_tokens", np.array([[4]], dtype=np.int32), "INT32")], "text_input"),
        "max_tokens 0": (
            [text(b"hi"), ("max_tokens", np.array([[0]], dtype=np.int32), "INT32")],
            "max_tokens must be > 0",
        ),
        "max_tokens too big": (
            [text(b"hi"), ("max_tokens", np.array([[100000]], dtype=np.int32), "INT32")],
            "above this engine's limit",
        ),
        "wrong dtype": (
            [text(b"hi"), ("max_tokens", np.array([[4.0]], dtype=np.float32), "FP32")],
            "data-type is 'FP32'",
        ),
        "empty prompt": ([text(b"   "), ("max_tokens", np.array([[4]], dtype=np.int32), "INT32")], "empty"),
        "invalid utf-8": (
            [text(b"\xff\xfe\xfa"), ("max_tokens", np.array([[4]], dtype=np.int32), "INT32")],
            "not valid UTF-8",
        ),
        "bad_words": ([text(b"hi"), ("bad_words", np.array([[b"foo"]], dtype=object), "BYTES")], "bad_words"),
        "top_p 1.5": ([text(b"hi"), ("top_p", np.array([[1.5]], dtype=np.float32), "FP32")], "top_p"),
        "top_p nan": (
            [text(b"hi"), ("top_p", np.array([[np.nan]], dtype=np.float32), "FP32")],
            "top_p must be in [0, 1]",
        ),
        **{
            f"temperature {v}": (
                [text(b"hi"), ("temperature", np.array([[v]], dtype=np.float32), "FP32")],
                "temperature must be a finite number >= 0",
            )
            for v in (np.nan, np.inf, -1.0)
        },
        "stop_words not UTF-8": (
            [text(b"hi"), ("stop_words", np.array([[b"ok", b"\xff\xfeend"]], dtype=object), "BYTES")],
            "stop_words is not valid UTF-8",
        ),
        "10 MB prompt": (
            [text(b"word " * (2 << 20)), ("max_tokens", np.array([[4]], dtype=np.int32), "INT32")],
            "text_input is 10485760 bytes, more than this engine can take",
        ),
    }
    for model in ("ensemble", "tensorrt_llm"):  # the generator takes the ensemble's requests too
        for what, (inputs, expect) in cases.items():
            t0 = time.monotonic()
            err = _grpc_raw(server, inputs, model)
            assert err is not None and expect in err, (model, what, err)
            # refused without reading it whole: no tokenizing; and no server path or traceback in what clients see
            assert time.monotonic() - t0 < 10, (model, what)
            assert str(server.repo.parent) not in err and "Traceback" not in err and ".py" not in err, err
    with pytest.raises(RemoteError, match="max_tokens must be > 0"):
        generate_remote(server.http_url, "hi", 0, stream=False, protocol="http")
    assert server.healthy()
    assert generate_remote(server.grpc_url, PROMPTS[0], 4)["tokens"] == 4  # still serving


def test_cancellation_stops_generation(server):
    """Cancelled on the gRPC stream, the generator drops the request from its batch. Sent to the generator model
    directly: tritonserver 2.51 propagates an ensemble's cancellation only between steps (core PR #263), never
    into a step that is already running, so a request cancelled at the ensemble runs to its end (documented)."""
    import tritonclient.grpc as g

    c = _grpc_client(server.grpc_url)
    ins = []
    for name, arr, dt in [
        ("input_ids", np.array([[1, 500, 600]], dtype=np.int32), "INT32"),
        ("input_lengths", np.array([[3]], dtype=np.int32), "INT32"),
        ("request_output_len", np.array([[500]], dtype=np.int32), "INT32"),
        ("streaming", np.array([[True]]), "BOOL"),
    ]:
        t = g.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        ins.append(t)
    c.async_stream_infer("tensorrt_llm", ins, request_id="to-cancel", enable_empty_final_response=True)
    result, error = c._bp_queue.get(timeout=60)
    assert error is None
    c.stop_stream(cancel_requests=True)
    c.close()
    deadline, found = time.monotonic() + 20, None
    while time.monotonic() < deadline and not found:
        found = [line for line in server.log_file.read_text().splitlines() if "generator: cancelled request" in line]
        time.sleep(0.2)
    assert found, server.log_tail()
    n = int(found[-1].rsplit(" after ", 1)[1].split()[0])
    assert n < 500  # stopped early
    assert server.healthy() and generate_remote(server.grpc_url, PROMPTS[1], 4)["tokens"] == 4


def test_generator_takes_the_ensemble_request(server, reference, tokenizer):
    """The ensemble's request sent to the generator itself (what streaming clients should do: there, their
    cancellation and disconnects reach the generation loop): same inputs, same outputs, same tokens and text."""
    for p in PROMPTS[:3]:
        for stream in (True, False):
            r = generate_remote(server.grpc_url, p, MAX_TOKENS, stream=stream, model="tensorrt_llm")
            assert r["token_ids"] == reference[p] and r["text"] == tokenizer.decode(reference[p]), (p, stream)
            assert r["out_of_order"] == 0 and r["engine_version"] == 1 and r["finish_reason"] in ("length", "stop")
            assert (r["responses"] > 1) == stream and r["total_draft_tokens"] > 0
    h = generate_remote(server.http_url, PROMPTS[2], MAX_TOKENS, stream=True, protocol="http", model="tensorrt_llm")
    assert h["token_ids"] == reference[PROMPTS[2]] and h["text"] == tokenizer.decode(reference[PROMPTS[2]])


def test_input_lengths_and_word_list_offsets(server, tokenizer):
    """tensorrtllm_backend's semantics: only the first input_lengths ids of input_ids are the prompt (the rest is
    padding), so a padded prompt generates what the unpadded one does. A stop_words_list ([1, 2, L]: ids, then end
    offsets padded with -1) whose offsets point past its ids, go down or follow the padding is refused by name
    instead of being sliced into other words."""
    url, ids = server.grpc_url, tokenizer.encode(PROMPTS[1]).ids
    padded = ids + [0, 0, 0]
    ((want, _),) = inflight_client_request(url, ids, 12, stream=False)
    ((got, _),) = inflight_client_request(url, padded, 12, stream=False)  # input_lengths covers the padding
    assert got != want  # so the padding would change the output if it were read as prompt
    ((got, _),) = inflight_client_request(url, padded, 12, stream=False, input_lengths=np.array([[len(ids)]], np.int32))
    assert got == want

    def error(**over):
        base = {"input_ids": [padded], "input_lengths": [[len(ids)]], "request_output_len": [[4]]}
        return _grpc_raw(
            server, [(k, np.array(v, np.int32), "INT32") for k, v in {**base, **over}.items()], "tensorrt_llm"
        )

    assert "input_lengths 7 is outside [1, 6]" in error(input_ids=[[1, 450, 300, 0, 0, 0]], input_lengths=[[7]])
    assert "input_lengths 0 is outside" in error(input_lengths=[[0]])
    a, b, c = ids[:3]
    bad = {
        "end offset 5 (word 0) is beyond the 2 token ids": [[[a, b], [5, -1]]],
        "end offset 1 (word 1) is below the previous one (2)": [[[a, b, c], [2, 1, -1]]],
        "end offset 3 (word 2) follows the -1 padding": [[[a, b, c], [1, -1, 3]]],
    }
    for why, words in bad.items():
        assert f"stop_words_list: {why}" in (error(stop_words_list=words) or ""), why
    assert error(stop_words_list=[[[a, b, c], [1, 3, -1]]]) is None  # a well-formed one is taken
    assert server.healthy()


def _stub_regions(server) -> list[tuple[int, str]]:
    """(stub pid, shared-memory region name) of each model stub: tritonserver's children, whose third argument
    names their region."""
    out = []
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"triton_python_backend_stub" in argv[0]:
                out.append((int(pid), argv[2].decode()))
    return out


def test_restricted_apis_and_private_shared_memory(server):
    """A client without the token cannot register a model stub's shared-memory region as an output buffer and
    have preprocessing write into it (which made tritonserver abort), nor read or change logging, trace or
    statistics (HTTP 403, gRPC refused); with the token's header it can. The stubs' regions, which hold every
    request's tensors, are mode 0600 in a /dev/shm only tritonserver's processes see: another user reads none.
    The server keeps serving throughout."""
    import os
    import stat
    import subprocess
    import urllib.error

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from bpcompile.serving.protocol import REPOSITORY_HEADER

    regions = _stub_regions(server)
    assert len(regions) == 3, regions  # preprocessing, tensorrt_llm, postprocessing

    def http(path, body=None, token=None):
        req = urllib.request.Request(
            f"http://{server.http_url}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={REPOSITORY_HEADER: token} if token else {},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    pid, name = regions[0]
    code, body = http("/v2/systemsharedmemory/region/stub/register", {"key": name, "offset": 0, "byte_size": 1 << 20})
    assert code == 403 and REPOSITORY_HEADER in body, (code, body)
    infer = {
        "inputs": [
            {"name": "QUERY", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]},
            {"name": "REQUEST_OUTPUT_LEN", "shape": [1, 1], "datatype": "INT32", "data": [4]},
        ],
        "outputs": [
            {"name": "INPUT_ID", "parameters": {"shared_memory_region": "stub", "shared_memory_byte_size": 64}}
        ],
    }
    code, body = http("/v2/models/preprocessing/infer", infer)
    assert code == 404 and "unable to find shared memory region: 'stub'" in body.lower(), (code, body)  # none taken
    for path, post in [
        ("/v2/systemsharedmemory/status", None),
        ("/v2/logging", None),
        ("/v2/logging", {"log_verbose_level": 1}),
        ("/v2/trace/setting", None),
        ("/v2/models/stats", None),
    ]:
        assert http(path, post)[0] == 403, path
        assert http(path, post, token="x" * 32)[0] == 403, path
    assert http("/v2/logging", token=server.repository_token)[0] == 200  # the restriction is the token
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for call in (
            lambda: c.register_system_shared_memory("stub", name, 1 << 20),
            lambda: c.update_log_settings({"log_verbose_level": 1}),
            lambda: c.get_inference_statistics(),
        ):
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
    finally:
        c.close()

    for pid, name in regions:
        path = Path(f"/proc/{pid}/root/dev/shm/{name}")  # the region as the stub sees it
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    if os.geteuid() == 0:  # as another user: neither the real /dev/shm nor the stub's holds a readable region
        for pid, name in regions:
            for p in (f"/dev/shm/{name}", f"/proc/{pid}/root/dev/shm/{name}"):
                r = subprocess.run(["cat", p], capture_output=True, user=65534, group=65534, extra_groups=[])
                assert r.returncode != 0 and not r.stdout, p
    assert _stub_regions(server) == regions  # no stub died
    assert server.healthy() and generate_remote(server.grpc_url, PROMPTS[0], 4)["tokens"] == 4


def _scrape(server) -> dict:
    """tritonserver's /metrics as {(name, frozenset of labels without model/version): value}, read with
    prometheus_client's parser; only the generating model's series."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("model") == "tensorrt_llm":
                labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("model", "version"))
                out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def _m(scrape, name, **labels) -> float:
    return scrape.get((name, frozenset(labels.items())), float("nan"))


def test_tensorrt_llm_metrics_match_a_known_run(server, tokenizer):
    """The nv_trt_llm_* families (tensorrtllm_backend's names and labels) and the token counters and latency
    histograms on tritonserver's metrics port, against a run whose numbers the client knows: N requests, their
    prompt lengths (the engine's tokenizer) and the tokens each got; then 20 requests on a batch of 16."""
    engine = json.loads((server.engines[1] / "engine.json").read_text())
    batch, page = engine["limits"]["max_batch_size"], engine["kv_cache"]["page_size"]
    before = _scrape(server)
    assert _m(before, "nv_trt_llm_request_metrics", request_type="max") == batch
    assert _m(before, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per") == page
    prompts = PROMPTS[:5]
    runs = [generate_remote(server.grpc_url, p, 6 + i, end_id=-1) for i, p in enumerate(prompts)]  # no early end
    n, tokens = len(runs), sum(r["tokens"] for r in runs)
    prompt_tokens = sum(len(tokenizer.encode(p).ids) for p in prompts)
    assert tokens == sum(6 + i for i in range(n))

    def delta(after, name, **labels):
        return _m(after, name, **labels) - _m(before, name, **labels)

    out_len, in_len = {"response_metric_type": "total_output_tokens"}, {"response_metric_type": "total_input_tokens"}
    deadline = time.monotonic() + 30
    while delta(after := _scrape(server), "nv_llm_output_token_len_count", **out_len) < n:
        assert time.monotonic() < deadline, "the finished requests never reached the metrics"
        time.sleep(0.1)
    assert delta(after, "nv_llm_output_token_len_count", **out_len) == n
    assert delta(after, "nv_llm_output_token_len_sum", **out_len) == tokens
    assert delta(after, "nv_llm_input_token_len_sum", **in_len) == prompt_tokens
    buckets = {float(dict(k[1])["le"]): k for k in after if k[0] == "nv_llm_output_token_len_bucket"}
    assert after[buckets[5.0]] - before[buckets[5.0]] == 0  # 6..10 tokens each
    assert after[buckets[10.0]] - before[buckets[10.0]] == n
    assert delta(after, "bpcompile_generator_generation_tokens_total") == tokens
    assert delta(after, "bpcompile_generator_prompt_tokens_total") == prompt_tokens
    for h in ("time_to_first_token", "inter_token_latency", "request_latency"):
        assert delta(after, f"bpcompile_generator_{h}_seconds_count") == n, h
    # the server's view is inside the client's: each request's server latency <= what the client waited
    assert 0 < delta(after, "bpcompile_generator_time_to_first_token_seconds_sum") <= sum(r["ttft_s"] for r in runs)
    assert 0 < delta(after, "bpcompile_generator_request_latency_seconds_sum") <= sum(r["latency_s"] for r in runs)
    # one after the other, each at least a prefill and a step (a step commits at most nodes + 1 = 6 tokens)
    assert delta(after, "nv_trt_llm_general_metrics", general_type="iteration_counter") >= 2 * n
    idle = {"active": 0, "scheduled": 0, "waiting": 0, "context": 0, "max": batch}
    for kind, v in idle.items():
        assert _m(after, "nv_trt_llm_request_metrics", request_type=kind) == v, kind
    kv = {k: _m(after, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type=k) for k in ("max", "free", "used")}
    assert kv["used"] == 0 and kv["free"] == kv["max"] > 0
    assert _m(after, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="fraction") == 0
    assert _m(after, "nv_trt_llm_runtime_memory_metrics", memory_type="cpu") > 10e6

    # 20 long requests on a batch of 16: 16 scheduled, 4 waiting, pages in use, while they run
    results, errors = [], []

    def one(i):
        try:
            results.append(generate_remote(server.grpc_url, PROMPTS[i % 16], 80, end_id=-1))
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    seen, deadline = None, time.monotonic() + 60
    while seen is None and time.monotonic() < deadline and not errors:
        m = _scrape(server)
        req = {k: _m(m, "nv_trt_llm_request_metrics", request_type=k) for k in ("active", "scheduled", "waiting")}
        if req == {"active": 20, "scheduled": batch, "waiting": 20 - batch}:
            seen = m
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert not errors and len(results) == 20, errors
    assert seen is not None, "never saw 20 active requests, 16 scheduled and 4 waiting"
    used = _m(seen, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used")
    assert used >= batch  # every running request holds at least its prompt's page
    fraction = _m(seen, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="fraction")
    assert fraction == pytest.approx(used / _m(seen, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max"))


def test_bench_remote_reports(server):
    from click.testing import CliRunner

    from bpcompile.cli import main

    r = bench_remote(server.grpc_url, PROMPTS[:4], n=4, concurrency=2, max_tokens=8, warmup=0)
    assert r["requests"] == 4 and r["errors"] == 0 and r["output_tokens"] == 32
    assert r["ttft_s"]["p50"] > 0 and r["latency_s"]["p99"] >= r["latency_s"]["p50"]
    assert r["tokens_per_step"] >= 1.0 and r["output_tokens_per_s"] > 0
    # genai-perf's metrics: a request's first token, then 7 gaps of the inter-token latency, end within its latency
    ttft, itl, lat = (r[k]["avg"] for k in ("time_to_first_token_s", "inter_token_latency_s", "request_latency_s"))
    assert 0 < ttft and 0 < itl and ttft + 7 * itl <= lat
    assert 0 < r["time_to_second_token_s"]["avg"] <= lat - ttft
    assert r["output_token_throughput_per_user"]["p50"] > 0 and r["request_throughput"] > 0
    json.dumps(r)
    res = CliRunner().invoke(main, ["bench", "--url", server.grpc_url, "-n", "2", "--max-tokens", "4"])
    assert res.exit_code == 0, res.output
    for row in (
        "Time to first token (ms)",
        "Time to second token (ms)",
        "Inter token latency (ms)",
        "Request latency (ms)",
        "Output token throughput per user (tokens/s)",
    ):
        assert len(re.search(rf"^{re.escape(row)}(.*)$", res.output, re.M).group(1).split()) == 4, res.output
    assert re.search(r"^Output token throughput \(tokens/s\): \d", res.output, re.M), res.output
    assert re.search(r"^Request throughput \(requests/s\): \d", res.output, re.M), res.output


def test_new_version_is_picked_up_old_answers_until_unloaded(server, engines, reference):
    """Runs last: it changes what the module's server serves."""
    url, p, tok = server.http_url, PROMPTS[0], server.repository_token
    add_version(server.repo, 2, engines[2])
    assert generate_remote(server.grpc_url, p, 4)["engine_version"] == 1  # publishing disturbs nothing

    inflight, during = {}, []
    t = threading.Thread(target=lambda: inflight.update(generate_remote(server.grpc_url, p, 200, stream=True)))
    t.start()
    loader = threading.Thread(target=lambda: load_version(url, token=tok))
    loader.start()  # policy 'latest': version 2 loads while version 1 serves; then version 1 unloads
    while loader.is_alive():
        during.append(generate_remote(server.grpc_url, p, 4)["engine_version"])
    loader.join()
    t.join(120)
    new = generate_remote(server.grpc_url, p, MAX_TOKENS)
    assert during and during[0] == 1 and set(during) <= {1, 2}  # the old version answered while v2 loaded
    assert new["engine_version"] == 2 and new["token_ids"] == reference[p]  # same weights in both versions
    assert inflight["engine_version"] == 1 and inflight["finish_reason"] in ("length", "stop")
    idx = {(m["name"], m["version"]): m["state"] for m in repository_index(url, token=tok)}
    assert idx[("tensorrt_llm", "2")] == "READY" and idx.get(("tensorrt_llm", "1")) != "READY"

    set_version_policy(server.repo, {"specific": [1]})  # rollback
    load_version(url, token=tok)
    assert generate_remote(server.grpc_url, p, 4)["engine_version"] == 1

    unload_model(url, "ensemble", token=tok)
    with pytest.raises(RemoteError):
        generate_remote(server.grpc_url, p, 4)
    load_model(url, "ensemble", token=tok)
    assert generate_remote(server.grpc_url, p, 4)["tokens"] == 4
