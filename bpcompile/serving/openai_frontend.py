"""An OpenAI-compatible HTTP endpoint in front of a running tritonserver: `GET /v1/models`, `POST /v1/completions`
and `POST /v1/chat/completions`, streamed (server-sent events) or not, with `usage`; `GET /health` and
`GET /metrics` (Prometheus text) on the same port.

The HTTP side is Starlette on uvicorn (asyncio; an idle or slow connection costs a coroutine, not a thread) with
pydantic models for the request bodies. Its limits, in the order a request meets them: a listen backlog of
BACKLOG; a connection that has not sent its request headers within HEADER_TIMEOUT s is closed; a body whose
Content-Length is over max_body is refused (413) before a byte of it is read, one that streams past it (chunked)
as soon as it does, and one that takes longer than BODY_TIMEOUT s to arrive gets 408; prompt and message sizes are
checked on their bytes before the chat template renders them or the tokenizer reads them.

Each choice of a request is one streamed gRPC request to the repository's generating model (`tensorrt_llm`, its
text interface: the ensemble's inputs and outputs), not to the ensemble: tritonserver passes a stream's
cancellation only to the model it was sent to, so when the HTTP client goes away the gRPC stream is cancelled and
the generator drops the request at its next step. The model lives once (in tritonserver), and OpenAI clients
share its in-flight batch with every other client. Chat messages go through the engine tokenizer's chat template
(transformers renders it, as `bpcompile generate` does). `stop` strings are sent as stop words and also cut from
the text, as the OpenAI API returns it (a stop string need not fall on token boundaries).

Sampling as the OpenAI API defines it: `n` choices (choice i seeded with seed + i), `seed`, `presence_penalty` /
`frequency_penalty` over the generated tokens only, subtracted from the logits before temperature (the
generator's `penalties_over_output`; TensorRT-LLM's own penalties cover the prompt too and act after temperature),
and `logprobs` / `top_logprobs`: log-softmax of the verifier's logits each token was chosen from (after the
penalties, before temperature, top-p), computed here from the generator's generation_logits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bpcompile.core.engine import EngineConfig
from bpcompile.core.errors import MissingDependency, UserError
from bpcompile.serving.protocol import BadRequest, TextInterface

try:
    import uvicorn
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ImportError as e:  # pragma: no cover - the [serve] extra
    raise MissingDependency(
        "the OpenAI endpoint needs starlette, uvicorn and prometheus_client (pip install 'bpcompile[serve]')"
    ) from e

GENERATOR = "tensorrt_llm"
MAX_STOPS = 4  # as the OpenAI API
MAX_N = 16  # choices per request: each is a request in the generator's batch
MAX_TOP_LOGPROBS = 20  # as the OpenAI API (completions: 5)
BACKLOG = 2048  # the listen queue (the kernel caps it at net.core.somaxconn)
HEADER_TIMEOUT = 10.0  # s from connect to a complete request head
BODY_TIMEOUT = 30.0  # s for the whole body to arrive
KEEP_ALIVE = 5  # s an idle keep-alive connection stays open between requests
MAX_BODY = 8 << 20  # bytes: far above any prompt an engine takes (TextInterface refuses those on their bytes)
UINT64 = (1 << 64) - 1

# OpenAI API fields this endpoint cannot honour: refused when set to anything but a no-op
UNSUPPORTED = {
    "echo": (None, False),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        kind: str = "invalid_request_error",
        code: Optional[str] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return JSONResponse(self.body(), status_code=self.status)


# --- request bodies ---------------------------------------------------------------------------------------------


class _Body(BaseModel):
    # strict: "1" is not a number and 1.0 is not a count, as the OpenAI API answers; unknown fields are ignored
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: Optional[int] = Field(None, ge=1, le=1 << 30)
    temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    n: Optional[int] = Field(None, ge=1, le=MAX_N)
    stream: Optional[bool] = None
    stream_options: Optional[dict[str, Any]] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=0, le=(1 << 63) - 1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False)
    user: Optional[str] = None


class CompletionBody(_Body):
    prompt: Union[str, list[str]]
    logprobs: Optional[int] = Field(None, ge=0, le=5)


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[_TextPart]]


class ChatBody(_Body):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=1 << 30)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


def _validation_error(e: ValidationError) -> ApiError:
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    loc = ".".join(str(x) for x in err["loc"])
    if not loc:
        return ApiError(400, f"the body must be a JSON object ({err['msg']})")
    return ApiError(400, f"{loc}: {err['msg']}", str(err["loc"][0]))


def _utf8(text: str, what: str) -> bytes:
    """JSON can carry lone surrogates (\\ud800) that no UTF-8 encoder takes: the request's fault, not ours."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{what} is not valid Unicode ({e.reason} at character {e.start})", what) from None


