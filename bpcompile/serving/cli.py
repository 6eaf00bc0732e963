"""Click commands for the serving side: `bpcompile emit`, `bpcompile serve`, `bpcompile bench --url`.
(`bpcompile generate --url` lives with `generate` in bpcompile/commands.py and calls client.generate_remote_cli.)
Thin: each parses options and calls one library function."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from bpcompile.core.errors import UserError
from bpcompile.core.store import no_verify_option
from bpcompile.core.switches import runtime_options


def _policy(text: str):
    """latest | all | latest:N | specific:1,2"""
    kind, _, arg = text.partition(":")
    try:
        if kind in ("latest", "all") and not arg:
            return kind
        if kind == "latest":
            return {"latest": int(arg)}
        if kind == "specific":
            return {"specific": [int(v) for v in arg.split(",")]}
    except ValueError:
        pass
    raise UserError(f"--policy {text!r}: expected latest, all, latest:N or specific:1,2")


def _version_of(engine_dir: Path) -> int:
    try:
        v = json.loads((engine_dir / "manifest.json").read_text()).get("version")
    except (OSError, ValueError):
        v = None
    v = v or (int(engine_dir.name) if engine_dir.name.isdigit() else None)
    if not v:
        raise UserError(f"{engine_dir}: cannot tell its version (no manifest.json version, not a numbered directory)")
    return int(v)


@click.command()
@click.argument("engines", nargs=-1)
@click.option(
    "--repo",
    default="triton_repo",
    show_default=True,
    type=click.Path(path_type=Path),
    help="Model repository to write.",
)
@click.option(
    "--add", is_flag=True, help="Add the ENGINES' versions to an existing repository (nothing served changes)."
)
@click.option(
    "--policy",
    default=None,
    help="Version policy: latest | all | latest:N | specific:1,2 (default: the "
    "recipe's). With no ENGINES, rewrite the policy of an existing repository (rollback), then reload.",
)
@click.option("--target", type=click.Choice(["native", "tensorrt-llm"]), default=None, help="Default: the recipe's.")
@click.option("--max-batch-size", type=click.IntRange(1), default=None, help="Default: the recipe's limits.")
@click.option("--no-speculation", is_flag=True, help="Serve verifier-only decoding (benchmark baseline).")
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda", "auto"]),
    default=None,
    help="Where the generator runs (cuda: GPU instance groups) [default: the recipe's runtime.device].",
)
@click.option(
    "--decoupled/--no-decoupled",
    default=None,
    help="tensorrt_llm and ensemble answer through a response stream (streaming, cancellation), or unary infer "
    "with the whole result (tensorrtllm_backend's decoupled_mode false) [default: the recipe's triton.decoupled].",
)
@click.option("--link", is_flag=True, help="Symlink engine versions instead of copying them.")
@click.option("--overwrite", is_flag=True, help="Replace an existing repository.")
@click.option(
    "--bls-from",
    type=click.Path(path_type=Path),
    default=None,
    help="Target tensorrt-llm with a draft: tensorrtllm_backend's all_models/inflight_batcher_llm/"
    "tensorrt_llm_bls/1 directory to copy the BLS model from (default: $BPCOMPILE_TRTLLM_BLS_DIR, "
    "else where TensorRT-LLM's Triton containers keep it).",
)
@click.option("--json", "as_json", is_flag=True)
def emit(
    engines,
    repo,
    add,
    policy,
    target,
    max_batch_size,
    no_speculation,
    device,
    decoupled,
    link,
    overwrite,
    bls_from,
    as_json,
):
    """Write a Triton model repository serving ENGINES (version directories, or NAME/N of ./engines)."""
    from bpcompile.core.store import engine_version_dir
    from bpcompile.serving.emit import add_version, emit_repository, set_version_policy

    pol = _policy(policy) if policy else None
    if not engines:
        if pol is None:
            raise UserError("give ENGINES to emit, or --policy to change the served versions of --repo")
        out = set_version_policy(repo, pol)
    else:
        dirs = [engine_version_dir(e) for e in engines]
        pairs = [(_version_of(d), d) for d in dirs]
        if add:
            out = {"added": [add_version(repo, v, d, link=link, bls_source=bls_from) for v, d in pairs]}
        else:
            out = emit_repository(
                pairs,
                repo,
                target=target,
                version_policy=pol,
                max_batch_size=max_batch_size,
                device=device,
                tree={"kind": "none"} if no_speculation else None,
                link=link,
                overwrite=overwrite,
                bls_source=bls_from,
                decoupled=decoupled,
            )
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
    else:
        click.echo(f"{repo}: " + json.dumps(out, default=str), err=True)


@click.command()
@click.argument("repo", default="triton_repo", type=click.Path(path_type=Path))
@runtime_options
@no_verify_option
@click.option("--http-port", default=8000, show_default=True, type=int)
@click.option("--grpc-port", default=8001, show_default=True, type=int)
@click.option("--metrics-port", default=8002, show_default=True, type=int)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 for all).")
@click.option(
    "--model-control",
    type=click.Choice(["none", "explicit", "poll"]),
    default="none",
    show_default=True,
    help="none: serve what REPO holds at start. explicit: the repository API loads and unloads models "
    "(new versions without a restart), for requests with the repository token only. poll: reload when "
    "REPO changes (whoever can write REPO runs code in the server).",
)
@click.option(
    "--repository-token",
    envvar="BPCOMPILE_REPOSITORY_TOKEN",
    show_envvar=True,
    default=None,
    help="Token the restricted tritonserver APIs (repository, shared memory, logging, trace, statistics) ask for "
    "in the header bpcompile-repository-token (default: a random one, printed with --model-control explicit/poll, "
    "told to nobody with none). Prefer the environment variable: a command line is visible to other local users.",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="On SIGTERM/SIGINT, seconds for running streams to finish before tritonserver is stopped.",
)
@click.option(
    "--openai-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Also serve an OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions) on this "
    "port, in front of tritonserver.",
)
@click.option(
    "--api-key",
    envvar="BPCOMPILE_API_KEY",
    default=None,
    help="With --openai-port: answer /v1 requests only with the header Authorization: Bearer <key> (401 "
    "otherwise; /health and /metrics stay open). Prefer the environment variable BPCOMPILE_API_KEY: a command "
    "line is visible to other local users.",
)
@click.option(
    "--health-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve GET /health on this port: 200 only while the repository can take requests (503 while starting, "
    "draining, or once a model process died). What a supervisor should probe.",
)
@click.option(
    "--open-shared-memory",
    is_flag=True,
    help="Leave tritonserver's shared-memory API open to every client (UNSAFE: a client can make the server "
    "write into its model processes' memory and abort it). Default: it needs the repository token.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="tritonserver's and bpcompile's log lines on stderr: as text, or one JSON object per line (time, level, "
    "logger, message; tritonserver's also pid and source) for a log collector.",
)
@click.option(
    "--log-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write tritonserver's log to this file instead of stderr (bpcompile's own lines stay on stderr).",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda", "auto"]),
    default=None,
    help="Where the generator runs: the repository's generator is re-placed before the server starts "
    "(cuda: GPU instances; auto: cuda where torch sees a GPU) [default: the repository's, i.e. the recipe's "
    "runtime.device].",
)
def serve(
    repo,
    http_port,
    grpc_port,
    metrics_port,
    host,
    model_control,
    repository_token,
    drain_timeout,
    openai_port,
    api_key,
    device,
    health_port,
    open_shared_memory,
    log_format,
    log_file,
):
    """Serve REPO with tritonserver until SIGINT / SIGTERM. The engine versions REPO holds are first checked
    against their manifests (exit 2 naming a changed file; --no-verify skips it).

    Exit code 0 after a requested, clean stop; 1 when tritonserver or a model process died (tritonserver is then
    stopped) or it did not stop cleanly; 2 for bad input, e.g. two endpoints on one port, or a repository for CUDA
    on a machine where torch sees no GPU."""
    from bpcompile.serving.emit import set_device
    from bpcompile.serving.serve import check_ports
    from bpcompile.serving.serve import serve as _serve

    # before anything is changed or started (serve checks again, for callers from Python)
    check_ports(
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        openai_port=openai_port,
        health_port=health_port,
    )

    from bpcompile.serving.logs import configure

    logger = configure(log_format)
    placed = set_device(repo, device)
    if placed["changed"]:
        logger.info(f"{repo}: the generator now runs on {placed['device']} (device {placed['setting']})")

    code = _serve(
        repo,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        host=host,
        model_control=model_control,
        repository_token=repository_token,
        drain_timeout=drain_timeout,
        log=logger.info,
        log_file=log_file,
        log_format=log_format,
        openai_port=openai_port,
        health_port=health_port,
        open_shared_memory=open_shared_memory,
        api_key=api_key,
    )
    sys.exit(code)


def _levels(ctx, param, value) -> list[int]:
    try:
        levels = sorted({int(v) for v in str(value).split(",") if v.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        raise click.BadParameter(f"{value!r}: expected a positive integer or a list such as 1,2,4,8")
    return levels


@click.command()
@click.option(
    "--url",
    required=True,
    help="host:port of the server's gRPC (--protocol http: HTTP) endpoint, or the "
    "base URL of an OpenAI-compatible API (--protocol openai: http://host:port/v1).",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Text file, one prompt per line (default: a few built-in prompts).",
)
@click.option(
    "-n",
    "--requests",
    "n",
    type=click.IntRange(1),
    default=32,
    show_default=True,
    help="Requests per concurrency level.",
)
@click.option(
    "--concurrency",
    "-c",
    default="1",
    show_default=True,
    callback=_levels,
    help="Clients in flight; a list (1,2,4,8) runs one level after another.",
)
@click.option("--max-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--protocol", type=click.Choice(["grpc", "http", "openai"]), default="grpc", show_default=True)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw TTFT, time per output token and throughput against concurrency into this PNG.",
)
@click.option(
    "--warmup",
    type=click.IntRange(0),
    default=1,
    show_default=True,
    help="Requests sent (the first prompts) before the timed ones. 0, e.g. to time the first sight of a prompt "
    "by a server that caches prompt prefixes.",
)
@click.option("--json", "as_json", is_flag=True)
def bench(url, prompts_file, n, concurrency, max_tokens, protocol, plot, warmup, as_json):
    """Load a running server and print what genai-perf prints (time to first and second token, inter-token
    latency, request latency, output tokens/s per user: avg, p50, p90, p99; output token and request
    throughput), plus tokens per verifier step. --json: those and more as JSON."""
    from bpcompile.serving.client import DEFAULT_PROMPTS, bench_remote

    prompts = [p for p in prompts_file.read_text().splitlines() if p.strip()] if prompts_file else DEFAULT_PROMPTS
    rows = []
    for level in concurrency:
        r = bench_remote(url, prompts, n=n, concurrency=level, max_tokens=max_tokens, protocol=protocol, warmup=warmup)
        rows.append(r)
        if not as_json:
            _show(r, max_tokens)
    if plot:
        from bpcompile.serving.plot import plot_sweep

        plot_sweep(rows, plot, title=f"{url} ({protocol}), {max_tokens} max tokens, {n} requests per level")
        if not as_json:
            click.echo(f"plot: {plot}")
    if as_json:
        click.echo(json.dumps(rows[0] if len(rows) == 1 else {"levels": rows}, indent=2))


# genai-perf's table: its metrics, per request (avg and percentiles), then the run's throughputs
_ROWS = (
    ("Time to first token (ms)", "time_to_first_token_s", 1e3),
    ("Time to second token (ms)", "time_to_second_token_s", 1e3),
    ("Inter token latency (ms)", "inter_token_latency_s", 1e3),
    ("Request latency (ms)", "request_latency_s", 1e3),
    ("Output token throughput per user (tokens/s)", "output_token_throughput_per_user", 1.0),
)


def _show(r: dict, max_tokens: int) -> None:
    click.echo(
        f"{r['requests']} requests ({r['errors']} errors), concurrency {r['concurrency']}, {max_tokens} max tokens; "
        f"tokens/verifier step {r['tokens_per_step'] or 0:.2f}, acceptance {r['acceptance_rate'] or 0:.2f}"
    )
    stats = ("avg", "p50", "p90", "p99")
    click.echo(f"{'':44s}" + "".join(f"{s:>10s}" for s in stats))
    for label, key, scale in _ROWS:
        cells = ["-" if r[key][s] is None else f"{r[key][s] * scale:.1f}" for s in stats]
        click.echo(f"{label:44s}" + "".join(f"{c:>10s}" for c in cells))
    click.echo(f"Output token throughput (tokens/s): {r['output_token_throughput'] or 0:.2f}")
    click.echo(f"Request throughput (requests/s): {r['request_throughput'] or 0:.2f}")


COMMANDS = [emit, serve, bench]
