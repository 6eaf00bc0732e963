"""The engine config: what a built engine version is, in one typed model.

The recipe's engine-facing sections are defined here (the recipe composes them, so a default has one home);
the build writes the resolved sections as `engine.json` into the version, and the runtime, the repository
emitter and the Triton models read it back with `EngineConfig.load`, never the YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bpcompile.core.errors import UserError
from bpcompile.core.kv_support import all_take, engine_readers

ENGINE_FILE = "engine.json"
TARGETS = ("native", "tensorrt", "tensorrt-llm")
EXECUTORS = ("torch", "onnxruntime")
DEVICES = ("cpu", "cuda", "auto")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Parallel(_Strict):
    # strict: YAML's `tp: true` would otherwise pass as 1, and "2" as 2
    tp: int = Field(1, ge=1, strict=True)
    pp: int = Field(1, ge=1, strict=True)


class Limits(_Strict):
    # Upper bounds catch typos before anything is sized from them; load_recipe also checks that the
    # KV pool these limits imply fits in memory.
    max_batch_size: int = Field(8, ge=1, le=4096)
    max_input_len: int = Field(256, ge=1)
    max_seq_len: int = Field(512, ge=2, le=2**20)

    @model_validator(mode="after")
    def _input_fits(self):
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(
                f"max_input_len ({self.max_input_len}) must be smaller than max_seq_len ({self.max_seq_len})"
            )
        return self


# int3_values: auto with INT6 keys (int6_keys: early, opt-in): on SmolLM2 (30 layers, 3 KV heads, head size 64,
# 2048 tokens) the keys of layers 0-9 in INT6 and 10-19 in INT5 with a window of 11 are 3.50x allocated with two
# thirds of the value units in INT3: the values outside the INT5 keys' layers (those go to INT3 last; INT3 values
# there changed what the model retrieves from 4k tokens back)
AUTO_INT3_VALUES = 0.6667


class KVCache(_Strict):
    format: Literal["int4-fp8-outlier", "fp8", "int8", "fp16"] = "int4-fp8-outlier"
    outlier_fraction: Union[Annotated[float, Field(ge=0.0, le=1.0)], Literal["auto"]] = Field(
        "auto",
        description="share of (layer, head, K|V) units kept in FP8; auto: 0 with INT5 keys, 0.01 with "
        "exact entries, else 0.08",
    )
    sink_tokens: Union[Annotated[int, Field(ge=0, le=1024)], Literal["auto"]] = Field(
        "auto",
        description="first positions of a sequence whose K/V are also kept in FP16 and read exact; "
        "auto: 0 (an exact sink lowered long-context passkey retrieval on SmolLM2)",
    )
    recent_window: Union[Annotated[int, Field(ge=0, le=4096)], Literal["auto"]] = Field(
        "auto",
        description="a query reads the K/V of the newest positions up to its own (this many, itself "
        "included) from an FP16 copy; auto: for int4-fp8-outlier on the native target with "
        "the torch executor 10 with INT5 keys (also with INT6 and KLT keys; 11 with INT6 keys "
        "and no KLT, 7 with KLT keys and no INT5 ones, 16 without INT5 keys: what 3.5x leaves on "
        "SmolLM2), else 0",
    )
    group_size: int = Field(64, ge=8, description="INT4 elements per scale along the head dimension")
    page_size: int = Field(16, ge=1, le=4096, description="tokens per KV page")
    rotation: Literal["auto", "hadamard", "none"] = Field(
        "auto",
        description="store K and V Hadamard-rotated (keys centered and query-scaled first); auto: where "
        "the head size is a power of two",
    )
    outlier_precision: Literal["fp8", "int8"] = Field("fp8", description="precision of the outlier units")
    retrieval_fraction: Union[Annotated[float, Field(ge=0.0, le=0.5)], Literal["auto"]] = Field(
        "auto",
        description="share of units holding the keys of retrieval heads (found with needle-in-a-haystack "
        "probes on the calibration text) stored in INT8; auto: 0.015 for int4-fp8-outlier with "
        "exact entries and no INT5 keys, else 0",
    )
    int5_keys: Literal["auto", "middle", "none"] = Field(
        "auto",
        description="keys stored in INT5: 'middle' = those of the middle third of the layers. auto: middle "
        "for int4-fp8-outlier with an exact window (on SmolLM2 INT4 noise in those keys, next "
        "to exact recent keys, changed what the model retrieves from 4k tokens back), else none",
    )

    int6_keys: Literal["auto", "early", "none"] = Field(
        "auto",
        description="keys stored in INT6: 'early' = those of the first third of the layers (with INT3 values "
        "to pay for them; which readers take them: bpcompile/core/kv_support.py). auto: early with INT5 keys and "
        "key_transform: klt, the default (on SmolLM2 the three together kept "
        "passkey retrieval within 2 points of FP16 KV's at every length), else none",
    )
    int3_values: Union[Annotated[float, Field(ge=0.0, le=1.0)], Literal["auto"]] = Field(
        "auto",
        description="share of the value units stored in INT3, the least sensitive first, those of the "
        f"INT5 keys' layers last; auto: {AUTO_INT3_VALUES} with INT6 keys (the values outside "
        "the INT5 keys' layers: what pays for them at 3.5x on SmolLM2), else 0",
    )

    key_transform: Literal["auto", "klt", "none"] = Field(
        "auto",
        description="klt: the INT4 / INT5 / INT6 keys of the first two thirds of the layers stored as "
        "coefficients of a calibrated basis before RoPE, bits per coefficient by their variance, at "
        "the same bytes per token plus a D x D table per unit (which readers take them: kv_support.py). "
        "With INT5 keys and int6_keys' auto: the keys of the first third INT6, KLT6 / KLT5 in "
        "layers 0-19 on SmolLM2, INT3 values outside the middle third (passkey within 2 points of "
        "FP16 KV's at every length). auto: klt with INT5 keys unless int6_keys is none "
        "(the default on the native target with the torch executor), else none; none gives the "
        "INT5-keys plan",
    )

    @model_validator(mode="after")
    def _bands_with_int4(self):
        for name, on in (
            ("int5_keys", self.int5_keys == "middle"),
            ("int6_keys", self.int6_keys == "early"),
            ("int3_values", self.int3_values not in ("auto", 0, 0.0)),
            ("key_transform", self.key_transform == "klt"),
        ):
            if on and self.format != "int4-fp8-outlier":
                raise ValueError(f"{name} needs format int4-fp8-outlier, not {self.format}")
        return self


class Speculative(_Strict):
    tree: Literal["dynamic", "static", "chain", "none"] = "dynamic"
    nodes: int = Field(5, ge=1, le=256, description="dynamic tree: node budget per step")
    length: int = Field(5, ge=1, le=64, description="chain: draft tokens per step")
    choices: Optional[list[list[int]]] = Field(None, description="static tree in Medusa/EAGLE notation")
    backoff: bool = Field(True, description="draft less, or not at all for a while, when speculation does not pay")

    @model_validator(mode="after")
    def _choices(self):
        if self.tree == "static":
            if not self.choices:
                raise ValueError("tree 'static' needs 'choices', e.g. [[0], [1], [0, 0]]")
            seen = {()}
            for c in sorted(self.choices, key=len):
                if not c or any(i < 0 for i in c):
                    raise ValueError(f"choice {c} must be a non-empty list of non-negative top-k indices")
                if tuple(c[:-1]) not in seen:
                    raise ValueError(f"choice {c} has no parent {c[:-1]} in choices")
                seen.add(tuple(c))
        return self


class Triton(_Strict):
    emit: bool = True
    version_policy: Union[Literal["latest", "all"], dict] = "latest"
    generator_instances: int = Field(1, ge=1)
    decoupled: bool = Field(
        True,
        description="tensorrt_llm and ensemble answer through a response stream (decoupled transaction policy): "
        "streaming, and a client's cancel reaching the generation loop. false: they answer unary infer (gRPC "
        "ModelInfer, HTTP /infer, perf_analyzer without --streaming) with the whole result, as "
        "tensorrtllm_backend's decoupled_mode: false, and refuse stream=true",
    )

    @field_validator("version_policy")
    @classmethod
    def _policy_shape(cls, v):
        # the shapes bpcompile/serving/emit.py writes into config.pbtxt: a bad one must fail here, not after publishing
        if isinstance(v, dict):
            kind, n = next(iter(v.items())) if len(v) == 1 else (None, None)
            if isinstance(n, dict):  # the protobuf-shaped form, {latest: {num_versions: 2}}
                n = n.get("num_versions" if kind == "latest" else "versions")
            if not (
                (kind == "latest" and type(n) is int and n >= 1)
                or (kind == "specific" and isinstance(n, list) and n and all(type(x) is int and x >= 1 for x in n))
            ):
                raise ValueError(
                    "expected latest, all, {latest: N} with N >= 1, or {specific: [N, ...]} of positive versions"
                )
        return v


class Runtime(_Strict):
    executor: Literal[EXECUTORS] = Field(
        "torch",
        description="what runs the models: torch (their modules) or onnxruntime (the exported step "
        "graphs with the KV-cache and attention custom ops; implies onnx)",
    )
    onnx: bool = Field(False, description="export each model's step graphs into the version (onnx/)")
    cpu_weights: Literal["auto", "both", "rows", "packed", "plain"] = Field(
        "auto",
        description="float32 weights on CPU with the torch executor: auto = one copy of the weights, rows "
        "where bpcompile's few-row kernel builds, else plain (docs/CPU.md: a second copy costs the weights' "
        "size again, +540 MB on SmolLM2, for at most ~3% of a decode step); both = the plain layout for one row "
        "(PyTorch's GEMV) and a second copy for products of several rows, multiplied by "
        "bpcompile's few-row kernel (up to 16 rows: a tree verify; built on first use with the "
        "C compiler, for AVX-512 CPUs) or, where that kernel is unavailable, oneDNN-packed; "
        "rows = one copy, the few-row kernel for one row too (~3% slower a decode step); "
        "packed = oneDNN-packed only; plain = PyTorch's plain products",
    )

    device: Literal[DEVICES] = Field(
        "cpu",
        description="where the models run: cpu; cuda (the GPU's Triton kernels are the attention, so the KV "
        "plan must be one they read; the Triton repository declares GPU instances); auto = cuda where torch "
        "sees a GPU when the engine starts, else cpu (the plan as for cuda)",
    )

    prefill_chunk: int = Field(
        512,
        ge=0,
        description="prompt tokens prefilled per step at most: a longer prompt prefills in chunks interleaved with "
        "the decode / speculative steps of the running sequences, which then wait one chunk's forward for their "
        "next token instead of the whole prompt's (outputs identical to an unchunked prefill; costs one prompt's "
        "K/V in the compute dtype while it prefills); 0 = off (every admitted prompt prefills whole at once)",
    )

    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="decode, draft and tree-verify steps from static per-bucket buffers (batch size rounded up to "
        "a power of two x query rows), each bucket captured once as a CUDA graph and replayed (docs/GPU.md); on "
        "CPU the same static step runs eagerly. auto = on for CUDA where it applies (the torch executor, any tp "
        "and KV plan), else off; on = also on CPU, and an error where it does not apply",
    )

    prefix_reuse: Union[bool, Literal["auto"]] = Field(
        "auto",
        description="reuse the KV pages of a prompt's leading full pages computed by an earlier request "
        "(multi-turn chats, a shared system prompt): only the rest of the prompt is computed (docs/KV_FORMAT.md, "
        "prefix reuse). auto = on for a float KV cache (outputs identical to computing it), off for a quantized "
        "plan (the rest of the prompt would read the prefix in its stored form, as decode steps do, where a "
        "full prefill reads it unquantized: outputs may differ); true = on for every plan; false = off",
    )

    @property
    def wants_onnx(self) -> bool:
        return self.onnx or self.executor == "onnxruntime"


class EngineConfig(_Strict):
    """The resolved engine-facing sections of the recipe a version was built from (the recipe adds the
    build's own sections: models, calibration, output, kernels)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    target: Literal[TARGETS] = "native"
    parallel: Parallel = Parallel()
    limits: Limits = Limits()
    kv_cache: KVCache = KVCache()
    speculative: Speculative = Speculative()
    triton: Triton = Triton()
    runtime: Runtime = Runtime()

    @property
    def kv_readers(self) -> tuple[str, ...]:
        """The readers this engine's KV cache must suit (bpcompile.core.kv_support: the torch executor on the
        CPU, the Triton kernels on CUDA, the step graphs with ONNX, the TensorRT plugin, TensorRT-LLM)."""
        return engine_readers(self.target, self.runtime.wants_onnx, self.runtime.device)

    def kv_takes(self, *features: str) -> bool:
        """Whether every reader of this engine's cache takes each of `features` (kv_support.SUPPORT)."""
        return self.kv_cache.format != "fp16" and all(all_take(self.kv_readers, f) for f in features)

    @property
    def exact_entries_readable(self) -> bool:
        """Whether this engine's runtime reads a plan's exact (FP16 sink / window) entries."""
        return self.kv_takes("exact")

    @model_validator(mode="after")
    def _resolve_kv(self):
        """Fill in the KV cache's auto settings for this target (engine.json stores the resolved values): the
        default plan's features where every reader of this engine takes them (kv_support.SUPPORT; e.g. the
        ONNX graphs and the TensorRT plugin read no exact entries); load_recipe refuses them where they would not
        be read."""
        kv = self.kv_cache
        exact_ok = self.exact_entries_readable
        auto = exact_ok and kv.format == "int4-fp8-outlier"
        if kv.sink_tokens == "auto":  # off: on SmolLM2 an exact sink cost passkey retrieval at 2k tokens
            kv.sink_tokens = 0
        # the default plan (measured on SmolLM2 next to the exact window, docs/KV_FORMAT.md §6): the middle third's
        # keys INT5, the first third's INT6, both stored as KLT units (KLT5 / KLT6), INT3 values outside the middle
        # third; each band alone moved passkey retrieval at 2k or 4k away from FP16 KV's, the three together did not
        windowed = auto and kv.recent_window != 0
        if kv.int5_keys == "auto":
            kv.int5_keys = "middle" if windowed else "none"
        int5 = kv.int5_keys == "middle"
        # at tp > 1 each rank takes its KV heads' units and KLT tables (KVPlan.shard), so the bundle is the same
        bundle = windowed and int5 and self.kv_takes("klt5", "klt6", "int6", "int3")
        if kv.key_transform == "auto":
            kv.key_transform = "klt" if bundle and kv.int6_keys != "none" else "none"
        klt = kv.key_transform == "klt"
        if kv.int6_keys == "auto":
            kv.int6_keys = "early" if bundle and klt else "none"
        int6 = kv.int6_keys == "early"
        if kv.int3_values == "auto":  # what pays for the INT6 keys
            kv.int3_values = AUTO_INT3_VALUES if int6 else 0.0
        if kv.recent_window == "auto":  # what keeps the plan at >= 3.5x on SmolLM2 (2048 tokens)
            kv.recent_window = (10 if int6 and klt else 11 if int6 else 10 if int5 else 7 if klt else 16) if auto else 0
        exact = bool(kv.sink_tokens or kv.recent_window)
        # KLT tables take what FP8 or INT8 units would (as INT5 keys' bytes do)
        if kv.outlier_fraction == "auto":  # INT5 keys take the bytes FP8 units would (and beat them on SmolLM2)
            kv.outlier_fraction = 0.0 if int5 or klt else 0.01 if exact else 0.08
        if kv.retrieval_fraction == "auto":  # measured with the exact window, where the byte budget has room
            kv.retrieval_fraction = 0.015 if exact and kv.format == "int4-fp8-outlier" and not (int5 or klt) else 0.0
        return self

    @classmethod
    def from_sections(cls, sections: dict) -> "EngineConfig":
        """From a resolved recipe (a dict with at least these sections; other keys are the build's own)."""
        return cls.model_validate({k: sections[k] for k in cls.model_fields if k in sections})

    def save(self, engine_dir: str | Path) -> None:
        (Path(engine_dir) / ENGINE_FILE).write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, engine_dir: str | Path) -> "EngineConfig":
        """The config of an engine version directory; UserError naming the file when it is missing or invalid."""
        f = Path(engine_dir) / ENGINE_FILE
        try:
            return cls.model_validate_json(f.read_text())
        except FileNotFoundError:
            raise UserError(
                f"{engine_dir} is not an engine version: {ENGINE_FILE} is missing (rebuild it with this bpcompile)",
                file=str(f),
            ) from None
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise UserError(f"invalid engine config: {where}: {first['msg']}", file=str(f)) from None


NO_CUDA = (
    "no CUDA device: this engine was built for runtime.device cuda and torch sees no GPU on this machine; "
    "run with --device cpu to use the CPU"
)


def resolve_device(requested: Optional[str], engine_device: str = "cpu") -> str:
    """The torch device an engine runs on: `requested` (cpu, cuda, cuda:N, auto; a command's --device) or else
    the engine's runtime.device; auto = cuda where torch sees a GPU now, else cpu. UserError (exit 2) when CUDA
    is asked for and absent, naming how to run on the CPU instead."""
    import torch

    dev = requested or engine_device
    if dev == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(dev).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise UserError(f"device {dev!r}: expected auto, cpu, cuda or cuda:N", key="device")
    if kind == "cuda" and not torch.cuda.is_available():
        if requested and requested != "auto" and engine_device == "cpu":
            raise UserError(f"--device {requested}: torch sees no CUDA device on this machine", key="device")
        raise UserError(NO_CUDA, key="runtime.device")
    return dev
