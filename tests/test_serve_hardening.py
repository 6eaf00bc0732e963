"""`bpcompile serve` as an operator runs it (a real subprocess, a real tritonserver, real signals) and as a
hostile client or local user probes it: planted backend stubs, the repository API, SIGTERM with streams in
flight, tritonserver killed under it. Also the CLI's error output and `build` without the serve extra."""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.serving_fixtures import REPO, TINY, make_engine

pytestmark = pytest.mark.timeout(400)

EVIL_MODEL = """
import pathlib
class TritonPythonModel:
    def initialize(self, args):
        pathlib.Path({marker!r}).write_text("ran")
    def execute(self, requests):
        return []
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient.grpc")
    from bpcompile.serving.emit import emit_repository

    root = tmp_path_factory.mktemp("hardening")
    emit_repository([(1, make_engine(root / "engine" / "1", 1))], root / "repo")
    return root / "repo"


class Serve:
    """`bpcompile serve REPO ...` in a subprocess, on free ports, stderr captured to a file."""

    def __init__(self, repo: Path, tmp: Path, *args: str, env: dict | None = None):
        from bpcompile.serving.serve import free_port

        self.http, self.grpc, self.metrics = free_port(), free_port(), free_port()
        self.err_file = tmp / f"serve-{self.http}.err"
        cmd = [
            sys.executable,
            "-m",
            "bpcompile.cli",
            "serve",
            str(repo),
            "--http-port",
            str(self.http),
            "--grpc-port",
            str(self.grpc),
            "--metrics-port",
            str(self.metrics),
            *args,
        ]
        with open(self.err_file, "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stderr=err, env={**os.environ, **(env or {})})
        _started.append(self)
        deadline = time.monotonic() + 240
        # ready: the ensemble answers and serve has printed its endpoints (the last being the log)
        while self.status("/v2/models/ensemble/ready") != 200 or not re.search(r"^log\s", self.messages(), re.M):
            assert self.proc.poll() is None, f"serve exited {self.proc.returncode}:\n{self.stderr()}"
            assert time.monotonic() < deadline, self.stderr()
            time.sleep(0.25)
        self.log = re.search(r"^log\s+(\S+)", self.messages(), re.M).group(1)  # "stderr" unless --log-file

    def stderr(self) -> str:
        return self.err_file.read_text(errors="replace")

    def messages(self) -> str:
        """stderr's messages, one a line (the message of each line that is a JSON object: --log-format json)."""
        return "\n".join(
            json.loads(line)["message"] if line.startswith("{") else line for line in self.stderr().splitlines()
        )

    @property
    def triton_pid(self) -> int:
        return int(re.search(r"tritonserver pid (\d+)", self.stderr()).group(1))

    def status(self, path: str, body: dict | None = None, headers: dict | None = None) -> int:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http}{path}",
            headers=headers or {},
            data=None if body is None else json.dumps(body).encode(),
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def wait(self, timeout=90) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self):
        """serve and tritonserver's whole process group (its own session: the Python backend stubs too)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        pids = children.read_text().split() if self.proc.poll() is None and children.exists() else []
        self.proc.kill()
        self.proc.wait()
        for pid in pids:
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


_started: list[Serve] = []


@pytest.fixture(autouse=True)
def _kill_leftovers():
    yield
    while _started:
        _started.pop().kill()


def _evil_load_body(marker: Path) -> dict:
    config = {
        "name": "evil",
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "IN", "data_type": "TYPE_INT32", "dims": [1]}],
        "output": [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]}],
    }
    model = base64.b64encode(EVIL_MODEL.format(marker=str(marker)).encode()).decode()
    return {"parameters": {"config": json.dumps(config), "file:1/model.py": model}}


def _plant_backends(tmpdir: Path, marker: Path) -> Path:
    """A working backends directory at the fixed path earlier versions reused, owned by another user, whose
    stub records who ran it before running the real one."""
    import hashlib

    from bpcompile.serving.serve import _pytriton_dist

    dist = _pytriton_dist()
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    root = (
        tmpdir
        / f"bpcompile-tritonserver-{os.getuid()}"
        / f"py{ver}-{hashlib.sha256(str(dist).encode()).hexdigest()[:10]}"
    )
    shutil.copytree(dist / "backends", root / "backends")
    stub = root / "backends" / "python" / "triton_python_backend_stub"
    real = root.parent / "real_stub"
    shutil.copy2(dist / "python_backend_stubs" / ver / "triton_python_backend_stub", real)
    stub.write_text(f'#!/bin/sh\nid > {marker}\nexec {real} "$@"\n')
    stub.chmod(0o755)
    for p in [root.parent, *root.parent.rglob("*")]:
        os.lchown(p, 12345, 12345)
    return root


def _stream(port: int, n: int, max_tokens: int):
    """n streams over gRPC; returns (results, a started Event set once every stream has text)."""
    from bpcompile.serving.client import generate_remote

    results, started = {}, [threading.Event() for _ in range(n)]

    def one(i):
        try:
            results[i] = generate_remote(
                f"127.0.0.1:{port}", "The quick brown fox", max_tokens, stream=True, on_text=lambda t: started[i].set()
            )
        except Exception as e:  # noqa: BLE001 - asserted below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return results, started, threads


def test_default_serve_is_closed_ignores_planted_stub_and_drains_on_sigterm(repo, tmp_path):
    from bpcompile.serving.client import RemoteError, generate_remote

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    planted_ran, evil_ran = tmp_path / "planted-stub-ran", tmp_path / "evil-ran"
    _plant_backends(tmpdir, planted_ran)
    from bpcompile.serving.serve import free_port

    oai, health = free_port(), free_port()
    s = Serve(repo, tmp_path, "--openai-port", str(oai), "--health-port", str(health), env={"TMPDIR": str(tmpdir)})
    assert _probe(health) == (200, "ready") and _probe(oai) == (200, "ok")
    assert not planted_ran.exists(), planted_ran.read_text()
    assert re.search(rf"^openai\s+http://127.0.0.1:{oai}/v1$", s.stderr(), re.M), s.stderr()
    with urllib.request.urlopen(f"http://127.0.0.1:{oai}/v1/models", timeout=30) as r:
        assert json.loads(r.read())["data"][0]["id"] == "tiny"
    assert s.log == "stderr"  # tritonserver's log passes through serve's stderr by default
    backends = Path(re.search(r'"backend-directory":"([^"]+)"', s.stderr()).group(1))
    assert backends.parent.parent == tmpdir and backends.parent.name.startswith("bpcompile-serve-")
    assert stat.S_IMODE(backends.parent.stat().st_mode) == 0o700 and backends.parent.stat().st_uid == os.getuid()

    # model control none: the repository API can neither load code nor unload what is served
    assert s.status("/v2/repository/models/evil/load", _evil_load_body(evil_ran)) >= 400
    assert s.status("/v2/repository/models/tensorrt_llm/unload", {}) >= 400
    assert not evil_ran.exists()
    assert s.status("/v2/models/tensorrt_llm/ready") == 200
    assert generate_remote(f"127.0.0.1:{s.grpc}", "Hello", 4)["tokens"] == 4

    results, started, threads = _stream(s.grpc, 4, 400)
    assert all(e.wait(120) for e in started), results
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the generators see the drain flag within 0.1 s
    # what a supervisor probes says "not ready" while the running streams finish
    assert _probe(health) == (503, "shutting down") and _probe(oai) == (503, "shutting down")
    with pytest.raises(RemoteError, match="shutting down"):
        generate_remote(f"127.0.0.1:{s.grpc}", "Hello", 4)
    req = urllib.request.Request(
        f"http://127.0.0.1:{oai}/v1/completions",
        method="POST",
        data=json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:  # the OpenAI endpoint drains with the server
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 503 and "shutting down" in e.value.read().decode()
    assert s.wait() == 0, s.stderr()
    for t in threads:
        t.join(30)
    for r in results.values():  # every stream ran to its end: a final response each
        assert isinstance(r, dict), r
        assert r["finish_reason"] in ("length", "stop") and r["tokens"] > 0, r
    assert "exit code 0" in s.stderr() and not backends.parent.exists()
    assert not planted_ran.exists()


def test_explicit_model_control_needs_the_token_and_a_dead_server_exits_nonzero(repo, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from bpcompile.serving.client import repository_index

    token = secrets.token_urlsafe(24)
    evil_ran = tmp_path / "evil-ran"
    from bpcompile.serving.serve import free_port

    oai = free_port()
    s = Serve(
        repo,
        tmp_path,
        *("--model-control", "explicit", "--log-format", "json", "--openai-port", str(oai)),
        env={"BPCOMPILE_REPOSITORY_TOKEN": token},
    )
    assert token not in s.stderr()  # given in the environment: not echoed
    with socket.create_connection(("127.0.0.1", oai), timeout=30) as c:  # not HTTP: the OpenAI server logs it
        c.sendall(b"\x16\x03\x01 not http\r\n\r\n")
        assert c.recv(100).startswith(b"HTTP/1.1 400")
    deadline = time.monotonic() + 10
    while "Invalid HTTP request" not in s.stderr() and time.monotonic() < deadline:
        time.sleep(0.1)
    # --log-format json: every stderr line is one JSON object, tritonserver's (with its pid and source), ours and
    # the OpenAI server's (uvicorn's loggers)
    records = [json.loads(line) for line in s.stderr().splitlines()]
    assert any(r["logger"].startswith("uvicorn") and r["level"] == "WARNING" for r in records), records[-5:]
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    triton = [r for r in records if r["logger"] == "tritonserver"]
    loaded = [r for r in triton if r["message"].startswith("generator: engine version 1")]  # the model's own line
    assert loaded and loaded[0]["level"] == "INFO" and re.fullmatch(r"\S+\.py:\d+", loaded[0]["source"]), loaded
    assert isinstance(loaded[0]["pid"], int)
    assert any(r["logger"] == "bpcompile.serve" and r["message"].startswith("tritonserver pid") for r in records)
    body = _evil_load_body(evil_ran)
    assert s.status("/v2/repository/models/evil/load", body) == 403
    assert s.status("/v2/repository/models/evil/load", body, {"bpcompile-repository-token": "x" * 32}) == 403
    assert s.status("/v2/repository/models/tensorrt_llm/unload", {}) == 403
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{s.grpc}")
    with pytest.raises(InferenceServerException):
        c.unload_model("tensorrt_llm")
    with pytest.raises(InferenceServerException):
        c.load_model(
            "evil",
            config=body["parameters"]["config"],
            files={"file:1/model.py": EVIL_MODEL.format(marker=str(evil_ran)).encode()},
        )
    c.close()
    assert not evil_ran.exists() and s.status("/v2/models/tensorrt_llm/ready") == 200
    # with the token the API answers (explicit mode is on; the restriction is the token)
    idx = {m["name"]: m.get("state") for m in repository_index(f"127.0.0.1:{s.http}", token=token)}
    assert idx["tensorrt_llm"] == "READY"

    os.kill(s.triton_pid, signal.SIGKILL)  # tritonserver dies under serve: a supervisor must see it
    assert s.wait(60) == 1, s.stderr()
    assert "killed by SIGKILL" in s.stderr()


def _probe(port: int, path: str = "/health") -> tuple[int, str]:
    """(status, the reason or status it gives) of GET path; (0, why) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read()).get("status", "")
    except urllib.error.HTTPError as e:
        body = json.loads(e.read() or b"{}")
        return e.code, body.get("reason") or body.get("status", "")
    except OSError as e:
        return 0, str(e)


