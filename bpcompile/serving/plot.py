"""A PNG of a concurrency sweep (`bpcompile bench --concurrency 1,2,4,8 --plot FILE`): time to first token, time
per output token and throughput against concurrency, p50 and p90. matplotlib is optional (the bench extra)."""

from __future__ import annotations

from pathlib import Path

from bpcompile.core.errors import MissingDependency


def plot_sweep(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """rows: bench_remote results, one per concurrency level."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependency("--plot needs matplotlib: pip install 'bpcompile[bench]'", key="plot") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["concurrency"])
    x = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in (
        (axes[0], "ttft_s", "time to first token (ms)"),
        (axes[1], "tpot_s", "time per output token (ms)"),
    ):
        for p, style in (("p50", "o-"), ("p90", "s--")):
            ys = [None if r[key][p] is None else r[key][p] * 1e3 for r in rows]
            ax.plot(x, ys, style, label=p)
        ax.set(xlabel="concurrency", ylabel=label)
        ax.legend()
    axes[2].plot(x, [r["output_tokens_per_s"] for r in rows], "o-")
    axes[2].set(xlabel="concurrency", ylabel="output tokens/s")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
