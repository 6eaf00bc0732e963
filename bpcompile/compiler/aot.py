"""Ahead-of-time compilation of the paged-KV kernels for an engine version: per specialization a cubin, its
PTX and a C launcher, which the TensorRT plugin (plugins/trt) wraps.

The compile itself runs in a bare subprocess with TRITON_INTERPRET=0 (Triton decides interpreted vs compiled
when it is first imported, and a CPU-only build process has already chosen the interpreter), which imports
this module and `bpcompile.kernels.paged` only."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bpcompile.core.checkpoint import attention_shape
from bpcompile.core.errors import UserError
from bpcompile.core.store import fault_point
from bpcompile.kernels import cbuild, paged
from bpcompile.runtime.kvcache import reader_precisions

# Triton's own AOT tool (triton/tools/compile.py) is not used as is: its launcher computes the grid from the
# kernel's arguments (ours depends on batch and split count, which are not arguments), maps fp32 scalars to
# `double` (the kernel reads 4 bytes), and calls exit() on a CUDA error (inside a server). The launcher
# below takes the grid, returns the CUresult, and loads the cubin on first use or explicitly.

_ARG_TYPES = {  # kernel argument -> Triton signature type; {dt} is the activation dtype (fp16 / bf16)
    "K": "*{dt}",
    "V": "*{dt}",
    "Q": "*{dt}",
    "Out": "*{dt}",
    "slots": "*i64",
    "q4": "*u8",
    "s4": "*fp16",
    "q8": "*u8",
    "s8": "*fp16",
    "qi8": "*u8",
    "si8": "*fp16",
    "q5": "*u8",
    "s5": "*fp16",
    "q6": "*u8",
    "s6": "*fp16",
    "q3": "*u8",
    "s3": "*fp16",
    "qk4": "*u8",
    "sk4": "*fp16",
    "qk5": "*u8",
    "sk5": "*fp16",
    "qk6": "*u8",
    "sk6": "*fp16",
    "unit_precision": "*i8",
    "unit_index": "*i32",
    "k_channel_scale": "*fp32",
    "int4_clip": "*fp32",
    "part_acc": "*fp32",
    "part_ml": "*fp32",
    "block_tables": "*i32",
    "context_lens": "*i32",
    "tree_mask": "*i32",
    "num_tree": "*i32",
    "num_q": "*i32",
    "src": "*u8",
    "dst": "*u8",
    "src_index": "*i64",
    "dst_index": "*i64",
    # KLT key units and exact entries (compiled out in the plugin's specializations: KLT = EXACT = 0)
    "positions": "*i32",
    "klt_bits": "*i32",
    "klt_offset": "*i32",
    "klt_step": "*fp32",
    "klt_level": "*fp32",
    "klt_basis": "*fp32",
    "klt_weight": "*fp32",
    "klt_mean": "*fp32",
    "inv_freq": "*fp32",
    "rec_k": "*fp16",
    "rec_v": "*fp16",
    "seq_row": "*i32",
    "q_pos": "*i32",
    "tree_pos": "*i32",
    "exact_k_map": "*fp32",
    "exact_k_bias": "*fp32",
    "exact_v_map": "*fp32",
}
_ALIGNED = {
    "K",
    "V",
    "Q",
    "Out",
    "q4",
    "s4",
    "q8",
    "s8",
    "qi8",
    "si8",
    "q5",
    "s5",
    "part_acc",
    "part_ml",
}  # 16-byte aligned
_C_TYPES = {"i8": "int8_t", "i32": "int32_t", "i64": "int64_t", "u8": "uint8_t", "fp32": "float"}
_KERNELS = {
    "quantize_append": "_quantize_append_kernel",
    "paged_attention": "_paged_attention_kernel",
    "combine_splits": "_combine_splits_kernel",
    "copy_rows": "_copy_rows_kernel",
}


def aot_specs(head_size: int, group_size: int, page_size: int, gqa: int, dtype: str = "fp16") -> list[dict]:
    """The specializations an engine needs: one quantize-append, paged attention for decode (16 query rows)
    and for trees (64 rows per program), each with and without split-K, the split merge, and the move."""
    common = dict(PAGE=page_size, D=head_size, GS=group_size)
    specs = [
        dict(
            name="quantize_append",
            kernel="quantize_append",
            constexprs={**common, "BLOCK_T": 16, "KLT": 0},
            num_warps=4,
            num_stages=1,
        )
    ]
    for rows, tag, warps in ((16, "decode", 4), (64, "tree", 8)):
        for split in (0, 1):
            specs.append(
                dict(
                    name=f"paged_attention_{tag}{'_split' if split else ''}",
                    kernel="paged_attention",
                    constexprs={
                        **common,
                        "R": gqa,
                        "BLOCK_M": rows,
                        "BLOCK_N": paged.DEFAULT_BLOCK_N,
                        "SPLIT": split,
                        "F32": 0,
                        "KLT": 0,
                        "EXACT": 0,
                    },
                    num_warps=warps,
                    num_stages=2,
                )
            )
    specs.append(
        dict(
            name="combine_splits",
            kernel="combine_splits",
            constexprs={"D": head_size, "BLOCK_R": 16},
            num_warps=4,
            num_stages=1,
        )
    )
    specs.append(
        dict(
            name="copy_rows",
            kernel="copy_rows",
            constexprs={"BLOCK_U": 16, "BLOCK_B": paged._pow2(head_size)},
            num_warps=4,
            num_stages=1,
        )
    )
    for s in specs:
        s["dtype"] = dtype
        s["name"] = f"bp_{s['name']}_{dtype}"
    return specs


def _signature(kernel, spec: dict) -> list[tuple[str, str]]:
    """[(argument, type)] of the runtime arguments, in order (constexprs removed)."""
    return [
        (a, _ARG_TYPES.get(a, "i32").format(dt=spec["dtype"])) for a in kernel.arg_names if a not in spec["constexprs"]
    ]


_LAUNCHER_C = """/* Generated by bpcompile.compiler.aot (Triton {triton_version}, {target}) from {kernel}: {doc}.
   {name}_launch(stream, gridX, gridY, gridZ, args...) launches it; the cubin is loaded on first use
   (or by {name}_load()), so load it before capturing a CUDA graph. Returns the CUresult, never exits. */
