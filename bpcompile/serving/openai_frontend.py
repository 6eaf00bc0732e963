"""An OpenAI-compatible HTTP endpoint in front of a running tritonserver: `GET /v1/models`, `POST /v1/completions`
and `POST /v1/chat/completions`, streamed (server-sent events) or not, with `usage`.

Each request becomes one streamed gRPC request to the repository's `ensemble`, so the model lives once (in
tritonserver) and OpenAI clients share its in-flight batch with every other client. Chat messages go through
the engine tokenizer's chat template (transformers renders it, as `bpcompile generate` does). `stop` strings are
sent as the ensemble's stop words (it stops on them) and cut from the text, as the OpenAI API returns it.

Built on the standard library's ThreadingHTTPServer: three routes and SSE need no web framework, and the serving
extra stays without one.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from bpcompile.core.engine import EngineConfig
from bpcompile.core.errors import UserError
from bpcompile.serving.client import RemoteError, generate_remote
from bpcompile.serving.protocol import BadRequest, TextInterface

MAX_STOPS = 4  # as the OpenAI API
# sampling fields of the OpenAI API that this endpoint cannot honour: refused when set to anything but a no-op
UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "n": (None, 1),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def _newest_engine(repo_dir: Path) -> Path:
    """The engine of the newest tensorrt_llm (generator) version in a repository (what the ensemble's latest policy serves)."""
    gen = Path(repo_dir) / "tensorrt_llm"
    versions = (
        sorted((int(p.name) for p in gen.iterdir() if p.name.isdigit() and (p / "engine").is_dir()), reverse=True)
        if gen.is_dir()
        else []
    )
    if not versions:
        raise UserError(f"{repo_dir}: no tensorrt_llm model versions (emit a repository first)", file=str(repo_dir))
    return gen / str(versions[0]) / "engine"


class _Stops:
    """Cuts text at the first stop string, holding back a tail that could still begin one (streaming)."""

    def __init__(self, stops: list[str]):
        self.stops, self.text, self.sent, self.hit = stops, "", 0, False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, piece: str, final: bool = False) -> str:
        """Text that can be emitted now."""
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


