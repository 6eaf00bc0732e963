#!/usr/bin/env python
"""GPU check and benchmark of bpcompile's Triton kernels for the INT4/FP8-outlier paged KV cache.

    python scripts/bench_gpu.py               # one H200 (or any sm_80+ GPU), about 3-5 minutes
    python scripts/bench_gpu.py --cpu-smoke   # no GPU: the correctness part only, tiny shapes, Triton interpreter

1. Correctness on the device against the PyTorch oracle (bpcompile.runtime.kvcache): quantize-and-append byte for byte,
   decode and tree attention within tolerance, the compaction move byte for byte.
2. A small sweep of tile size / warps / splits at 32k context, batch 8, to pick the kernel configuration.
3. Decode attention (one layer of Llama-3-70B shape: 64 query heads, 8 KV heads, head size 128, page 16,
   group 128, 2 of the layer's 16 units in FP8) vs FP16 attention (torch scaled_dot_product_attention over
   dense fp16 K/V) at contexts 8k/32k/128k and batch 1/8/32, and tree verification at G = 6 and 64.
   Bytes/s = bytes the kernel must read (payload + scales of every visible token, q, out) / time,
   against the H200's 4.8 TB/s.

Prints markdown tables; writes everything as JSON to $OUT/bench_kernels.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types
from pathlib import Path

CPU_SMOKE = "--cpu-smoke" in sys.argv
if CPU_SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

try:
    import safetensors.torch  # noqa: F401  (bpcompile.runtime.kvcache imports it for KVPlan.save/load only)
except ImportError:  # the GPU machine may lack it; nothing here saves or loads plans

    def _unavailable(*a, **k):
        raise RuntimeError("safetensors is not installed")

    st_mod = types.ModuleType("safetensors.torch")
    st_mod.load_file = st_mod.save_file = _unavailable
    sys.modules.setdefault("safetensors", types.ModuleType("safetensors"))
    sys.modules["safetensors.torch"] = st_mod

from bpcompile.kernels import paged as K  # noqa: E402
from bpcompile.kernels import tree_mask as TM  # noqa: E402
from bpcompile.kernels.reference import paged_attention_reference  # noqa: E402
from bpcompile.runtime.kvcache import FP8, INT4, KVPlan, QuantKVStore  # noqa: E402  # noqa: E402

H200_BW = 4.8e12
RESULTS: dict = {"device": None, "correctness": [], "sweep": [], "decode": [], "tree": []}


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------
# stores


def plan_for(layers: int, kv: int, d: int, group: int, fp8_units: list[tuple[int, str, int]]) -> KVPlan:
    prec = [{"k": ["int4"] * kv, "v": ["int4"] * kv} for _ in range(layers)]
    for layer, t, h in fp8_units:
        prec[layer][t][h] = "fp8"
    g = torch.Generator().manual_seed(0)
    return KVPlan(
        "int4-fp8-outlier",
        layers,
        kv,
        d,
        group,
        prec,
        k_channel_scale=torch.rand(layers, kv, d, generator=g) + 0.5,
        int4_clip=torch.rand(layers, 2, kv, generator=g) * 0.2 + 0.8,
    )


def random_fill(st: QuantKVStore, seed: int = 0) -> None:
    """Random payload bytes and sane fp16 scales (timing only: no NaN codes, no zero scales)."""
    g = torch.Generator(device=st.payload[INT4].device).manual_seed(seed)
    for q in (st.payload[INT4], st.payload[FP8]):
        if q.numel():
            q.copy_(torch.randint(0, 256, q.shape, dtype=torch.uint8, device=q.device, generator=g))
    if st.payload[FP8].numel():
        st.payload[FP8][(st.payload[FP8] & 0x7F) == 0x7F] = 0x7E
    for s in (st.scales[INT4], st.scales[FP8]):
        if s.numel():
            s.copy_((torch.rand(s.shape, device=s.device, generator=g) * 0.2 + 0.05).half())


def sequences(num_pages: int, batch: int, tokens: int, page: int, device, seed=0):
    """Block tables of `batch` sequences of `tokens` tokens over randomly scattered pages."""
    per = math.ceil(tokens / page)
    g = torch.Generator().manual_seed(seed)
    bt = torch.randperm(num_pages, generator=g)[: batch * per].reshape(batch, per).int().to(device)
    return bt


# ------------------------------------------------------------------------------------------------
# 1. correctness


def check_correctness(dev, tiny: bool) -> bool:
    L, KV, H, D, GS, S = (2, 2, 8, 64, 32, 16) if tiny else (2, 8, 64, 128, 128, 16)
    plan = plan_for(L, KV, D, GS, [(0, "k", 0), (0, "v", 1), (1, "k", KV - 1)])
    ok_all = True

    def record(name, ok, detail):
        nonlocal ok_all
        ok_all &= bool(ok)
        RESULTS["correctness"].append({"check": name, "ok": bool(ok), "detail": detail})
        log(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")

    # quantize-and-append, bit for bit (with an all-zero group and a tiny-scale token)
    n = 40 if tiny else 4096
    pages = 8 if tiny else 600
    ref, ker = QuantKVStore(plan, pages, S, device=dev), QuantKVStore(plan, pages, S, device=dev)
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(pages * S, generator=g)[:n].to(dev)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        k = (torch.randn(n, KV, D, generator=g) * 3).to(dtype).to(dev)
        v = torch.randn(n, KV, D, generator=g).to(dtype).to(dev)
        k[0, 0, :GS] = 0
        v[1, 0] *= 1e-6
        for layer in range(L):
            ref.write(layer, slots, k, v)
            K.quantize_append(ker, layer, slots, k, v)
        same = all(torch.equal(a, b) for a, b in zip(ref.pools(), ker.pools()))
        diff = sum(int((a != b).sum()) for a, b in zip(ref.pools(), ker.pools()))
        record(f"quantize_append {str(dtype)[6:]}", same, f"{n} tokens x {L} layers, {diff} differing bytes")

    # attention: decode (G=1) and trees (G=6 branching, G=64 chain/branching) vs the reference
    st = QuantKVStore(plan, 64 if tiny else 2048, S, device=dev)
    ctxs = [37, 0, 90] if tiny else [3000, 17, 1500]
    bt = sequences(st.num_pages, len(ctxs), max(ctxs) + 64, S, dev, seed=2)
    for b, c in enumerate(ctxs):
        t = torch.arange(c + 64, device=dev)
        slots_b = bt[b, t // S].long() * S + t % S
        for layer in range(L):
            st.write(layer, slots_b, torch.randn(c + 64, KV, D, device=dev) * 2, torch.randn(c + 64, KV, D, device=dev))
    trees = {1: [[-1]], 6: [[-1, 0, 0, 1, 1, 2]], 64: [list(range(-1, 63)), [-1] + [i // 2 for i in range(63)]]}
    for G, shapes in trees.items():
        if tiny and G == 64:
            continue
        masks = torch.zeros(len(ctxs), G, G, dtype=torch.bool)
        nt = []
        for b in range(len(ctxs)):
            par = shapes[b % len(shapes)]
            masks[b, : len(par), : len(par)] = TM.tree_mask_from_parents(par)
            nt.append(len(par))
        tm, nt = TM.pack_bool_mask(masks).to(dev), torch.tensor(nt, device=dev)
        ctx = torch.tensor(ctxs, device=dev)
        for dtype, tol in ((torch.float16, 2e-2), (torch.float32, 1e-3)):
            q = (torch.randn(len(ctxs), G, H, D, device=dev) * 1.5).to(dtype)
            for splits in (1, 3):
                refo = paged_attention_reference(q, st, 1, bt, ctx, tm, nt, 1 / math.sqrt(D))
                out = K.paged_attention(q, st, 1, bt, ctx, tm, nt, 1 / math.sqrt(D), num_splits=splits)
                err = ((out.float() - refo.float()).abs().max() / refo.float().abs().max()).item()
                record(
                    f"attention G={G} {str(dtype)[6:]} splits={splits}",
                    err <= tol,
                    f"max rel err {err:.2e} (tol {tol})",
                )

    # compaction move with overlapping src/dst
    a = QuantKVStore(plan, 8, S, device=dev)
    for layer in range(L):
        a.write(
            layer,
            torch.arange(20, 40, device=dev),
            torch.randn(20, KV, D, device=dev),
            torch.randn(20, KV, D, device=dev),
        )
    b = QuantKVStore(plan, 8, S, device=dev)
    for x, y in zip(b.pools(), a.pools()):
        x.copy_(y)
    src, dst = torch.tensor([20, 22, 25, 31], device=dev), torch.tensor([20, 21, 22, 23], device=dev)
    a.move(src, dst)
    K.move_slots(b, src, dst)
    record(
        "move_slots (overlapping)", all(torch.equal(x, y) for x, y in zip(a.pools(), b.pools())), "4 slots, all pools"
    )
    return ok_all


# ------------------------------------------------------------------------------------------------
# 2-3. timing


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50)


def layer_bytes_per_token(st: QuantKVStore, layer: int) -> int:
    """Payload + scale bytes one token of this layer occupies (what attention must read per visible token)."""
    D, NG = st.head_size, st.head_size // st.G
    per = {0: D // 2, 1: D, 2: D}
    return sum(per[int(c)] + 2 * NG for c in st.unit_precision[layer].flatten().tolist())


class Setup:
    """One layer of the 70B shape: B sequences of T committed tokens (+ tree room) in a random-filled store."""

    def __init__(self, dev, B, T, G=1, tree_room=64):
        self.KV, self.H, self.D, self.S = 8, 64, 128, 16
        plan = plan_for(1, self.KV, self.D, 128, [(0, "k", 0), (0, "v", 3)])
        per = math.ceil((T + tree_room) / self.S)
        self.st = QuantKVStore(plan, B * per, self.S, device=dev)
        random_fill(self.st)
        self.bt = sequences(self.st.num_pages, B, T + tree_room, self.S, dev)
        self.ctx = torch.full((B,), T, dtype=torch.int32, device=dev)
        parents = [-1] + [(i - 1) // 2 for i in range(1, G)]  # binary tree
        m = TM.tree_mask_from_parents(parents)
        self.tm = TM.pack_bool_mask(m)[None].expand(B, G, -1).contiguous().to(dev)
        self.nt = torch.full((B,), G, dtype=torch.int32, device=dev)
        self.q = torch.randn(B, G, self.H, self.D, device=dev, dtype=torch.float16)
        self.B, self.T, self.G = B, T, G
        self.bytes = B * (T + G) * layer_bytes_per_token(self.st, 0) + 2 * self.q.numel() * 2 + self.bt.numel() * 4

    def run(self, **kw):
        return K.paged_attention(self.q, self.st, 0, self.bt, self.ctx, self.tm, self.nt, 1 / math.sqrt(self.D), **kw)


def sdpa_fp16(dev, B, T, KV=8, H=64, D=128):
    """FP16 decode attention baseline: dense K/V [B, KV, T, D]; the R = H/KV query heads of a KV head are
    the query rows of one flash-attention call, so K/V are read once (GQA without expanding K/V)."""
    R = H // KV
    k = torch.randn(B, KV, T, D, device=dev, dtype=torch.float16)
    v = torch.randn(B, KV, T, D, device=dev, dtype=torch.float16)
    q = torch.randn(B, KV, R, D, device=dev, dtype=torch.float16)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
    return fn, nbytes, (k, v, q)


def fits(dev, B, T) -> bool:
    need = B * T * 8 * 128 * 2 * 2 * 1.2 + B * (T + 64) * 1200 * 1.2  # fp16 K/V + quantized store
    free, _ = torch.cuda.mem_get_info(dev)
    return need < 0.8 * free


def sweep(dev) -> dict:
    """Tile size / warps / splits at the target point (32k, batch 8); returns the best kwargs."""
    s = Setup(dev, 8, 32768)
    base = K.default_num_splits(
        8, 8, 1, s.bt.shape[1] * s.S, torch.cuda.get_device_properties(dev).multi_processor_count
    )
    best = None
    for bn in (16, 32, 64):
        for nw in (4, 8):
            for sp in sorted({max(1, base // 2), base, base * 2}):
                kw = dict(block_n=bn, num_warps=nw, num_splits=sp)
                try:
                    ms = bench_ms(lambda: s.run(**kw))
                except Exception as e:  # e.g. out of shared memory / registers for a config
                    RESULTS["sweep"].append({**kw, "error": repr(e)[:200]})
                    continue
                bw = s.bytes / (ms * 1e-3)
                RESULTS["sweep"].append({**kw, "ms": ms, "bytes_per_s": bw})
                log(f"  block_n={bn:3d} warps={nw} splits={sp:3d}: {ms * 1e3:8.1f} us  {bw / 1e12:5.2f} TB/s")
                if best is None or ms < best[0]:
                    best = (ms, kw)
    s = None
    torch.cuda.empty_cache()
    return best[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: correctness only, tiny shapes, interpreter")
    ap.add_argument("--quick", action="store_true", help="skip the sweep and the 128k column")
    args = ap.parse_args()
    t0 = time.time()
    if args.cpu_smoke:
        RESULTS["device"] = "cpu (Triton interpreter)"
        log("## correctness (CPU smoke, tiny shapes)")
        ok = check_correctness(torch.device("cpu"), tiny=True)
        return finish(ok, t0)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu-smoke for the CPU check")
    dev = torch.device("cuda")
    import triton

    props = torch.cuda.get_device_properties(dev)
    RESULTS["device"] = (
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}"
    )
    log(f"# bpcompile kernels on {RESULTS['device']}")
    log("## correctness vs the PyTorch oracle")
    ok = check_correctness(dev, tiny=False)

    kw = {}
    if not args.quick:
        log("## sweep at 32k context, batch 8")
        kw = sweep(dev)
        log(f"  best: {kw}")
    RESULTS["config"] = kw

    log("## decode attention, one 70B layer (H=64, KV=8, D=128, page 16)")
    rows = [
        "| context | batch | mixed INT4/FP8 (us) | TB/s | % of 4.8 | FP16 SDPA (us) | FP16 TB/s | speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for T in (8192, 32768) + (() if args.quick else (131072,)):
        for B in (1, 8, 32):
            if not fits(dev, B, T):
                RESULTS["decode"].append({"context": T, "batch": B, "skipped": "does not fit"})
                rows.append(f"| {T} | {B} | skipped (memory) | | | | | |")
                continue
            s = Setup(dev, B, T)
            auto = {k: v for k, v in kw.items() if k != "num_splits"}  # splits follow the shape
            ms = bench_ms(lambda: s.run(**auto))
            bw = s.bytes / (ms * 1e-3)
            s = None
            torch.cuda.empty_cache()
            fn, fbytes, keep = sdpa_fp16(dev, B, T)
            fms = bench_ms(fn)
            fbw = fbytes / (fms * 1e-3)
            del keep, fn
            torch.cuda.empty_cache()
            RESULTS["decode"].append(
                {
                    "context": T,
                    "batch": B,
                    "us": ms * 1e3,
                    "bytes_per_s": bw,
                    "fraction_of_4p8": bw / H200_BW,
                    "fp16_sdpa_us": fms * 1e3,
                    "fp16_bytes_per_s": fbw,
                    "speedup": fms / ms,
                }
            )
            rows.append(
                f"| {T} | {B} | {ms * 1e3:.1f} | {bw / 1e12:.2f} | {100 * bw / H200_BW:.0f}% | "
                f"{fms * 1e3:.1f} | {fbw / 1e12:.2f} | {fms / ms:.2f}x |"
            )
    log("\n".join(rows))

    log("## tree verification (32k context, batch 8)")
    trows = ["| G | batch | us | TB/s | % of 4.8 |", "|---|---|---|---|---|"]
    for G in (6, 64):
        s = Setup(dev, 8, 32768, G=G)
        ms = bench_ms(lambda: s.run())
        bw = s.bytes / (ms * 1e-3)
        RESULTS["tree"].append({"G": G, "batch": 8, "context": 32768, "us": ms * 1e3, "bytes_per_s": bw})
        trows.append(f"| {G} | 8 | {ms * 1e3:.1f} | {bw / 1e12:.2f} | {100 * bw / H200_BW:.0f}% |")
        s = None
        torch.cuda.empty_cache()
    log("\n".join(trows))
    target = next(
        (r for r in RESULTS["decode"] if r.get("context") == 32768 and r.get("batch") == 8 and "us" in r), None
    )
    if target:
        log(
            f"## targets at 32k, batch 8: {100 * target['fraction_of_4p8']:.0f}% of 4.8 TB/s (goal >= 70%), "
            f"{target['speedup']:.2f}x FP16 SDPA (goal >= 2.5x)"
        )
    return finish(ok, t0)


def finish(ok: bool, t0: float):
    RESULTS["ok"] = ok
    RESULTS["seconds"] = round(time.time() - t0, 1)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "bench_kernels.json").write_text(json.dumps(RESULTS, indent=1))
    log(f"{'all correctness checks passed' if ok else 'CORRECTNESS FAILURES'} ({RESULTS['seconds']}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
