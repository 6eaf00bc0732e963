"""Prefix reuse through a real tritonserver (the tiny pair's engine, its quantized KV plan, speculation on): 50
multi-turn conversations sharing a system prompt, 16 requests in flight, give the greedy tokens of the in-process
runtime with reuse off; the responses' kv_cache_reused_blocks and the generator's metrics show the reuse."""

from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("pytriton")

from bpcompile.serving.emit import emit_repository  # noqa: E402
from bpcompile.serving.serve import ServerProcess  # noqa: E402
from tests.serving_fixtures import make_engine  # noqa: E402
from tests.test_serving import stream_request  # noqa: E402

pytestmark = pytest.mark.server
CONVERSATIONS, TOKENS = 50, 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_engine(tmp_path_factory.mktemp("engines") / "1", 1)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton") / "repo"
    emit_repository([(1, engine)], repo)
    with ServerProcess(repo, log_file=repo.parent / "server.log", startup_timeout=240) as s:
        yield s


def ask(url: str, ids: list[int]) -> tuple[list[int], int]:
    """A token-id request to `tensorrt_llm` (greedy, no end id, perf metrics on) -> (its tokens, the KV blocks its
    prompt took from the prefix cache)."""
    inputs = {
        "input_ids": np.array([ids], np.int32),
        "input_lengths": np.array([[len(ids)]], np.int32),
        "request_output_len": np.array([[TOKENS]], np.int32),
        "temperature": np.array([[0.0]], np.float32),
        "end_id": np.array([[-1]], np.int32),
        "return_perf_metrics": np.array([[True]]),
        "exclude_input_in_output": np.array([[True]]),  # the generated tokens only (the default puts the prompt first)
    }
    (r,) = stream_request(url, "tensorrt_llm", inputs)
    n = int(r.as_numpy("sequence_length")[0][0])
    return [int(t) for t in r.as_numpy("output_ids")[0][0][:n]], int(r.as_numpy("kv_cache_reused_blocks")[0][0])


def test_conversations_through_the_server_equal_reuse_off(server, engine):
    import pydoc_data.topics as topics

    from tokenizers import Tokenizer

    from bpcompile.runtime.generator import Generator, SamplingParams

    tok = Tokenizer.from_file(str(engine / "tokenizer" / "tokenizer.json"))
    words = tok.encode(topics.topics["assert"] + topics.topics["assignment"]).ids
    system, rest = words[:70], words[70:]
    users = [[rest[(3 * c + t) * 5 : (3 * c + t) * 5 + 5] for t in range(3)] for c in range(CONVERSATIONS)]
    ref = Generator.from_engine(engine, prefix_reuse=False)
    hist = [list(system) for _ in users]
    reused = []
    with ThreadPoolExecutor(16) as pool:
        for t in range(3):
            prompts = [h + u[t] for h, u in zip(hist, users)]
            got = list(pool.map(lambda p: ask(server.grpc_url, p), prompts))
            want = [toks for toks, _ in ref.generate(prompts, SamplingParams(max_tokens=TOKENS))]
            assert [g for g, _ in got] == want, t
            reused.append([b for _, b in got])
            hist = [p + w for p, w in zip(prompts, want)]
    # every turn after the first takes at least the system prompt's 4 pages of 16 (most the previous turn's too)
    assert all(b >= len(system) // 16 for b in reused[1] + reused[2])
    assert sum(b >= len(system) // 16 for b in reused[0]) >= CONVERSATIONS - 16
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    metric = {m[0]: float(m[1]) for m in re.findall(r"^(bpcompile_generator_prefix_\w+)\{[^}]*\} (\S+)$", text, re.M)}
    assert metric["bpcompile_generator_prefix_hit_rate"] > 0.5 and metric["bpcompile_generator_prefix_cached_pages"] > 0
