"""`target: tensorrt`: TensorRT engines built from the exported step graphs (onnx/<model>/{prefill,step}.onnx)
with the plugin library (trt_plugin/libbpcompile_trt_plugins.so) that implements their custom-op nodes.

This is one of the two boundaries to NVIDIA's libraries (the other is trtllm.py): where TensorRT is absent the
build refuses before doing any work, naming the commands that do the job on a machine that has it.
"""

from __future__ import annotations

from bpcompile.core.errors import MissingDependency
from bpcompile.runtime import plugin_ops as ops

PLUGIN_LIB = "libbpcompile_trt_plugins.so"


def tensorrt_version() -> str | None:
    try:
        import tensorrt
    except ImportError:
        return None
    v = getattr(tensorrt, "__version__", None)
    return v if isinstance(v, str) and v[:1].isdigit() else None  # a placeholder package has no real version


def require_tensorrt(recipe) -> str:
    """Refuse target tensorrt clearly where it cannot be built (before any stage runs)."""
    problems = []
    if recipe.kv_cache.format == "fp16":
        problems.append(
            "kv_cache.format fp16: the plugin library implements the quantized cache only "
            f"({ops.QUANT_APPEND}, {ops.QUANT_ATTENTION})"
        )
    if recipe.speculative.tree != "none":
        problems.append(
            f"speculation: the draft's unquantized cache ({ops.FLOAT_APPEND}, {ops.FLOAT_ATTENTION}) "
            "has no TensorRT plugin yet"
        )
    v = tensorrt_version()
    if v is None:
        problems.append("TensorRT (the `tensorrt` Python package, 10.x, and a GPU) is not installed here")
    elif int(v.split(".")[0]) < 10:
        problems.append(f"TensorRT {v} found; the plugins are IPluginV3 (TensorRT >= 10)")
    if problems:
        raise MissingDependency(
            "target 'tensorrt' cannot be built: " + "; ".join(problems) + ". What works today: build with "
            "`target: native` and `runtime: {onnx: true}` (the step graphs with the plugin nodes, run here by "
            "`bpcompile generate --executor onnxruntime`), then on a TensorRT machine, per graph: "
            "trtexec --onnx=<version>/onnx/verifier/step.onnx --dynamicPlugins=<version>/trt_plugin/"
            f"{PLUGIN_LIB} --saveEngine=verifier_step.plan --fp16 --preview=+aliasedPluginIO1003",
            key="target",
        )
    return v
