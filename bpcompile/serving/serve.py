"""Start tritonserver on an emitted repository.

The binary: `tritonserver` on PATH (the NGC container), else the one bundled in the nvidia-pytriton wheel.
For the bundled one we do what pytriton does (pytriton/triton.py `_prepare_triton_inference_server`,
pytriton/server/triton_server.py `_get_env`): lay out a backends directory, private to the run, whose python/
holds libtriton_python.so plus the stub built for *this* Python version (python_backend_stubs/<major.minor>/), put
the wheel's bundled libraries (nvidia_pytriton.libs) on LD_LIBRARY_PATH, and put this interpreter's bin/ first
on PATH. The stub embeds libpython and, like any embedded interpreter, finds its prefix by looking up
`python3` on PATH: with the venv's bin/ first it reads the venv's pyvenv.cfg and sees the venv's
site-packages (torch, tokenizers, ...). PYTHONPATH adds the directory holding `bpcompile` so the models can
import it from a source checkout.
"""

from __future__ import annotations

import os
import re
import secrets
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

from bpcompile.core.errors import MissingDependency, UserError
from bpcompile.serving import drain
from bpcompile.serving.protocol import GRPC_REPOSITORY_HEADER, REPOSITORY_HEADER, TOKEN_ENV

_TOKEN = re.compile(r"[A-Za-z0-9._~-]{16,}")  # no , : = (the separators of tritonserver's flag)


def _pytriton_dist() -> Optional[Path]:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")  # located, not imported: importing pytriton is slow
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    return d if (d / "bin" / "tritonserver").is_file() else None


def _prepare_backends(dist: Path, run_dir: Path) -> Path:
    """run_dir/backends, whose python/ = the wheel's backend library + the stub for this Python version.

    Per run, inside a private directory (mkdtemp: mode 0700, unpredictable name): tritonserver executes the
    stub it finds there, so a shared or predictable path would run whatever another local user planted."""
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise MissingDependency(f"nvidia-pytriton has no Python backend stub for Python {ver} ({stub})")
    dst = run_dir / "backends"
    shutil.copytree(dist / "backends", dst, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, dst / "python" / "triton_python_backend_stub")
    return dst


def server_command(
    repo_dir,
    run_dir,
    *,
    http_port=8000,
    grpc_port=8001,
    metrics_port=8002,
    host="127.0.0.1",
    model_control="none",
    repository_token=None,
    load_models=("*",),
    log_verbose=0,
    exit_timeout=30,
    extra_args=(),
) -> tuple[list[str], dict]:
    """The tritonserver command line and environment. Nothing is started; run_dir (private to this run)
    receives the backends directory and is where the models look for the drain flag (drain.py).

    With model control explicit or poll, the repository API (index, load, unload) answers only requests
    carrying the header REPOSITORY_HEADER: repository_token (gRPC: metadata GRPC_REPOSITORY_HEADER): a load
    request can carry a model's files, so an open one runs any client's code in the server."""
    repo = Path(repo_dir).resolve()
    if not (repo / "ensemble" / "config.pbtxt").is_file():
        raise UserError(
            f"{repo} is not a model repository emitted by bpcompile (no ensemble/config.pbtxt); "
            f"run `bpcompile emit` first",
            file=str(repo),
        )
    if model_control not in ("none", "explicit", "poll"):
        raise UserError(f"model_control must be none, explicit or poll, got {model_control!r}")
    if model_control != "none" and not _TOKEN.fullmatch(repository_token or ""):
        raise UserError(
            f"model control {model_control} needs a repository API token: at least 16 characters "
            f"among letters, digits and . _ ~ - (${TOKEN_ENV})",
            key="repository_token",
        )
    env = dict(os.environ)
    binary = shutil.which("tritonserver")
    args: list[str] = []
    if binary is None:
        dist = _pytriton_dist()
        if dist is None:
            raise MissingDependency(
                "tritonserver is not on PATH and nvidia-pytriton (which bundles it) is not "
                "installed: pip install 'bpcompile[serve]', or use the NGC tritonserver container"
            )
        binary = str(dist / "bin" / "tritonserver")
        libs = dist.parent.parent / "nvidia_pytriton.libs"
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (env.get("LD_LIBRARY_PATH"), str(libs)) if p)
        args += [
            f"--backend-directory={_prepare_backends(dist, Path(run_dir))}",
            f"--cache-directory={dist / 'caches'}",
        ]
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    src = str(Path(__file__).resolve().parents[2])  # the directory holding the bpcompile package
    env["PYTHONPATH"] = ":".join(p for p in (src, env.get("PYTHONPATH")) if p)
    env[drain.ENV] = str(run_dir)
    env.pop(TOKEN_ENV, None)  # the models have no use for it
    args += [
        f"--model-repository={repo}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        f"--http-address={host}",
        f"--grpc-address={host}",
        f"--metrics-address={host}",
        f"--model-control-mode={model_control}",
        f"--log-verbose={log_verbose}",
        f"--exit-timeout-secs={exit_timeout}",
    ]
    if model_control != "none":
        args += [
            f"--http-restricted-api=model-repository:{REPOSITORY_HEADER}={repository_token}",
            f"--grpc-restricted-protocol=model-repository:{REPOSITORY_HEADER}={repository_token}",
        ]
    if model_control == "explicit":
        args += [f"--load-model={m}" for m in load_models]
    if model_control == "poll":
        args += ["--repository-poll-secs=2"]
    cmd = [binary, *args, *extra_args]
    world, engines = trtllm_world(repo)
    if world > 1:  # TensorRT-LLM engines over several GPUs: one tritonserver per rank under MPI
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            raise MissingDependency(
                f"{repo} serves TensorRT-LLM engines built for {world} ranks (tp x pp), which "
                "tritonserver runs as one process per rank under MPI: mpirun is not on PATH "
                "(serve inside TensorRT-LLM's Triton container)",
                key="target",
            )
        cmd = mpi_command(cmd, world, engines, mpirun)
    return cmd, env


