"""The runtime's own cost per step: wall time of `Generator.step` minus the time spent inside the models'
forward passes (attention and KV writes included: they run inside the forward), on SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/bench_overhead.py                  # batch 8, 64 tokens, 3 repeats
    .venv/bin/python benchmarks/bench_overhead.py --rows fp16      # one row

Rows: verifier only with an FP16 cache, verifier only with the default KV plan (calibrated here), dynamic
tree of 5 with the shipped draft and an FP16 cache (back-off off, so every step drafts). Every row runs the
same 8 chat prompts together (in-flight batch 8) for 64 new tokens; the prefill step is reported apart.
Overhead = step wall time - sum of the forward passes inside it: scheduling, batch and metadata tensors,
tree building, verification, acceptance, KV compaction and stop processing.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from bpcompile.compiler import corpus  # noqa: E402
from bpcompile.compiler.calibrate import calibrate  # noqa: E402
from bpcompile.compiler.convert import convert_checkpoint  # noqa: E402
from bpcompile.runtime.generator import Generator, SamplingParams, TreeSpec  # noqa: E402
from bpcompile.runtime.kvcache import kv_store_factory  # noqa: E402
from bpcompile.runtime.model import Llama, cpu_layout  # noqa: E402
from bpcompile.runtime.paged_kv import float_store_factory  # noqa: E402


class Timed:
    """Wraps a model's forward to add the seconds spent in it to `self.spent`."""

    def __init__(self, model: Llama):
        self.spent = 0.0
        inner = model.forward

        def forward(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - t

        model.forward = forward


def run(gen: Generator, timers: list[Timed], prompts: list[list[int]], n: int) -> dict:
    for p in prompts:
        gen.add_request(p, SamplingParams(max_tokens=n))
    steps = []
    while gen.has_work():
        before = sum(t.spent for t in timers)
        t0 = time.perf_counter()
        gen.step()
        wall = time.perf_counter() - t0
        steps.append((wall, sum(t.spent for t in timers) - before))
    prefill, decode = steps[0], steps[1:]
    return {
        "prefill_ms": prefill[0] * 1e3,
        "steps": len(decode),
        "step_us": statistics.median(w for w, _ in decode) * 1e6,
        "forward_us": statistics.median(f for _, f in decode) * 1e6,
        "overhead_us": statistics.median(w - f for w, f in decode) * 1e6,
        "overhead_share": sum(w - f for w, f in decode) / sum(w for w, _ in decode),
    }


def default_kv_cache(overrides: dict | None = None) -> dict:
    """recipes/smollm2.yaml's kv_cache section (with `overrides`, as a recipe would set them) as the native target
    resolves it (the default plan)."""
    import yaml

    from bpcompile.core.engine import EngineConfig

    kv = yaml.safe_load((REPO / "recipes" / "smollm2.yaml").read_text())["kv_cache"] | (overrides or {})
    return EngineConfig.model_validate({"name": "bench", "kv_cache": kv}).kv_cache.model_dump()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default=str(REPO / "models/smollm2/verifier"))
    ap.add_argument("--draft", default=str(REPO / "models/smollm2/draft"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="fp16,plan,dyn5")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    spec = importlib.util.spec_from_file_location("bench_smollm2", REPO / "benchmarks" / "bench_smollm2.py")
    smol = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smol)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.verifier)
    prompts = smol.prompts(tok, a.batch, 256, 1)
    tmp = Path(tempfile.mkdtemp())
    convert_checkpoint(a.verifier, tmp / "v")
    convert_checkpoint(a.draft, tmp / "d")
    v, d = Llama.from_checkpoint(tmp / "v"), Llama.from_checkpoint(tmp / "d")
    # the plan is calibrated first (calibration backpropagates), then the models are packed as engines run on CPU
    plan = (
        calibrate(v, corpus.calibration_samples(a.verifier, 16, 128), default_kv_cache(), tokenizer=a.verifier)[0]
        if "plan" in a.rows.split(",")
        else None
    )
    for m in (v, d):
        m.pack_for_cpu()
    timers = [Timed(v), Timed(d)]
    fp16 = float_store_factory(torch.float16)
    rows = {
        "fp16": ("verifier only, FP16 KV", None, TreeSpec("none"), lambda: fp16),
        "plan": ("verifier only, default KV plan", None, TreeSpec("none"), lambda: kv_store_factory(plan)),
        "dyn5": ("dynamic tree 5, shipped draft, FP16 KV, no back-off", d, TreeSpec("dynamic", nodes=5), lambda: fp16),
    }
    print(
        f"# Runtime overhead per step, SmolLM2-135M-Instruct, batch {a.batch} x {a.max_tokens} tokens\n\n"
        f"Command: `.venv/bin/python benchmarks/bench_overhead.py --batch {a.batch} --max-tokens {a.max_tokens} "
        f"--repeats {a.repeats}`\n\nMachine: {platform.machine()}, {a.threads} threads, torch {torch.__version__}, "
        f"float32 weights (runtime.cpu_weights default, as engines run on CPU: {cpu_layout(v)}). Medians over decode "
        "steps; min..max over repeats.\n\n"
        "| row | decode steps | step (µs) | forwards (µs) | overhead (µs) | overhead share of step time | prefill (ms) |\n"
        "|---|---|---|---|---|---|---|"
    )
    for key in a.rows.split(","):
        name, draft, tree, factory = rows[key]
        gen = Generator(
            v, draft, tree, max_batch_size=a.batch, max_seq_len=1024, kv_store_factory=factory(), backoff=False
        )
        run(gen, timers, prompts[:1], 4)  # warm-up
        res = [run(gen, timers, prompts, a.max_tokens) for _ in range(a.repeats)]
        med = {k: statistics.median(r[k] for r in res) for k in res[0]}
        share = [r["overhead_share"] for r in res]
        print(
            f"| {name} | {med['steps']:.0f} | {med['step_us']:,.0f} | {med['forward_us']:,.0f} | "
            f"{med['overhead_us']:,.0f} | **{med['overhead_share']:.1%}** ({min(share):.1%}..{max(share):.1%}) | "
            f"{med['prefill_ms']:,.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
