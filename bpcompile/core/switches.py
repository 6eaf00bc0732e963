"""Run-time switches the commands take as flags: `--kernels`, `--cpu-kernels` and `--cuda-graphs` (generate, serve,
eval) and `--kv-memory-limit` (build, validate).

A flag sets the environment variable that the code deciding reads (docs/ENVIRONMENT.md lists them all), because
the environment is what every process a command starts inherits: tensor-parallel workers, and for `serve`
tritonserver and its Python-backend models. Without the flag the variable, if set, still decides: it stays a
debugging override.
"""

from __future__ import annotations

import os

import click

KERNELS = "BPCOMPILE_KERNELS"
CPU_KERNELS = ("BPCOMPILE_CPU_ROWS", "BPCOMPILE_CPU_DECODE")
KV_MEMORY_LIMIT = "BPCOMPILE_KV_MEMORY_LIMIT"
CUDA_GRAPHS = "BPCOMPILE_CUDA_GRAPHS"
PREFIX_REUSE = "BPCOMPILE_PREFIX_REUSE"


def _set(names: tuple[str, ...], value: str | None) -> None:
    if value is not None:
        for name in names:
            os.environ[name] = value


def prefix_reuse_override() -> bool | None:
    """$BPCOMPILE_PREFIX_REUSE (`--prefix-reuse`): on -> True, off -> False; unset -> None (the engine's
    runtime.prefix_reuse decides)."""
    value = os.environ.get(PREFIX_REUSE, "")
    if value not in ("", "on", "off"):
        from bpcompile.core.errors import UserError

        raise UserError(f"{PREFIX_REUSE}={value!r}: expected on or off", key=PREFIX_REUSE)
    return {"on": True, "off": False}.get(value)


def runtime_options(command):
    """Add --kernels, --cpu-kernels and --cuda-graphs to a click command (no new parameters reach the command's
    function)."""
    command = click.option(
        "--cuda-graphs",
        type=click.Choice(["auto", "on", "off"]),
        default=None,
        expose_value=False,
        callback=lambda ctx, p, v: _set((CUDA_GRAPHS,), v),
        help="Steps after prefill from static per-bucket buffers, captured as CUDA graphs on CUDA: auto (on for "
        "CUDA where the engine allows it), on (also on CPU, where they run eagerly; an error where the engine "
        "does not allow it), off [default: the engine's runtime.cuda_graphs].",
    )(command)
    command = click.option(
        "--prefix-reuse",
        type=click.Choice(["on", "off"]),
        default=None,
        expose_value=False,
        callback=lambda ctx, p, v: _set((PREFIX_REUSE,), v),
        help="Prefix reuse: a prompt starts from the cached KV pages of the leading full pages an earlier prompt "
        "computed (outputs equal either way) [default: the engine's runtime.prefix_reuse].",
    )(command)
    command = click.option(
        "--cpu-kernels",
        type=click.Choice(["on", "off"]),
        default=None,
        expose_value=False,
        callback=lambda ctx, p, v: _set(CPU_KERNELS, {"on": "1", "off": "0", None: None}[v]),
        help="bpcompile's own CPU kernels (few-row products, few-query attention): on where they build "
        "[default], off for PyTorch's (or oneDNN's) products and attention.",
    )(command)
    return click.option(
        "--kernels",
        type=click.Choice(["auto", "triton", "torch"]),
        default=None,
        expose_value=False,
        callback=lambda ctx, p, v: _set((KERNELS,), v),
        help="The paged KV cache's kernels: auto (Triton kernels on CUDA for quantized caches) [default], "
        "triton (always; on CPU through Triton's interpreter) or torch (the PyTorch reference).",
    )(command)


def build_options(command):
    """Add --kv-memory-limit to a click command."""
    return click.option(
        "--kv-memory-limit",
        type=click.IntRange(0),
        default=None,
        expose_value=False,
        callback=lambda ctx, p, v: _set((KV_MEMORY_LIMIT,), None if v is None else str(v)),
        help="Memory of the machine that will serve the engine, in bytes, that the recipe's KV cache must fit "
        "(0: no check) [default: this machine's RAM].",
    )(command)
