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
import tempfile
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Optional

from bpcompile.core.errors import MissingDependency, UserError
from bpcompile.serving import drain
from bpcompile.serving.protocol import GRPC_REPOSITORY_HEADER, REPOSITORY_HEADER, TOKEN_ENV

_TOKEN = re.compile(r"[A-Za-z0-9._~-]{16,}")  # no , : = (the separators of tritonserver's flag)
# tritonserver APIs that answer only requests carrying the token header (gRPC: its metadata). shared-memory: a client
# registering a model stub's /dev/shm region as an output buffer has tritonserver write into the stub's IPC memory
# (it aborts); logging and trace change what the server records and where; statistics and the repository index
# tell what is served and how much; the repository API (load) runs a client's code in the server.
RESTRICTED = ("model-repository", "shared-memory", "logging", "trace", "statistics")
# Files tritonserver and the model stubs create readable and writable by this user only. It does not reach the
# Python backend's /dev/shm regions (which hold every request's tensors): boost.interprocess sets their mode to 0644
# with fchmod after creating them. Those get a private /dev/shm instead (PRIVATE_SHM), and mode 0600 (protect_regions).
UMASK = 0o077
# tritonserver in its own mount namespace over a private tmpfs /dev/shm (mode 0700): the stubs' regions are invisible
# to every process outside it from their creation on (a chmod after creation would leave a window in which another
# user opens one and keeps the descriptor). Needs CAP_SYS_ADMIN (root); probed before each start.
PRIVATE_SHM = (
    "-m",
    "--propagation",
    "private",
    "sh",
    "-c",
    'mount -t tmpfs -o mode=700,nosuid,nodev bpcompile-shm /dev/shm && exec "$@"',
    "sh",
)


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
    open_shared_memory=False,
    private_shm=False,
) -> tuple[list[str], dict]:
    """The tritonserver command line and environment. Nothing is started; run_dir (private to this run)
    receives the backends directory and is where the models look for the drain flag (drain.py).

    The APIs in RESTRICTED (the repository API, shared memory, logging, trace, statistics) answer only requests
    carrying the header REPOSITORY_HEADER: repository_token (gRPC: metadata GRPC_REPOSITORY_HEADER). Model control
    explicit or poll needs the token given; with none, a token given is used, else a random one nobody is told
    (what those APIs offer is then out of every client's reach). open_shared_memory leaves the shared-memory API
    open (unsafe: see RESTRICTED). private_shm: run it over a private /dev/shm (PRIVATE_SHM; see private_shm_works)."""
    repo = Path(repo_dir).resolve()
    if not (repo / "ensemble" / "config.pbtxt").is_file():
        raise UserError(
            f"{repo} is not a model repository emitted by bpcompile (no ensemble/config.pbtxt); "
            f"run `bpcompile emit` first",
            file=str(repo),
        )
    if model_control not in ("none", "explicit", "poll"):
        raise UserError(f"model_control must be none, explicit or poll, got {model_control!r}")
    if (model_control != "none" or repository_token) and not _TOKEN.fullmatch(repository_token or ""):
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
    apis = ",".join(a for a in RESTRICTED if not (open_shared_memory and a == "shared-memory"))
    token = repository_token or secrets.token_urlsafe(24)
    args += [
        f"--http-restricted-api={apis}:{REPOSITORY_HEADER}={token}",
        f"--grpc-restricted-protocol={apis}:{REPOSITORY_HEADER}={token}",
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
    if private_shm:
        cmd = [shutil.which("unshare") or "unshare", *PRIVATE_SHM, *cmd]
    return cmd, env


def private_shm_works() -> bool:
    """Whether this process may give tritonserver a private /dev/shm (PRIVATE_SHM): root, util-linux unshare."""
    unshare = shutil.which("unshare")
    if unshare is None or not Path("/dev/shm").is_dir():
        return False
    try:
        return subprocess.run([unshare, *PRIVATE_SHM, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


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

    `repository_token` (generated when not given) is what the restricted APIs ask for (see server_command).
    Model instances that die (killed, crashed) without being unloaded are reported by dead_instances().

    Its log: to `log_file` when given, else to this process's stderr; log_format "json" writes one JSON object per
    line (serving/logs.py) instead of tritonserver's text. Either way log_tail() has the last lines."""

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
        open_shared_memory=False,
        log_format="text",
    ):
        self.repo_dir, self.host, self.model_control = repo_dir, host, model_control
        self.log_format = log_format
        self.tail: deque = deque(maxlen=400)  # the last lines, when they pass through this process
        self.pump: Optional[threading.Thread] = None
        self.open_shared_memory = open_shared_memory
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.repository_token = repository_token or secrets.token_urlsafe(24)
        self.load_models, self.log_verbose, self.exit_timeout = load_models, log_verbose, exit_timeout
        self.log_file = Path(log_file) if log_file else None
        self.startup_timeout = startup_timeout
        self.proc: Optional[subprocess.Popen] = None
        # a client's shared-memory regions live in the real /dev/shm: an open API needs the server to see it
        self.private_shm: Optional[bool] = None
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
            "log": self.log_where,
        }

    @property
    def log_where(self) -> str:
        return str(self.log_file) if self.log_file else "stderr"

    def _log_lines(self, pipe, out) -> None:
        """tritonserver's output (and its stubs', which share it), line by line, to `out` as text or JSON."""
        from bpcompile.serving.logs import TritonLines

        fmt = TritonLines() if self.log_format == "json" else None
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.tail.append(line)
            try:
                out.write((fmt(line) if fmt else line) + "\n")
                out.flush()
            except (OSError, ValueError):  # our stderr closed: keep draining, or tritonserver blocks on a full pipe
                pass
        pipe.close()

    def _note(self, message: str) -> None:
        """A line of our own in tritonserver's log."""
        from bpcompile.serving.logs import json_line

        line = json_line("INFO", "bpcompile.serve", message) if self.log_format == "json" else f"bpcompile: {message}"
        self.tail.append(line)
        if self.log_file:
            with open(self.log_file, "a") as log:
                log.write(line + "\n")
        else:
            print(line, file=sys.stderr, flush=True)

    def start(self) -> "ServerProcess":
        self.run_dir = Path(tempfile.mkdtemp(prefix="bpcompile-serve-"))
        self.private_shm = not self.open_shared_memory and private_shm_works()
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
                open_shared_memory=self.open_shared_memory,
                private_shm=self.private_shm,
            )
            # tritonserver writes a text log file itself; anything else passes through a thread of ours
            direct = self.log_file is not None and self.log_format == "text"
            out = open(self.log_file, "ab" if direct else "a") if self.log_file else sys.stderr
            try:
                # own process group: a terminal's Ctrl-C reaches only us, and we stop the server deliberately
                # the repository is the working directory: TensorRT-LLM engine paths in it are relative to it
                self.proc = subprocess.Popen(
                    self.cmd,
                    env=env,
                    stdout=out if direct else subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=str(Path(self.repo_dir).resolve()),
                    umask=UMASK,
                )
            finally:
                if direct:
                    out.close()
            if not direct:
                self.pump = threading.Thread(
                    target=self._log_lines, args=(self.proc.stdout, out), name="tritonserver-log", daemon=True
                )
                self.pump.start()
            self.wait_ready()
            self.protect_regions()
            if not self.private_shm:
                self._note(
                    "no private /dev/shm for tritonserver (not root, or --open-shared-memory): its "
                    "shared-memory regions are mode 0600 from a moment after their creation"
                )
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
        if self.pump is not None or self.log_file is None:
            return "\n".join(list(self.tail)[-n:])
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def healthy(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self._get("/v2/health/ready") == 200

    def dead_instances(self) -> list[tuple[str, int]]:
        """(model, pid) of model instances whose process died without being unloaded (drain.py)."""
        return drain.dead_instances(self.run_dir) if self.run_dir is not None else []

    def failed_instances(self) -> list[tuple[str, int, str]]:
        """(model, pid, why) of live model instances that cannot serve any more (drain.py)."""
        return drain.failed_instances(self.run_dir) if self.run_dir is not None else []

    def _stubs(self) -> list[tuple[int, list[str]]]:
        """(pid, command line) of tritonserver's child processes (the Python backend stubs)."""
        out = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                pids = (task / "children").read_text().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    out.append(
                        (int(pid), Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0"))
                    )
                except OSError:
                    pass
        return out

    def regions(self) -> list[Path]:
        """The stubs' shared-memory regions, as paths through each stub's root (a private /dev/shm or the real one)."""
        out = []
        for pid, cmd in self._stubs():
            if len(cmd) > 2 and cmd[0].endswith("triton_python_backend_stub") and "/" not in cmd[2]:
                out.append(Path(f"/proc/{pid}/root/dev/shm/{cmd[2]}"))
        return out

    def protect_regions(self) -> None:
        """Mode 0600 for every stub's region (boost.interprocess creates them 0644; see UMASK)."""
        for p in self.regions():
            try:
                if stat.S_IMODE(p.stat().st_mode) != 0o600:
                    p.chmod(0o600)
            except OSError:  # the stub went away meanwhile
                pass

    def kill(self) -> None:
        """SIGKILL tritonserver and its stubs now (open streams end with a connection error, not a hang), and
        remove the stubs' shared-memory regions, which only a clean shutdown removes."""
        if self.proc is None or self.proc.poll() is not None:
            return
        regions = [p.name for p in self.regions()]
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for name in regions:  # (a private /dev/shm went with its last process)
            Path("/dev/shm", name).unlink(missing_ok=True)

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
                    self.kill()
        finally:
            if self.run_dir is not None:
                shutil.rmtree(self.run_dir, ignore_errors=True)
                self.run_dir = None
        return None if self.proc is None else self.proc.returncode

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc):
        self.stop()


class Health:
    """Whether the served repository can take requests, as `bpcompile serve` reports it on /health (--health-port,
    and the OpenAI endpoint's): tritonserver's own /v2/health/ready cannot say "draining" (2.51 has no switch for
    it; its model readiness is load state only), and stays 200 for a model whose stub process died."""

    def __init__(self, server: ServerProcess):
        self.server, self.started, self.stopping = server, False, None

    def problem(self) -> Optional[str]:
        """None when ready, else why not."""
        p = self.server.proc
        if self.stopping:
            return self.stopping
        if p is None or not self.started:
            return "starting"
        if p.poll() is not None:
            return f"tritonserver exited ({describe_exit(p.returncode)})"
        dead = self.server.dead_instances()
        if dead:
            return f"model {', '.join(f'{m} (pid {pid})' for m, pid in dead)} died"
        failed = self.server.failed_instances()
        return "; ".join(f"model {m} (pid {pid}) failed: {why}" for m, pid, why in failed) or None


class HealthServer:
    """GET /health: 200 {"status": "ready"} or 503 {"status": "unavailable", "reason": ...} from Health.problem."""

    def __init__(self, host: str, port: int, problem):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path.split("?")[0].rstrip("/") not in ("/health", "/health/ready"):
                    code, body = 404, {"error": f"no route GET {self.path}"}
                else:
                    why = problem()
                    code, body = (
                        (200, {"status": "ready"}) if why is None else (503, {"status": "unavailable", "reason": why})
                    )
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/health"

    def start(self) -> "HealthServer":
        import threading

        threading.Thread(target=self.httpd.serve_forever, name="bpcompile-health", daemon=True).start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def check_ports(**ports) -> None:
    """Each endpoint its own port (option name -> port; None: not served), refused before anything starts."""
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port is None:
            continue
        opt = "--" + name.replace("_", "-")
        if port in seen:
            raise UserError(f"{seen[port]} and {opt} are both {port}: give each endpoint its own port", key=opt)
        seen[port] = opt


def check_openai_repository(repo_dir) -> None:
    """The OpenAI endpoint streams every choice from the generator (a client's disconnect reaches its loop only
    through a response stream), which a repository emitted with triton.decoupled false cannot do: refused before
    anything starts, naming the setting."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from bpcompile.serving.emit import GENERATOR

    path = Path(repo_dir) / GENERATOR / "config.pbtxt"
    try:
        cfg = text_format.Parse(path.read_text(), mc.ModelConfig())
    except (OSError, text_format.ParseError):
        return  # no such model or an unreadable config: tritonserver's own error says which
    if not cfg.model_transaction_policy.decoupled:
        raise UserError(
            "model_transaction_policy.decoupled is false (emitted with triton.decoupled false / emit "
            "--no-decoupled), and --openai-port streams from this model: re-emit the repository with --decoupled, "
            "or serve it without --openai-port",
            file=str(path),
            key="triton.decoupled",
        )


def _bind(opt: str, port: int, make):
    try:
        return make()
    except OSError as e:
        raise UserError(f"{opt} {port}: cannot listen there ({e.strerror})", key=opt) from None


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
    log_format="text",
    openai_port=None,
    health_port=None,
    open_shared_memory=False,
    api_key=None,
) -> int:
    """Start tritonserver, wait until the ensemble is ready, print the endpoints, and block until SIGINT or
    SIGTERM; then drain and stop it (a second signal skips what is left of the drain). openai_port: also serve
    the OpenAI-compatible endpoint there (serving/openai_frontend.py), in this process, asking for `api_key` as
    `Authorization: Bearer` where given; health_port: serve
    /health there (Health), which is what a supervisor should probe.

    A model instance whose process dies (killed, crashed) is not recovered in place: tritonserver keeps it
    "ready" while its requests hang, so serve kills tritonserver at once (open streams get a connection error, not
    a hang; readiness is false everywhere) and returns 1 for a supervisor to restart it.

    Returns the exit code for a supervisor: 0 when a signal asked for the stop and tritonserver exited
    cleanly; 1 when tritonserver or a model instance died by itself, or tritonserver did not stop cleanly."""
    from bpcompile.serving import emit
    from bpcompile.serving.integrity import verify_before_serving

    check_ports(
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        openai_port=openai_port,
        health_port=health_port,
    )
    if openai_port is not None:
        check_openai_repository(repo_dir)
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
        open_shared_memory=open_shared_memory,
        log_format=log_format,
    )
    health = Health(s)
    signals = []
    frontend = checker = None
    old = {
        sig: signal.signal(sig, lambda signum, _frame: signals.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        # both listen before tritonserver starts: a port in use is an error naming its option, nothing started
        if health_port is not None:
            checker = _bind("--health-port", health_port, lambda: HealthServer(host, health_port, health.problem))
            checker.start()  # 503 "starting" until the ensemble is ready
        if openai_port is not None:
            from bpcompile.serving.openai_frontend import OpenAIFrontend

            frontend = _bind(
                "--openai-port",
                openai_port,
                lambda: OpenAIFrontend(repo_dir, s.grpc_url, host=host, port=openai_port, api_key=api_key),
            )
            frontend.health = health.problem
        log(f"starting tritonserver (log: {s.log_where})")
        s.start()
        health.started = True
        log(f"tritonserver pid {s.proc.pid}, model control {model_control}")
        if frontend is not None:
            frontend.start()
        ends = s.endpoints()
        extra = {"openai": frontend and frontend.url, "health": checker and checker.url}
        # before the log line, which supervisors and tests take as "ready"
        ends = {**{k: v for k, v in ends.items() if k != "log"}, **{k: v for k, v in extra.items() if v}}
        ends["log"] = s.log_where
        for k, v in ends.items():
            log(f"{k:8s} {v}")
        apis = ", ".join(a for a in RESTRICTED if not (open_shared_memory and a == "shared-memory"))
        if repository_token or model_control != "none":
            shown = f"${TOKEN_ENV}" if repository_token else s.repository_token
            log(
                f"restricted APIs ({apis}): only with header {REPOSITORY_HEADER}: {shown} (gRPC metadata {GRPC_REPOSITORY_HEADER})"
            )
        else:
            log(f"restricted APIs ({apis}): closed (set ${TOKEN_ENV} to reach them with header {REPOSITORY_HEADER})")
        if open_shared_memory:
            log("shared-memory API open to every client (--open-shared-memory): unsafe, see docs/SECURITY.md")
        dead = []
        while not signals and s.proc.poll() is None and not dead:
            time.sleep(0.2)
            dead = s.dead_instances() or s.failed_instances()
            if not s.private_shm:
                s.protect_regions()  # new stubs (a version loaded) have new regions
        if dead:
            health.stopping = health.problem()
            log(f"{health.stopping}: stopping tritonserver (exit 1: a supervisor restarts serve)")
            s.kill()
            if frontend is not None:
                frontend.stop(wait=5)  # open OpenAI streams end with their error event
            return 1
        if not signals:
            code = s.proc.returncode
            s.stop()
            log(f"tritonserver exited by itself ({describe_exit(code)}); log: {s.log_where}")
            return 1
        log(f"{signal.Signals(signals[0]).name}: draining (up to {drain_timeout:g}s; again to stop now)")
        health.stopping = "shutting down"
        if frontend is not None:
            frontend.accepting = False  # new OpenAI requests get 503 while the running ones finish
        code = s.stop(drain_timeout=drain_timeout, stop_waiting=lambda: len(signals) > 1)
        log(f"tritonserver stopped ({describe_exit(code)})")
        return 0 if code == 0 else 1
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        s.stop(drain_timeout=0)
        for srv in (frontend, checker):
            if srv is not None:
                srv.stop()
