"""The `bpcompile` command: a thin Click layer over library functions you can call from Python.

Exit codes: 0 success, 2 bad input (a message naming the file, line, key and what was expected; no
traceback), 1 internal error. `--json` prints one machine-readable result on stdout; human messages
and progress go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bpcompile.core.errors import RunFailure, UserError
from bpcompile.core.switches import build_options

err = Console(stderr=True, highlight=False)


def _emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


class _Group(click.Group):
    """Maps exceptions onto exit codes for every subcommand."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as e:
            err.print(
                f"[bold red]error:[/] {escape(str(e))}", markup=True, soft_wrap=True
            )  # messages hold [serve], [0]...
            sys.exit(2)
        except RunFailure as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", markup=True, soft_wrap=True)
            sys.exit(1)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException, SystemExit):
            raise
        except KeyboardInterrupt:
            err.print("interrupted")
            sys.exit(130)
        except Exception as e:  # noqa: BLE001 - the one place internal errors are turned into exit 1
            if os.environ.get("BPCOMPILE_DEBUG"):
                traceback.print_exc()
            err.print(
                f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e))} "
                "(set BPCOMPILE_DEBUG=1 for a traceback)",
                markup=True,
                soft_wrap=True,
            )
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(package_name="bpcompile")
def main():
    """Build draft+verifier inference engines with an INT4/FP8-outlier KV cache and tree speculative
    decoding, and serve them with Triton Inference Server."""


class _RichProgress:
    """Per-stage progress bars on stderr (silent when stderr is not a terminal)."""

    def __init__(self):
        self.p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=err,
            transient=True,
            disable=not err.is_terminal,
        )

    def __enter__(self):
        self.p.__enter__()
        return self

    def __exit__(self, *a):
        self.p.__exit__(*a)

    def factory(self, label):
        task = self.p.add_task(label, total=None)

        def update(done, total):
            self.p.update(task, completed=done, total=total)

        return update


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@build_options
@click.option("--force", is_flag=True, help="Rebuild even if a version with the same build id exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON result on stdout.")
def build(recipe, force, as_json):
    """Build RECIPE into a new engine version (and its Triton repository)."""
    from bpcompile.compiler.pipeline import Reporter
    from bpcompile.compiler.pipeline import build as do_build

    with _RichProgress() as prog:
        rep = Reporter(log=lambda s: err.print(s, markup=False, soft_wrap=True), progress=prog.factory)
        res = do_build(recipe, force=force, reporter=rep)
    if as_json:
        _emit_json(res.to_json())
    else:
        skipped = [s for s in res.stages if s.status == "skipped"]
        if skipped:
            err.print("skipped stages: " + "; ".join(f"{s.name} ({s.detail})" for s in skipped), markup=False)
        click.echo(str(res.path))


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@build_options
@click.option("--json", "as_json", is_flag=True)
def validate(recipe, as_json):
    """Check RECIPE (types, paths, checkpoints, tokenizers, parallelism) without building."""
    from bpcompile.compiler.recipe import load_recipe

    loaded = load_recipe(recipe)
    for note in loaded.notes:
        err.print(f"warning: {note}", markup=False, soft_wrap=True)
    if as_json:
        _emit_json({"valid": True, "recipe": loaded.resolved_dict(), "notes": loaded.notes})
    else:
        click.echo(f"{recipe}: ok ({loaded.recipe.name}: verifier {loaded.verifier_dir}, draft {loaded.draft_dir})")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--device", default="h200", show_default=True, help="h200 | h100 | a100-80gb")