def trtllm_world(repo: Path) -> tuple[int, list[str]]:
    """(world size, the tensorrtllm-backend models) of a repository: tp x pp of its newest TensorRT-LLM engine
    version; (1, []) for the native target."""
    import json

    try:
        summary = json.loads((repo / "bpcompile_repository.json").read_text())
    except (OSError, ValueError):
        return 1, []
    if summary.get("target") != "tensorrt-llm" or not summary.get("versions"):
        return 1, []
    from bpcompile.core.engine import EngineConfig
    from bpcompile.serving.emit import DRAFT, GENERATOR

    newest = max(v["version"] for v in summary["versions"])
    par = EngineConfig.load(repo / GENERATOR / str(newest) / "engine").parallel
    return par.tp * par.pp, [m for m in (GENERATOR, DRAFT) if (repo / m / "config.pbtxt").is_file()]


def mpi_command(cmd: list[str], world: int, trtllm_models: list[str], mpirun: str = "mpirun") -> list[str]:
    """tritonserver once per rank under one mpirun, as tensorrtllm_backend launches a multi-GPU engine: rank 0 is
    the server clients talk to; ranks 1.. load only the TensorRT-LLM models (explicit model control), whose
    backend joins them to rank 0's executor. Each rank's Python backend gets its own shared-memory prefix."""
    drop = (
        "--model-control-mode=",
        "--load-model=",
        "--repository-poll-secs=",
        "--http-restricted-api=",
        "--grpc-restricted-protocol=",
    )
    out = [mpirun, "--allow-run-as-root"]
    for rank in range(world):
        args = (
            cmd
            if rank == 0
            else [a for a in cmd if not a.startswith(drop)]
            + ["--model-control-mode=explicit"]
            + [f"--load-model={m}" for m in trtllm_models]
        )
        out += [
            "-n",
            "1",
            *args,
            "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
        ]
        if rank < world - 1:
            out.append(":")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ServerProcess:
    """A running tritonserver; a context manager (`with ServerProcess(repo) as s: s.http_url`).

    With model control explicit or poll, `repository_token` (generated when not given) is what the
    repository API asks for (see server_command)."""

    def __init__(
        self,
        repo_dir,
        *,
        http_port=None,
        grpc_port=None,
        metrics_port=None,
        host="127.0.0.1",
        model_control="none",
        repository_token=None,
        load_models=("*",),
        log_file=None,
        startup_timeout=300.0,
        log_verbose=0,
        exit_timeout=30,
    ):
        self.repo_dir, self.host, self.model_control = repo_dir, host, model_control
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.repository_token = repository_token or (secrets.token_urlsafe(24) if model_control != "none" else None)
        self.load_models, self.log_verbose, self.exit_timeout = load_models, log_verbose, exit_timeout
        self.log_file = Path(log_file) if log_file else Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        self.startup_timeout = startup_timeout
        self.proc: Optional[subprocess.Popen] = None
        self.run_dir: Optional[Path] = None
        self.cmd: Optional[list[str]] = None

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
        return {
            "http": f"http://{self.http_url}",
            "grpc": self.grpc_url,
            "metrics": self.metrics_url,
            "log": str(self.log_file),
        }

    def start(self) -> "ServerProcess":
        self.run_dir = Path(tempfile.mkdtemp(prefix="bpcompile-serve-"))
        try:
            self.cmd, env = server_command(
                self.repo_dir,
                self.run_dir,
                http_port=self.http_port,
                grpc_port=self.grpc_port,
                metrics_port=self.metrics_port,
                host=self.host,
                model_control=self.model_control,
                repository_token=self.repository_token,
                load_models=self.load_models,
                log_verbose=self.log_verbose,
                exit_timeout=self.exit_timeout,
            )
            with open(self.log_file, "ab") as log:
                # own process group: a terminal's Ctrl-C reaches only us, and we stop the server deliberately
                # the repository is the working directory: TensorRT-LLM engine paths in it are relative to it
                self.proc = subprocess.Popen(
                    self.cmd,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=str(Path(self.repo_dir).resolve()),
                )
            self.wait_ready()
        except BaseException:
            self.stop(drain_timeout=0)
            raise
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
                raise RuntimeError(
                    f"tritonserver exited ({describe_exit(self.proc.returncode)}); log:\n{self.log_tail()}"
                )
            if self._get("/v2/health/live") == 200 and all(self._get(f"/v2/models/{m}/ready") == 200 for m in models):
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {self.startup_timeout:.0f}s; log:\n{self.log_tail()}")

    def log_tail(self, n=60) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def healthy(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self._get("/v2/health/ready") == 200

    def drain(self, timeout: float = 30.0, stop_waiting=lambda: False) -> bool:
        """Generators refuse new requests and finish their running ones; True when all went idle in time."""
        if self.proc is None or self.proc.poll() is not None or self.run_dir is None:
            return False
        done = drain.drain(self.run_dir, timeout, stop_waiting)
        if done:
            time.sleep(0.5)  # the last final responses still pass through postprocessing, a new request each
        return done

    def stop(self, drain_timeout: float = 30.0, stop_waiting=lambda: False) -> Optional[int]:
        """Drain (up to drain_timeout s), then SIGTERM tritonserver: it unloads the models and exits. SIGKILL
        for its whole process group (the Python backend stubs too) if it has not exited exit_timeout + 15 s
        later. Returns tritonserver's exit status (negative: the signal that ended it)."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                if drain_timeout > 0:
                    self.drain(drain_timeout, stop_waiting)
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(self.exit_timeout + 15)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
        finally:
            if self.run_dir is not None:
                shutil.rmtree(self.run_dir, ignore_errors=True)
                self.run_dir = None
        return None if self.proc is None else self.proc.returncode

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc):
        self.stop()


def serve(
    repo_dir,
    http_port=8000,
    grpc_port=8001,
    metrics_port=8002,
    host="127.0.0.1",
    model_control="none",
    repository_token=None,
    drain_timeout=30.0,
    log=print,
    log_file=None,
    openai_port=None,
) -> int:
    """Start tritonserver, wait until the ensemble is ready, print the endpoints, and block until SIGINT or
    SIGTERM; then drain and stop it (a second signal skips what is left of the drain). openai_port: also serve
    the OpenAI-compatible endpoint there (serving/openai_frontend.py), in this process.

    Returns the exit code for a supervisor: 0 when a signal asked for the stop and tritonserver exited
    cleanly; 1 when tritonserver died by itself (any code or signal) or did not stop cleanly."""
    from bpcompile.serving import emit
    from bpcompile.serving.integrity import verify_before_serving

    # A build killed mid-switch leaves some models on the new version and some on the old one until the next
    # emission replays its journal: replay it here too, so a server never loads a half-switched repository.
    if (Path(repo_dir) / emit.MARKER).is_file():
        for line in emit.repair_repository(repo_dir):
            log(f"repaired repository: {line}")
    verify_before_serving(repo_dir, log)  # a tampered engine file: exit 2 naming it, before tritonserver starts
    s = ServerProcess(
        repo_dir,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        host=host,
        model_control=model_control,
        repository_token=repository_token,
        log_file=log_file,
    )
    signals = []
    frontend = None
    old = {
        sig: signal.signal(sig, lambda signum, _frame: signals.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        log(f"starting tritonserver (log: {s.log_file})")
        s.start()
        log(f"tritonserver pid {s.proc.pid}, model control {model_control}")
        if openai_port is not None:
            from bpcompile.serving.openai_frontend import OpenAIFrontend

            frontend = OpenAIFrontend(repo_dir, s.grpc_url, host=host, port=openai_port).start()
        ends = s.endpoints()
        if frontend is not None:  # before the log line, which supervisors and tests take as "ready"
            ends = {**{k: v for k, v in ends.items() if k != "log"}, "openai": frontend.url, "log": ends["log"]}
        for k, v in ends.items():
            log(f"{k:8s} {v}")
        if model_control != "none":
            shown = f"${TOKEN_ENV}" if repository_token else s.repository_token
            log(
                f"repository API: only with header {REPOSITORY_HEADER}: {shown} "
                f"(gRPC metadata {GRPC_REPOSITORY_HEADER})"
            )
        while not signals and s.proc.poll() is None:
            time.sleep(0.2)
        if not signals:
            code = s.proc.returncode
            s.stop()
            log(f"tritonserver exited by itself ({describe_exit(code)}); log: {s.log_file}")
            return 1
        log(f"{signal.Signals(signals[0]).name}: draining (up to {drain_timeout:g}s; again to stop now)")
        if frontend is not None:
            frontend.accepting = False  # new OpenAI requests get 503 while the running ones finish
        code = s.stop(drain_timeout=drain_timeout, stop_waiting=lambda: len(signals) > 1)
        log(f"tritonserver stopped ({describe_exit(code)})")
        return 0 if code == 0 else 1
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        s.stop(drain_timeout=0)
        if frontend is not None:
            frontend.stop()