# --- metrics ------------------------------------------------------------------------------------------------------


class _Metrics:
    """Prometheus series of this endpoint (GET /metrics); one registry per endpoint."""

    LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
    ITL = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)

    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "bpcompile_openai_"
        self.requests = Counter(
            p + "requests", "HTTP requests answered, by route and status", ["route", "status"], registry=r
        )
        self.running = Gauge(p + "requests_running", "completion requests being answered", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of answered completions", registry=r)
        self.cached_tokens = Counter(
            p + "cached_prompt_tokens", "prompt tokens taken from the KV prefix cache", registry=r
        )
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated (all choices)", registry=r)
        self.disconnects = Counter(p + "disconnects", "requests whose client went away before the end", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "request arrival to first token, per choice",
                              buckets=self.LATENCY, registry=r)  # fmt: skip
        self.itl = Histogram(p + "inter_token_latency_seconds", "time between generated tokens, per token",
                             buckets=self.ITL, registry=r)  # fmt: skip
        self.latency = Histogram(p + "request_latency_seconds", "request arrival to its last token",
                                 buckets=self.LATENCY, registry=r)  # fmt: skip


# --- the gRPC side ---------------------------------------------------------------------------------------------

_DTYPES = {
    "text_input": "BYTES",
    "stop_words": "BYTES",
    "max_tokens": "INT32",
    "stream": "BOOL",
    "temperature": "FP32",
    "top_p": "FP32",
    "presence_penalty": "FP32",
    "frequency_penalty": "FP32",
    "penalties_over_output": "BOOL",
    "return_generation_logits": "BOOL",
    "seed": "UINT64",
}
_NP = {"INT32": np.int32, "BOOL": np.bool_, "FP32": np.float32, "UINT64": np.uint64}


def _infer_request(rid: str, fields: dict):
    """The ModelInferRequest of one generation (each input [1, n], the text interface's shapes)."""
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=GENERATOR, id=rid)
    # the generator's last response carries the final flag; this makes tritonserver tell us which one it is
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, value in fields.items():
        dt = _DTYPES[name]
        vals = value if isinstance(value, list) else [value]
        inp = req.inputs.add(name=name, datatype=dt)
        inp.shape.extend([1, len(vals)])
        if dt == "BYTES":
            raw = b"".join(struct.pack("<I", len(b)) + b for b in (v.encode("utf-8") for v in vals))
        else:
            raw = np.array(vals, dtype=_NP[dt]).tobytes()
        req.raw_input_contents.append(raw)
    return req


class _Choice:
    """One choice's state: its text through the stop-string cutter, tokens, log probabilities, timings."""

    def __init__(self, index: int, stops: list[str], hold: bool):
        self.index = index
        self.stops, self.text, self.sent, self.hit = stops, "", 0, False
        self.hold = max((len(s) for s in stops), default=1) - 1 if hold else 0
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.offsets: list[int] = []  # where each token's text starts in self.text
        self.decoded = 0  # characters the tokens so far decode to
        self.finish: Optional[str] = None
        self.cached = self.version = 0

    def feed(self, piece: str, final: bool = False) -> str:
        """Text that can be emitted now: cut at the first stop string, holding back a tail that could begin one."""
        if self.hit:
            return ""
        self.text += piece
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, end = True, cut
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def emitted_tokens(self) -> int:
        """Tokens whose text starts inside what was emitted (a stop cut drops the rest)."""
        if not self.hit:
            return len(self.tokens)
        return sum(1 for o in self.offsets if o < self.sent) or min(1, len(self.tokens))


