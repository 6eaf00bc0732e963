#!/usr/bin/env python
"""The GPU check: what bpcompile's CUDA path does, in one command and one JSON report.

    python benchmarks/gpu_check.py --out report.json                    # one GPU (H100 / H200), <= 8 minutes
    python benchmarks/gpu_check.py --device cpu --quick --out r.json    # no GPU: the same code, tiny sizes

1. kernels: the Triton kernels against the PyTorch oracle (bpcompile.runtime.kvcache, kernels/reference.py) for
   every precision they claim (the support table, bpcompile.core.kv_support: one plan holding units of each;
   KLT units, which need calibrated bases, are checked end to end by the pair), head sizes 64 and 128:
   quantize-and-append byte for byte, paged attention (decode G = 1 and a tree G = 6) within tolerance, the
   compaction move byte for byte. On CPU they run in Triton's interpreter.
2. kernel_speed (CUDA only): decode attention over one Llama-3-70B layer (64 query heads, 8 KV heads, head
   size 128) against FP16 scaled_dot_product_attention, and tree verification, at 8k / 32k tokens.
3. pair: an engine version (default: the newest of engines/smollm2, built from recipes/smollm2.yaml; on CPU with
   --quick the tiny pair's) on the device in --dtype (bf16 on CUDA): its greedy tokens against the CPU float32
   reference (the same engine and KV plan, PyTorch attention), the first divergence of each prompt with the
   reference's top-2 logit gap there; speculation (the engine's tree) against verifier-only on the device;
   decode tokens/s at batch 1 and 8 next to transformers' `generate` on the same device and dtype; peak memory
   (torch.cuda.max_memory_allocated on CUDA, the process's peak RSS on CPU) against `bpcompile plan`'s figure.
4. cuda_graphs: the pair's steps after prefill from static per-bucket buffers (runtime.cuda_graphs on:
   captured CUDA graphs on CUDA, the same static step eagerly on CPU) against the engine's own step (off): greedy
   tokens (speculation on; divergences with their top-2 gap) and decode tokens/s at batch 1 and 8, the graphs
   captured. Over the engine's KV plan (exact entries included: the static step writes and reads their copies).
   At tp 1 only: at tp > 1 each rank captures its buckets with the NCCL all-reduces inside, which needs two or
   more GPUs (NCCL puts one rank on a GPU); that capture has not run yet (docs/GPU.md).

Exit 0 when every kernel check passes and every divergence is within --tie-ulps bf16 ulps of the top logit
(rounding decides a near tie); 1 otherwise; 2 for bad arguments (no CUDA device for --device cuda, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU = "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 : sys.argv.index("--device") + 2] == ["cpu"]
if CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels on CPU tensors

import torch  # noqa: E402

from bpcompile.kernels import paged as K  # noqa: E402
from bpcompile.kernels import tree_mask as TM  # noqa: E402
from bpcompile.kernels.reference import paged_attention_reference  # noqa: E402
from bpcompile.runtime.kvcache import KVPlan, QuantKVStore, reader_precisions  # noqa: E402

CLAIMED = reader_precisions("triton")  # the readers' support table (bpcompile.core.kv_support)

H200_BW = 4.8e12


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# 1. kernels against the oracle


def unit_precisions() -> tuple[list[str], list[str]]:
    """The precisions the kernels claim (the support table, bpcompile.core.kv_support): those checked unit by unit
    here, and the tabled ones (KLT keys need calibrated bases; the pair checks them end to end where its plan has
    them)."""
    claimed = CLAIMED
    return [p.name for p in claimed if not p.tabled], [p.name for p in claimed if p.tabled]


def mixed_plan(layers: int, kv: int, d: int, group: int) -> KVPlan:
    """Units of every untabled precision the kernels claim, in turn over (layer, K|V, head), with channel scales
    and clips as calibration writes them."""
    names = unit_precisions()[0]
    prec, u = [], 0
    for _ in range(layers):
        row = {"k": [], "v": []}
        for t in ("k", "v"):
            for _ in range(kv):
                row[t].append(names[u % len(names)])
                u += 1
        prec.append(row)
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


def check_kernels(dev, quick: bool) -> list[dict]:
    out = []

    def record(name, ok, **detail):
        out.append({"check": name, "ok": bool(ok), **detail})
        log(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")

    cuda = dev.type == "cuda"
    # (layers, KV heads, query heads, head size, group, page, tokens written, contexts)
    shapes = [(2, 2, 4, 64, 32, 16, 40, [37, 0, 21])]
    shapes.append(
        (2, 2, 4, 128, 128, 16, 40, [29, 5]) if quick or not cuda else (2, 8, 64, 128, 128, 16, 4096, [3000, 17, 1500])
    )
    if cuda and not quick:
        shapes[0] = (2, 2, 8, 64, 32, 16, 4096, [2000, 1, 700])
    in_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    q_dtypes = ((torch.float16, 2e-2), (torch.bfloat16, 3e-2), (torch.float32, 1e-3))
    if not cuda and quick:
        in_dtypes, q_dtypes = (torch.float32,), ((torch.float16, 2e-2),)
    for L, KV, H, D, GS, S, n, ctxs in shapes:
        plan = mixed_plan(L, KV, D, GS)
        tag = f"D={D} KV={KV} H={H}"
        pages = -(-n // S) + 4
        ref, ker = QuantKVStore(plan, pages, S, device=dev), QuantKVStore(plan, pages, S, device=dev)
        g = torch.Generator().manual_seed(1)
        slots = torch.randperm(pages * S, generator=g)[:n].to(dev)
        for dtype in in_dtypes:
            k = (torch.randn(n, KV, D, generator=g) * 3).to(dtype).to(dev)
            v = torch.randn(n, KV, D, generator=g).to(dtype).to(dev)
            k[0, 0, :GS] = 0  # an all-zero group
            v[1, 0] *= 1e-6  # a tiny scale
            for layer in range(L):
                ref.write(layer, slots, k, v)
                K.quantize_append(ker, layer, slots, k, v)
            diff = sum(int((a != b).sum()) for a, b in zip(ref.pools(), ker.pools()))
            record(f"quantize_append {tag} {str(dtype)[6:]}", diff == 0, tokens=n, layers=L, differing_bytes=diff)

        st = QuantKVStore(plan, -(-(max(ctxs) + 8) // S) * len(ctxs) + 2, S, device=dev)
        per = -(-(max(ctxs) + 8) // S)
        bt = torch.randperm(st.num_pages, generator=g)[: len(ctxs) * per].reshape(len(ctxs), per).int().to(dev)
        for b, c in enumerate(ctxs):
            t = torch.arange(c + 8, device=dev)
            sl = bt[b, t // S].long() * S + t % S
            for layer in range(L):
                st.write(layer, sl, torch.randn(c + 8, KV, D, device=dev) * 2, torch.randn(c + 8, KV, D, device=dev))
        for G, parents in ((1, [-1]), (6, [-1, 0, 0, 1, 1, 2])):
            masks = torch.zeros(len(ctxs), G, G, dtype=torch.bool)
            masks[:, :, :] = TM.tree_mask_from_parents(parents)
            tm, nt = TM.pack_bool_mask(masks).to(dev), torch.full((len(ctxs),), G, device=dev)
            ctx = torch.tensor(ctxs, device=dev)
            for dtype, tol in q_dtypes:
                q = (torch.randn(len(ctxs), G, H, D, device=dev) * 1.5).to(dtype)
                err = 0.0
                for layer in range(L):  # each layer holds other precisions
                    r = paged_attention_reference(q, st, layer, bt, ctx, tm, nt, 1 / math.sqrt(D)).float()
                    o = K.paged_attention(q, st, layer, bt, ctx, tm, nt, 1 / math.sqrt(D)).float()
                    err = max(err, ((o - r).abs().max() / r.abs().max()).item())
                record(f"attention {tag} G={G} q {str(dtype)[6:]}", err <= tol, max_rel_err=err, tol=tol)

        a = QuantKVStore(plan, 8, S, device=dev)
        for layer in range(L):
            s20 = torch.arange(20, 40, device=dev)
            a.write(layer, s20, torch.randn(20, KV, D, device=dev), torch.randn(20, KV, D, device=dev))
        b = QuantKVStore(plan, 8, S, device=dev)
        for x, y in zip(b.pools(), a.pools()):
            x.copy_(y)
        src, dst = torch.tensor([20, 22, 25, 31], device=dev), torch.tensor([20, 21, 22, 23], device=dev)
        a.move(src, dst)
        K.move_slots(b, src, dst)
        record(f"move_slots {tag} (overlapping)", all(torch.equal(x, y) for x, y in zip(a.pools(), b.pools())))
    return out


# ------------------------------------------------------------------------------------------------
# 2. kernel speed (CUDA): one 70B layer


def kernel_speed(dev, quick: bool) -> dict:
    import triton.testing

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=50)

    KV, H, D, S = 8, 64, 128, 16
    prec = [{"k": ["int4"] * KV, "v": ["int4"] * KV}]
    prec[0]["k"][0], prec[0]["v"][3] = "fp8", "fp8"  # 2 of 16 units in FP8, as calibration would keep outliers
    plan = KVPlan("int4-fp8-outlier", 1, KV, D, 128, prec)
    rows = []
    for T, B, G in [(8192, 1, 1), (8192, 8, 1), (32768, 1, 1), (32768, 8, 1), (32768, 8, 6)][: 3 if quick else None]:
        per = -(-(T + 64) // S)
        st = QuantKVStore(plan, B * per, S, device=dev)
        g = torch.Generator(device=dev).manual_seed(0)
        for p in st.pools():  # random codes and sane scales: timing only
            if p.dtype == torch.float16:
                p.copy_((torch.rand(p.shape, device=dev, generator=g) * 0.2 + 0.05).half())
            elif p.numel():
                p.copy_(torch.randint(0, 127, p.shape, device=dev, generator=g).to(p.dtype))
        bt = torch.randperm(B * per, device=dev).reshape(B, per).int()
        ctx = torch.full((B,), T, dtype=torch.int32, device=dev)
        parents = [-1] + [(i - 1) // 2 for i in range(1, G)]
        tm = TM.pack_bool_mask(TM.tree_mask_from_parents(parents))[None].expand(B, G, -1).contiguous().to(dev)
        nt = torch.full((B,), G, dtype=torch.int32, device=dev)
        q = torch.randn(B, G, H, D, device=dev, dtype=torch.float16)
        t = ms(lambda: K.paged_attention(q, st, 0, bt, ctx, tm, nt, 1 / math.sqrt(D)))
        per_token = sum((D // 2 if c == 0 else D) + 2 * (D // 128) for c in st.unit_precision[0].flatten().tolist())
        nbytes = B * (T + G) * per_token + 2 * q.numel() * 2
        k = torch.randn(B, KV, T, D, device=dev, dtype=torch.float16)
        vv = torch.randn(B, KV, T, D, device=dev, dtype=torch.float16)
        qq = torch.randn(B, KV, (H // KV) * G, D, device=dev, dtype=torch.float16)
        f = ms(lambda: torch.nn.functional.scaled_dot_product_attention(qq, k, vv))
        rows.append(
            {
                "context": T,
                "batch": B,
                "tree_tokens": G,
                "us": t * 1e3,
                "bytes_per_s": nbytes / (t * 1e-3),
                "fraction_of_h200_4p8_tbs": nbytes / (t * 1e-3) / H200_BW,
                "fp16_sdpa_us": f * 1e3,
                "speedup_vs_fp16_sdpa": f / t,
            }
        )
        log(
            f"  T={T} B={B} G={G}: {t * 1e3:.1f} us ({nbytes / (t * 1e-3) / 1e12:.2f} TB/s), FP16 SDPA {f * 1e3:.1f} us"
        )
        st = k = vv = qq = q = None  # freed before the next shape's buffers
        torch.cuda.empty_cache()
    return {
        "layer": "Llama-3-70B: 64 query heads, 8 KV heads, head 128, page 16, group 128, 2/16 units FP8",
        "rows": rows,
    }


def sweep(dev) -> list[dict]:
    """Tile size / warps / splits of decode attention at 32k tokens, batch 8 (one 70B layer): what the kernels'
    defaults should be on this GPU (--sweep)."""
    import triton.testing

    KV, H, D, S, B, T = 8, 64, 128, 16, 8, 32768
    plan = KVPlan("int4-fp8-outlier", 1, KV, D, 128, [{"k": ["int4"] * KV, "v": ["int4"] * KV}])
    per = -(-(T + 64) // S)
    st = QuantKVStore(plan, B * per, S, device=dev)
    bt = torch.randperm(B * per, device=dev).reshape(B, per).int()
    ctx = torch.full((B,), T, dtype=torch.int32, device=dev)
    tm = TM.pack_bool_mask(TM.tree_mask_from_parents([-1]))[None].expand(B, 1, -1).contiguous().to(dev)
    nt = torch.ones(B, dtype=torch.int32, device=dev)
    q = torch.randn(B, 1, H, D, device=dev, dtype=torch.float16)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    base = K.default_num_splits(B, KV, 1, per * S, sms)
    rows = []
    for bn in (16, 32, 64):
        for nw in (4, 8):
            for sp in sorted({max(1, base // 2), base, base * 2}):
                kw = dict(block_n=bn, num_warps=nw, num_splits=sp)
                try:
                    ms = triton.testing.do_bench(
                        lambda: K.paged_attention(q, st, 0, bt, ctx, tm, nt, 1 / math.sqrt(D), **kw), warmup=10, rep=50
                    )
                except Exception as e:  # e.g. out of shared memory or registers for a configuration
                    rows.append({**kw, "error": repr(e)[:200]})
                    continue
                rows.append({**kw, "us": ms * 1e3})
                log(f"  block_n={bn} warps={nw} splits={sp}: {ms * 1e3:.1f} us")
    return rows


# ------------------------------------------------------------------------------------------------
# 3. the pair


def newest_engine(name: str) -> Path | None:
    d = ROOT / "engines" / name
    vs = sorted((int(p.name), p) for p in d.glob("*") if p.name.isdigit() and (p / "engine.json").is_file())
    return vs[-1][1] if vs else None


def load_generator(
    engine: Path, device: str, dtype: torch.dtype, tree, kernels: str, factory=None, cuda_graphs: str = "off"
):
    """The engine's models in `dtype` on `device` with its KV plan and limits (what Generator.from_engine loads,
    with the dtype chosen here). kernels: BPCOMPILE_KERNELS while the caches are made (auto: the Triton kernels
    on CUDA; triton: through the interpreter on CPU; torch: the PyTorch attention). factory: the verifier's KV
    store factory instead of the engine's plan. cuda_graphs: runtime.cuda_graphs (off: the executor's own step,
    what the other checks run)."""
    from bpcompile.core.engine import EngineConfig
    from bpcompile.runtime.generator import Generator
    from bpcompile.runtime.kvcache import kv_store_factory
    from bpcompile.runtime.model import FeatureDraft, Llama, is_feature_draft
    from bpcompile.runtime.paged_kv import float_store_factory

    cfg = EngineConfig.load(engine)
    verifier = Llama.from_checkpoint(engine / "verifier", dtype=dtype)
    draft = None
    if tree.kind != "none":
        d = engine / "draft"
        draft = FeatureDraft.from_dir(d, verifier) if is_feature_draft(d) else Llama.from_checkpoint(d, dtype=dtype)
    if factory is None and (engine / "kv_plan" / "plan.json").is_file():
        factory = kv_store_factory(KVPlan.load(engine / "kv_plan"))
    elif factory is None and cfg.kv_cache.format == "fp16":
        factory = float_store_factory(torch.float16)
    old = os.environ.get("BPCOMPILE_KERNELS")
    os.environ["BPCOMPILE_KERNELS"] = kernels
    try:
        lim = cfg.limits
        return Generator(
            verifier,
            draft,
            tree,
            max_batch_size=lim.max_batch_size,
            max_seq_len=lim.max_seq_len,
            page_size=cfg.kv_cache.page_size,
            kv_store_factory=factory,
            device=device,
            max_input_len=lim.max_input_len,
            backoff=cfg.speculative.backoff,
            cuda_graphs=cuda_graphs,
        )
    finally:
        if old is None:
            os.environ.pop("BPCOMPILE_KERNELS", None)
        else:
            os.environ["BPCOMPILE_KERNELS"] = old


def greedy(gen, prompts, n: int, logits: bool = False):
    """Greedy tokens per prompt (and the verifier's logits each was chosen from)."""
    from bpcompile.runtime.request import SamplingParams

    index = {
        gen.add_request(p, SamplingParams(max_tokens=n, generation_logits=logits)): i for i, p in enumerate(prompts)
    }
    toks = [[] for _ in prompts]
    rows = [[] for _ in prompts]
    while gen.has_work():
        for o in gen.step():
            i = index[o.request_id]
            toks[i] += o.new_tokens
            if o.generation_logits is not None:
                rows[i].append(o.generation_logits)
    return toks, [torch.cat(r) if r else None for r in rows]


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


def compare(got, ref, ref_logits, tie_ulps: float) -> dict:
    """Prompts identical, and per differing prompt its first divergence with the reference's top-2 gap there."""
    div = []
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            j = next(j for j in range(max(len(a), len(b))) if j >= len(a) or j >= len(b) or a[j] != b[j])
            d = {
                "prompt": i,
                "position": j,
                "got": a[j] if j < len(a) else None,
                "reference": b[j] if j < len(b) else None,
            }
            if ref_logits[i] is not None and j < len(ref_logits[i]):
                top2 = ref_logits[i][j].float().topk(2).values
                gap = float(top2[0] - top2[1])
                d.update(top_logit=float(top2[0]), top2_gap=gap, bf16_ulps=gap / bf16_ulp(float(top2[0])))
                d["near_tie"] = d["bf16_ulps"] <= tie_ulps
            div.append(d)
    return {"prompts": len(ref), "identical": len(ref) - len(div), "divergences": div}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def runtime_speed(gen, prompts, n: int, dev) -> float:
    from bpcompile.runtime.request import SamplingParams

    sync(dev)
    t = time.perf_counter()
    out = gen.generate(prompts, SamplingParams(max_tokens=n))
    sync(dev)
    return sum(len(o[0]) for o in out) / (time.perf_counter() - t)


def transformers_speed(hf: Path, prompts, n: int, dev, dtype) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=dtype).to(dev).eval()
    res = {}
    with torch.inference_mode():
        for B in (1, 8):
            x = torch.tensor(prompts[:B], device=dev)
            kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            model.generate(x[:, :8], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
            sync(dev)
            t = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), **kw)
            sync(dev)
            res[f"batch_{B}"] = B * n / (time.perf_counter() - t)
    del model
    return res


