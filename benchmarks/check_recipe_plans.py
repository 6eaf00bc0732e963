"""The KV plan each shipped recipe resolves to, generated through the Triton kernels and through the torch executor.

    python benchmarks/check_recipe_plans.py recipes/qwen2.5-coder.yaml recipes/70b.yaml --prompts 8 --tokens 16

For each recipe: its `kv_cache` section resolved as a build resolves it (the `auto` settings for the recipe's target,
device and tp: `EngineConfig`), calibrated on a small random model of the recipe's attention shape (head size, query
heads per KV head, the recipe's group and page size; six layers so that every layer band of the plan exists; the
per-rank shape at tp > 1), then greedy generation of --prompts prompts of random token ids with the recipe's
speculation (a noisy copy of the verifier drafts), once with BPCOMPILE_KERNELS=torch and once with
BPCOMPILE_KERNELS=triton (on a CPU in Triton's interpreter), each in its own process. `--default` also checks the
plan the recipe gets with its explicit KV settings other than format, group and page size dropped (what `auto` gives
it). For a real checkpoint's own plan use benchmarks/check_kernel_path.py on a built engine.

Prints one JSON object per recipe (the plan's unit kinds and window, each run's seconds, whether the kernels ran with
no fallback, whether the tokens are identical); exits 1 when any differ or fell back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEED = 0
LAYERS = 6  # thirds of two layers: the first (INT6 / KLT6 keys), middle (INT5 / KLT5 keys) and last bands
KEEP = ("format", "group_size", "page_size")  # what --default keeps of a recipe's kv_cache


def _shape(recipe: dict) -> dict:
    """The small random model's attention shape for a recipe: its verifier's head size and heads per rank."""
    known = {  # the shipped recipes' verifiers, by recipe name (their checkpoints need not be here)
        "llama3-70b-spec": dict(num_heads=64, num_kv_heads=8, head_size=128),
        "qwen2.5-coder": dict(num_heads=12, num_kv_heads=2, head_size=128, attn_bias=True),
        "smollm2": dict(num_heads=9, num_kv_heads=3, head_size=64),
        "tiny": dict(num_heads=4, num_kv_heads=2, head_size=64),
    }
    s = dict(known[recipe["name"]])
    tp = recipe.get("parallel", {}).get("tp", 1)
    s["num_heads"], s["num_kv_heads"] = s["num_heads"] // tp, max(1, s["num_kv_heads"] // tp)
    return s


def _model(shape: dict, seed: int, noise: float = 0.0):
    """A random Llama-shaped model (attention biases where the architecture has them); noise: a relative Gaussian
    perturbation of the seed's weights (the draft)."""
    import torch

    from bpcompile.runtime.model import Llama, ModelConfig

    H, KV, D = shape["num_heads"], shape["num_kv_heads"], shape["head_size"]
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=128,
        num_layers=LAYERS,
        num_heads=H,
        num_kv_heads=KV,
        head_size=D,
        intermediate_size=256,
        attn_bias=shape.get("attn_bias", False),
    )
    g = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    w = {
        "transformer.vocab_embedding.weight": torch.randn(cfg.vocab_size, h, generator=g),
        "transformer.ln_f.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "lm_head.weight": torch.randn(cfg.vocab_size, h, generator=g) * 3 / h**0.5,
    }
    for i in range(LAYERS):
        p = f"transformer.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        w[p + "post_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        w[p + "attention.qkv.weight"] = torch.randn((H + 2 * KV) * D, h, generator=g) / h**0.5
        if cfg.attn_bias:
            w[p + "attention.qkv.bias"] = 0.5 * torch.randn((H + 2 * KV) * D, generator=g)
        w[p + "attention.dense.weight"] = torch.randn(h, H * D, generator=g) / (H * D) ** 0.5
        w[p + "mlp.fc.weight"] = torch.randn(256, h, generator=g) / h**0.5
        w[p + "mlp.gate.weight"] = torch.randn(256, h, generator=g) / h**0.5
        w[p + "mlp.proj.weight"] = torch.randn(h, 256, generator=g) / 256**0.5
    if noise:
        gn = torch.Generator().manual_seed(seed + 1)
        w = {k: v + noise * v.std() * torch.randn(v.shape, generator=gn) for k, v in w.items()}
    return Llama(cfg, w)