def _stub_pid(triton_pid: int, model: str) -> int:
    """The Python backend stub of `model`: the child of tritonserver whose first argument is its model.py."""
    for task in Path(f"/proc/{triton_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if len(argv) > 1 and Path(argv[1].decode()).parent.parent.name == model:
                return int(pid)
    raise AssertionError(f"no stub of {model} under tritonserver {triton_pid}")


@pytest.mark.server
def test_dead_model_process_fails_open_streams_readiness_and_serve(repo, tmp_path):
    """kill -9 of the generating model's stub with streams open (gRPC and OpenAI): tritonserver 2.51 would keep
    the model "ready" and every stream would hang. Every open client gets an error within 5 s, readiness (serve's
    /health, the OpenAI endpoint's, tritonserver's) is false within 5 s, and serve exits 1 for its supervisor."""
    import openai

    from bpcompile.serving.serve import free_port

    oai, health = free_port(), free_port()
    s = Serve(repo, tmp_path, "--openai-port", str(oai), "--health-port", str(health))
    assert _probe(health)[0] == 200 and s.status("/v2/health/ready") == 200
    results, started, threads = _stream(s.grpc, 2, 400)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{oai}/v1", api_key="unused", max_retries=0)

    def chat(i):
        try:
            for _ in client.completions.create(
                model="tiny", prompt="Once upon a time", max_tokens=400, stream=True, temperature=0
            ):
                started[i].set()
            results[i] = "finished"
        except Exception as e:  # noqa: BLE001 - asserted below
            results[i] = e
        results[i, "t"] = time.monotonic()

    started += [threading.Event(), threading.Event()]
    threads += [threading.Thread(target=chat, args=(i,), daemon=True) for i in (2, 3)]
    for t in threads[2:]:
        t.start()
    assert all(e.wait(120) for e in started), results
    assert not results  # all four streams are open

    stub = _stub_pid(s.triton_pid, "tensorrt_llm")
    os.kill(stub, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(max(0.0, killed + 5 - time.monotonic()))
    assert not any(t.is_alive() for t in threads), results  # no client hangs
    for i in range(4):
        assert isinstance(results[i], Exception), (i, results[i])
    assert all(results[i, "t"] - killed < 5 for i in (2, 3)), results
    deadline = killed + 5
    while time.monotonic() < deadline and (_probe(health)[0] == 200 or s.status("/v2/health/ready") == 200):
        time.sleep(0.1)
    assert _probe(health)[0] != 200 and _probe(oai)[0] != 200 and s.status("/v2/health/ready") != 200
    assert s.wait(60) == 1, s.stderr()
    assert f"model tensorrt_llm (pid {stub}) died" in s.stderr(), s.stderr()
    assert not Path(f"/proc/{s.triton_pid}").exists()  # tritonserver stopped, not left behind


def test_two_endpoints_on_one_port_are_refused_before_starting():
    r = _cli("serve", "nowhere", "--http-port", "8000", "--openai-port", "8000")
    assert r.returncode == 2 and "--http-port and --openai-port are both 8000" in r.stderr, r.stderr
    r = _cli("serve", "nowhere", "--grpc-port", "9001", "--health-port", "9001")
    assert r.returncode == 2 and "--grpc-port and --health-port are both 9001" in r.stderr, r.stderr


def _cli(*args: str, pre: str = "") -> subprocess.CompletedProcess:
    code = f"import sys\n{pre}\nfrom bpcompile.cli import main\nsys.argv = ['bpcompile', *sys.argv[1:]]\nmain()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_error_messages_keep_square_brackets():
    r = _cli("emit", "--policy", "latest:[serve]", "--repo", "nowhere")
    assert r.returncode == 2 and "--policy 'latest:[serve]'" in r.stderr, r.stderr


@pytest.mark.parametrize("missing", ["tritonclient", "google.protobuf"])
def test_build_without_the_serve_extra_fails_before_publishing(tmp_path, missing):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""name: t
models:
  verifier: {{path: {TINY / "verifier"}, dtype: float32}}
  draft: {{path: {TINY / "draft"}, dtype: float32}}
limits: {{max_batch_size: 4, max_input_len: 64, max_seq_len: 128}}
kv_cache: {{format: fp16}}
output: {{store: {tmp_path / "engines"}, triton_repo: {tmp_path / "triton_repo"}}}
triton: {{emit: true}}
kernels: {{compile: false}}
""")
    # the extra's modules made unimportable in this interpreter, as when it is not installed
    r = _cli("build", str(recipe), pre=f"sys.modules[{missing!r}] = None")
    assert r.returncode == 2, r.stderr
    assert "pip install 'bpcompile[serve]'" in r.stderr and "triton.emit" in r.stderr, r.stderr
    assert not list(tmp_path.rglob("manifest.json"))  # no engine version published
    assert not (tmp_path / "triton_repo").exists()


def test_an_instance_that_cannot_serve_is_a_failure_until_unloaded(tmp_path, monkeypatch):
    """A live model instance that says it cannot serve any more (a generator whose tensor-parallel rank died) is
    listed with its reason, which serve's health reports and its main loop stops on; unloading it clears it. It is
    not a dead instance: its process lives."""
    from bpcompile.serving import drain

    monkeypatch.setenv(drain.ENV, str(tmp_path))
    inst = drain.Instance("tensorrt_llm")
    assert drain.failed_instances(tmp_path) == []
    inst.fail("tensor-parallel rank 1 exited with code -9")
    assert drain.failed_instances(tmp_path) == [
        ("tensorrt_llm", os.getpid(), "tensor-parallel rank 1 exited with code -9")
    ]
    assert drain.dead_instances(tmp_path) == []
    inst.close()
    assert drain.failed_instances(tmp_path) == []