#include <cuda.h>
#include <stdint.h>
#include "{name}.h"

static const unsigned char {name}_cubin[{size}] = {{
{data}
}};
static CUmodule {name}_mod = NULL;
static CUfunction {name}_func = NULL;

CUresult {name}_load(void) {{
  if ({name}_func) return CUDA_SUCCESS;
  CUresult r = cuModuleLoadData(&{name}_mod, {name}_cubin);
  if (r != CUDA_SUCCESS) return r;
  r = cuModuleGetFunction(&{name}_func, {name}_mod, "{symbol}");
  if (r == CUDA_SUCCESS && {shared} > 49152)
    r = cuFuncSetAttribute({name}_func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, {shared});
  return r;
}}

CUresult {name}_unload(void) {{
  CUresult r = {name}_mod ? cuModuleUnload({name}_mod) : CUDA_SUCCESS;
  {name}_mod = NULL;
  {name}_func = NULL;
  return r;
}}

CUresult {name}_launch(CUstream stream, unsigned int gridX, unsigned int gridY, unsigned int gridZ{params}) {{
  CUresult r = {name}_load();
  if (r != CUDA_SUCCESS) return r;
  if (gridX == 0 || gridY == 0 || gridZ == 0) return CUDA_SUCCESS;
  CUdeviceptr scratch = 0; /* Triton's trailing global/profile scratch pointers (unused: size 0) */
  void *args[] = {{ {arg_ptrs} }};
  return cuLaunchKernel({name}_func, gridX, gridY, gridZ, {threads}, 1, 1, {shared}, stream, args, NULL);
}}
"""

_LAUNCHER_H = """/* Generated by bpcompile.compiler.aot: launcher of {name} ({kernel}; {doc}). */
#pragma once
#include <cuda.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {{
#endif
CUresult {name}_load(void);
CUresult {name}_unload(void);
CUresult {name}_launch(CUstream stream, unsigned int gridX, unsigned int gridY, unsigned int gridZ{params});
#ifdef __cplusplus
}}
#endif
"""


def _ptx_param_count(ptx: str, symbol: str) -> int:
    start = ptx.index(f".entry {symbol}(")
    return ptx[start : ptx.index(")", start)].count(".param")


def _aot_compile(spec_file: str) -> None:
    """Subprocess body (TRITON_INTERPRET=0): compile every spec in spec_file's JSON into its out dir."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    job = json.loads(Path(spec_file).read_text())
    out = Path(job["out_dir"])
    target = GPUTarget("cuda", job["capability"], 32)
    for spec in job["specs"]:
        kernel = getattr(paged, _KERNELS[spec["kernel"]])
        sig = _signature(kernel, spec)
        signature = {a: t for a, t in sig}
        signature.update({c: "constexpr" for c in spec["constexprs"]})
        signature = {a: signature[a] for a in kernel.arg_names}
        attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a, _ in sig if a in _ALIGNED}
        src = ASTSource(fn=kernel, signature=signature, constexprs=dict(spec["constexprs"]), attrs=attrs)
        cc = paged.triton.compile(
            src,
            target=target,
            options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"], "enable_fp_fusion": False},
        )
        md = cc.metadata
        if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
            raise RuntimeError(f"{spec['name']} needs global scratch memory; the launcher does not provide it")
        name, ptx, cubin = spec["name"], cc.asm["ptx"], cc.asm["cubin"]
        symbol = md.name
        extra = _ptx_param_count(ptx, symbol) - len(sig)
        params = "".join(f", {'CUdeviceptr' if t[0] == '*' else _C_TYPES[t]} {a}" for a, t in sig)
        arg_ptrs = ", ".join([f"&{a}" for a, _ in sig] + ["&scratch"] * extra)
        doc = ", ".join(f"{k}={v}" for k, v in spec["constexprs"].items()) + f", num_warps={spec['num_warps']}"
        hexes = [f"0x{b:02x}" for b in cubin]
        data = ",\n".join(", ".join(hexes[i : i + 16]) for i in range(0, len(hexes), 16))
        fmt = dict(
            name=name,
            kernel=spec["kernel"],
            doc=doc,
            triton_version=paged.triton.__version__,
            target=f"sm_{job['capability']}{'a' if job['capability'] == 90 else ''}",
            size=len(cubin),
            data=data,
            symbol=symbol,
            shared=md.shared,
            params=params,
            arg_ptrs=arg_ptrs,
            threads=32 * spec["num_warps"],
        )
        (out / f"{name}.cubin").write_bytes(cubin)
        (out / f"{name}.ptx").write_text(ptx)
        (out / f"{name}.c").write_text(_LAUNCHER_C.format(**fmt))
        (out / f"{name}.h").write_text(_LAUNCHER_H.format(**fmt))
        (out / f"{name}.meta.json").write_text(
            json.dumps(
                {
                    "symbol": symbol,
                    "shared": md.shared,
                    "num_warps": spec["num_warps"],
                    "num_stages": spec["num_stages"],
                    "extra_params": extra,
                    "signature": sig,
                },
                indent=1,
            )
        )


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# The compiler subprocess's entry point. It first asks the kernel to SIGKILL it when its parent dies (Linux
# PR_SET_PDEATHSIG; the parent check covers a parent that died before that), so a build killed with -9 does
# not leave a compiler running on as an orphan; only then does it import torch and triton.
_COMPILER_MAIN = """import os, signal, sys
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[2]):
    os._exit(1)
from bpcompile.compiler.aot import _aot_compile
_aot_compile(sys.argv[1])
"""