class OpenAIFrontend:
    """The endpoint over a repository's newest engine version, talking to tritonserver at grpc_url."""

    def __init__(self, repo_dir, grpc_url: str, host: str = "127.0.0.1", port: int = 0, timeout: float = 600.0):
        self.engine = _newest_engine(Path(repo_dir))
        cfg = EngineConfig.load(self.engine)
        self.model_id, self.max_seq_len = cfg.name, cfg.limits.max_seq_len
        self.text = TextInterface(self.engine / "tokenizer", cfg.limits.max_input_len)
        self.grpc_url, self.timeout = grpc_url, timeout
        self.created = int(time.time())
        self.accepting = True  # False while draining: new requests get 503
        # why the server behind cannot take requests (None: it can); `bpcompile serve` sets its Health check
        self.health: Callable[[], Optional[str]] = lambda: None
        self.active, self._active_lock = 0, threading.Lock()  # requests being answered
        self._chat_tok = None
        self._lock = threading.Lock()
        frontend = self

        class Handler(_Handler):
            app = frontend

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> "OpenAIFrontend":
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="openai-frontend", daemon=True)
        self.thread.start()
        return self

    def problem(self) -> Optional[str]:
        """None when requests can be taken, else why not (the /health answer)."""
        return "shutting down" if not self.accepting else self.health()

    def stop(self, wait: float = 0.0) -> None:
        """Stop listening; then wait up to `wait` s for the requests being answered to end (a stream whose server
        went away still gets its error event)."""
        if self.thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        deadline = time.monotonic() + wait
        while self.active and time.monotonic() < deadline:
            time.sleep(0.05)

    # ---------------------------------------------------------------------------------------------- requests

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model_id, "object": "model", "created": self.created, "owned_by": "bpcompile"}],
        }

    def chat_template(self, messages) -> str:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                raise ApiError(400, f"messages[{i}]: role must be system, developer, user or assistant", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
                ):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string", "messages")
            clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        with self._lock:
            if self._chat_tok is None:
                from transformers import AutoTokenizer
                from transformers.utils import logging as hf_logging

                hf_logging.set_verbosity_error()
                self._chat_tok = AutoTokenizer.from_pretrained(str(self.engine / "tokenizer"))
        if not getattr(self._chat_tok, "chat_template", None):
            raise ApiError(400, f"model {self.model_id} has no chat template: use /v1/completions", "messages")
        try:
            return self._chat_tok.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that does not render these messages is the request's problem
            raise ApiError(400, f"the chat template does not render these messages: {e}", "messages") from None

    def params(self, body: dict, chat: bool, prompt_tokens: int) -> dict:
        """The generation parameters of a request, validated."""
        if body.get("model") != self.model_id:
            raise ApiError(
                404,
                f"model {body.get('model')!r} is not served here; this endpoint serves {self.model_id!r}",
                "model",
                "model_not_found",
            )
        for k, ok in UNSUPPORTED.items():
            if k in body and body[k] not in ok:
                raise ApiError(400, f"{k} is not supported by this endpoint (leave it unset)", k)

        def number(k, default, lo, hi, kind=float):
            v = body.get(k, default)
            if v is None:
                return default
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or (kind is int and not float(v).is_integer())
                or not lo <= v <= hi
            ):
                raise ApiError(
                    400, f"{k} must be a{'n integer' if kind is int else ' number'} in [{lo}, {hi}], got {v!r}", k
                )
            return kind(v)

        room = max(1, self.max_seq_len - prompt_tokens)
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = number(key, room if chat else 16, 1, 1 << 30, int)
        if max_tokens > room:
            raise ApiError(
                400,
                f"{key}={max_tokens} with a {prompt_tokens}-token prompt exceeds the model's "
                f"context ({self.max_seq_len} tokens)",
                key,
            )
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS}", "stop")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ApiError(400, "seed must be a non-negative integer", "seed")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise ApiError(400, "stream_options must be an object", "stream_options")
        return {
            "max_tokens": max_tokens,
            "temperature": number("temperature", 1.0, 0, 2),
            "top_p": number("top_p", 1.0, 1e-9, 1),
            "seed": seed,
            "stop": stop,
            "stream": bool(body.get("stream", False)),
            "usage_in_stream": bool(so.get("include_usage")),
        }

    def complete(self, body: dict, chat: bool, send: Callable[[dict], None]) -> Optional[dict]:
        """Run one request; with stream, send(chunk) per piece and return None; else return the response."""
        if chat:
            prompt = self.chat_template(body.get("messages"))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise ApiError(
                    400, "prompt must be a non-empty string (token-id and batched prompts are not supported)", "prompt"
                )
        try:  # the same size check (on bytes, before tokenizing) and tokenization as the preprocessing model
            prompt_tokens = len(self.text.prompt(np.array([prompt.encode("utf-8")], dtype=object)))
        except BadRequest as e:
            raise ApiError(400, str(e), "messages" if chat else "prompt") from None
        p = self.params(body, chat, prompt_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        stops = _Stops(p["stop"])

        def chunk(text: Optional[str], finish: Optional[str], first: bool = False) -> dict:
            if chat:
                delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {
                "id": rid,
                "object": obj + ".chunk" if chat else obj,
                "created": created,
                "model": self.model_id,
                "choices": [choice],
            }

        if p["stream"] and chat:
            send(chunk(None, None, first=True))

        def on_text(piece: str) -> None:
            out = stops.feed(piece)
            if out:
                send(chunk(out, None))

        try:
            res = generate_remote(
                self.grpc_url,
                prompt,
                p["max_tokens"],
                stream=True,
                temperature=p["temperature"],
                top_p=p["top_p"],
                seed=p["seed"],
                stop_words=p["stop"] or None,
                on_text=on_text if p["stream"] else None,
                timeout=self.timeout,
            )
        except RemoteError as e:
            why = self.problem()  # the server failed under the request: not the request's fault
            if why is not None:
                raise ApiError(503, f"the inference server is unavailable ({why}): {e}", kind="server_error") from None
            raise ApiError(400, f"the server refused the request: {e}") from None
        except TimeoutError as e:
            raise ApiError(504, str(e), kind="timeout") from None
        except Exception as e:  # tritonserver unreachable, a stream that broke
            raise ApiError(503, f"the inference server is unavailable: {e}", kind="server_error") from None
        tail = stops.feed("", final=True) if p["stream"] else None
        text = res["text"] if not p["stream"] else None
        if text is not None:
            stops.feed(text, final=True)
            text = stops.text[: stops.sent]
        finish = "stop" if stops.hit or res.get("finish_reason") == "stop" else "length"
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": res["tokens"],
            "total_tokens": prompt_tokens + res["tokens"],
            # prompt tokens the server took from its KV prefix cache instead of computing them
            "prompt_tokens_details": {"cached_tokens": int(res.get("cached_tokens") or 0)},
        }
        fingerprint = f"{self.model_id}-v{res.get('engine_version')}"
        if p["stream"]:
            if tail:
                send(chunk(tail, None))
            last = chunk(None, finish)
            last["system_fingerprint"] = fingerprint
            send(last)
            if p["usage_in_stream"]:
                send(
                    {
                        "id": rid,
                        "object": last["object"],
                        "created": created,
                        "model": self.model_id,
                        "choices": [],
                        "usage": usage,
                    }
                )
            return None
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.model_id,
            "system_fingerprint": fingerprint,
            "choices": [choice],
            "usage": usage,
        }


