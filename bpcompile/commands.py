"""CLI commands backed by the runtime, evaluation and serving modules (imported lazily: `bpcompile --help`
stays fast and a missing optional dependency only affects the command that needs it)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import click

from bpcompile.core.errors import UserError
from bpcompile.core.store import MANIFEST, engine_version_dir, no_verify_option, verify_enabled, verify_version
from bpcompile.core.switches import runtime_options


def _device(value: Optional[str]) -> Optional[str]:
    """A torch device string (or auto, or None: the engine's runtime.device), checked before any model is loaded
    (exit 2 naming the option)."""
    import torch

    if value in (None, "auto"):
        return value
    try:
        dev = torch.device(value)
    except RuntimeError:
        raise UserError(f"--device {value!r}: expected cpu, cuda or cuda:N", key="device") from None
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"--device {value!r}: expected cpu, cuda or cuda:N", key="device")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {value}: this machine's torch sees no CUDA device", key="device")
    return value


@click.command()
@click.argument("engine", required=False)
@runtime_options
@no_verify_option
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option(
    "--tree", default=None, help="Override the engine's tree: chain:5 | dynamic:5 | static:'[[0],[1],[0,0]]'."
)
@click.option("--no-speculation", is_flag=True, help="Verifier-only decoding (the reference for speed and output).")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0))
@click.option("--seed", default=None, type=int)
@click.option("--url", default=None, help="Generate from a running server instead (host:port of its gRPC endpoint).")
@click.option(
    "--chat/--raw",
    default=True,
    show_default=True,
    help="Wrap the prompt in the engine tokenizer's chat template as a user turn (where it has one).",
)
@click.option(
    "--executor",
    type=click.Choice(["torch", "onnxruntime"]),
    default=None,
    help="What runs the models (default: the engine's runtime.executor); onnxruntime runs the version's "
    "exported step graphs (built with runtime.onnx: true).",
)
@click.option(
    "--tp",
    type=click.IntRange(1),
    default=None,
    help="Tensor-parallel size: the engine's parallel.tp (default; one process per rank: gloo on CPU, NCCL on "
    "CUDA) or 1 (its rank files merged into this process).",
)
@click.option(
    "--device",
    default=None,
    callback=lambda c, p, v: _device(v),
    help="Where the models run: cpu, cuda, cuda:N or auto [default: the engine's runtime.device].",
)
@click.option("--json", "as_json", is_flag=True)
def generate(
    engine, prompt, max_tokens, tree, no_speculation, temperature, seed, url, chat, executor, tp, device, as_json
):
    """Generate from ENGINE in-process (streams tokens, prints statistics), or from a server with --url.

    The engine version's files are first checked against the size and sha256 its manifest records (exit 2
    naming a file that changed; --no-verify skips it)."""
    if url:
        from bpcompile.serving.client import generate_remote_cli

        generate_remote_cli(url, prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, json_out=as_json)
        return
    if not engine:
        raise UserError("give an ENGINE (a version directory such as engines/tiny/1) or --url of a running server")

    generate_text(
        engine_version_dir(engine),
        prompt,
        max_tokens=max_tokens,
        tree=tree,
        no_speculation=no_speculation,
        temperature=temperature,
        seed=seed,
        json_out=as_json,
        chat=chat,
        executor=executor,
        tp=tp,
        device=device,
    )


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
@runtime_options
@no_verify_option
@click.argument("engine")
@click.option(
    "--text",
    "text",
    type=click.Path(dir_okay=False),
    default=None,
    help="UTF-8 text file to evaluate on [default: the builtin pydoc held-out split].",
)
@click.option("--sequences", default=16, show_default=True, type=click.IntRange(1), help="Windows of the text.")
@click.option("--length", default=256, show_default=True, type=click.IntRange(2), help="Tokens per window.")
@click.option(
    "--plans",
    default=None,
    help="Comma-separated rows to evaluate (FP16 always): fp8, int8, "
    "int4-naive, 'int4+fp8 8%', 'unrotated int4+fp8 8%', engine [default: all but the unrotated row].",
)
@click.option(
    "--passkey",
    "passkey",
    default="",
    callback=_lengths,
    help="Passkey-retrieval prompt lengths in tokens, e.g. 512,1k,2k,4k [default: none].",
)
@click.option("--passkey-trials", default=100, show_default=True, type=click.IntRange(1))
@click.option(
    "--parity-prompts",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Greedy-continuation parity on this many prompts (0: skip).",
)
@click.option("--parity-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    callback=lambda c, p, v: _device(v),
    help="Where the models run: cpu, cuda or cuda:N.",
)
@click.option("--json", "as_json", is_flag=True)
def eval_(
    engine,
    text,
    sequences,
    length,
    plans,
    passkey,
    passkey_trials,
    parity_prompts,
    parity_tokens,
    seed,
    device,
    as_json,
):
    """KV-cache fidelity of ENGINE: perplexity, top-1 agreement and attention error per KV format; optionally
    passkey retrieval and greedy-continuation parity against FP16 KV."""
    from bpcompile.eval.evaluate import evaluate_engine

    engine = engine_version_dir(engine)
    if verify_enabled():  # evaluate reads the checkpoints directly, not through Generator.from_engine
        verify_version(engine)
    click.echo(
        evaluate_engine(
            engine,
            json_out=as_json,
            text=text,
            n=sequences,
            length=length,
            plans=[p.strip() for p in plans.split(",") if p.strip()] if plans else None,
            passkey_lengths=passkey,
            passkey_trials=passkey_trials,
            parity_prompts=parity_prompts,
            parity_tokens=parity_tokens,
            seed=seed,
            device=device,
        )
    )


COMMANDS: list = [generate, eval_]

try:  # serving commands: emit, serve, bench (their module imports tritonclient lazily too)
    from bpcompile.serving.cli import COMMANDS as _SERVING

    COMMANDS += _SERVING
except ImportError:  # pragma: no cover - only while the serving package is absent
    pass


def generate_text(
    engine_dir,
    prompt_text: str,
    max_tokens: int = 64,
    tree: Optional[str] = None,
    no_speculation: bool = False,
    temperature: float = 0.0,
    seed: Optional[int] = None,
    json_out: bool = False,
    chat: bool = True,
    executor: Optional[str] = None,
    tp: Optional[int] = None,
    device: Optional[str] = None,
) -> dict:
    """`bpcompile generate`: stream tokens to stdout as they come, statistics at the end."""
    from tokenizers import Tokenizer

    from bpcompile.runtime.generator import Generator
    from bpcompile.runtime.speculative import TreeSpec, parse_tree_spec

    d = Path(engine_dir)
    if verify_enabled() and (d / MANIFEST).is_file():  # before anything (the tokenizer first) is read from it
        verify_version(d)
    tj = d / "tokenizer" / "tokenizer.json"
    if not tj.is_file():
        raise UserError(f"{d}: no tokenizer (expected {tj})")
    tok = Tokenizer.from_file(str(tj))
    from bpcompile.runtime.text import end_ids

    end_id = end_ids(d / "tokenizer", tok)  # every one the tokenizer and generation config name
    spec = TreeSpec("none") if no_speculation else (parse_tree_spec(tree) if tree else None)
    gen = Generator.from_engine(d, tree=spec, executor=executor, tp=tp, device=device, verify=False)  # checked above
    try:
        return generate_loaded(gen, d, tok, prompt_text, max_tokens, temperature, seed, end_id, json_out, chat)
    finally:
        gen.close()


def generate_loaded(
    gen,
    d: Path,
    tok,
    prompt_text: str,
    max_tokens: int,
    temperature: float,
    seed: Optional[int],
    end_id: list[int],
    json_out: bool,
    chat: bool,
) -> dict:
    """`bpcompile generate`'s work for one prompt on an already loaded Generator (a caller that runs many prompts
    through the command's own path loads the engine once)."""
    from tokenizers.decoders import DecodeStream

    from bpcompile.runtime.generator import SamplingParams
    from bpcompile.runtime.model import cpu_layout
    from bpcompile.runtime.text import chat_prompt

    templated = chat_prompt(d / "tokenizer", prompt_text) if chat else None
    ids = tok.encode(templated if templated is not None else prompt_text).ids
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        end_id=end_id[0] if end_id else None,
        end_ids=tuple(end_id[1:]),
    )
    detok = DecodeStream(skip_special_tokens=True)  # holds a partial UTF-8 character back until it is whole
    shown = []

    def stream(_, new: list[int]) -> None:
        shown.append("".join(filter(None, (detok.step(tok, t) for t in new))))
        sys.stdout.write(shown[-1])
        sys.stdout.flush()

    t0 = time.perf_counter()
    ((out, stats),) = gen.generate([ids], params, on_token=None if json_out else stream)
    wall = time.perf_counter() - t0
    result = {
        "tree": gen.tree.kind if gen.draft is not None else "none",
        "prompt_tokens": len(ids),
        "executor": gen.executor,
        "tp": gen.tp,
        "cpu_weights": cpu_layout(gen.verifier)
        if gen.tp == 1 and gen.executor == "torch" and str(gen.device).startswith("cpu")
        else None,
        "chat_template": templated is not None,
        "tokens": out,
        "text": tok.decode(out),
        "tokens_per_s": len(out) / wall if wall > 0 else None,
        "wall_s": wall,
        "tau": stats.tau,
        "verifier_steps": stats.verifier_steps,
        "accepted_per_depth": stats.accepted_per_depth,
        "proposed_per_depth": stats.proposed_per_depth,
        "draft_s": stats.draft_s,
        "verify_s": stats.verify_s,
        "bookkeeping_s": stats.bookkeeping_s,
    }
    if json_out:
        print(json.dumps(result, indent=2))
    else:  # what the stream still held back: an incomplete character at the end shows as U+FFFD
        sys.stdout.write(result["text"][len("".join(shown)) :] + "\n")
        print(
            f"[{len(out)} tokens in {wall:.2f}s = {result['tokens_per_s']:.1f} tok/s; tree {result['tree']}; "
            f"tau {stats.tau:.2f} tokens/verifier step over {stats.verifier_steps} steps; accepted per depth "
            f"{stats.accepted_per_depth} of {stats.proposed_per_depth}; draft {stats.draft_s:.2f}s, verify "
            f"{stats.verify_s:.2f}s, bookkeeping {stats.bookkeeping_s:.2f}s"
            + (f"; CPU weights {result['cpu_weights']}" if result["cpu_weights"] else "")
            + "]",
            file=sys.stderr,
        )
    return result