def _run_compiler(job: Path, env: dict) -> None:
    cmd = [sys.executable, "-c", _COMPILER_MAIN, str(job), str(os.getpid())]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        fault_point("kernels")
        try:
            _, err = proc.communicate()
        except BaseException:  # interrupted: take the compiler down with us
            proc.kill()
            raise
    if proc.returncode != 0:
        raise RuntimeError(f"Triton AOT compile failed:\n{err[-6000:]}")


def _remove_dead_tmp(cache: Path) -> None:
    """Remove <key>.tmp<pid> directories of compiles whose process is gone (a build killed mid-compile)."""
    for d in cache.glob("*.tmp*"):
        pid = d.name.rpartition(".tmp")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


def _cache_root() -> Path:
    """Compiled cubins are reused across builds by a key of public inputs and copied into engines that are run:
    they are cached only where the CPU kernels' cache is trusted (see kernels.cbuild), else privately."""
    return cbuild.cache_subdir("kernels")


def find_cuda_include() -> Path | None:
    """cuda.h's directory: $CUDA_HOME/$CUDA_PATH, next to nvcc, or /usr/local/cuda."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if nvcc := shutil.which("nvcc"):
        cands.append(str(Path(nvcc).resolve().parent.parent))
    cands.append("/usr/local/cuda")
    for c in filter(None, cands):
        if (Path(c) / "include" / "cuda.h").is_file():
            return Path(c) / "include"
    return None


def check_launchers(kernels_dir: Path) -> dict:
    """Compile every generated launcher with the CUDA headers (a C compiler, else nvcc) to prove they build.
    Skipped, with the reason, where no CUDA headers or compiler exist."""
    inc = find_cuda_include()
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("nvcc")
    if inc is None:
        return {"status": "skipped", "reason": "no CUDA headers (cuda.h) found: set CUDA_HOME"}
    if cc is None:
        return {"status": "skipped", "reason": "no C compiler (cc, gcc or nvcc) on PATH"}
    import tempfile

    sources = sorted(str(p) for p in Path(kernels_dir).glob("*.c"))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [cc, "-c", "-O0", "-Wall", "-Werror", f"-I{inc}", f"-I{kernels_dir}", *sources]
        if Path(cc).name == "nvcc":
            cmd = [cc, "-c", f"-I{inc}", f"-I{kernels_dir}", *sources]
        r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"generated launchers do not compile ({' '.join(cmd[:2])} ...):\n{r.stderr[-4000:]}")
    return {"status": "ok", "compiler": cc, "cuda_include": str(inc), "files": len(sources)}


def _write_kernels_header(out_dir: Path, specs: list[dict], model: dict, gqa: int) -> None:
    """bp_kernels.h: the specialization's constants and generic launcher names for the TensorRT plugin (plugins/trt)."""
    lines = [
        "/* Generated by bpcompile.compiler.aot: the kernels in this directory, for the TensorRT plugin (plugins/trt). */",
        "#pragma once",
    ]
    lines += [f'#include "{s["name"]}.h"' for s in specs]
    attn = next(s for s in specs if s["kernel"] == "paged_attention")
    const = {
        "BP_HEAD_SIZE": model["head_size"],
        "BP_GROUP_SIZE": model["group_size"],
        "BP_PAGE_SIZE": model["page_size"],
        "BP_GQA": gqa,
        "BP_BLOCK_N": attn["constexprs"]["BLOCK_N"],
        "BP_DTYPE_IS_BF16": int(model["dtype"] == "bf16"),
        "BP_QUANT_BLOCK_T": specs[0]["constexprs"]["BLOCK_T"],
        "BP_COMBINE_BLOCK_R": next(s for s in specs if s["kernel"] == "combine_splits")["constexprs"]["BLOCK_R"],
    }
    lines += [f"#define {k} {v}" for k, v in const.items()]
    # The KV pools as the store lays them out (runtime/kvcache.py's precision registry): a payload and an fp16
    # scale pool per unit precision, then how to pass them (pointers, then each precision's unit count).
    # The kernels take the pools of every precision the Triton kernels read; the plugin has those of the ones it
    # reads (bpcompile.core.kv_support), and passes null pools with no units for the others.
    trt = {torch.uint8: "kUINT8", torch.int8: "kINT8", torch.float16: "kHALF"}  # the ONNX graphs' pool types
    ours = reader_precisions("tensorrt")
    pools = [t for prec in ours for t in (trt[prec.payload_dtype], "kHALF")]
    args, units = [], []
    for prec in reader_precisions("triton"):
        i = ours.index(prec) if prec in ours else None
        args += [f"POOL({2 * i})", f"POOL({2 * i + 1})"] if i is not None else ["0", "0"]
        units.append(f"UNITS({2 * i})" if i is not None else "0")
    # the arguments after the plugin's own (KLT tables, exact entries): zeros, compiled out (KLT = EXACT = 0)
    tail = {
        "quantize_append": paged._quantize_append_kernel.arg_names.index("KVH") + 1,
        "paged_attention": paged._paged_attention_kernel.arg_names.index("chunk") + 1,
    }
    extra = {}
    for name, start in tail.items():
        spec = next(s for s in specs if s["kernel"] == name)
        rest = [a for a in getattr(paged, _KERNELS[name]).arg_names[start:] if a not in spec["constexprs"]]
        extra[name] = ", ".join("0" for _ in rest)
    lines += [
        f"/* unit precisions: {', '.join(f'{p.name} = {p.code}' for p in reader_precisions('triton'))}; the plugin "
        f"reads {', '.join(p.name for p in ours)} */",
        f"#define BP_NUM_KV_POOLS {len(pools)}",
        "#define BP_KV_POOL_TYPES " + ", ".join(f"nvinfer1::DataType::{t}" for t in pools),
        "#define BP_KV_POOL_ARGS(POOL, UNITS) " + ", ".join(args + units),
        f"#define BP_QUANT_EXTRA_ARGS {extra['quantize_append']}",
        f"#define BP_ATTN_EXTRA_ARGS {extra['paged_attention']}",
    ]
    suffix = f"_{model['dtype']}"
    lines += [f"#define {s['name'][: -len(suffix)]}_launch {s['name']}_launch" for s in specs]
    # every module loaded up front (the plugins call this outside enqueue, so capture never sees a module load)
    lines += ["static inline CUresult bp_load_kernels(void) {", "  CUresult r = CUDA_SUCCESS;"]
    lines += [f"  if ((r = {s['name']}_load()) != CUDA_SUCCESS) return r;" for s in specs]
    lines += ["  return r;", "}"]
    (out_dir / "bp_kernels.h").write_text("\n".join(lines) + "\n")