def predicted_bytes(engine: Path, hf: Path | None, dtype: torch.dtype, dev) -> dict:
    """`bpcompile plan`'s per-GPU total for the engine's recipe in the dtype it runs in here."""
    from bpcompile.compiler.hf import is_feature_draft, read_feature_draft, read_hf_config
    from bpcompile.compiler.plan import Device, plan
    from bpcompile.compiler.recipe import parse_recipe

    if not (engine / "recipe.yaml").is_file():
        return {"skipped": f"{engine}/recipe.yaml is missing"}
    r, _ = parse_recipe(engine / "recipe.yaml")
    vdir = hf or Path(r.models.verifier.path)
    ddir = Path(r.models.draft.path)
    if not (vdir / "config.json").is_file() or not ddir.is_dir():
        return {"skipped": f"the recipe's HF checkpoints ({vdir}, {ddir}) are not on this machine"}
    v = read_hf_config(vdir)
    d = read_feature_draft(ddir, v) if is_feature_draft(ddir) else read_hf_config(ddir)
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    r.models.verifier.dtype = r.models.draft.dtype = name
    mem = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 0
    p = plan(r, v, d, Device(str(dev), mem, H200_BW))
    return {k: p[k] for k in ("weights_bytes", "kv_bytes", "activations_bytes", "total_bytes")}


