"""Benchmark: conversion HF -> TensorRT-LLM checkpoint (tp=1, tp=2) vs a plain `cp` of the same bytes.

Generates a random Llama-shaped checkpoint (Llama-3-8B layer shapes, bf16, a few layers; >= 4 GB,
sharded safetensors with an index) under /tmp, written tensor by tensor so generating it needs no
more memory than one tensor. Then, alternating, repeats: `cp` of the shards, conversion at tp=1,
conversion at tp=2, each in its own process, and reports the median wall time and each process's
peak RSS (os.wait4 gives the rusage of that one child). Everything under /tmp is removed at the end.

    .venv/bin/python benchmarks/bench_convert.py            # ~4.3 GB, 3 repetitions
    .venv/bin/python benchmarks/bench_convert.py --layers 1 --reps 1   # quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
from bpcompile.compiler.convert import RankWriter  # noqa: E402  (the same streaming writer the converter uses)

# Llama-3-8B shapes
HID, INTER, HEADS, KV, HEAD, VOCAB = 4096, 14336, 32, 8, 128, 128256


def hf_tensors(layers: int):
    yield "model.embed_tokens.weight", (VOCAB, HID)
    for l in range(layers):
        p = f"model.layers.{l}."
        yield p + "input_layernorm.weight", (HID,)
        yield p + "self_attn.q_proj.weight", (HEADS * HEAD, HID)
        yield p + "self_attn.k_proj.weight", (KV * HEAD, HID)
        yield p + "self_attn.v_proj.weight", (KV * HEAD, HID)
        yield p + "self_attn.o_proj.weight", (HID, HEADS * HEAD)
        yield p + "post_attention_layernorm.weight", (HID,)
        yield p + "mlp.gate_proj.weight", (INTER, HID)
        yield p + "mlp.up_proj.weight", (INTER, HID)
        yield p + "mlp.down_proj.weight", (HID, INTER)
    yield "model.norm.weight", (HID,)
    yield "lm_head.weight", (VOCAB, HID)


def generate(d: Path, layers: int, shard_bytes: int = 2 * 2**30) -> int:
    """Write a sharded bf16 checkpoint tensor by tensor; returns its size in bytes."""
    d.mkdir(parents=True)
    shards, cur, size = [], [], 0
    for name, shape in hf_tensors(layers):
        n = 2 * torch.Size(shape).numel()
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    shards.append(cur)
    block = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)).mul_(0.02).bfloat16()
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        w = RankWriter(d / fname, [(n, torch.bfloat16, s) for n, s in shard])
        for name, shape in shard:
            numel = torch.Size(shape).numel()
            # random-looking content without generating every value: tile one random block
            t = block.repeat(-(-numel // block.numel()))[:numel].reshape(shape)
            w.write(name, t)
            weight_map[name] = fname
            del t
        w.close()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": HID,
                "intermediate_size": INTER,
                "num_hidden_layers": layers,
                "num_attention_heads": HEADS,
                "num_key_value_heads": KV,
                "head_dim": HEAD,
                "vocab_size": VOCAB,
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "dtype": "bfloat16",
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            }
        )
    )
    return sum(f.stat().st_size for f in d.iterdir())


# Runs the measured command as a child of a small launcher process. Linux carries the parent's RSS
# high-water mark into a forked child's ru_maxrss, so forking it from this process (which holds torch)
# would report at least this process's RSS even for `cp`.
LAUNCHER = """
import json, os, subprocess, sys, time
t0 = time.perf_counter()
p = subprocess.Popen(sys.argv[1:])
_, status, ru = os.wait4(p.pid, 0)
print(json.dumps({"wall": time.perf_counter() - t0, "rc": os.waitstatus_to_exitcode(status), "maxrss_kib": ru.ru_maxrss}))
"""


def run(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS in bytes) of one child process."""
    os.sync()  # start each run without the previous run's dirty pages still being flushed
    out = subprocess.run(
        [sys.executable, "-c", LAUNCHER, *cmd], cwd=REPO, stdout=subprocess.PIPE, text=True, check=True
    ).stdout
    r = json.loads(out.strip().splitlines()[-1])
    if r["rc"] != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return r["wall"], r["maxrss_kib"] * 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=5, help="decoder layers (5 -> 4.3 GB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tmp", default="/tmp")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bpcompile-bench-convert-", dir=args.tmp))
    py = sys.executable
    try:
        src = root / "hf"
        t0 = time.perf_counter()
        nbytes = generate(src, args.layers)
        print(f"generated {nbytes / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s: {src}", flush=True)
        shards = sorted(str(p) for p in src.glob("*.safetensors"))
        conv = "from bpcompile.compiler.convert import convert_checkpoint as c; import sys; c(sys.argv[1], sys.argv[2], tp=int(sys.argv[3]))"
        cmds = {
            "cp": lambda out: ["cp", *shards, str(out)],
            "convert tp=1": lambda out: [py, "-c", conv, str(src), str(out), "1"],
            "convert tp=2": lambda out: [py, "-c", conv, str(src), str(out), "2"],
            "python + import only": lambda out: [py, "-c", "import bpcompile.compiler.convert"],
        }
        res = {k: [] for k in cmds}
        for rep in range(args.reps):
            for name, make in cmds.items():
                out = root / "out"
                out.mkdir()
                wall, rss = run(make(out))
                written = sum(f.stat().st_size for f in out.iterdir())
                shutil.rmtree(out)
                res[name].append((wall, rss, written))
                print(
                    f"rep {rep + 1}: {name:22s} {wall:7.2f} s  peak RSS {rss / 2**20:7.0f} MiB  "
                    f"wrote {written / 1e9:.2f} GB",
                    flush=True,
                )
        cp = statistics.median(w for w, _, _ in res["cp"])
        print(
            f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM; "
            f"checkpoint {nbytes / 1e9:.2f} GB, median of {args.reps}"
        )
        print("| run | median wall s | GB/s (source bytes) | x cp | max peak RSS MiB | written GB |")
        print("|---|---|---|---|---|---|")
        for name, rows in res.items():
            wall = statistics.median(w for w, _, _ in rows)
            rss = max(r for _, r, _ in rows)
            gbs = f"{nbytes / 1e9 / wall:.2f}" if name != "python + import only" else "-"
            ratio = f"{wall / cp:.2f}" if name != "python + import only" else "-"
            print(f"| {name} | {wall:.2f} | {gbs} | {ratio} | {rss / 2**20:.0f} | {rows[0][2] / 1e9:.2f} |")
        largest = 2 * VOCAB * HID
        print(f"largest tensor: {largest / 2**20:.0f} MiB (embedding / lm_head)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
