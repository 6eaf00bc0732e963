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
        if p.is_dir() and p.parent != Path("."):  # an engine's directory in any store: its newest version
            return EngineStore(p.parent).resolve(p.name).path
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
@click.option("--chat/--raw", default=True, show_default=True,
              help="Wrap the prompt in the engine tokenizer's chat template as a user turn (where it has one).")
@click.option("--json", "as_json", is_flag=True)
def generate(engine, prompt, max_tokens, tree, no_speculation, temperature, seed, url, chat, as_json):
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
                 temperature=temperature, seed=seed, json_out=as_json, chat=chat)


def _lengths(ctx, param, value):
    """'512,1k,2k' -> [512, 1024, 2048]."""
    out = []
    for part in filter(None, (p.strip().lower() for p in (value or "").split(","))):
        try:
            n = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        except ValueError:
            n = 0
        if n < 16:
            raise click.BadParameter(f"{part!r}: expected token counts >= 16 such as 512,1k,2k,4k")
        out.append(n)
    return out


@click.command(name="eval")
@click.argument("engine")
@click.option("--text", "text", type=click.Path(dir_okay=False), default=None,
              help="UTF-8 text file to evaluate on [default: the builtin pydoc held-out split].")
@click.option("--sequences", default=16, show_default=True, type=click.IntRange(1), help="Windows of the text.")
@click.option("--length", default=256, show_default=True, type=click.IntRange(2), help="Tokens per window.")
@click.option("--plans", default=None, help="Comma-separated rows to evaluate (FP16 always): fp8, int8, "
              "int4-naive, 'int4+fp8 8%', 'unrotated int4+fp8 8%', engine [default: all but the unrotated row].")
@click.option("--passkey", "passkey", default="", callback=_lengths,
              help="Passkey-retrieval prompt lengths in tokens, e.g. 512,1k,2k,4k [default: none].")
@click.option("--passkey-trials", default=100, show_default=True, type=click.IntRange(1))
@click.option("--parity-prompts", default=0, show_default=True, type=click.IntRange(0),
              help="Greedy-continuation parity on this many prompts (0: skip).")
@click.option("--parity-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True)
def eval_(engine, text, sequences, length, plans, passkey, passkey_trials, parity_prompts, parity_tokens, seed,
          as_json):
    """KV-cache fidelity of ENGINE: perplexity, top-1 agreement and attention error per KV format; optionally
    passkey retrieval and greedy-continuation parity against FP16 KV."""
    from .evaluate import evaluate_engine

    click.echo(evaluate_engine(_engine_dir(engine), json_out=as_json, text=text, n=sequences, length=length,
                               plans=[p.strip() for p in plans.split(",") if p.strip()] if plans else None,
                               passkey_lengths=passkey, passkey_trials=passkey_trials,
                               parity_prompts=parity_prompts, parity_tokens=parity_tokens, seed=seed))


COMMANDS: list = [generate, eval_]

try:  # serving commands: emit, serve, bench (their module imports tritonclient lazily too)
    from .triton.cli import COMMANDS as _SERVING

    COMMANDS += _SERVING
except ImportError:  # pragma: no cover - only while the serving package is absent
    pass