def _prompts(n: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(SEED + 7)
    return [
        torch.randint(2, 256, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def resolve(recipe: dict, default: bool) -> dict:
    """The recipe's kv_cache as a build resolves it (EngineConfig's auto settings for its target, device, tp)."""
    from bpcompile.core.engine import EngineConfig

    sections = dict(recipe)
    if default:
        sections["kv_cache"] = {k: v for k, v in recipe["kv_cache"].items() if k in KEEP}
    return EngineConfig.from_sections(sections).kv_cache.model_dump()


def calibrate_plan(recipe: dict, kv: dict, out: Path) -> dict:
    """Calibrate the recipe's resolved kv_cache on the small random model; save the plan to out."""
    import torch

    from bpcompile.compiler.calibrate import calibrate

    model = _model(_shape(recipe), SEED)
    g = torch.Generator().manual_seed(SEED + 3)
    samples = [torch.randint(2, 256, (64,), generator=g).tolist() for _ in range(8)]
    limits = recipe.get("limits", {})
    plan, _ = calibrate(model, samples, kv, seq_len=limits.get("max_seq_len", 2048))
    plan.save(out)
    return {
        "units": sorted({x for p in plan.precision for t in "kv" for x in p[t]}),
        "recent_window": plan.recent_window,
        "sink_tokens": plan.sink_tokens,
        "group_size": plan.group_size,
        "rotation": plan.rotation,
    }


def run_one(recipe_path: str, plan_dir: str, n: int, tokens: int) -> dict:
    """In this process (its BPCOMPILE_KERNELS chosen by the caller): generate with the saved plan."""
    import yaml

    from bpcompile.runtime.generator import Generator, SamplingParams
    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory
    from bpcompile.runtime.speculative import TreeSpec

    recipe = yaml.safe_load(Path(recipe_path).read_text())
    shape, spec = _shape(recipe), recipe.get("speculative", {})
    v, d = _model(shape, SEED), _model(shape, SEED, noise=0.3)
    tree = TreeSpec(spec.get("tree", "dynamic"), nodes=spec.get("nodes", 5), length=spec.get("length", 3))
    t0 = time.time()
    gen = Generator(
        v,
        d,
        tree,
        max_batch_size=n,
        max_seq_len=64,
        page_size=recipe["kv_cache"].get("page_size", 16),
        kv_store_factory=kv_store_factory(KVPlan.load(plan_dir)),
        backoff=False,
    )
    out = gen.generate(_prompts(n), SamplingParams(max_tokens=tokens))
    return {"kernels": gen.vkv.kern is not None, "tokens": [t for t, _ in out], "seconds": round(time.time() - t0, 1)}


def check(recipe_path: str, default: bool, n: int, tokens: int) -> dict:
    import yaml

    recipe = yaml.safe_load(Path(recipe_path).read_text())
    kv = resolve(recipe, default)
    with tempfile.TemporaryDirectory() as tmp:
        desc = calibrate_plan(recipe, kv, Path(tmp))
        runs = {}
        for mode in ("torch", "triton"):
            env = dict(os.environ, BPCOMPILE_KERNELS=mode, OMP_NUM_THREADS="1")
            if mode == "triton":
                env.setdefault("TRITON_INTERPRET", "1")
            cmd = [sys.executable, __file__, recipe_path, "--one", tmp, "--prompts", str(n), "--tokens", str(tokens)]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{recipe_path} ({mode}): {r.stderr[-3000:]}")
            runs[mode] = json.loads(r.stdout.strip().splitlines()[-1])
            runs[mode]["fallback"] = "using the PyTorch path" in r.stderr
    shape = _shape(recipe)
    return {
        "recipe": recipe_path + (" (auto KV settings)" if default else ""),
        "model": f"random, {LAYERS} layers, {shape['num_heads']} q / {shape['num_kv_heads']} KV heads of "
        f"{shape['head_size']}" + (", attention biases" if shape.get("attn_bias") else ""),
        "kv_cache": {k: kv[k] for k in sorted(kv) if kv[k] not in (None, "none", 0, 0.0)},
        "plan": desc,
        "prompts": n,
        "tokens": tokens,
        "kernels_ran": runs["triton"]["kernels"] and not runs["triton"]["fallback"],
        "identical": runs["torch"]["tokens"] == runs["triton"]["tokens"],
        "seconds": {m: r["seconds"] for m, r in runs.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipes", nargs="+", help="recipe files (e.g. recipes/qwen2.5-coder.yaml recipes/70b.yaml)")
    ap.add_argument("--prompts", type=int, default=8, help="how many prompts (default 8)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per prompt (default 16)")
    ap.add_argument("--default", action="store_true", help="also the plan auto settings give each recipe")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child run: the saved plan's directory
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.recipes[0], a.one, a.prompts, a.tokens)))
        return 0
    ok = True
    for path in a.recipes:
        for default in (False, True) if a.default else (False,):
            rep = check(path, default, a.prompts, a.tokens)
            ok &= rep["identical"] and rep["kernels_ran"]
            print(json.dumps(rep), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