class _Handler(BaseHTTPRequestHandler):
    app: OpenAIFrontend
    protocol_version = "HTTP/1.1"
    server_version = "bpcompile-openai"

    def log_message(self, fmt, *args) -> None:  # quiet: tritonserver's log and metrics are the record
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path == "/v1/models":
            return self._json(200, self.app.models())
        if path == f"/v1/models/{self.app.model_id}":
            return self._json(200, self.app.models()["data"][0])
        if path in ("/health", "/v1/health"):
            why = self.app.problem()
            return self._json(200 if why is None else 503, {"status": "ok" if why is None else why})
        self._json(404, ApiError(404, f"no route GET {path}", kind="not_found").body())

    def do_POST(self) -> None:
        with self.app._active_lock:
            self.app.active += 1
        try:
            self._post()
        finally:
            with self.app._active_lock:
                self.app.active -= 1

    def _post(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        started = False
        try:
            if path not in ("/v1/completions", "/v1/chat/completions"):
                raise ApiError(404, f"no route POST {path}", kind="not_found")
            why = self.app.problem()
            if why is not None:
                raise ApiError(503, f"the server is {why}" if why == "shutting down" else why, kind="server_error")
            n = int(self.headers.get("Content-Length") or 0)
            if n > 64 << 20:
                raise ApiError(413, "request body over 64 MiB")
            try:
                body = json.loads(self.rfile.read(n) or b"null")
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise ApiError(400, "the body must be a JSON object")

            def send(event: dict) -> None:
                nonlocal started
                if not started:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    started = True
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()

            out = self.app.complete(body, path.endswith("chat/completions"), send)
            if out is not None:
                return self._json(200, out)
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True
        except ApiError as e:
            if started:  # the stream is open: the error is its last event
                self.wfile.write(b"data: " + json.dumps(e.body()).encode() + b"\n\n")
                self.close_connection = True
            else:
                self._json(e.status, e.body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away
        except Exception as e:  # never let one request take the endpoint down
            if not started:
                self._json(500, ApiError(500, f"internal error: {e}", kind="server_error").body())
            self.close_connection = True