# --- the endpoint ------------------------------------------------------------------------------------------------


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection that sends no complete request head in HEADER_TIMEOUT s
    (uvicorn times out idle keep-alive connections, not slow first requests)."""

    header_timeout = HEADER_TIMEOUT

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout, self._no_request)

    def _no_request(self) -> None:
        if self.cycle is None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)


def _newest_engine(repo_dir: Path) -> Path:
    """The engine of the newest tensorrt_llm (generator) version in a repository (what the latest policy serves)."""
    gen = Path(repo_dir) / GENERATOR
    versions = (
        sorted((int(p.name) for p in gen.iterdir() if p.name.isdigit() and (p / "engine").is_dir()), reverse=True)
        if gen.is_dir()
        else []
    )
    if not versions:
        raise UserError(f"{repo_dir}: no tensorrt_llm model versions (emit a repository first)", file=str(repo_dir))
    return gen / str(versions[0]) / "engine"


class OpenAIFrontend:
    """The endpoint over a repository's newest engine version, talking to tritonserver at grpc_url. The port is
    bound here (an OSError names a port in use before anything starts); start() serves it from a thread."""

    def __init__(
        self,
        repo_dir,
        grpc_url: str,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 600.0,
        api_key: Optional[str] = None,
        max_body: int = MAX_BODY,
    ):
        self.engine = _newest_engine(Path(repo_dir))
        cfg = EngineConfig.load(self.engine)
        self.model_id, self.max_seq_len = cfg.name, cfg.limits.max_seq_len
        self.text = TextInterface(self.engine / "tokenizer", cfg.limits.max_input_len)
        self.grpc_url, self.timeout, self.max_body = grpc_url, timeout, int(max_body)
        self.api_key = api_key or None
        self.created = int(time.time())
        self.accepting = True  # False while draining: new requests get 503
        # why the server behind cannot take requests (None: it can); `bpcompile serve` sets its Health check
        self.health: Callable[[], Optional[str]] = lambda: None
        self.active = 0  # completion requests being answered
        self.metrics = _Metrics()
        self._chat_tok = None
        self._tok_lock = threading.Lock()
        self._stub = None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
        self.app = Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model:path}", self._model, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_found},
        )
        config = uvicorn.Config(
            self.app,
            http=_Protocol,
            loop="asyncio",
            lifespan="off",
            log_level="warning",
            log_config=None,  # uvicorn's loggers propagate to the root handler: serve's --log-format applies
            access_log=False,
            backlog=BACKLOG,
            timeout_keep_alive=KEEP_ALIVE,
            h11_max_incomplete_event_size=64 << 10,  # request head size
        )
        self.server = uvicorn.Server(config)
        self.thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"

    def start(self) -> "OpenAIFrontend":
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="openai-frontend", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError("the OpenAI endpoint did not start")
        return self

    def problem(self) -> Optional[str]:
        """None when requests can be taken, else why not (the /health answer)."""
        return "shutting down" if not self.accepting else self.health()

    def stop(self, wait: float = 0.0) -> None:
        """Stop listening; then wait up to `wait` s for the requests being answered to end (a stream whose server
        went away still gets its error event), and cancel what is left."""
        if self.thread is None:
            self.sock.close()
            return
        self.server.config.timeout_graceful_shutdown = max(0.1, wait)
        self.server.should_exit = True
        self.thread.join(timeout=wait + 10)

    # --- routes ---------------------------------------------------------------------------------------------

    async def _not_found(self, request: Request, exc) -> Response:
        self.metrics.requests.labels("other", "404").inc()
        return ApiError(404, f"no route {request.method} {request.url.path}", kind="not_found").response()

    def models(self) -> dict:
        return {"object": "list", "data": [self._card()]}

    def _card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "bpcompile"}

    def _authorized(self, request: Request) -> Optional[Response]:
        if self.api_key is None:
            return None
        got = request.headers.get("authorization", "")
        if hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            return None
        return ApiError(401, "missing or incorrect API key (send Authorization: Bearer <key>)",
                        code="invalid_api_key").response()  # fmt: skip

    async def _models(self, request: Request) -> Response:
        return self._authorized(request) or JSONResponse(self.models())

    async def _model(self, request: Request) -> Response:
        denied = self._authorized(request)
        if denied is not None:
            return denied
        if request.path_params["model"] != self.model_id:
            return ApiError(404, f"model {request.path_params['model']!r} is not served here", "model",
                            code="model_not_found").response()  # fmt: skip
        return JSONResponse(self._card())

    async def _health(self, request: Request) -> Response:
        why = self.problem()
        return JSONResponse({"status": "ok" if why is None else why}, status_code=200 if why is None else 503)

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _completions(self, request: Request) -> Response:
        return await self._answer(request, chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._answer(request, chat=True)

    async def _answer(self, request: Request, chat: bool) -> Response:
        route = "chat" if chat else "completions"
        self.active += 1
        self.metrics.running.inc()

        def end() -> None:
            self.active -= 1
            self.metrics.running.dec()

        try:
            resp = await self._run(request, chat, end)
        except ApiError as e:
            resp = e.response()
        except Exception as e:  # never let one request take the endpoint down
            resp = ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").response()
        if not isinstance(resp, StreamingResponse):  # a stream ends when its events do
            end()
        self.metrics.requests.labels(route, str(resp.status_code)).inc()
        return resp

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused as soon as it is known to be over max_body (413) or slower than BODY_TIMEOUT (408)."""
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > self.max_body:
            raise ApiError(413, f"the body is {int(n)} bytes; this endpoint takes at most {self.max_body}")
        buf = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                buf.extend(chunk)
                if len(buf) > self.max_body:
                    raise ApiError(413, f"the body is over {self.max_body} bytes, the most this endpoint takes")

        try:
            await asyncio.wait_for(read(), BODY_TIMEOUT)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the body did not arrive within {BODY_TIMEOUT:g}s") from None
        return bytes(buf)

    async def _run(self, request: Request, chat: bool, end: Callable[[], None]) -> Response:
        denied = self._authorized(request)
        if denied is not None:
            return denied
        why = self.problem()
        if why is not None:
            raise ApiError(503, f"the server is {why}" if why == "shutting down" else why, kind="server_error")
        raw = await self._read_body(request)
        try:
            body = (ChatBody if chat else CompletionBody).model_validate_json(raw or b"null")
        except ValidationError as e:
            raise _validation_error(e) from None
        if body.model != self.model_id:
            raise ApiError(404, f"model {body.model!r} is not served here; this endpoint serves {self.model_id!r}",
                           "model", code="model_not_found")  # fmt: skip
        extra = body.model_extra or {}
        for k, ok in UNSUPPORTED.items():
            if k in extra and extra[k] not in ok:
                raise ApiError(400, f"{k} is not supported by this endpoint (leave it unset)", k)
        # rendering and tokenizing (bounded by the byte checks) off the event loop
        prompt, prompt_tokens = await asyncio.get_running_loop().run_in_executor(None, self._prompt, body, chat)
        p = self._params(body, chat, prompt_tokens)
        job = _Job(self, body, chat, prompt, prompt_tokens, p)
        if p["stream"]:
            return StreamingResponse(
                job.events(end), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return JSONResponse(await job.whole(request))

    # --- request checks -------------------------------------------------------------------------------------

    def _prompt(self, body, chat: bool) -> tuple[str, int]:
        """The prompt text and its token count; sizes checked on bytes before rendering or tokenizing."""
        if chat:
            clean, size = [], 0
            for i, m in enumerate(body.messages):
                content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
                size += len(_utf8(content, f"messages[{i}].content"))
                clean.append({"role": "system" if m.role == "developer" else m.role, "content": content})
            if size > self.text.max_bytes:
                raise ApiError(400, f"messages hold {size} bytes of content, more than this engine can take "
                               f"({self.text.max_bytes} bytes: limits.max_input_len is {self.text.max_input_len} "
                               "tokens); send shorter ones", "messages")  # fmt: skip
            prompt = self._render(clean)
            what = "messages"
        else:
            prompt = body.prompt
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    raise ApiError(400, "prompt must be one string (batched prompts are not supported)", "prompt")
                prompt = prompt[0]
            if not prompt:
                raise ApiError(400, "prompt must be a non-empty string", "prompt")
            what = "prompt"
        data = _utf8(prompt, what)
        try:  # the same size check (on bytes, before tokenizing) and tokenization as the generator
            return prompt, len(self.text.prompt(np.array([data], dtype=object)))
        except BadRequest as e:
            raise ApiError(400, str(e).replace("text_input", what), what) from None

    def _render(self, messages: list[dict]) -> str:
        with self._tok_lock:
            if self._chat_tok is None:
                from transformers import AutoTokenizer
                from transformers.utils import logging as hf_logging

                hf_logging.set_verbosity_error()
                self._chat_tok = AutoTokenizer.from_pretrained(str(self.engine / "tokenizer"))
        if not getattr(self._chat_tok, "chat_template", None):
            raise ApiError(400, f"model {self.model_id} has no chat template: use /v1/completions", "messages")
        try:
            return self._chat_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that does not render these messages is the request's problem
            raise ApiError(400, f"the chat template does not render these messages: {e}", "messages") from None

    def _params(self, body, chat: bool, prompt_tokens: int) -> dict:
        room = max(1, self.max_seq_len - prompt_tokens)
        key = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(body, key)
        max_tokens = max_tokens if max_tokens is not None else (room if chat else 16)
        if max_tokens > room:
            raise ApiError(400, f"{key}={max_tokens} with a {prompt_tokens}-token prompt exceeds the model's "
                           f"context ({self.max_seq_len} tokens)", key)  # fmt: skip
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stop) > MAX_STOPS or not all(stop):
            raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
        for s in stop:
            _utf8(s, "stop")
        if chat:
            top = body.top_logprobs or 0
            if top and not body.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            logprobs = bool(body.logprobs)
        else:
            logprobs, top = body.logprobs is not None, body.logprobs or 0
        so = body.stream_options or {}
        return {
            "max_tokens": max_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "n": body.n or 1,
            "seed": body.seed,
            "stop": stop,
            "presence": body.presence_penalty or 0.0,
            "frequency": body.frequency_penalty or 0.0,
            "logprobs": logprobs,
            "top_logprobs": top,
            "stream": bool(body.stream),
            "usage_in_stream": bool(so.get("include_usage")),
        }

    # --- the generator ------------------------------------------------------------------------------------

    def stub(self):
        """The gRPC stub, made in the serving loop the first time (a grpc.aio channel belongs to one loop)."""
        if self._stub is None:
            import grpc
            from tritonclient.grpc import service_pb2_grpc

            channel = grpc.aio.insecure_channel(
                self.grpc_url, options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
            )
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return self._stub


