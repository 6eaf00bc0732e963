"""The TensorRT plugin library (libbpcompile_trt_plugins.so: the KV quantize-append and paged tree-attention
plugins over an engine's AOT-compiled kernels), built with CMake only where TensorRT's headers and libraries
exist; elsewhere a "skipped" record with the reason."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from bpcompile.core.errors import MissingDependency


def _plugin_src() -> Path:
    """plugins/trt at the repository's top level (a source checkout), else bpcompile/plugins/trt (where the wheel
    installs the same files: pyproject maps the package bpcompile.plugins to the top-level folder)."""
    pkg = Path(__file__).resolve().parents[1]
    top = pkg.parent / "plugins" / "trt"
    return top if (top / "CMakeLists.txt").is_file() else pkg / "plugins" / "trt"


PLUGIN_SRC = _plugin_src()
PLUGIN_LIB = "libbpcompile_trt_plugins.so"


def find_tensorrt() -> tuple[Path, Path] | None:
    """(include dir with NvInfer.h, libnvinfer.so) from $TENSORRT_ROOT or the usual install places."""
    roots = [os.environ.get("TENSORRT_ROOT"), "/usr/local/tensorrt", "/opt/tensorrt", "/usr"]
    for r in filter(None, roots):
        r = Path(r)
        incs = [r / "include", r / "include" / "x86_64-linux-gnu", r / "include" / "aarch64-linux-gnu"]
        libs = [r / "lib", r / "lib64", r / "lib" / "x86_64-linux-gnu", r / "lib" / "aarch64-linux-gnu"]
        inc = next((i for i in incs if (i / "NvInfer.h").is_file()), None)
        lib = next((f for d in libs if d.is_dir() for f in sorted(d.glob("libnvinfer.so*"))), None)
        if inc and lib:
            return inc, lib
    return None


def build_trt_plugin(kernels_dir: Path, out_dir: Path, *, required: bool = False) -> dict:
    """Build libbpcompile_trt_plugins.so (plugins/trt, CMake) against an engine's compiled kernels.

    Where TensorRT (or CMake, or the plugin sources, or compiled kernels) is missing, returns a "skipped"
    record with the reason, or raises MissingDependency when `required`. Never reports a library it did
    not build. Load the result before building or deserializing engines: IPluginRegistry::loadLibrary /
    trtexec --dynamicPlugins, or ctypes.CDLL(path, RTLD_GLOBAL) then initBpcompilePlugins."""
    kernels_dir, out_dir = Path(kernels_dir), Path(out_dir)

    def skip(reason: str) -> dict:
        if required:
            raise MissingDependency(f"TensorRT plugin library: {reason}", key="target")
        return {"status": "skipped", "reason": reason, "detail": f"skipped: {reason}"}

    if not (PLUGIN_SRC / "CMakeLists.txt").is_file():
        return skip(f"plugin sources not found at {PLUGIN_SRC} (a broken install of bpcompile)")
    try:
        kj = json.loads((kernels_dir / "kernels.json").read_text())
    except FileNotFoundError:
        return skip(f"{kernels_dir / 'kernels.json'} not found: compile the kernels first (kernels.compile: true)")
    if kj.get("status") != "compiled":
        return skip(f"the engine's kernels were not compiled ({kj.get('reason', kj.get('status'))})")
    trt = find_tensorrt()
    if trt is None:
        return skip(
            "TensorRT headers and libraries (NvInfer.h, libnvinfer.so) not found; set TENSORRT_ROOT "
            "to a TensorRT 10.x installation (the tensorrt-llm 1.2.x container has one)"
        )
    cmake = shutil.which("cmake")
    if cmake is None:
        return skip("cmake not found on PATH")
    build = out_dir / "build"
    root = trt[0].parent if trt[0].name == "include" else trt[0].parent.parent
    cfg = [
        cmake,
        "-S",
        str(PLUGIN_SRC),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DTENSORRT_ROOT={root}",
        f"-DBP_KERNELS_DIR={kernels_dir.resolve()}",
    ]
    for cmd in (cfg, [cmake, "--build", str(build), "-j", "2"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"TensorRT plugin build failed: {' '.join(cmd)}\n{(r.stdout + r.stderr)[-6000:]}")
    lib = out_dir / PLUGIN_LIB
    shutil.copy2(build / PLUGIN_LIB, lib)
    shutil.rmtree(build, ignore_errors=True)
    record = {
        "status": "built",
        "library": lib.name,
        "sha256": hashlib.sha256(lib.read_bytes()).hexdigest(),
        "tensorrt_include": str(trt[0]),
        "tensorrt_library": str(trt[1]),
        "namespace": "bpcompile",
        "plugins": ["BpQuantizeAppend", "BpPagedTreeAttention"],
        "load": "IPluginRegistry::loadLibrary(path) or trtexec --dynamicPlugins=path; from Python "
        "ctypes.CDLL(path, RTLD_GLOBAL).initBpcompilePlugins(None, b'bpcompile')",
    }
    (out_dir / "plugin.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return {"detail": f"built {lib.name} against {trt[1]}", **record}
