"""Start tritonserver on an emitted repository.

The binary: `tritonserver` on PATH (the NGC container), else the one bundled in the nvidia-pytriton wheel.
For the bundled one we do what pytriton does (pytriton/triton.py `_prepare_triton_inference_server`,
pytriton/server/triton_server.py `_get_env`): lay out a backends directory whose python/ holds
libtriton_python.so plus the stub built for *this* Python version (python_backend_stubs/<major.minor>/), put
the wheel's bundled libraries (nvidia_pytriton.libs) on LD_LIBRARY_PATH, and put this interpreter's bin/ first
on PATH. The stub embeds libpython and, like any embedded interpreter, finds its prefix by looking up
`python3` on PATH: with the venv's bin/ first it reads the venv's pyvenv.cfg and sees the venv's
site-packages (torch, tokenizers, ...). PYTHONPATH adds the directory holding `bpcompile` so the models can
import it from a source checkout.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

from ..errors import MissingDependency, UserError


def _pytriton_dist() -> Optional[Path]:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")  # located, not imported: importing pytriton is slow
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    return d if (d / "bin" / "tritonserver").is_file() else None


def _prepared_backends(dist: Path) -> Path:
    """backends/ with python/ = the backend library + this Python's stub (cached per interpreter version)."""
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise MissingDependency(f"nvidia-pytriton has no Python backend stub for Python {ver} ({stub})")
    root = Path(tempfile.gettempdir()) / f"bpcompile-tritonserver-{os.getuid()}" / f"py{ver}-{hashlib.sha256(str(dist).encode()).hexdigest()[:10]}"
    py = root / "backends" / "python"
    if not (py / "triton_python_backend_stub").is_file():
        tmp = root.with_name(root.name + f".{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(dist / "backends", tmp / "backends", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, tmp / "backends" / "python" / "triton_python_backend_stub")
        try:
            os.rename(tmp, root)
        except OSError:  # another process prepared it first
            shutil.rmtree(tmp, ignore_errors=True)
    return root / "backends"


def server_command(repo_dir, *, http_port=8000, grpc_port=8001, metrics_port=8002, host="127.0.0.1",
                   model_control="none", load_models=("*",), log_verbose=0, extra_args=()) -> tuple[list[str], dict]:
    """The tritonserver command line and environment (nothing is started)."""
    repo = Path(repo_dir).resolve()
    if not (repo / "ensemble" / "config.pbtxt").is_file():
        raise UserError(f"{repo} is not a model repository emitted by bpcompile (no ensemble/config.pbtxt); "
                        f"run `bpcompile emit` first", file=str(repo))
    if model_control not in ("none", "explicit", "poll"):
        raise UserError(f"model_control must be none, explicit or poll, got {model_control!r}")
    env = dict(os.environ)
    binary = shutil.which("tritonserver")
    args: list[str] = []
    if binary is None:
        dist = _pytriton_dist()
        if dist is None:
            raise MissingDependency("tritonserver is not on PATH and nvidia-pytriton (which bundles it) is not "
                                    "installed: pip install 'bpcompile[serve]', or use the NGC tritonserver container")
        binary = str(dist / "bin" / "tritonserver")
        libs = dist.parent.parent / "nvidia_pytriton.libs"
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (env.get("LD_LIBRARY_PATH"), str(libs)) if p)
        args += [f"--backend-directory={_prepared_backends(dist)}", f"--cache-directory={dist / 'caches'}"]
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    src = str(Path(__file__).resolve().parents[2])  # the directory holding the bpcompile package
    env["PYTHONPATH"] = ":".join(p for p in (src, env.get("PYTHONPATH")) if p)
    args += [f"--model-repository={repo}", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
             f"--metrics-port={metrics_port}", f"--http-address={host}", f"--grpc-address={host}",
             f"--metrics-address={host}", f"--model-control-mode={model_control}", f"--log-verbose={log_verbose}",
             "--exit-timeout-secs=30"]
    if model_control == "explicit":
        args += [f"--load-model={m}" for m in load_models]
    if model_control == "poll":
        args += ["--repository-poll-secs=2"]
    return [binary, *args, *extra_args], env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running tritonserver; a context manager (`with ServerProcess(repo) as s: s.http_url`)."""

    def __init__(self, repo_dir, *, http_port=None, grpc_port=None, metrics_port=None, host="127.0.0.1",
                 model_control="none", load_models=("*",), log_file=None, startup_timeout=300.0, log_verbose=0):
        self.host = host
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.cmd, self.env = server_command(
            repo_dir, http_port=self.http_port, grpc_port=self.grpc_port, metrics_port=self.metrics_port,
            host=host, model_control=model_control, load_models=load_models, log_verbose=log_verbose)
        self.log_file = Path(log_file) if log_file else Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        self.startup_timeout = startup_timeout
        self.proc: Optional[subprocess.Popen] = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def endpoints(self) -> dict:
        return {"http": f"http://{self.http_url}", "grpc": self.grpc_url, "metrics": self.metrics_url,
                "log": str(self.log_file)}

    def start(self) -> "ServerProcess":
        log = open(self.log_file, "ab")
        # own process group: Ctrl-C in a terminal reaches us, and we stop the server deliberately
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        self.wait_ready()
        return self

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as r:
                return r.status
        except Exception:
            return 0

    def wait_ready(self, models=("ensemble",)) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode}; log:\n{self.log_tail()}")
            if self._get("/v2/health/live") == 200 and all(
                    self._get(f"/v2/models/{m}/ready") == 200 for m in models):
                return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {self.startup_timeout:.0f}s; log:\n{self.log_tail()}")

    def log_tail(self, n=60) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def healthy(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self._get("/v2/health/ready") == 200

    def stop(self, timeout=40.0) -> Optional[int]:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)  # graceful: in-flight requests finish, models unload
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc):
        self.stop()


def serve(repo_dir, http_port=8000, grpc_port=8001, metrics_port=8002, host="127.0.0.1", model_control="none",
          wait=True, log=print, log_file=None) -> ServerProcess:
    """Start tritonserver, wait until the ensemble is ready, print the endpoints. With wait=True block until
    Ctrl-C / SIGTERM and stop the server cleanly; else return the running ServerProcess."""
    s = ServerProcess(repo_dir, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, host=host,
                      model_control=model_control, log_file=log_file)
    log(f"starting {s.cmd[0]} (log: {s.log_file})")
    s.start()
    for k, v in s.endpoints().items():
        log(f"{k:8s} {v}")
    if not wait:
        return s
    stop = {"sig": None}

    def handler(signum, _frame):
        stop["sig"] = signum

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while stop["sig"] is None and s.proc.poll() is None:
            time.sleep(0.5)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        log("stopping tritonserver" if stop["sig"] else f"tritonserver exited ({s.proc.returncode})")
        s.stop()
    return s