class _Job:
    """One completion request: its choices' generations, streamed as events or gathered into one response."""

    def __init__(self, front: OpenAIFrontend, body, chat: bool, prompt: str, prompt_tokens: int, p: dict):
        self.front, self.chat, self.prompt, self.prompt_tokens, self.p = front, chat, prompt, prompt_tokens, p
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.obj = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.t0 = time.monotonic()
        self.choices = [_Choice(i, p["stop"], p["stream"]) for i in range(p["n"])]
        self.done = False

    def fields(self, i: int) -> dict:
        p = self.p
        f = {"text_input": self.prompt, "max_tokens": p["max_tokens"], "stream": True}
        # both always: without them the generator is greedy, as TensorRT-LLM (top_k 0 and top_p 0 by default)
        f.update(temperature=p["temperature"], top_p=p["top_p"])
        if p["seed"] is not None:
            f["seed"] = (p["seed"] + i) & UINT64
        if p["stop"]:
            f["stop_words"] = p["stop"]
        if p["presence"] or p["frequency"]:
            f.update(presence_penalty=p["presence"], frequency_penalty=p["frequency"], penalties_over_output=True)
        if p["logprobs"]:
            f["return_generation_logits"] = True
        return f

    async def _generate(self, ch: _Choice, out: asyncio.Queue) -> None:
        """Run one choice, putting (choice, text piece) on `out` as it comes; cancelled, it cancels the gRPC call."""
        from tritonclient.grpc import InferResult

        front, m = self.front, self.front.metrics
        sent = asyncio.Event()
        request = _infer_request(f"{self.rid}-{ch.index}", self.fields(ch.index))

        async def requests():
            yield request
            await sent.wait()  # keep the stream open until the last response: closing it early ends it

        call = front.stub().ModelStreamInfer(requests(), timeout=front.timeout)
        first = last = None
        try:
            async for resp in call:
                if resp.error_message:
                    raise _RemoteError(resp.error_message)
                r = resp.infer_response
                final = "triton_final_response" in r.parameters and r.parameters["triton_final_response"].bool_param
                if r.outputs:
                    res = InferResult(r)
                    now = time.monotonic()
                    ids = [int(t) for t in res.as_numpy("output_ids").reshape(-1)]
                    if ids:
                        if first is None:
                            first = now
                            m.ttft.observe(now - self.t0)
                        last = now
                    self._take(ch, res, ids)
                    piece = b"".join(res.as_numpy("text_output").reshape(-1)).decode("utf-8")
                    reason = _scalar(res, "finish_reason")
                    ch.finish = reason or ch.finish
                    await out.put((ch, piece))
                    if ch.hit:  # a stop string ended it here: the rest would be cut anyway
                        break
                if final:
                    break
            else:
                raise _RemoteError("the stream ended before the last response")
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception as e:
            import grpc

            call.cancel()
            if isinstance(e, grpc.aio.AioRpcError):
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise ApiError(504, f"no answer within {front.timeout:g}s", kind="timeout") from None
                raise _RemoteError(f"{e.code().name}: {e.details()}", unavailable=True) from None
            raise
        finally:
            sent.set()
        if ch.hit:
            call.cancel()
        n = len(ch.tokens)
        # genai-perf's inter-token latency: the time after the first token over the tokens after it (speculation
        # commits several tokens per step, so the gaps between responses are not the gaps between tokens)
        for _ in range(n - 1):
            m.itl.observe((last - first) / (n - 1))
        await out.put((ch, None))

    def _take(self, ch: _Choice, res, ids: list[int]) -> None:
        ch.version = int(_scalar(res, "engine_version") or ch.version)
        ch.cached = int(_scalar(res, "cached_tokens") or ch.cached)
        dec = self.front.text.decode
        for t in ids:
            if self.p["logprobs"] or self.p["stop"]:  # token offsets: for logprobs and to count tokens at a stop cut
                ctx = ch.tokens[-8:]  # enough left context for a byte-level decoder (protocol.CONTEXT_TOKENS)
                ch.offsets.append(ch.decoded)
                ch.decoded += len(dec(ctx + [t]).rstrip("\ufffd")) - len(dec(ctx).rstrip("\ufffd"))
            ch.tokens.append(t)
        if self.p["logprobs"] and ids:
            logits = res.as_numpy("generation_logits").reshape(len(ids), -1).astype(np.float64)
            lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            lp = logits - lse[:, None]
            k = self.p["top_logprobs"]
            for row, t in zip(lp, ids):
                ch.logprobs.append(float(row[t]))
                if k:
                    idx = np.argpartition(-row, k - 1)[:k]
                    idx = idx[np.argsort(-row[idx], kind="stable")]
                    ch.top.append([(int(i), float(row[i])) for i in idx])
                else:
                    ch.top.append([])

    def _error(self, e: BaseException) -> ApiError:
        if isinstance(e, ApiError):
            return e
        front = self.front
        if isinstance(e, _RemoteError):
            why = front.problem()  # the server failed under the request: not the request's fault
            if why is not None or e.unavailable:
                return ApiError(503, f"the inference server is unavailable ({why or e}): {e}", kind="server_error")
            return ApiError(400, f"the server refused the request: {e}")
        return ApiError(503, f"the inference server is unavailable: {type(e).__name__}: {e}", kind="server_error")

    async def _pieces(self) -> AsyncIterator[tuple[_Choice, Optional[str]]]:
        """(choice, text piece) as the generations answer; (choice, None) when a choice has ended. Leaving early
        (the client went away, an error) cancels every generation still running."""
        out: asyncio.Queue = asyncio.Queue()

        async def run(ch: _Choice) -> None:
            try:
                await self._generate(ch, out)
            except Exception as e:  # to the reader, which answers it
                await out.put((ch, e))

        tasks = [asyncio.create_task(run(ch)) for ch in self.choices]
        ended, failed = 0, False
        try:
            while ended < len(tasks):
                ch, piece = await out.get()
                if isinstance(piece, Exception):
                    failed = True
                    raise self._error(piece)
                ended += piece is None
                yield ch, piece
            self.done = True
        finally:
            for t in tasks:
                t.cancel()
            if not self.done and not failed:  # left early without an error: the client went away
                self.front.metrics.disconnects.inc()

    def _finish(self, ch: _Choice) -> str:
        return "stop" if ch.hit or ch.finish == "stop" else "length"

    def usage(self) -> dict:
        completion = sum(ch.emitted_tokens() for ch in self.choices)
        cached = max(ch.cached for ch in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            # prompt tokens the server took from its KV prefix cache instead of computing them
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _account(self) -> None:
        m = self.front.metrics
        u = self.usage()
        m.prompt_tokens.inc(u["prompt_tokens"])
        m.cached_tokens.inc(u["prompt_tokens_details"]["cached_tokens"])
        m.generation_tokens.inc(u["completion_tokens"])
        m.latency.observe(time.monotonic() - self.t0)

    def _logprobs(self, ch: _Choice, first: int, last: int) -> Optional[dict]:
        """OpenAI's logprobs object for tokens [first, last) of a choice."""
        if not self.p["logprobs"]:
            return None
        dec = self.front.text.decode
        if self.chat:
            return {
                "content": [
                    {
                        "token": (s := dec([ch.tokens[j]])),
                        "logprob": ch.logprobs[j],
                        "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [
                            {"token": (a := dec([i])), "logprob": lp, "bytes": list(a.encode("utf-8"))}
                            for i, lp in ch.top[j]
                        ],
                    }
                    for j in range(first, last)
                ],
                "refusal": None,
            }
        return {
            "tokens": [dec([ch.tokens[j]]) for j in range(first, last)],
            "token_logprobs": ch.logprobs[first:last],
            "top_logprobs": [{dec([i]): lp for i, lp in ch.top[j]} for j in range(first, last)]
            if self.p["top_logprobs"]
            else None,
            "text_offset": ch.offsets[first:last],
        }

    async def whole(self, request: Request) -> dict:
        """The non-streamed response; the request is cancelled if its client disconnects meanwhile."""

        async def gather():
            async with contextlib.aclosing(self._pieces()) as pieces:
                async for ch, piece in pieces:
                    ch.feed(piece or "", final=piece is None)

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():  # the client went away: nobody to answer
                work.cancel()
        if work.cancelled():
            return {}
        if work.exception() is not None:
            raise self._error(work.exception())
        self._account()
        choices = []
        for ch in self.choices:
            text = ch.text[: ch.sent]
            c = {
                "index": ch.index,
                "finish_reason": self._finish(ch),
                "logprobs": self._logprobs(ch, 0, ch.emitted_tokens()),
            }
            c.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
            choices.append(c)
        return {
            "id": self.rid,
            "object": self.obj,
            "created": self.created,
            "model": self.front.model_id,
            "system_fingerprint": self._fingerprint(),
            "choices": choices,
            "usage": self.usage(),
        }

    def _fingerprint(self) -> str:
        return f"{self.front.model_id}-v{max(ch.version for ch in self.choices)}"

    def _chunk(self, ch: _Choice, text: Optional[str], finish: Optional[str], logprobs=None, first=False) -> bytes:
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
            choice = {"index": ch.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": ch.index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        event = {
            "id": self.rid,
            "object": self.obj + ".chunk" if self.chat else self.obj,
            "created": self.created,
            "model": self.front.model_id,
            "choices": [choice],
        }
        if finish is not None:
            event["system_fingerprint"] = self._fingerprint()
        return _sse(event)

    async def events(self, end: Callable[[], None]) -> AsyncIterator[bytes]:
        """Server-sent events; an error after the stream opened is its last event; end() once it is over."""
        try:
            if self.chat:
                for ch in self.choices:
                    yield self._chunk(ch, None, None, first=True)
            given = [0] * len(self.choices)  # tokens whose log probabilities were sent
            async with contextlib.aclosing(self._pieces()) as pieces:
                async for ch, piece in pieces:
                    text = ch.feed(piece or "", final=piece is None)
                    lp = None
                    if self.p["logprobs"]:  # those of the tokens whose text starts in what is sent
                        upto = ch.emitted_tokens() if piece is None else sum(1 for o in ch.offsets if o < ch.sent)
                        lp, given[ch.index] = self._logprobs(ch, given[ch.index], upto), max(given[ch.index], upto)
                    if text or (lp and (lp.get("content") or lp.get("tokens"))):
                        yield self._chunk(ch, text, None, lp)
                    if piece is None:
                        yield self._chunk(ch, None, self._finish(ch))
            self._account()
            if self.p["usage_in_stream"]:
                yield _sse({"id": self.rid, "object": self.obj + ".chunk" if self.chat else self.obj,
                            "created": self.created, "model": self.front.model_id, "choices": [],
                            "usage": self.usage()})  # fmt: skip
            yield b"data: [DONE]\n\n"
        except ApiError as e:
            yield _sse(e.body())
        except _RemoteError as e:
            yield _sse(self._error(e).body())
        finally:
            end()


class _RemoteError(RuntimeError):
    """The server answered the request with an error (message as the server wrote it)."""

    def __init__(self, message: str, unavailable: bool = False):
        super().__init__(message)
        self.unavailable = unavailable


def _scalar(res, name: str):
    try:
        a = res.as_numpy(name)
    except Exception:
        return None
    if a is None or a.size == 0:
        return None
    x = a.reshape(-1)[0]
    return x.decode("utf-8") if isinstance(x, bytes) else x.item()


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event, allow_nan=False).encode() + b"\n\n"