@click.option("--memory-gb", type=click.FloatRange(min=1), default=None, help="Override the device's memory.")
@click.option("--bandwidth-tbs", type=click.FloatRange(min=0.01), default=None, help="Override its bandwidth.")
@click.option("--json", "as_json", is_flag=True)
def plan(recipe, device, memory_gb, bandwidth_tbs, as_json):
    """Per-GPU memory plan of RECIPE: weights, KV caches at its limits, activations, what fits, a projected
    decode speed; at the recipe's tp and at the smallest tp that fits. Reads only the models' config.json.
    Exit 2 when the recipe does not fit at its own tp."""
    from bpcompile.compiler.hf import is_feature_draft, read_feature_draft, read_hf_config
    from bpcompile.compiler.plan import device_from, markdown, plan_report
    from bpcompile.compiler.recipe import parse_recipe

    r, _ = parse_recipe(recipe)
    base = recipe.resolve().parent
    cfgs = [read_hf_config(base / r.models.verifier.path)]
    d = base / r.models.draft.path
    cfgs.append(read_feature_draft(d, cfgs[0]) if is_feature_draft(d) else read_hf_config(d))
    report = plan_report(r, cfgs[0], cfgs[1], device_from(device, memory_gb, bandwidth_tbs))
    if as_json:
        _emit_json(report)
    else:
        click.echo(markdown(report))
    if not report["at_recipe_tp"]["fits"]:
        smallest = report["smallest_tp_that_fits"]
        hint = f"parallel.tp: {smallest['tp']}" if smallest else "a smaller limits.max_batch_size or max_seq_len"
        raise UserError(
            f"{r.name} does not fit {report['at_recipe_tp']['device']} at tp = {r.parallel.tp}: try {hint}",
            file=str(recipe),
            key="parallel.tp" if smallest else "limits",
        )


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "--no-verify", is_flag=True, help="Do not check an engine version's files against its manifest (reads every byte)."
)
@click.option("--json", "as_json", is_flag=True)
def inspect(path, no_verify, as_json):
    """Describe PATH: an engine version, a converted checkpoint or an HF checkpoint.

    An engine version's files are checked against the size and sha256 its manifest records (about 1-2 s per
    GB): a file that differs is reported, and the exit code is 2."""
    from bpcompile.info import inspect_path

    info = inspect_path(path, verify=not no_verify)
    bad = (info.get("verified") or {}).get("problem")
    if as_json:
        _emit_json(info)
        if bad:
            raise UserError(bad)
        return
    if info["kind"] == "engine-version":
        click.echo(
            f"engine {info['name']} version {info['version']}  build {info['build_id']}  "
            f"published {info['published']}  {info['bytes'] / 1e6:.1f} MB"
        )
        for s in info["stages"]:
            click.echo(f"  stage {s['name']:<24} {s['status']:<8} {s['seconds']:>7.2f}s  {s.get('detail', '')}")
        for name, part in info["contents"].items():
            if "architecture" in part:
                click.echo(
                    f"  {name}/: {part['architecture']} {part['parameters'] / 1e6:.2f}M params, {part.get('dtype')}, "
                    f"tp={part.get('tp')} pp={part.get('pp')}, {len(part['shards'])} shards, {part['bytes'] / 1e6:.1f} MB"
                )
            else:
                click.echo(f"  {name}/: {part['bytes'] / 1e6:.2f} MB")
        if info["verified"] is None:
            click.echo("  files: not verified (--no-verify)")
        elif bad:
            raise UserError(bad)
        else:
            click.echo(f"  files: match the manifest (sizes and sha256, {info['verified']['seconds']:.1f}s)")
        return
    click.echo(
        f"{info['kind']}: {info['architecture']}, {info['parameters'] / 1e6:.2f}M parameters, dtype {info['dtype']}"
    )
    click.echo(
        f"  layers {info['layers']}, hidden {info['hidden']}, heads {info['heads']}/{info['kv_heads']} KV, vocab {info['vocab']}"
        + (f", tp={info['tp']} pp={info['pp']}" if "tp" in info else "")
    )
    for s in info["shards"]:
        click.echo(f"  {s['file']}: {s['tensors']} tensors, {s['params'] / 1e6:.2f}M params, {s['bytes'] / 1e6:.1f} MB")


@main.command(name="list")
@click.argument("store", required=False, default="engines", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def list_(store, as_json):
    """List engine versions in STORE (default ./engines)."""
    from bpcompile.core.store import EngineStore

    s = EngineStore(store)
    rows = [
        {
            "name": v.name,
            "version": v.version,
            "build_id": v.build_id,
            "published": v.manifest.get("published"),
            "bytes": v.manifest.get("bytes"),
            "path": str(v.path),
        }
        for n in s.names()
        for v in s.versions(n)
    ]
    if as_json:
        _emit_json(rows)
        return
    if not rows:
        err.print(f"no engine versions in {store}", markup=False)
        return
    t = Table("name", "version", "build id", "published", "size")
    for r in rows:
        t.add_row(
            r["name"], str(r["version"]), r["build_id"], r["published"] or "", f"{(r['bytes'] or 0) / 1e6:.1f} MB"
        )
    Console().print(t)


def _register_optional():
    """Commands whose implementation lives in a stage module (runtime, eval, serving)."""
    from bpcompile import commands

    for cmd in commands.COMMANDS:
        main.add_command(cmd)


_register_optional()

if __name__ == "__main__":
    main()
