"""Hostile load on a real tritonserver: clients that disconnect mid-stream and 10 MB prompts must not stall
anyone else.

64 streaming gRPC clients (tritonclient): 16 in a separate process that is SIGKILLed while its streams run
(the disconnect a crashed or hostile client makes), 48 that finish normally; then four 10 MB prompts. A normal
16-token request through the ensemble must stay within 3x of its solo latency. The engine's batch holds 16
requests, so the killed client's 16 long streams fill it: if they kept generating, everything else would
wait for their 400 tokens. What the generator does is read from the server itself: its metrics
(bpcompile_generator_*: steps, requests, KV pages) and the line it logs for each cancellation, naming the
generator step it was seen at.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("pytriton")

from bpcompile.serving.client import RemoteError, generate_remote  # noqa: E402
from bpcompile.serving.emit import emit_repository  # noqa: E402
from bpcompile.serving.serve import ServerProcess  # noqa: E402
from tests.serving_fixtures import REPO, make_engine  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

NORMAL = "def main():"
LIVE = ["The quick brown fox", "import os", "class Foo:", "for i in range(10):"]
LIVE_TOKENS = 8
KILLED, KILLED_TOKENS = 16, 400  # the batch size of the tiny recipe; long enough to outlast the test

# One process, 16 gRPC streams to the generator (where streaming clients go: there a disconnect reaches the
# generation loop); it writes the file named by argv[4] once every stream has had a response, then waits.
KILLED_CLIENT = r"""
import sys, time
from pathlib import Path
from bpcompile.serving.client import _grpc_client, _grpc_inputs, _request_fields
url, n, max_tokens, ready = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
clients = []
for i in range(n):
    c = _grpc_client(url)
    fields = _request_fields(f"Story number {i}:", max_tokens, True, 0, 0, 1.0, None, None, None)
    c.async_stream_infer("tensorrt_llm", _grpc_inputs(fields), request_id=f"killed-{i}")
    clients.append(c)
for c in clients:
    result, error = c._bp_queue.get(timeout=120)
    assert error is None, error
ready.write_text("streaming")
time.sleep(600)
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    engine = make_engine(root / "engines" / "1", 1)
    emit_repository([(1, engine)], root / "repo")
    s = ServerProcess(root / "repo", log_file=root / "server.log", startup_timeout=240)
    with s:
        yield s
    assert s.proc.returncode == 0, s.log_tail()


def metrics(s) -> dict[str, float]:
    """The generator's metrics (summed over instances), read from tritonserver's /metrics."""
    with urllib.request.urlopen(s.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^(bpcompile_generator_\w+)\{[^}]*\} (\S+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def wait_for(what, check, timeout: float):
    deadline = time.monotonic() + timeout
    while not (v := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return v


def cancellations(s) -> list[int]:
    """The generator step at which each cancellation was seen (from the server's log)."""
    return [
        int(m.group(1))
        for m in re.finditer(
            r"generator: cancelled request .*; generator step (\d+)\)", s.log_file.read_text(errors="replace")
        )
    ]


def test_disconnects_and_huge_prompts_do_not_stall_a_normal_request(served, tmp_path):
    s = served

    def normal() -> float:
        return generate_remote(s.grpc_url, NORMAL, 16, timeout=120)["latency_s"]

    for _ in range(2):
        normal()  # first requests pay one-time costs
    ref = {p: generate_remote(s.grpc_url, p, LIVE_TOKENS, model="tensorrt_llm")["token_ids"] for p in LIVE}
    solo = statistics.median(normal() for _ in range(3))

    ready = tmp_path / "ready"
    killed = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, s.grpc_url, str(KILLED), str(KILLED_TOKENS), str(ready)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        wait_for("the killed client's streams", lambda: ready.exists() or killed.poll() is not None, 120)
        assert killed.poll() is None, "the client process failed before streaming"

        live, errors = {}, []

        def stream(i: int):
            try:
                live[i] = generate_remote(
                    s.grpc_url, LIVE[i % len(LIVE)], LIVE_TOKENS, model="tensorrt_llm", timeout=120
                )
            except Exception as e:  # reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(64 - KILLED)]
        for t in threads:
            t.start()
        # all 64 streams are in the generator (16 running, 48 queued behind them) when the 16 lose their client
        wait_for(
            "64 requests in the generator", lambda: metrics(s).get("bpcompile_generator_requests") == 64 or errors, 60
        )
        steps_at_kill = metrics(s)["bpcompile_generator_steps_total"]
        killed.kill()
    finally:
        killed.kill()
        killed.wait(30)

    seen = wait_for("16 cancellations in the log", lambda: (c := cancellations(s)) and len(c) >= KILLED and c, 30)
    # The generator checks for cancellation before every step, so each disconnected stream ran at most the step
    # in progress when its client died (+1: a step may end between reading the counter and the kill).
    assert len(seen) == KILLED and max(seen) <= steps_at_kill + 2, (steps_at_kill, seen)
    for t in threads:
        t.join(120)
    assert not errors and len(live) == 64 - KILLED, errors[:3]
    for i, r in live.items():
        assert r["token_ids"] == ref[LIVE[i % len(LIVE)]] and r["out_of_order"] == 0  # same as solo

    # four 10 MB prompts, two through the ensemble (preprocessing) and two to the generator, while normal
    # requests run: refused on their size before any tokenizing, the normal requests do not wait for them
    refusals = []

    def huge(model: str):
        t0 = time.monotonic()
        try:
            generate_remote(s.grpc_url, "word " * (2 << 20), 4, model=model, timeout=120)
        except RemoteError as e:
            refusals.append((str(e), time.monotonic() - t0))

    attackers = [threading.Thread(target=huge, args=(m,)) for m in ("ensemble", "tensorrt_llm") * 2]
    for t in attackers:
        t.start()
    time.sleep(0.2)  # the prompts are on their way
    loaded = statistics.median(normal() for _ in range(3))
    for t in attackers:
        t.join(120)
    assert len(refusals) == 4 and all("more than this engine can take" in e for e, _ in refusals), refusals
    assert max(dt for _, dt in refusals) < 10, refusals
    assert loaded <= 3 * solo, (loaded, solo)

    # nothing left behind: no request in the generator, every KV page back, each disconnect counted once
    m = wait_for("an idle generator", lambda: (m := metrics(s))["bpcompile_generator_requests"] == 0 and m, 30)
    assert m["bpcompile_generator_kv_pages_used"] == 0 and m["bpcompile_generator_cancelled_total"] == KILLED, m
    assert s.healthy()
