"""The OpenAI-compatible endpoint in front of a real tritonserver, driven by the `openai` package: the same text
as `bpcompile generate` (greedy) through /v1/completions and /v1/chat/completions, streamed and not; `stop`,
`usage`, and malformed requests answered 400/404 with the endpoint staying healthy. The server serves a copy of
the emitted repository whose original is gone and whose engine version has moved: a repository is
self-contained."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner

openai = pytest.importorskip("openai")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("pytriton")

from conftest import rerecord, update_engine_config  # noqa: E402

from bpcompile.cli import main  # noqa: E402
from bpcompile.core.store import MANIFEST, sha256_file  # noqa: E402
from bpcompile.serving.emit import emit_repository  # noqa: E402
from bpcompile.serving.openai_frontend import OpenAIFrontend  # noqa: E402
from bpcompile.serving.serve import ServerProcess  # noqa: E402
from tests.serving_fixtures import make_engine  # noqa: E402

pytestmark = pytest.mark.server

# A user-supplied chat template for the tiny pair (it ships none), written into the engine's tokenizer config:
# generate and the endpoint both render it through transformers.
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPTS = ["The import statement", "Exceptions are raised when"]
N = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = make_engine(tmp_path_factory.mktemp("engines") / "1", 1)
    cfg = e / "tokenizer" / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "chat_template": TEMPLATE}))
    man = json.loads((e / MANIFEST).read_text())  # recorded as a rebuild would, so the version still verifies
    man["artifacts"]["tokenizer/tokenizer_config.json"] = {"sha256": sha256_file(cfg), "bytes": cfg.stat().st_size}
    (e / MANIFEST).write_text(json.dumps(man))
    rerecord(e, "tokenizer/tokenizer_config.json")
    # prefix reuse on for this quantized plan (its default is off there); the other tests' prompts are shorter
    # than one KV page, so nothing of theirs is reused
    runtime = json.loads((e / "engine.json").read_text()).get("runtime", {})
    update_engine_config(e, runtime={**runtime, "prefix_reuse": True})
    return e


@pytest.fixture(scope="module")
def api(engine, tmp_path_factory):
    """The endpoint over a server of a *copied* repository: emitted in one directory, copied to another, the
    original removed and the engine version moved away, so any path into either would fail."""
    first = tmp_path_factory.mktemp("triton") / "repo"
    emit_repository([(1, engine)], first)
    repo = tmp_path_factory.mktemp("copied") / "repo"
    shutil.copytree(first, repo, symlinks=True)
    shutil.rmtree(first)
    engine.rename(engine.with_name("moved"))
    s = ServerProcess(repo, log_file=repo.parent / "server.log", startup_timeout=240)
    try:
        with s:
            front = OpenAIFrontend(repo, s.grpc_url).start()
            try:
                yield openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0), front
            finally:
                front.stop()
    finally:
        engine.with_name("moved").rename(engine)


def reference(engine, prompt: str, chat: bool) -> str:
    args = ["generate", str(engine.with_name("moved")), "--prompt", prompt, "--max-tokens", str(N), "--json"]
    res = CliRunner().invoke(main, args + ([] if chat else ["--raw"]))
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["chat_template"] is chat
    return out["text"]


def test_models(api):
    client, front = api
    assert [m.id for m in client.models.list().data] == [front.model_id] == ["tiny"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_generate(api, engine, stream):
    client, _ = api
    for p in PROMPTS:
        want = reference(engine, p, chat=False)
        if stream:
            chunks = list(
                client.completions.create(
                    model="tiny",
                    prompt=p,
                    max_tokens=N,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
            assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # it did stream
        else:
            r = client.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0)
            text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
            assert r.system_fingerprint == "tiny-v1"
        assert text == want
        assert finish == "length" and usage.completion_tokens == N and usage.prompt_tokens > 0
        assert usage.total_tokens == usage.prompt_tokens + N


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_equal_generate(api, engine, stream):
    client, _ = api
    for p in PROMPTS:
        want = reference(engine, p, chat=True)
        msgs = [{"role": "user", "content": p}]
        if stream:
            chunks = list(
                client.chat.completions.create(model="tiny", messages=msgs, max_tokens=N, temperature=0, stream=True)
            )
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=N, temperature=0)
            assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == N
            text = r.choices[0].message.content
        assert text == want


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_and_are_cut(api, engine, stream):
    client, _ = api
    want = reference(engine, PROMPTS[0], chat=False)
    words = [w for w in want.split() if want.find(w) > 2]
    assert words, want
    stop = words[0]
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0, stop=[stop, "\u2603never"])
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == want[: want.find(stop)] and finish == "stop"


def test_a_repeated_prompt_reports_cached_tokens(api):
    """A prompt sent again starts from the KV pages the first request computed: usage.prompt_tokens_details
    .cached_tokens says how many prompt tokens (whole 16-token pages, the last prompt token always computed),
    0 the first time."""
    client, _ = api
    prompt = " ".join(["Exceptions are raised when an error is detected."] * 6)
    first, again = (client.completions.create(model="tiny", prompt=prompt, max_tokens=4) for _ in range(2))
    n = first.usage.prompt_tokens
    assert n >= 32 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16


def test_malformed_requests_get_400_and_the_endpoint_stays_healthy(api):
    client, front = api
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=7)
    assert e.value.status_code == 400 and "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}], max_tokens=4)
    assert "role" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, n=3)
    assert "n is not supported" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # refused on its size, before it is tokenized
        client.completions.create(model="tiny", prompt="word " * 200_000, max_tokens=4)
    assert "bytes" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    req = urllib.request.Request(
        front.url + "/completions", data=b"{not json", method="POST", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "JSON" in json.loads(e.value.read())["error"]["message"]
    with urllib.request.urlopen(front.url.removesuffix("/v1") + "/health", timeout=30) as r:
        assert r.status == 200
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4 and r.choices[0].text


def test_bench_against_the_openai_endpoint_with_a_plot(api, tmp_path):
    """`bpcompile bench --protocol openai` over a concurrency sweep: both levels complete every request with the
    tokens asked for, percentiles present, and the PNG is drawn."""
    _, front = api
    png = tmp_path / "sweep.png"
    res = CliRunner().invoke(
        main,
        [
            "bench",
            "--url",
            front.url,
            "--protocol",
            "openai",
            "-n",
            "4",
            "--max-tokens",
            "8",
            "--concurrency",
            "1,2",
            "--plot",
            str(png),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    levels = json.loads(res.stdout)["levels"]
    assert [r["concurrency"] for r in levels] == [1, 2]
    for r in levels:
        assert r["requests"] == 4 and r["errors"] == 0 and r["output_tokens"] == 32
        assert 0 < r["ttft_s"]["p50"] <= r["latency_s"]["p50"] and r["tpot_s"]["p50"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
