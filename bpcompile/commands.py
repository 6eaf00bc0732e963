"""CLI commands backed by the runtime, evaluation and serving modules (imported lazily: `bpcompile --help`
stays fast and a missing optional dependency only affects the command that needs it)."""
from __future__ import annotations

import json
from pathlib import Path

import click


def _engine_dir(ref: str) -> Path:
    """ENGINE may be a version directory or `name[/N]` in ./engines."""
    from .errors import UserError
    from .store import EngineStore

    p = Path(ref)
    if (p / "manifest.json").is_file():
        return p
    try:
        return EngineStore("engines").resolve(ref).path
    except (FileNotFoundError, ValueError):
        raise UserError(f"no engine version at {ref!r} (give a version directory such as engines/tiny/1, "
                        "or NAME[/N] of ./engines)") from None


@click.command()
@click.argument("engine", required=False)
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option("--tree", default=None, help="Override the engine's tree: chain:5 | dynamic:5 | static:'[[0],[1],[0,0]]'.")
@click.option("--no-speculation", is_flag=True, help="Verifier-only decoding (the reference for speed and output).")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0))
@click.option("--seed", default=None, type=int)
@click.option("--url", default=None, help="Generate from a running server instead (host:port of its gRPC endpoint).")
@click.option("--json", "as_json", is_flag=True)
def generate(engine, prompt, max_tokens, tree, no_speculation, temperature, seed, url, as_json):
    """Generate from ENGINE in-process (streams tokens, prints statistics), or from a server with --url."""
    from .errors import UserError

    if url:
        from .triton.client import generate_remote_cli

        generate_remote_cli(url, prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, json_out=as_json)
        return
    if not engine:
        raise UserError("give an ENGINE (a version directory such as engines/tiny/1) or --url of a running server")
    from .runtime import generate_cli

    generate_cli(_engine_dir(engine), prompt, max_tokens=max_tokens, tree=tree, no_speculation=no_speculation,
                 temperature=temperature, seed=seed, json_out=as_json)


@click.command(name="eval")
@click.argument("engine")
@click.option("--json", "as_json", is_flag=True)
def eval_(engine, as_json):
    """KV-cache fidelity of ENGINE: perplexity, top-1 agreement and attention error per KV format."""
    from .evaluate import evaluate_engine

    click.echo(evaluate_engine(_engine_dir(engine), json_out=as_json))


COMMANDS: list = [generate, eval_]

try:  # serving commands: emit, serve, bench (their module imports tritonclient lazily too)
    from .triton.cli import COMMANDS as _SERVING

    COMMANDS += _SERVING
except ImportError:  # pragma: no cover - only while the serving package is absent
    pass