def check_pair(engine: Path, hf: Path | None, dev, dtype, n: int, n_prompts: int, quick: bool, tie_ulps: float):
    from tokenizers import Tokenizer

    from bpcompile.compiler.corpus import heldout_prompts
    from bpcompile.core.engine import EngineConfig
    from bpcompile.core.errors import UserError
    from bpcompile.runtime.speculative import TreeSpec

    cfg = EngineConfig.load(engine)
    spec = cfg.speculative
    tree = TreeSpec(spec.tree, length=spec.length, choices=spec.choices, nodes=spec.nodes)
    tok = Tokenizer.from_file(str(engine / "tokenizer" / "tokenizer.json"))
    plen = 16 if quick else 32
    prompts = heldout_prompts(tok, max(n_prompts, 8), plen)
    out = {"engine": str(engine), "dtype": str(dtype)[6:], "tokens": n, "prompts": n_prompts, "prompt_tokens": plen}
    out["tree"] = tree.kind

    secs, t = {}, time.perf_counter()

    def lap(name):
        nonlocal t
        secs[name] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()

    log("  CPU float32 reference (PyTorch attention)")
    ref_gen = load_generator(engine, "cpu", torch.float32, TreeSpec("none"), "torch")
    ref, ref_logits = greedy(ref_gen, prompts[:n_prompts], n, logits=True)
    del ref_gen
    lap("reference")

    kernels = "auto" if dev.type == "cuda" else "triton"
    tn = n if quick else 4 * n
    speed = {}

    def run(name: str, spec_tree, logits: bool):
        """Greedy tokens on the device, then decode speed; the peak memory of this configuration alone."""
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        g = load_generator(engine, str(dev), dtype, spec_tree, kernels)
        # on CPU the interpreter's kernels where the plan is theirs (the runtime warns and uses PyTorch where not)
        out["attention"] = "Triton kernels" if g.vkv.kern is not None else "PyTorch (the plan is not the kernels')"
        log(f"  {name} on {dev} ({out['attention']})")
        toks, rows = greedy(g, prompts[:n_prompts], n, logits)
        lap(name)
        if dev.type == "cpu":  # timed on the CPU's own attention path: the interpreter's times say nothing
            g = load_generator(engine, "cpu", dtype, spec_tree, "auto")
            speed["attention"] = "the CPU path (not the interpreted kernels)"
        speed[f"runtime_{name}"] = {f"batch_{B}": runtime_speed(g, prompts[:B], tn, dev) for B in (1, 8)}
        lap(f"{name}_speed")
        mem = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        return toks, rows, mem

    try:
        if tree.kind != "none":  # the served configuration first: its peak is what the plan predicts
            sp_toks, _, mem = run("speculative", tree, False)
        vo_toks, vo_logits, vo_mem = run("verifier_only", TreeSpec("none"), True)
    except UserError as e:  # a plan the kernels cannot read: refused on CUDA, not run on another path
        out["skipped"] = str(e)
        return out, False
    out["vs_cpu_fp32_reference"] = compare(vo_toks, ref, ref_logits, tie_ulps)
    if tree.kind != "none":
        out["speculation_vs_verifier_only"] = compare(sp_toks, vo_toks, vo_logits, tie_ulps)
    else:
        mem = vo_mem
    if dev.type == "cuda":
        peak = {f"torch.cuda.max_memory_allocated ({tree.kind if tree.kind != 'none' else 'verifier only'})": mem}
        torch.cuda.empty_cache()
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak = {"process_peak_rss (the whole check: reference, both runs, Python)": rss}
    hf_dir = hf
    if hf_dir is None and (engine / "recipe.yaml").is_file():
        from bpcompile.compiler.recipe import parse_recipe

        hf_dir = Path(parse_recipe(engine / "recipe.yaml")[0].models.verifier.path)
    if hf_dir is not None and (hf_dir / "config.json").is_file():
        log("  transformers generate")
        speed["transformers_generate"] = transformers_speed(hf_dir, prompts, tn, dev, dtype)
    else:
        speed["transformers_generate"] = f"skipped: no HF checkpoint at {hf_dir} (--hf)"
    lap("transformers")
    speed["tokens_per_request"] = tn
    speed["note"] = "generated tokens / wall time of the whole call (prefill included), greedy, no end id"
    out["decode_tokens_per_s"] = speed
    out["peak_memory_bytes"] = peak
    out["plan_predicts"] = predicted_bytes(engine, hf, dtype, dev)
    out["seconds"] = secs
    log("  CUDA graphs on vs off")
    out["cuda_graphs"] = check_graphs(engine, dev, dtype, tree, prompts, n_prompts, n, tn, kernels, tie_ulps)
    lap("cuda_graphs")
    ok = all(
        d.get("near_tie", False)
        for key in ("vs_cpu_fp32_reference", "speculation_vs_verifier_only")
        for d in out.get(key, {}).get("divergences", [])
    ) and all(d.get("near_tie", False) for d in out["cuda_graphs"]["on_vs_off"]["divergences"])
    return out, ok