def compile_engine_kernels(stage_dir: Path, recipe, out_dir: Path) -> dict:
    """Compile the kernels for the engine in stage_dir (its verifier's shape, the recipe's KV page and group
    size, recipe.kernels.arch) into out_dir: per specialization a .cubin, .ptx, C launcher (.c/.h), plus
    kernels.json (every file's sha256, the specialization, Triton version, arch). Results are cached under
    ~/.cache/bpcompile/kernels keyed by kernel source, Triton version and specialization."""
    stage_dir, out_dir = Path(stage_dir), Path(out_dir)
    cfg_file = stage_dir / "verifier" / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
        heads, kv_heads, head_size = attention_shape(cfg)
    except FileNotFoundError:
        raise UserError("converted verifier config not found", file=str(cfg_file)) from None
    except KeyError as e:
        raise UserError("missing key in converted checkpoint config", file=str(cfg_file), key=str(e.args[0])) from None
    arch = recipe.kernels.arch
    capability = int(arch[3:].rstrip("a"))
    group = min(recipe.kv_cache.group_size, head_size)
    dtype = {"float16": "fp16", "bfloat16": "bf16"}.get(cfg.get("dtype"), "fp16")  # fp32 models run fp16 on GPU
    model = {
        "head_size": head_size,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "page_size": recipe.kv_cache.page_size,
        "group_size": group,
        "dtype": dtype,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    why = paged.check_shape(head_size, group)
    if why is None and capability < 80:
        why = f"arch {arch}: the kernels need sm_80 or newer (fp16 tensor-core dots, fp8 decode)"
    if why is not None:
        record = {"status": "skipped", "reason": why, "arch": arch, "model": model}
        (out_dir / "kernels.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        return {"detail": f"skipped: {why}", **record}

    specs = aot_specs(head_size, group, recipe.kv_cache.page_size, heads // kv_heads, dtype)
    source = Path(paged.__file__).read_bytes()
    key = hashlib.sha256(
        source + paged.triton.__version__.encode() + arch.encode() + json.dumps(specs, sort_keys=True).encode()
    ).hexdigest()[:20]
    cached = _cache_root() / key
    t0 = time.perf_counter()
    hit = (cached / "done").is_file()
    if not hit:
        _remove_dead_tmp(cached.parent)
        tmp = cached.with_name(f"{key}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        job = tmp / "job.json"
        job.write_text(json.dumps({"out_dir": str(tmp), "capability": capability, "specs": specs}))
        env = dict(
            os.environ,
            TRITON_INTERPRET="0",
            TRITON_CACHE_DIR=str(tmp / ".triton"),
            PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
        )
        _run_compiler(job, env)
        shutil.rmtree(tmp / ".triton", ignore_errors=True)
        job.unlink()
        (tmp / "done").write_text(key + "\n")
        try:
            tmp.rename(cached)
        except OSError:  # a concurrent build cached the same key first
            shutil.rmtree(tmp, ignore_errors=True)
    compile_s = time.perf_counter() - t0
    kernels = []
    for spec in specs:
        name = spec["name"]
        meta = json.loads((cached / f"{name}.meta.json").read_text())
        files = {}
        for ext in ("cubin", "ptx", "c", "h"):  # (bp_kernels.h is listed below)
            shutil.copy2(cached / f"{name}.{ext}", out_dir / f"{name}.{ext}")
            files[ext] = {"path": f"{name}.{ext}", "sha256": _sha256(out_dir / f"{name}.{ext}")}
        kernels.append(
            {
                "name": name,
                "kernel": _KERNELS[spec["kernel"]],
                "constexprs": spec["constexprs"],
                "signature": [list(x) for x in meta["signature"]],
                "num_warps": spec["num_warps"],
                "num_stages": spec["num_stages"],
                "shared_bytes": meta["shared"],
                "launch": f"{name}_launch(CUstream, gridX, gridY, gridZ, <signature>)",
                "files": files,
            }
        )
    _write_kernels_header(out_dir, specs, model, gqa=heads // kv_heads)
    check = check_launchers(out_dir)
    files_extra = {"bp_kernels.h": _sha256(out_dir / "bp_kernels.h")}
    record = {
        "status": "compiled",
        "arch": arch,
        "headers": files_extra,
        "target": f"cuda:{capability} (Triton emits sm_{capability}a)",
        "triton_version": paged.triton.__version__,
        "source_sha256": hashlib.sha256(source).hexdigest(),
        "model": model,
        "kernels": kernels,
        "launcher_check": check,
    }
    (out_dir / "kernels.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    detail = (
        f"{len(kernels)} kernels for {arch} (D={head_size}, group {group}, page {recipe.kv_cache.page_size}, "
        f"GQA {heads // kv_heads}, {dtype}) {'from cache' if hit else f'compiled in {compile_s:.1f}s'}; "
        f"launchers: {check['status']}" + (f" ({check['reason']})" if check["status"] == "skipped" else "")
    )
    return {"detail": detail, "status": "compiled", "cached": hit, "launcher_check": check["status"]}