def check_graphs(engine: Path, dev, dtype, tree, prompts, n_prompts: int, n: int, tn: int, kernels: str, tie_ulps):
    """runtime.cuda_graphs on (the static-buffer step: captured graphs on CUDA, eager on CPU) against off (the
    executor's own step): greedy tokens with the engine's tree, then decode tokens/s at batch 1 and 8, each after
    an untimed warm-up at that batch (on CUDA the first step of a bucket captures it)."""
    from bpcompile.runtime.request import SamplingParams

    res, factory = {"kv": "the engine's"}, None
    toks, logits, speed = {}, None, {}
    for mode in ("off", "on"):
        g = load_generator(engine, str(dev), dtype, tree, kernels, factory, mode)
        toks[mode], rows = greedy(g, prompts[:n_prompts], n, logits=mode == "off")
        logits = rows if mode == "off" else logits
        st = [e.static for e in (g.v_exec, g.d_exec) if e is not None and e.static is not None]
        if mode == "on":
            res["static_step"] = bool(st)
            res["attention"] = "Triton kernels" if g.vkv.kern is not None else "PyTorch (paged, fixed width)"
        if dev.type == "cpu":  # timed on the CPU's own path (an interpreter's times say nothing)
            g = load_generator(engine, "cpu", dtype, tree, "auto", factory, mode)
            st = [e.static for e in (g.v_exec, g.d_exec) if e is not None and e.static is not None]
        speed[mode] = {}
        for B in (1, 8):
            g.generate(prompts[:B], SamplingParams(max_tokens=min(tn, 8)))  # warm-up: captures this batch's buckets
            speed[mode][f"batch_{B}"] = runtime_speed(g, prompts[:B], tn, dev)
        if mode == "on":
            res["buckets"] = sum(len(s.buckets) for s in st)
            res["captured_graphs"] = sum(b.graph is not None for s in st for b in s.buckets.values())
    res["on_vs_off"] = compare(toks["on"], toks["off"], logits, tie_ulps)
    res["decode_tokens_per_s"] = speed
    if dev.type == "cpu":
        res["note"] = "CPU: the static step runs eagerly (no graphs); its speed is not the point here"
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--engine", type=Path, default=None, help="engine version [default: newest of engines/smollm2]")
    ap.add_argument("--hf", type=Path, default=None, help="the verifier's HF checkpoint [default: the recipe's]")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None, help="[cuda: bf16, cpu: fp32]")
    ap.add_argument("--tokens", type=int, default=None, help="greedy tokens per prompt [32; --quick: 4]")
    ap.add_argument("--prompts", type=int, default=None, help="prompts compared [16; --quick: 1]")
    ap.add_argument("--tie-ulps", type=float, default=4.0, help="a divergence within this many bf16 ulps is a tie")
    ap.add_argument("--quick", action="store_true", help="small sizes (CI on CPU); no kernel speed")
    ap.add_argument("--skip-pair", action="store_true", help="kernels only")
    ap.add_argument(
        "--sweep", action="store_true", help="CUDA: also sweep the attention kernel's tiles / warps / splits"
    )
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here (also printed)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda: torch sees no CUDA device here; --device cpu runs the same checks on the CPU",
            file=sys.stderr,
        )
        return 2
    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device == "cuda" else "float32"))
    n, n_prompts = a.tokens or (4 if a.quick else 32), a.prompts or (1 if a.quick else 16)
    t0 = time.time()
    import triton

    report = {
        "device": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "quick": a.quick,
        "kernel_precisions": unit_precisions()[0],
        "kernel_precisions_checked_end_to_end_only": unit_precisions()[1],
    }
    log("## kernels vs the PyTorch oracle")
    checks = check_kernels(dev, a.quick)
    report["kernels"] = {"ok": all(c["ok"] for c in checks), "checks": checks}
    ok = report["kernels"]["ok"]
    if dev.type == "cuda":
        log("## kernel speed")
        report["kernel_speed"] = kernel_speed(dev, a.quick)
        if a.sweep:
            log("## sweep")
            report["kernel_sweep"] = sweep(dev)
    else:
        report["kernel_speed"] = "not run: CUDA only (the interpreter's times say nothing)"
    if a.skip_pair:
        report["pair"] = "skipped (--skip-pair)"
    else:
        engine = a.engine or newest_engine("smollm2" if not a.quick or dev.type == "cuda" else "tiny")
        if engine is None or not (engine / "engine.json").is_file():
            report["pair"] = {
                "skipped": f"no engine version ({engine or 'engines/smollm2/<N>'}): build recipes/smollm2.yaml or pass --engine"
            }
            ok = False
        else:
            log(f"## pair {engine} on {dev}")
            report["pair"], pair_ok = check_pair(engine, a.hf, dev, dtype, n, n_prompts, a.quick, a.tie_ulps)
            ok = ok and pair_ok
    report["ok"] = ok
    report["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(report, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)
    log(f"{'all checks passed' if ok else 'CHECKS FAILED'} ({report['seconds']}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
