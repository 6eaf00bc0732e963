"""Emit a Triton model repository from engine store versions.

Layout (native target):

    repo/
      ensemble/config.pbtxt        platform "ensemble": preprocessing -> tensorrt_llm -> postprocessing
      ensemble/1/                  (an ensemble has no artifacts; its steps use model_version -1 = newest loaded)
      preprocessing/config.pbtxt   python backend
      preprocessing/<N>/           model.py + tokenizer/            (N = engine store version)
      tensorrt_llm/config.pbtxt    python backend, decoupled unless triton.decoupled is false (tensorrtllm_backend's
                                   model name and interface)
      tensorrt_llm/<N>/            model.py + engine/ (a copy of engines/<name>/<N>/) + engine_source.json
      postprocessing/config.pbtxt  python backend, ONE instance (response order, see below)
      postprocessing/<N>/          model.py + tokenizer/
      bpcompile_repository.json    what was emitted from where (for people and for add_version)
      .bpcompile-repository.json   the ownership marker: {"engine": NAME}
      .bpcompile-repository.lock   held while emitting

Decisions:
* Version directories are the engine store's version numbers, for the three models that carry a version's
  files; the same version policy is written into all three, so they always serve the same engine version.
* The engine version is *copied* into tensorrt_llm/<N>/engine/: the repository is self-contained (it can be
  rsynced to a server, and the engine store can be cleaned without breaking what is served). The tiny pair is
  ~20 MB; for a 70B verifier pass `link=True` to symlink instead. engine_source.json names the origin and its
  build id either way.
* The repository is bpcompile's: it is created with a marker (.bpcompile-repository.json naming the engine), and
  emission refuses a non-empty directory without one and a repository of another engine name, so it never
  deletes or mixes in what it did not write. Emission holds the repository's lock (.bpcompile-repository.lock).
* Publishing a version stages everything first (each model's <N>/ in a hidden .staging-* sibling, configs and
  the summary as hidden .tmp-* files: Triton ignores non-numeric version names), then switches: it writes the
  list of renames (.bpcompile-switch.json) and performs them, generator last. Renames take microseconds and
  next to no space; if the process dies between two of them, the next emission finishes the switch before
  anything else, and removes staging that was never committed. Configs of served models are not touched by
  add_version, so nothing being served changes until the models are (re)loaded (explicit mode: load API; poll
  mode: the next poll). Rollback = set_version_policy(repo, {"specific": [old]}) and reload.
* Response order: a decoupled generator's responses travel through postprocessing independently; with several
  postprocessing instances they can overtake each other (seen with 2.51: A C D B E). Each response is decodable
  on its own (protocol.py), and postprocessing runs as exactly one instance, so it handles one request's
  responses first-in first-out and they leave in the order the generator sent them. RESPONSE_INDEX
  (`response_index` output) numbers them so a client can check, or reorder defensively.
* Every config is a ModelConfig protobuf written with text_format: valid by construction, parsed back in tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

from filelock import FileLock
from google.protobuf import text_format

from bpcompile.core.engine import TARGETS, EngineConfig
from bpcompile.core.errors import UserError
from bpcompile.core.store import fault_point, write_atomic

try:
    from tritonclient.grpc import model_config_pb2 as mc
except ImportError as e:  # pragma: no cover - the [serve] extra
    from bpcompile.core.errors import MissingDependency

    raise MissingDependency("emitting a Triton repository needs tritonclient (pip install 'bpcompile[serve]')") from e

MODELS_DIR = Path(__file__).parent / "models"
GENERATOR = "tensorrt_llm"  # the model that generates: tensorrtllm_backend's name for it
VERSIONED = ("preprocessing", GENERATOR, "postprocessing")
SUMMARY = "bpcompile_repository.json"
T = mc.DataType

# (name, type, dims, optional) — ensemble inputs as tensorrtllm_backend's ensemble names them
# text_input is required, but declared optional: tritonserver 2.51 answers an ensemble request that lacks a
# required input with an empty final response and no error (seen); optional, the request reaches
# preprocessing, which answers "text_input is missing".
ENSEMBLE_INPUTS = [
    ("text_input", T.TYPE_STRING, [1], True),
    ("max_tokens", T.TYPE_INT32, [1], True),
    ("stream", T.TYPE_BOOL, [1], True),
    ("temperature", T.TYPE_FP32, [1], True),
    ("top_k", T.TYPE_INT32, [1], True),
    ("top_p", T.TYPE_FP32, [1], True),
    ("seed", T.TYPE_UINT64, [1], True),
    ("end_id", T.TYPE_INT32, [1], True),
    ("stop_words", T.TYPE_STRING, [-1], True),
    ("bad_words", T.TYPE_STRING, [-1], True),
]
# The rest of tensorrtllm_backend's ensemble inputs (its inflight_batcher_llm ensemble, TensorRT-LLM 1.2 line), with
# its names, types and dims: the native ensemble passes them to the generator under the same names, which honours,
# ignores or refuses each per request (protocol.backend_options). tests/data/tensorrtllm_backend_ensemble.json is
# the backend's own list, which the tests compare with what is emitted.
BACKEND_INPUTS = [
    ("exclude_input_in_output", T.TYPE_BOOL, [1]),
    ("beam_width", T.TYPE_INT32, [1]),
    ("num_return_sequences", T.TYPE_INT32, [1]),
    ("pad_id", T.TYPE_INT32, [1]),
    ("min_tokens", T.TYPE_INT32, [1]),
    ("length_penalty", T.TYPE_FP32, [1]),
    ("repetition_penalty", T.TYPE_FP32, [1]),
    ("presence_penalty", T.TYPE_FP32, [1]),
    ("frequency_penalty", T.TYPE_FP32, [1]),
    ("return_log_probs", T.TYPE_BOOL, [1]),
    ("return_context_logits", T.TYPE_BOOL, [1]),
    ("return_generation_logits", T.TYPE_BOOL, [1]),
    ("return_perf_metrics", T.TYPE_BOOL, [1]),
    ("return_num_input_tokens", T.TYPE_BOOL, [1]),
    ("return_num_output_tokens", T.TYPE_BOOL, [1]),
    ("decoder_text_input", T.TYPE_STRING, [1]),
    ("prompt_embedding_table", T.TYPE_FP16, [-1, -1]),
    ("prompt_table_extra_id", T.TYPE_UINT64, [1]),
    ("prompt_vocab_size", T.TYPE_INT32, [1]),
    ("embedding_bias_words", T.TYPE_STRING, [-1]),
    ("embedding_bias_weights", T.TYPE_FP32, [-1]),
    ("lora_task_id", T.TYPE_UINT64, [1]),
    ("lora_weights", T.TYPE_FP16, [-1, -1]),
    ("lora_config", T.TYPE_INT32, [-1, 3]),
    ("guided_decoding_guide_type", T.TYPE_STRING, [1]),
    ("guided_decoding_guide", T.TYPE_STRING, [1]),
]
# tensorrtllm_backend's `tensorrt_llm` model, inputs and outputs in its order (its inflight_batcher_llm
# tensorrt_llm/config.pbtxt, TensorRT-LLM 1.2 line; templated types at their defaults: FP16 tables, FP32 logits).
# The native generator declares all of them (its clients, inflight_batcher_llm_client.py and the BLS model, send
# them to the model by this name; protocol.backend_options honours, ignores or refuses each per request), and so
# does the C++ backend's config for target tensorrt-llm. tests/data/tensorrtllm_backend_tensorrt_llm.json is the
# backend's own list, compared with what is emitted.
TRTLLM_MODEL_INPUTS = [
    ("input_ids", T.TYPE_INT32, [-1]),
    ("encoder_input_features", T.TYPE_FP16, [-1, -1]),
    ("encoder_output_lengths", T.TYPE_INT32, [1]),
    ("input_lengths", T.TYPE_INT32, [1]),
    ("request_output_len", T.TYPE_INT32, [1]),
    ("num_return_sequences", T.TYPE_INT32, [1]),
    ("draft_input_ids", T.TYPE_INT32, [-1]),
    ("decoder_input_ids", T.TYPE_INT32, [-1]),
    ("decoder_input_lengths", T.TYPE_INT32, [1]),
    ("draft_logits", T.TYPE_FP32, [-1, -1]),
    ("draft_acceptance_threshold", T.TYPE_FP32, [1]),
    ("end_id", T.TYPE_INT32, [1]),
    ("pad_id", T.TYPE_INT32, [1]),
    ("stop_words_list", T.TYPE_INT32, [2, -1]),
    ("bad_words_list", T.TYPE_INT32, [2, -1]),
    ("embedding_bias", T.TYPE_FP32, [-1]),
    ("beam_width", T.TYPE_INT32, [1]),
    ("temperature", T.TYPE_FP32, [1]),
    ("runtime_top_k", T.TYPE_INT32, [1]),
    ("runtime_top_p", T.TYPE_FP32, [1]),
    ("runtime_top_p_min", T.TYPE_FP32, [1]),
    ("runtime_top_p_decay", T.TYPE_FP32, [1]),
    ("runtime_top_p_reset_ids", T.TYPE_INT32, [1]),
    ("len_penalty", T.TYPE_FP32, [1]),
    ("early_stopping", T.TYPE_BOOL, [1]),
    ("repetition_penalty", T.TYPE_FP32, [1]),
    ("min_tokens", T.TYPE_INT32, [1]),
    ("beam_search_diversity_rate", T.TYPE_FP32, [1]),
    ("presence_penalty", T.TYPE_FP32, [1]),
    ("frequency_penalty", T.TYPE_FP32, [1]),
    ("seed", T.TYPE_UINT64, [1]),
    ("return_log_probs", T.TYPE_BOOL, [1]),
    ("return_context_logits", T.TYPE_BOOL, [1]),
    ("return_generation_logits", T.TYPE_BOOL, [1]),
    ("return_perf_metrics", T.TYPE_BOOL, [1]),
    ("return_num_input_tokens", T.TYPE_BOOL, [1]),
    ("return_num_output_tokens", T.TYPE_BOOL, [1]),
    ("exclude_input_in_output", T.TYPE_BOOL, [1]),
    ("stop", T.TYPE_BOOL, [1]),
    ("streaming", T.TYPE_BOOL, [1]),
    ("prompt_embedding_table", T.TYPE_FP16, [-1, -1]),
    ("prompt_table_extra_ids", T.TYPE_UINT64, [-1]),
    ("prompt_vocab_size", T.TYPE_INT32, [1]),
    ("cross_attention_mask", T.TYPE_BOOL, [-1, -1]),
    ("mrope_rotary_cos_sin", T.TYPE_FP32, [-1]),
    ("mrope_position_deltas", T.TYPE_INT64, [1]),
    ("lora_task_id", T.TYPE_UINT64, [1]),
    ("lora_weights", T.TYPE_FP16, [-1, -1]),
    ("lora_config", T.TYPE_INT32, [-1, 3]),
    ("context_phase_params", T.TYPE_UINT8, [-1]),
    ("skip_cross_attn_blocks", T.TYPE_BOOL, [1]),
    ("retention_token_range_starts", T.TYPE_INT32, [-1]),
    ("retention_token_range_ends", T.TYPE_INT32, [-1]),
    ("retention_token_range_priorities", T.TYPE_INT32, [-1]),
    ("retention_token_range_durations_ms", T.TYPE_INT32, [-1]),
    ("retention_decode_priority", T.TYPE_INT32, [1]),
    ("retention_decode_duration_ms", T.TYPE_INT32, [1]),
    ("guided_decoding_guide_type", T.TYPE_STRING, [1]),
    ("guided_decoding_guide", T.TYPE_STRING, [1]),
    ("lookahead_window_size", T.TYPE_INT32, [1]),
    ("lookahead_ngram_size", T.TYPE_INT32, [1]),
    ("lookahead_verification_set_size", T.TYPE_INT32, [1]),
]
TRTLLM_REQUIRED = ("input_lengths", "request_output_len")
# [1] inputs the backend does not reshape to scalars; [-1]-shaped ones and these are ragged-batched
TRTLLM_NOT_RESHAPED = (
    "mrope_position_deltas",
    "skip_cross_attn_blocks",
    "retention_decode_priority",
    "retention_decode_duration_ms",
    "guided_decoding_guide_type",
    "guided_decoding_guide",
    "lookahead_window_size",
    "lookahead_ngram_size",
    "lookahead_verification_set_size",
)
# The native generator sends the first six on every response (output_ids [beam, tokens] with one beam); it never
# sends log probs, logits, disaggregated-serving parameters, KV-cache statistics or timings (requests for them are
# refused); the speculation statistics are its STATS.
TRTLLM_MODEL_OUTPUTS = [
    ("output_ids", T.TYPE_INT32, [-1, -1]),
    ("sequence_length", T.TYPE_INT32, [-1]),
    ("cum_log_probs", T.TYPE_FP32, [-1]),
    ("output_log_probs", T.TYPE_FP32, [-1, -1]),
    ("context_logits", T.TYPE_FP32, [-1, -1]),
    ("generation_logits", T.TYPE_FP32, [-1, -1, -1]),
    ("batch_index", T.TYPE_INT32, [1]),
    ("sequence_index", T.TYPE_INT32, [1]),
    ("context_phase_params", T.TYPE_UINT8, [-1]),
    ("kv_cache_alloc_new_blocks", T.TYPE_INT32, [1]),
    ("kv_cache_reused_blocks", T.TYPE_INT32, [1]),
    ("kv_cache_alloc_total_blocks", T.TYPE_INT32, [1]),
    ("arrival_time_ns", T.TYPE_INT64, [1]),
    ("first_scheduled_time_ns", T.TYPE_INT64, [1]),
    ("first_token_time_ns", T.TYPE_INT64, [1]),
    ("last_token_time_ns", T.TYPE_INT64, [1]),
    ("acceptance_rate", T.TYPE_FP32, [1]),
    ("total_accepted_draft_tokens", T.TYPE_INT32, [1]),
    ("total_draft_tokens", T.TYPE_INT32, [1]),
    ("num_input_tokens", T.TYPE_INT32, [1]),
    ("num_output_tokens", T.TYPE_INT32, [1]),
]
STATS = [  # generator -> postprocessing -> client, unchanged; the first three are TRT-LLM's names
    ("acceptance_rate", T.TYPE_FP32),
    ("total_accepted_draft_tokens", T.TYPE_INT32),
    ("total_draft_tokens", T.TYPE_INT32),
    ("tokens_per_step", T.TYPE_FP32),
    ("verifier_steps", T.TYPE_INT32),
    ("engine_version", T.TYPE_INT32),
    ("cached_tokens", T.TYPE_INT32),  # prompt tokens whose KV came from the prefix cache (OpenAI's usage name)
]


# --- protobuf helpers -------------------------------------------------------------------------------------


def _io(cls, name, dtype, dims, optional=False):
    m = cls(name=name, data_type=dtype, dims=dims)
    if optional:
        m.optional = True
    return m


def _inputs(cfg, specs):
    cfg.input.extend(_io(mc.ModelInput, n, t, d, o) for n, t, d, o in specs)


def _outputs(cfg, specs):
    cfg.output.extend(_io(mc.ModelOutput, n, t, d) for n, t, d in specs)


def _params(cfg, **kv):
    for k, v in kv.items():
        cfg.parameters[k].string_value = str(v)


def version_policy_proto(policy) -> mc.ModelVersionPolicy:
    """'latest' | 'all' | {'latest': n} | {'specific': [versions]} (also the protobuf-shaped dict forms)."""
    p = mc.ModelVersionPolicy()
    if policy in (None, "latest"):
        p.latest.num_versions = 1
    elif policy == "all":
        p.all.SetInParent()
    elif isinstance(policy, dict) and len(policy) == 1 and "latest" in policy:
        n = policy["latest"]
        n = n.get("num_versions", 1) if isinstance(n, dict) else n
        if not isinstance(n, int) or n < 1:
            raise UserError(
                f"version_policy latest needs a positive number of versions, got {n!r}", key="triton.version_policy"
            )
        p.latest.num_versions = n
    elif isinstance(policy, dict) and len(policy) == 1 and "specific" in policy:
        vs = policy["specific"]
        vs = vs.get("versions", []) if isinstance(vs, dict) else vs
        if not vs or not all(isinstance(v, int) and v > 0 for v in vs):
            raise UserError(
                f"version_policy specific needs a list of positive versions, got {vs!r}", key="triton.version_policy"
            )
        p.specific.versions.extend(vs)
    else:
        raise UserError(
            f"version_policy must be 'latest', 'all', {{latest: n}} or {{specific: [..]}}, got {policy!r}",
            key="triton.version_policy",
        )
    return p


def write_config(path: Path, cfg: mc.ModelConfig) -> None:
    write_atomic(Path(path), text_format.MessageToString(cfg))  # a poller never reads half a config


def read_config(path: Path) -> mc.ModelConfig:
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig())


# --- the four configs -------------------------------------------------------------------------------------

# tensorrtllm_backend's preprocessing interface (its config.pbtxt, same line), which its BLS model sends and
# requests by name; the first five inputs and seven outputs are what bpcompile's preprocessing uses and makes,
# the rest (encoder-decoder, multimodal, embedding bias, prompt tables) are declared and refused when sent.
PREPROCESSING_INPUTS = [
    ("QUERY", T.TYPE_STRING, [1], True),
    ("REQUEST_OUTPUT_LEN", T.TYPE_INT32, [1], True),
    ("STOP_WORDS_DICT", T.TYPE_STRING, [-1], True),
    ("BAD_WORDS_DICT", T.TYPE_STRING, [-1], True),
    ("END_ID", T.TYPE_INT32, [1], True),
    ("PAD_ID", T.TYPE_INT32, [1], True),
    ("DECODER_QUERY", T.TYPE_STRING, [1], True),
    ("IMAGE_BYTES", T.TYPE_UINT8, [-1, -1, -1, -1], True),
    ("IMAGE_URL", T.TYPE_STRING, [1], True),
    ("IMAGES", T.TYPE_STRING, [-1], True),
    ("VIDEO_BYTES", T.TYPE_UINT8, [-1, -1, -1, -1], True),
    ("EMBEDDING_BIAS_WORDS", T.TYPE_STRING, [-1], True),
    ("EMBEDDING_BIAS_WEIGHTS", T.TYPE_FP32, [-1], True),
    ("PROMPT_TABLE_EXTRA_ID", T.TYPE_UINT64, [1], True),
    # bpcompile's: the native ensemble's request's exclude_input_in_output, answered as OUT_EXCLUDE_INPUT_IN_OUTPUT
    # (true when not sent) for the generator, whose own default (its parameter) is what a token request gets
    ("EXCLUDE_INPUT_IN_OUTPUT", T.TYPE_BOOL, [1], True),
]
PREPROCESSING_OUTPUTS = [
    ("INPUT_ID", T.TYPE_INT32, [-1]),
    ("REQUEST_INPUT_LEN", T.TYPE_INT32, [1]),
    ("REQUEST_OUTPUT_LEN", T.TYPE_INT32, [-1]),
    ("STOP_WORDS_IDS", T.TYPE_INT32, [2, -1]),
    ("BAD_WORDS_IDS", T.TYPE_INT32, [2, -1]),
    ("OUT_END_ID", T.TYPE_INT32, [1]),
    ("OUT_PAD_ID", T.TYPE_INT32, [1]),
    ("DECODER_INPUT_ID", T.TYPE_INT32, [-1]),
    ("REQUEST_DECODER_INPUT_LEN", T.TYPE_INT32, [1]),
    ("EMBEDDING_BIAS", T.TYPE_FP32, [-1]),
    ("OUT_PROMPT_TABLE_EXTRA_IDS", T.TYPE_UINT64, [-1]),
    ("PIXEL_VALUES", T.TYPE_FP16, [-1, -1, -1, -1]),
    ("ASPECT_RATIO_IDS", T.TYPE_INT64, [-1]),
    ("ASPECT_RATIO_MASK", T.TYPE_INT64, [-1, -1]),
    ("CROSS_ATTENTION_MASK", T.TYPE_INT64, [-1, -1, -1]),
    ("IMAGE_SIZES", T.TYPE_INT64, [-1, 2]),
    ("IS_VIDEO_INPUT", T.TYPE_BOOL, [1]),
    ("ATTENTION_MASK", T.TYPE_INT64, [-1]),
    ("IMAGE_GRID_THW", T.TYPE_INT64, [3]),
    ("OUT_EXCLUDE_INPUT_IN_OUTPUT", T.TYPE_BOOL, [1]),  # bpcompile's (EXCLUDE_INPUT_IN_OUTPUT above)
    ("VISION_INPUT_ID", T.TYPE_INT32, [-1]),
]


def preprocessing_config(max_batch_size: int, policy, instances: int = 1) -> mc.ModelConfig:
    cfg = mc.ModelConfig(
        name="preprocessing",
        backend="python",
        max_batch_size=max_batch_size,
        version_policy=version_policy_proto(policy),
    )
    _inputs(cfg, PREPROCESSING_INPUTS)
    _outputs(cfg, PREPROCESSING_OUTPUTS)
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=instances)
    return cfg


# The generator also takes the ensemble's own requests (text in, text out; models/generator.py): only on a
# request sent to the generator itself does a client's cancellation or disconnect reach the generation loop. It
# tells its interfaces apart by input_ids, so every input is optional.
_TRTLLM_NAMES = {n for n, _, _ in TRTLLM_MODEL_INPUTS}
GENERATOR_TEXT_INPUTS = [i for i in ENSEMBLE_INPUTS if i[0] not in _TRTLLM_NAMES] + [
    # presence / frequency penalties as the OpenAI API defines them (over the generated tokens, before temperature)
    # rather than TensorRT-LLM's (the whole sequence, after temperature): what the OpenAI endpoint sends
    ("penalties_over_output", T.TYPE_BOOL, [1], True),
]
GENERATOR_TEXT_OUTPUTS = [
    ("text_output", T.TYPE_STRING, [-1]),
    ("response_index", T.TYPE_INT32, [1]),
    ("finish_reason", T.TYPE_STRING, [1]),
]


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def instance_groups(cfg: mc.ModelConfig, device: str, tp: int, instances: int) -> None:
    """The generator's instance groups for a device setting (cpu, cuda, auto; auto = cuda where torch sees a GPU
    on this machine, which `bpcompile serve` re-decides on the serving machine with set_device).

    On CUDA each instance (one runtime, one in-flight batch) takes tp GPUs: Triton places it on the first of them
    (KIND_GPU, its own group, gpus [i * tp]; the Python backend hands the model that GPU's id) and its
    tensor-parallel ranks take the next tp - 1 (runtime/tp.py: rank r on the r-th device from the one asked for).
    One group per instance, not `gpus: [0..tp-1]`: Triton starts `count` instances on every listed GPU, and each
    would load all tp ranks."""
    del cfg.instance_group[:]
    if device == "cuda" or (device == "auto" and gpu_available()):
        for i in range(instances):
            cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_GPU, count=1, gpus=[i * tp])
    else:
        cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=instances)


def generator_config(
    max_batch_size: int,
    policy,
    instances: int = 1,
    device: str = "cpu",
    tree: Optional[dict] = None,
    tp: int = 1,
    decoupled: bool = True,
) -> mc.ModelConfig:
    cfg = mc.ModelConfig(
        name=GENERATOR, backend="python", max_batch_size=max_batch_size, version_policy=version_policy_proto(policy)
    )
    # decoupled: responses through a stream (streaming, cancellation); not: one response per unary infer, as
    # tensorrtllm_backend's decoupled_mode false. The ensemble follows it (Triton: an ensemble is decoupled when a
    # step is).
    cfg.model_transaction_policy.decoupled = decoupled
    _inputs(
        cfg,
        [(n, t, d, True) for n, t, d in TRTLLM_MODEL_INPUTS]
        + GENERATOR_TEXT_INPUTS
        + [(n, t, d, True) for n, t, d in BACKEND_INPUTS if n not in _TRTLLM_NAMES],
    )
    ours = (
        [
            ("CONTEXT_IDS", T.TYPE_INT32, [-1]),
            ("READ_OFFSET", T.TYPE_INT32, [1]),
            ("IS_FINAL", T.TYPE_BOOL, [1]),
            ("RESPONSE_INDEX", T.TYPE_INT32, [1]),
            ("FINISH_REASON", T.TYPE_STRING, [1]),
        ]
        + [(n, t, [1]) for n, t in STATS]
        + GENERATOR_TEXT_OUTPUTS
    )
    _outputs(cfg, ours + [o for o in TRTLLM_MODEL_OUTPUTS if o[0] not in {n for n, _, _ in ours}])
    # One instance = one runtime = one in-flight batch; more instances are more model copies, each its own batch.
    instance_groups(cfg, device, tp, instances)
    # exclude_input_in_output: what a token request that does not send it gets (the backend's parameter of that
    # name, false in its config template: the prompt leads a non-streamed output, which its clients expect unless
    # given --exclude-input-in-output); text requests (the ensemble's, the OpenAI endpoint's) get the generated
    # text only unless they say otherwise (preprocessing's OUT_EXCLUDE_INPUT_IN_OUTPUT, models/generator.py).
    # device: the setting (auto stays auto: the model resolves it where it runs); tp: for set_device's groups
    _params(cfg, device=device, tp=tp, tree=json.dumps(tree) if tree else "", exclude_input_in_output="false")
    return cfg


DEVICE_SETTINGS = ("cpu", "cuda", "auto")


def _device_setting(device: Optional[str], cfg: EngineConfig) -> str:
    device = device or cfg.runtime.device
    if device not in DEVICE_SETTINGS:
        raise UserError(f"device {device!r}: expected one of {', '.join(DEVICE_SETTINGS)}", key="device")
    return device


def set_device(repo_dir: Union[str, Path], device: Optional[str] = None) -> dict:
    """Called by `bpcompile serve` before tritonserver starts: settle where the generator runs on this machine.
    device: cpu, cuda or auto (default: the repository's setting, from the recipe's runtime.device). Rewrites
    the generator's instance groups (and its device parameter, when device is given) where they differ, e.g. a
    repository emitted with auto on a machine without GPUs now served on one. UserError when CUDA is asked for
    and torch sees no GPU (or fewer than the instances need)."""
    repo = Path(repo_dir)
    final = repo / GENERATOR / "config.pbtxt"
    if not final.is_file() or _marker(repo) is None:  # not bpcompile's to place: the server's checks say what it is
        return {"repo": str(repo), "device": None, "changed": False}
    with _locked(repo, None):
        return _set_device_locked(repo, final, device)


def _set_device_locked(repo: Path, final: Path, device: Optional[str]) -> dict:
    from bpcompile.core.engine import NO_CUDA

    cfg = read_config(final)
    if cfg.backend != "python":  # TensorRT-LLM's own backend places itself
        return {"repo": str(repo), "device": None, "changed": False}
    have = cfg.parameters["device"].string_value if "device" in cfg.parameters else "cpu"
    setting = device or have
    if setting not in DEVICE_SETTINGS:
        raise UserError(f"device {setting!r}: expected one of {', '.join(DEVICE_SETTINGS)}", key="device")
    if setting == "cuda" and not gpu_available():
        raise UserError(
            NO_CUDA if have == "cuda" and device is None else f"--device {setting}: torch sees no CUDA device here",
            key="device",
        )
    tp = int(cfg.parameters["tp"].string_value) if "tp" in cfg.parameters else 1
    on_gpu = all(g.kind == mc.ModelInstanceGroup.KIND_GPU for g in cfg.instance_group)
    # instance_groups' forms: one KIND_GPU group per instance, or one KIND_CPU group of `count` instances
    instances = (len(cfg.instance_group) if on_gpu else sum(g.count for g in cfg.instance_group)) or 1
    new = mc.ModelConfig()
    new.CopyFrom(cfg)
    instance_groups(new, setting, tp, instances)
    _params(new, device=setting)
    resolved = "cuda" if new.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU else "cpu"
    if resolved == "cuda":
        import torch

        need, n = instances * tp, torch.cuda.device_count()
        if n < need:
            raise UserError(
                f"the generator needs {need} GPUs ({instances} instance(s) x tp {tp}); torch sees {n} here",
                key="device",
            )
    changed = new != cfg
    if changed:
        _commit(repo, [(_stage_text(final, text_format.MessageToString(new)), final)])
    return {"repo": str(repo), "device": resolved, "setting": setting, "changed": changed}


def postprocessing_config(max_batch_size: int, policy, target: str = "native") -> mc.ModelConfig:
    cfg = mc.ModelConfig(
        name="postprocessing",
        backend="python",
        max_batch_size=max_batch_size,
        version_policy=version_policy_proto(policy),
    )
    if target == "tensorrt-llm":
        _inputs(cfg, [("TOKENS_BATCH", T.TYPE_INT32, [-1, -1], False), ("SEQUENCE_LENGTH", T.TYPE_INT32, [-1], False)])
        _outputs(cfg, [("OUTPUT", T.TYPE_STRING, [-1]), ("OUTPUT_IDS", T.TYPE_INT32, [-1])])
        _params(cfg, input_format="trtllm")
    else:
        _inputs(
            cfg,
            [
                ("CONTEXT_IDS", T.TYPE_INT32, [-1], False),
                ("READ_OFFSET", T.TYPE_INT32, [1], False),
                ("IS_FINAL", T.TYPE_BOOL, [1], False),
                ("RESPONSE_INDEX", T.TYPE_INT32, [1], False),
                ("FINISH_REASON", T.TYPE_STRING, [1], False),
            ]
            + [(n, t, [1], False) for n, t in STATS],
        )
        _outputs(
            cfg,
            [
                ("OUTPUT", T.TYPE_STRING, [-1]),
                ("OUTPUT_IDS", T.TYPE_INT32, [-1]),
                ("OUT_RESPONSE_INDEX", T.TYPE_INT32, [1]),
                ("OUT_FINISH_REASON", T.TYPE_STRING, [1]),
            ]
            + [("OUT_" + n, t, [1]) for n, t in STATS],
        )
        _params(cfg, input_format="native")
    # Exactly one instance: responses of one request are processed first-in first-out (see module doc).
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    return cfg


DRAFT, BLS = "tensorrt_llm_draft", "tensorrt_llm_bls"  # target tensorrt-llm with a draft: the backend's names
BLS_ENV = "BPCOMPILE_TRTLLM_BLS_DIR"
# Where TensorRT-LLM's Triton containers keep tensorrtllm_backend's BLS model (its model.py and lib/): the BLS is
# the backend's own code, copied into the repository at emission, not part of bpcompile.
BLS_CANDIDATES = (
    "/app/all_models/inflight_batcher_llm/tensorrt_llm_bls/1",
    "/app/tensorrt_llm/triton_backend/all_models/inflight_batcher_llm/tensorrt_llm_bls/1",
)


def trtllm_engine_path(version: int, role: str) -> str:
    """gpt_model_path of a version's engine, relative to the repository: tritonserver resolves it against its
    working directory, which `bpcompile serve` sets to the repository (by hand: start tritonserver in it)."""
    return f"{GENERATOR}/{version}/engine/trtllm/{role}"


def trtllm_generator_config(
    max_batch_size: int,
    engine_path: str,
    *,
    name: str = GENERATOR,
    decoupled: bool = True,
    kv_cache_reuse: bool = False,
    kv_cache_free_gpu_mem_fraction=0.9,
    batch_scheduler_policy="guaranteed_no_evict",
    max_queue_delay_microseconds=0,
    gpu_device_ids: str = "",
    tokenizer_dir: str = "",
) -> mc.ModelConfig:
    """A TensorRT-LLM engine as the C++ `tensorrtllm` backend serves it, with the backend's tensorrt_llm inputs and
    outputs. Model versions do not apply to it: the engine is named by gpt_model_path, which add_version points at
    the newest version. With a draft model (speculative decoding through the BLS model) both engines are
    non-decoupled and reuse KV blocks, as tensorrtllm_backend sets them up."""
    cfg = mc.ModelConfig(name=name, backend="tensorrtllm", max_batch_size=max_batch_size)
    cfg.model_transaction_policy.decoupled = decoupled
    cfg.dynamic_batching.preferred_batch_size.append(max_batch_size)
    cfg.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_microseconds
    _inputs(cfg, [(n, t, d, n not in TRTLLM_REQUIRED) for n, t, d in TRTLLM_MODEL_INPUTS])
    for i in cfg.input:
        if list(i.dims) == [1] and i.name not in TRTLLM_NOT_RESHAPED:
            i.reshape.SetInParent()  # [1] -> scalar, as tensorrtllm_backend declares them
        elif -1 in i.dims or i.name in TRTLLM_NOT_RESHAPED:
            i.allow_ragged_batch = True
    _outputs(cfg, TRTLLM_MODEL_OUTPUTS)
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    _params(
        cfg,
        gpt_model_path=engine_path,
        gpt_model_type="inflight_fused_batching",
        batch_scheduler_policy=batch_scheduler_policy,
        kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction,
        max_beam_width=1,
        exclude_input_in_output="true",
        enable_kv_cache_reuse="true" if kv_cache_reuse else "false",
        decoupled_mode="true" if decoupled else "false",
        cancellation_check_period_ms=100,
        stats_check_period_ms=100,
        FORCE_CPU_ONLY_INPUT_TENSORS="no",
        **({"gpu_device_ids": gpu_device_ids} if gpu_device_ids else {}),
        **({"tokenizer_dir": tokenizer_dir} if tokenizer_dir else {}),
    )
    return cfg


# tensorrtllm_backend's tensorrt_llm_bls model (its config.pbtxt, same line): the draft-target loop (draft model
# proposes num_draft_tokens, the target verifies them) as a decoupled Python model calling preprocessing,
# tensorrt_llm_draft, tensorrt_llm and postprocessing.
BLS_INPUTS = [
    ("text_input", T.TYPE_STRING, [1], False),
    ("decoder_text_input", T.TYPE_STRING, [1], True),
    ("image_input", T.TYPE_FP16, [-1, 3, -1, -1], True),
    ("image_bytes_input", T.TYPE_UINT8, [-1, -1, -1, -1], True),
    ("image_url_input", T.TYPE_STRING, [1], True),
    ("video_bytes_input", T.TYPE_UINT8, [-1, -1, -1, -1], True),
    ("max_tokens", T.TYPE_INT32, [1], False),
    ("bad_words", T.TYPE_STRING, [-1], True),
    ("stop_words", T.TYPE_STRING, [-1], True),
    ("exclude_input_in_output", T.TYPE_BOOL, [1], True),
    ("end_id", T.TYPE_INT32, [1], True),
    ("pad_id", T.TYPE_INT32, [1], True),
    ("top_k", T.TYPE_INT32, [1], True),
    ("top_p", T.TYPE_FP32, [1], True),
    ("temperature", T.TYPE_FP32, [1], True),
    ("length_penalty", T.TYPE_FP32, [1], True),
    ("repetition_penalty", T.TYPE_FP32, [1], True),
    ("min_tokens", T.TYPE_INT32, [1], True),
    ("presence_penalty", T.TYPE_FP32, [1], True),
    ("frequency_penalty", T.TYPE_FP32, [1], True),
    ("seed", T.TYPE_UINT64, [1], True),
    ("return_log_probs", T.TYPE_BOOL, [1], True),
    ("return_context_logits", T.TYPE_BOOL, [1], True),
    ("return_generation_logits", T.TYPE_BOOL, [1], True),
    ("num_return_sequences", T.TYPE_INT32, [1], True),
    ("beam_width", T.TYPE_INT32, [1], True),
    ("stream", T.TYPE_BOOL, [1], True),
    ("prompt_embedding_table", T.TYPE_FP16, [-1, -1], True),
    ("prompt_vocab_size", T.TYPE_INT32, [1], True),
    ("prompt_table_extra_id", T.TYPE_UINT64, [1], True),
    ("embedding_bias_words", T.TYPE_STRING, [-1], True),
    ("embedding_bias_weights", T.TYPE_FP32, [-1], True),
    ("num_draft_tokens", T.TYPE_INT32, [1], True),
    ("use_draft_logits", T.TYPE_BOOL, [1], True),
    ("lora_task_id", T.TYPE_UINT64, [1], True),
    ("lora_weights", T.TYPE_FP16, [-1, -1], True),
    ("lora_config", T.TYPE_INT32, [-1, 3], True),
    ("return_perf_metrics", T.TYPE_BOOL, [1], True),
    ("return_num_input_tokens", T.TYPE_BOOL, [1], True),
    ("return_num_output_tokens", T.TYPE_BOOL, [1], True),
    ("guided_decoding_guide_type", T.TYPE_STRING, [1], True),
    ("guided_decoding_guide", T.TYPE_STRING, [1], True),
]
BLS_RESHAPED = (
    "return_log_probs",
    "return_context_logits",
    "return_generation_logits",
    "num_return_sequences",
    "use_draft_logits",
    "lora_task_id",
    "return_perf_metrics",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


def bls_config(max_batch_size: int, instances: int = 1) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=BLS, backend="python", max_batch_size=max_batch_size)
    cfg.model_transaction_policy.decoupled = True
    _inputs(cfg, BLS_INPUTS)
    for i in cfg.input:
        if i.name in BLS_RESHAPED:
            i.reshape.SetInParent()
        if i.name in ("lora_weights", "lora_config"):
            i.allow_ragged_batch = True
    _outputs(
        cfg,
        [("text_output", T.TYPE_STRING, [-1])]
        + [o for o in TRTLLM_MODEL_OUTPUTS if o[0] not in ("output_ids", "sequence_length", "context_phase_params")],
    )
    _params(
        cfg,
        accumulate_tokens="false",
        tensorrt_llm_model_name=GENERATOR,
        tensorrt_llm_draft_model_name=DRAFT,
        multimodal_encoders_name="",
    )
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=instances)
    return cfg


def find_bls_source(explicit: Optional[Union[str, Path]] = None) -> Path:
    """tensorrtllm_backend's BLS model directory (model.py and lib/): `explicit`, else $BPCOMPILE_TRTLLM_BLS_DIR,
    else where TensorRT-LLM's Triton containers keep it."""
    tried = [explicit] if explicit else ([os.environ[BLS_ENV]] if os.environ.get(BLS_ENV) else list(BLS_CANDIDATES))
    for c in tried:
        if (Path(c) / "model.py").is_file():
            return Path(c)
    raise UserError(
        f"target tensorrt-llm with a draft model needs tensorrtllm_backend's {BLS} model (its model.py "
        f"and lib/, which TensorRT-LLM's Triton containers ship); none found at {', '.join(map(str, tried))}. "
        f"Emit inside that container, or point {BLS_ENV} (or emit --bls-from) at its "
        f"all_models/inflight_batcher_llm/{BLS}/1 directory",
        key="target",
    )


# tensorrtllm_backend's ensemble outputs that its tensorrt_llm step produces (its ensemble config.pbtxt, TensorRT-LLM
# 1.2 line; tests/data/tensorrtllm_backend_ensemble.json), mapped from the generator under the same names: its
# clients request them by name (end_to_end_grpc_client.py: batch_index with --batch-inputs, sequence_index with
# -n, the KV blocks and timestamps with --return-perf-metrics). The speculation statistics come through
# postprocessing (STATS), as text_output does. tritonserver assembles one ensemble response from the tensors of
# one generator response and the postprocessing step run on it, and leaves out an output a response lacks.
ENSEMBLE_FROM_GENERATOR = (
    "cum_log_probs",
    "output_log_probs",
    "context_logits",
    "generation_logits",
    "batch_index",
    "sequence_index",
    "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
    "num_input_tokens",
    "num_output_tokens",
)


def ensemble_config(max_batch_size: int, target: str = "native") -> mc.ModelConfig:
    cfg = mc.ModelConfig(name="ensemble", platform="ensemble", max_batch_size=max_batch_size)
    ins = ENSEMBLE_INPUTS + (
        [("return_perf_metrics", T.TYPE_BOOL, [1], True)]
        if target == "tensorrt-llm"
        else [(n, t, d, True) for n, t, d in BACKEND_INPUTS]
    )
    _inputs(cfg, ins)
    outs = [("text_output", T.TYPE_STRING, [-1]), ("output_ids", T.TYPE_INT32, [-1])]
    if target == "native":
        outs += [("response_index", T.TYPE_INT32, [1]), ("finish_reason", T.TYPE_STRING, [1])]
        outs += [(n, t, [1]) for n, t in STATS]
        outs += [o for o in TRTLLM_MODEL_OUTPUTS if o[0] in ENSEMBLE_FROM_GENERATOR]
    else:
        outs += [(n, t, [1]) for n, t in STATS[:3]]
        outs += [o for o in TRTLLM_MODEL_OUTPUTS if o[0] in ENSEMBLE_FROM_GENERATOR]
    _outputs(cfg, outs)

    def step(model, inputs, outputs):
        s = cfg.ensemble_scheduling.step.add(model_name=model, model_version=-1)
        s.input_map.update(inputs)
        s.output_map.update(outputs)

    step(
        "preprocessing",
        {
            "QUERY": "text_input",
            "REQUEST_OUTPUT_LEN": "max_tokens",
            "STOP_WORDS_DICT": "stop_words",
            "BAD_WORDS_DICT": "bad_words",
            "END_ID": "end_id",
        },
        {
            "INPUT_ID": "_INPUT_ID",
            "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
            "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
            "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
            "BAD_WORDS_IDS": "_BAD_WORDS_IDS",
            "OUT_END_ID": "_PREPROCESSOR_END_ID",
        },
    )
    gen_in = {
        "input_ids": "_INPUT_ID",
        "input_lengths": "_REQUEST_INPUT_LEN",
        "request_output_len": "_REQUEST_OUTPUT_LEN",
        "end_id": "_PREPROCESSOR_END_ID",
        "stop_words_list": "_STOP_WORDS_IDS",
        "bad_words_list": "_BAD_WORDS_IDS",
        "streaming": "stream",
        "temperature": "temperature",
        "runtime_top_k": "top_k",
        "runtime_top_p": "top_p",
        "seed": "seed",
    }
    if target == "native":
        gen_in.update({n: n for n, _, _ in BACKEND_INPUTS})
        # through preprocessing, which makes it true when the client did not send it: the ensemble answers the
        # generated text only, whatever the generator's default for token requests
        pre = cfg.ensemble_scheduling.step[0]
        pre.input_map["EXCLUDE_INPUT_IN_OUTPUT"] = "exclude_input_in_output"
        pre.output_map["OUT_EXCLUDE_INPUT_IN_OUTPUT"] = "_EXCLUDE_INPUT_IN_OUTPUT"
        gen_in["exclude_input_in_output"] = "_EXCLUDE_INPUT_IN_OUTPUT"
        mid = ["CONTEXT_IDS", "READ_OFFSET", "IS_FINAL", "RESPONSE_INDEX", "FINISH_REASON"] + [n for n, _ in STATS]
        step(
            GENERATOR,
            gen_in,
            {**{n: "_" + n.upper() for n in mid}, **{n: n for n in ENSEMBLE_FROM_GENERATOR}},
        )
        post_out = {
            "OUTPUT": "text_output",
            "OUTPUT_IDS": "output_ids",
            "OUT_RESPONSE_INDEX": "response_index",
            "OUT_FINISH_REASON": "finish_reason",
        }
        post_out.update({"OUT_" + n: n for n, _ in STATS})
        step("postprocessing", {n: "_" + n.upper() for n in mid}, post_out)
    else:
        gen_in["return_perf_metrics"] = "return_perf_metrics"
        gen_out = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"}
        gen_out.update({n: n for n, _ in STATS[:3]})
        gen_out.update({n: n for n in ENSEMBLE_FROM_GENERATOR})
        step(GENERATOR, gen_in, gen_out)
        step(
            "postprocessing",
            {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
            {"OUTPUT": "text_output", "OUTPUT_IDS": "output_ids"},
        )
    return cfg


# --- ownership, lock and the version switch ---------------------------------------------------------------

MARKER = ".bpcompile-repository.json"  # {"engine": NAME}: written when bpcompile creates the repository
LOCK = ".bpcompile-repository.lock"
JOURNAL = ".bpcompile-switch.json"  # the renames of a switch in progress (see _commit)
PLACEHOLDERS = ("README.md",)  # a new repository directory may hold a README (this checkout's does)
_STAGED = (".staging-", ".tmp-")  # names of staged version directories and files


def _marker(repo: Path) -> Optional[dict]:
    f = repo / MARKER
    if not f.exists():
        return None
    try:
        m = json.loads(f.read_text())
    except (OSError, ValueError):
        m = None
    if not isinstance(m, dict) or not isinstance(m.get("engine"), str):
        raise UserError(
            'damaged ownership marker (expected {"engine": NAME}); restore it or emit into a new directory', file=str(f)
        )
    return m


def check_repository(repo_dir: Union[str, Path], name: Optional[str]) -> Optional[dict]:
    """Refuse, before anything is written, a repository that bpcompile may not write into: not a directory; a
    non-empty directory it did not create (no MARKER: emission creates and replaces model directories, which
    would destroy someone else's); or one created for another engine name (one engine name per repository:
    the versions are that engine's versions). `name` None: an existing emitted repository is required.
    Returns the marker, or None for a new (or empty) directory."""
    repo = Path(repo_dir)
    if not repo.exists() and name is not None:
        return None
    if not repo.is_dir():
        raise UserError("not a directory" if repo.exists() else "no such repository", file=str(repo))
    m = _marker(repo)
    if m is None:
        foreign = sorted(
            p.name for p in repo.iterdir() if p.name != LOCK and not (p.name in PLACEHOLDERS and p.is_file())
        )
        if name is None:
            raise UserError(f"not a repository emitted by bpcompile (no {MARKER})", file=str(repo))
        if foreign:
            older = " (an older bpcompile's repository: move it away)" if SUMMARY in foreign else ""
            listing = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            raise UserError(
                f"this directory is not empty ({listing})"
                f" and was not created by bpcompile (no {MARKER}){older}; bpcompile emits only into a "
                f"new or empty directory, which it then owns: choose another one (output.triton_repo "
                f"of the recipe, --repo of bpcompile emit)",
                file=str(repo),
            )
        return None
    if name is not None and m["engine"] != name:
        raise UserError(
            f"this repository serves engine {m['engine']!r}, not {name!r}: one engine name per "
            f"repository (its model versions are that engine's versions); choose another directory "
            f"(output.triton_repo of the recipe, --repo of bpcompile emit)",
            file=str(repo),
        )
    return m


def _check_apart(repo: Path, engine_dir: Path) -> None:
    """The repository must not overlap the engine store: emission creates and replaces directories in it."""
    r, e = repo.resolve(), Path(engine_dir).resolve()
    if e.is_relative_to(r) or r.is_relative_to(e.parent):
        raise UserError(
            f"the repository overlaps the engine store of {e} (emission would write among engine "
            f"versions); emit into a directory outside it",
            file=str(repo),
        )


def _model_versions(d: Path) -> set[int]:
    return (
        {int(p.name) for p in d.iterdir() if p.name.isdigit() and not p.name.startswith("0") and p.is_dir()}
        if d.is_dir()
        else set()
    )


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _clean_staged(repo: Path) -> list[str]:
    """Remove staged directories and files that no commit refers to (only ever called under the lock)."""
    if (repo / JOURNAL).exists():
        return []  # they are what the journal's switch still has to move
    out = []
    for d in [repo] + [repo / m for m in VERSIONED + ("ensemble",)]:
        if d.is_dir():
            for p in d.iterdir():
                if p.name.startswith(_STAGED):
                    _remove(p)
                    out.append(f"removed {p.relative_to(repo)}, left by an interrupted emission")
    return out


def _repair(repo: Path) -> list[str]:
    """Finish a switch that was interrupted (kill -9, full disk), drop what an uncommitted emission staged, and
    remove a version that only some of the models have (what emission before the journal could leave)."""
    out = []
    j = repo / JOURNAL
    if j.is_file():
        try:
            renames = json.loads(j.read_text())["renames"]
        except (OSError, ValueError, KeyError, TypeError):
            renames = []  # it is renamed into place whole, so this is not a journal bpcompile wrote
        for src, dst in renames:
            s, d = repo / src, repo / dst
            if not (s.resolve().is_relative_to(repo.resolve()) and d.resolve().is_relative_to(repo.resolve())):
                continue
            if s.exists() and not (s.is_dir() and d.exists()):
                os.replace(s, d)
        j.unlink()
        out.append(f"finished an interrupted switch ({len(renames)} renames)")
    out += _clean_staged(repo)
    have = {m: _model_versions(repo / m) for m in VERSIONED}
    if all((repo / m).is_dir() for m in VERSIONED):
        for v in sorted(set.union(*have.values()) - set.intersection(*have.values())):
            holders = [m for m in VERSIONED if v in have[m]]
            for m in holders:
                _remove(repo / m / str(v))
            out.append(f"removed version {v}, which only {', '.join(holders)} had")
    return out


@contextlib.contextmanager
def _locked(repo: Path, name: Optional[str], engine_dirs: Iterable[Path] = ()) -> Iterator[list[str]]:
    """Check that bpcompile may write `repo`, lock it (one emission at a time), mark a new repository as
    bpcompile's for engine `name`, and repair what an interrupted emission left. Yields the repairs made."""
    for e in engine_dirs:
        _check_apart(repo, e)
    check_repository(repo, name)  # refuse before writing anything
    if (repo / "generator" / "config.pbtxt").is_file() and (repo / MARKER).is_file():
        raise UserError(
            f"{repo} was emitted by an earlier bpcompile, whose generating model was named 'generator' "
            f"(now '{GENERATOR}', tensorrtllm_backend's name): emit into a new directory",
            file=str(repo),
        )
    repo.mkdir(parents=True, exist_ok=True)
    with FileLock(str(repo / LOCK)):
        if check_repository(repo, name) is None:  # again: another process may have got here first
            write_atomic(repo / MARKER, json.dumps({"engine": name}) + "\n")
        repaired = _repair(repo)
        try:
            yield repaired
        except BaseException:
            _clean_staged(repo)  # a failure (a full disk, say) before the commit: nothing of it stays
            raise


def repair_repository(repo_dir: Union[str, Path]) -> list[str]:
    """Finish a switch that a killed emission left half done, and drop its uncommitted staging; returns what was
    done. Every emission does this first; a server can call it before it loads the repository."""
    with _locked(Path(repo_dir), None) as repaired:
        return repaired


def _stage_text(final: Path, text: str) -> Path:
    """Write `text` next to `final` under a hidden name (Triton ignores it); _commit renames it into place."""
    tmp = final.with_name(f".tmp-{final.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    return tmp


def _commit(repo: Path, renames: list[tuple[Path, Path]]) -> None:
    """Make what was staged visible. The list of renames is written first, atomically: from then on the new
    version cannot stay half-switched, because the next emission (under the lock) replays what is left.
    Renames allocate no file data, so a full disk that let the staging finish does not stop the switch.
    Order: version directories (generator last within each version), then configs, then the summary."""
    journal = [[str(s.relative_to(repo)), str(d.relative_to(repo))] for s, d in renames]
    write_atomic(repo / JOURNAL, json.dumps({"renames": journal}))
    for i, (s, d) in enumerate(renames):
        os.replace(s, d)
        if i == 0:
            fault_point("switch")
    (repo / JOURNAL).unlink()


# --- engine versions --------------------------------------------------------------------------------------


def _engine_config(engine_dir: Path) -> EngineConfig:
    cfg = EngineConfig.load(engine_dir)
    for need in ("tokenizer/tokenizer.json",):
        if not (engine_dir / need).is_file():
            raise UserError(f"engine version {engine_dir} has no {need}", file=str(engine_dir / need))
    return cfg


def _manifest(engine_dir: Path) -> dict:
    try:
        m = json.loads((engine_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return m if isinstance(m, dict) else {}


def _engine_name(engine_dir: Path) -> str:
    return _engine_config(engine_dir).name


def _check_links(engine_dir: Path) -> None:
    """What is copied into the repository must come from the engine version: no link may lead out of it."""
    root = engine_dir.resolve()
    for d, dirs, files in os.walk(engine_dir):
        for n in dirs + files:
            p = Path(d) / n
            if p.is_symlink() and not p.resolve().is_relative_to(root):
                raise UserError(
                    f"a symbolic link to {p.resolve()}, outside the engine version: it would be "
                    f"copied into the repository",
                    file=str(p),
                )


def _tokenizer_hash(engine_dir: Path) -> str:
    return hashlib.sha256((engine_dir / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()[:16]


def _speculative_trtllm(engine_dir: Path, target: str) -> bool:
    """Target tensorrt-llm with a draft engine: served through the BLS model (draft-target speculative decoding)."""
    return target == "tensorrt-llm" and _engine_config(engine_dir).speculative.tree == "chain"


def _stage_version(
    repo: Path, version: int, engine_dir: Path, target: str, link: bool, bls_source: Optional[Path] = None
) -> tuple[list[tuple[Path, Path]], dict]:
    """Fill hidden staging directories for model_dir/<version>/ of the three models (and, for a TensorRT-LLM
    draft-target pair, of tensorrt_llm_draft, empty, and tensorrt_llm_bls, the backend's BLS files); returns the
    renames that publish them (generator last) and the version's summary entry."""
    engine_dir = Path(engine_dir).resolve()
    existing = [m for m in VERSIONED if (repo / m / str(version)).exists()]
    if existing:
        raise UserError(
            f"{repo} already has version {version} of {', '.join(existing)}; "
            f"versions are immutable (publish a new engine version instead)",
            file=str(repo),
        )
    _check_links(engine_dir)
    tok = engine_dir / "tokenizer"

    def copy_tokenizer(model):
        def fill(d):
            shutil.copy2(MODELS_DIR / f"{model}.py", d / "model.py")
            shutil.copytree(tok, d / "tokenizer")

        return fill

    def fill_generator(d):
        if target == "native":
            shutil.copy2(MODELS_DIR / "generator.py", d / "model.py")
        if link:
            os.symlink(engine_dir, d / "engine")
        else:
            shutil.copytree(engine_dir, d / "engine", symlinks=False)
        m = _manifest(engine_dir)
        (d / "engine_source.json").write_text(
            json.dumps(
                {
                    "engine_dir": str(engine_dir),
                    "copied": not link,
                    "name": m.get("name"),
                    "version": m.get("version"),
                    "build_id": m.get("build_id"),
                },
                indent=2,
            )
            + "\n"
        )

    fills = [("preprocessing", copy_tokenizer("preprocessing")), ("postprocessing", copy_tokenizer("postprocessing"))]
    if _speculative_trtllm(engine_dir, target):  # the C++ backend takes the draft engine from gpt_model_path
        src = find_bls_source(bls_source)
        fills += [
            (DRAFT, lambda d: None),
            (BLS, lambda d: shutil.copytree(src, d, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))),
        ]
    renames = []
    for model, fill in fills + [(GENERATOR, fill_generator)]:
        tmp = repo / model / f".staging-{version}-{uuid.uuid4().hex[:8]}"  # Triton ignores non-numeric names
        tmp.mkdir(parents=True)
        renames.append((tmp, repo / model / str(version)))
        fill(tmp)
    return renames, {
        "version": version,
        "engine_dir": str(engine_dir),
        "build_id": _manifest(engine_dir).get("build_id"),
        "tokenizer": _tokenizer_hash(engine_dir),
    }


def _versions(repo: Path) -> list[int]:
    """Versions that all three versioned models have."""
    return sorted(set.intersection(*(_model_versions(repo / m) for m in VERSIONED)))


def _has_version(repo: Path, version: int, build_id: Optional[str]) -> bool:
    """The repository serves `version` from build `build_id`: every model has it and every config is in place."""
    configs = [repo / m / "config.pbtxt" for m in VERSIONED + ("ensemble",)]
    if version not in _versions(repo) or not all(c.is_file() for c in configs):
        return False
    try:
        have = json.loads((repo / GENERATOR / str(version) / "engine_source.json").read_text()).get("build_id")
    except (OSError, ValueError, AttributeError):
        return False
    return bool(have) and have == build_id


def _summary(repo: Path) -> dict:
    try:
        s = json.loads((repo / SUMMARY).read_text())
    except (OSError, ValueError):
        return {}
    return s if isinstance(s, dict) else {}


def _prepare(
    engine_dirs: Iterable[tuple[int, Union[str, Path]]],
    repo: Path,
    *,
    target,
    version_policy,
    max_batch_size,
    preprocessing_instances,
    generator_instances,
    device,
    tree,
    decoupled=None,
) -> dict:
    """Check the engines and build every config before anything is written."""
    engines = sorted((int(v), Path(p)) for v, p in engine_dirs)
    if not engines:
        raise UserError("emit needs at least one engine version")
    for v, p in engines:
        if v <= 0:
            raise UserError(f"engine version numbers are positive integers (Triton's rule), got {v}")
        _engine_config(p)
    names = sorted({_engine_name(p) for _, p in engines})
    if len(names) > 1:
        raise UserError(f"the engine versions are of several engines ({', '.join(names)}); a repository serves one")
    cfg = _engine_config(engines[-1][1])
    target = target or cfg.target
    if target not in TARGETS:
        raise UserError(f"target must be one of {', '.join(TARGETS)}, got {target!r}", key="target")
    policy = version_policy if version_policy is not None else cfg.triton.version_policy
    mbs = int(max_batch_size or cfg.limits.max_batch_size)
    gen_inst = int(generator_instances or cfg.triton.generator_instances)
    decoupled = cfg.triton.decoupled if decoupled is None else bool(decoupled)
    configs = {
        "preprocessing": preprocessing_config(mbs, policy, preprocessing_instances),
        "postprocessing": postprocessing_config(mbs, policy, target),
        "ensemble": ensemble_config(mbs, target),
    }
    device = _device_setting(device, cfg)
    if target == "native":
        tp = cfg.parallel.tp if cfg.parallel.pp == 1 else 1  # the runtime merges the ranks of a pp engine
        configs[GENERATOR] = generator_config(mbs, policy, gen_inst, device, tree, tp, decoupled)
    else:
        v, newest = engines[-1]
        spec = _speculative_trtllm(newest, target)
        configs[GENERATOR] = trtllm_generator_config(
            mbs,
            trtllm_engine_path(v, "verifier"),
            decoupled=decoupled and not spec,
            kv_cache_reuse=spec,
            tokenizer_dir=f"preprocessing/{v}/tokenizer",
        )
        if spec:
            configs[DRAFT] = trtllm_generator_config(
                mbs, trtllm_engine_path(v, "draft"), name=DRAFT, decoupled=False, kv_cache_reuse=True
            )
            configs[BLS] = bls_config(mbs)
    return {
        "engines": engines,
        "name": names[0],
        "target": target,
        "policy": policy,
        "mbs": mbs,
        "device": device,
        "tree": tree,
        "decoupled": decoupled,
        "configs": configs,
    }


def _emit_locked(repo: Path, plan: dict, link: bool, overwrite: bool, bls_source=None) -> dict:
    ours = VERSIONED + ("ensemble", DRAFT, BLS)
    if any((repo / m / "config.pbtxt").is_file() for m in ours):
        if not overwrite:
            raise UserError(
                f"{repo} already holds a model repository; use add_version, or overwrite=True", file=str(repo)
            )
        for m in ours:  # ours: the marker says so
            shutil.rmtree(repo / m, ignore_errors=True)
    for m in plan["configs"]:
        (repo / m).mkdir(exist_ok=True)
    (repo / "ensemble" / "1").mkdir(exist_ok=True)
    renames, written = [], []
    for v, p in plan["engines"]:
        r, w = _stage_version(repo, v, p, plan["target"], link, bls_source)
        renames += r
        written.append(w)
    for name, cfg in plan["configs"].items():
        final = repo / name / "config.pbtxt"
        renames.append((_stage_text(final, text_format.MessageToString(cfg)), final))
    summary = {
        "target": plan["target"],
        "version_policy": plan["policy"],
        "max_batch_size": plan["mbs"],
        "device": plan["device"],
        "tree": plan["tree"],
        "decoupled": plan["decoupled"],
        "versions": written,
        "models": sorted(plan["configs"]),
    }
    renames.append((_stage_text(repo / SUMMARY, json.dumps(summary, indent=2, sort_keys=True) + "\n"), repo / SUMMARY))
    fault_point("emit")
    _commit(repo, renames)
    return dict(summary, repo=str(repo))


def emit_repository(
    engine_dirs: Iterable[tuple[int, Union[str, Path]]],
    repo_dir: Union[str, Path],
    *,
    target: Optional[str] = None,
    version_policy=None,
    max_batch_size: Optional[int] = None,
    preprocessing_instances: int = 1,
    generator_instances: Optional[int] = None,
    device: Optional[str] = None,
    tree: Optional[dict] = None,
    link: bool = False,
    overwrite: bool = False,
    bls_source: Optional[Union[str, Path]] = None,
    decoupled: Optional[bool] = None,
) -> dict:
    """Write a complete repository holding the given engine versions (of one engine). Defaults come from the
    newest engine's recipe (target, triton.version_policy, triton.generator_instances, limits.max_batch_size).

    `tree` overrides the recipe's speculation for the served generator (e.g. {"kind": "none"}); `device` (cpu,
    cuda, auto) the recipe's runtime.device: cuda declares GPU instance groups (generator_instances).
    `bls_source`: tensorrtllm_backend's tensorrt_llm_bls/1 directory, for target tensorrt-llm with a draft
    (default: $BPCOMPILE_TRTLLM_BLS_DIR, else where TensorRT-LLM's Triton containers keep it).
    `decoupled` overrides the recipe's triton.decoupled (false: unary infer, no streaming).
    The directory must be new, empty or a repository bpcompile emitted for the same engine name. An existing
    repository is refused unless overwrite=True (use add_version to add to one)."""
    repo = Path(repo_dir)
    plan = _prepare(
        engine_dirs,
        repo,
        target=target,
        version_policy=version_policy,
        max_batch_size=max_batch_size,
        preprocessing_instances=preprocessing_instances,
        generator_instances=generator_instances,
        device=device,
        tree=tree,
        decoupled=decoupled,
    )
    with _locked(repo, plan["name"], [p for _, p in plan["engines"]]) as repaired:
        return dict(_emit_locked(repo, plan, link, overwrite, bls_source), repaired=repaired)


def _add_locked(repo: Path, version: int, engine_dir: Path, link: bool, bls_source=None) -> dict:
    if not (repo / GENERATOR / "config.pbtxt").is_file():
        raise UserError(
            f"{repo} is not an emitted repository (no tensorrt_llm/config.pbtxt); run emit first", file=str(repo)
        )
    summary = _summary(repo)
    engine_target = _engine_config(engine_dir).target
    target = summary.get("target", "native")
    if engine_target != target:
        raise UserError(
            f"engine {engine_dir} is for target {engine_target!r} but {repo} serves {target!r}", key="target"
        )
    renames, w = _stage_version(repo, version, engine_dir, target, link, bls_source)
    note = None
    old_tok = {v.get("tokenizer") for v in summary.get("versions", [])}
    if old_tok and w["tokenizer"] not in old_tok:
        note = (
            "this version has a different tokenizer: load preprocessing, generator and postprocessing together "
            "(unload the ensemble first) so no request mixes tokenizers"
        )
    if target == "tensorrt-llm":  # the C++ backend takes its engine from a parameter, not a version dir
        for model, role in ((GENERATOR, "verifier"), (DRAFT, "draft")):
            final = repo / model / "config.pbtxt"
            if final.is_file():
                cfg = read_config(final)
                cfg.parameters["gpt_model_path"].string_value = trtllm_engine_path(version, role)
                renames.append((_stage_text(final, text_format.MessageToString(cfg)), final))
    summary.setdefault("versions", []).append(w)
    renames.append((_stage_text(repo / SUMMARY, json.dumps(summary, indent=2, sort_keys=True) + "\n"), repo / SUMMARY))
    fault_point("emit")
    _commit(repo, renames)
    return {"repo": str(repo), "added": w, "versions": _versions(repo), "note": note}


def add_version(
    repo_dir: Union[str, Path],
    version: int,
    engine_dir: Union[str, Path],
    *,
    link: bool = False,
    bls_source: Optional[Union[str, Path]] = None,
) -> dict:
    """Add one engine version to an emitted repository without touching what is being served (configs are
    unchanged; the server picks the version up on its next load of the models, or poll)."""
    repo, engine_dir = Path(repo_dir), Path(engine_dir)
    check_repository(repo, None)
    with _locked(repo, _engine_name(engine_dir), [engine_dir]) as repaired:
        return dict(_add_locked(repo, int(version), engine_dir, link, bls_source), repaired=repaired)


def set_version_policy(repo_dir: Union[str, Path], policy) -> dict:
    """Point the served version(s) somewhere else (rollback = {'specific': [old]}); takes effect on reload.
    The three configs change together (one switch, like a new version)."""
    repo = Path(repo_dir)
    proto = version_policy_proto(policy)
    with _locked(repo, None) as repaired:
        if not (repo / GENERATOR / "config.pbtxt").is_file():
            raise UserError("not an emitted repository (no tensorrt_llm/config.pbtxt)", file=str(repo))
        have = set(_versions(repo))
        if proto.HasField("specific") and not set(proto.specific.versions) <= have:
            raise UserError(
                f"version_policy names versions {sorted(set(proto.specific.versions) - have)} that "
                f"{repo} does not have (it has {sorted(have)})",
                key="triton.version_policy",
            )
        renames = []
        for m in VERSIONED:
            final = repo / m / "config.pbtxt"
            cfg = read_config(final)
            if m == GENERATOR and cfg.backend == "tensorrtllm":
                continue
            cfg.version_policy.CopyFrom(proto)
            renames.append((_stage_text(final, text_format.MessageToString(cfg)), final))
        summary = _summary(repo)
        summary["version_policy"] = policy
        renames.append(
            (_stage_text(repo / SUMMARY, json.dumps(summary, indent=2, sort_keys=True) + "\n"), repo / SUMMARY)
        )
        _commit(repo, renames)
    return {"repo": str(repo), "version_policy": policy, "versions": sorted(have), "repaired": repaired}


def publish_version(repo_dir: Union[str, Path], engine_dir: Union[str, Path], version: int, recipe=None) -> dict:
    """Called by `bpcompile build`: emit the repository if there is none, else add the version. A no-op only if
    the repository really serves this version of this build (every model has it), after repairing what an
    interrupted emission left."""
    repo, engine_dir = Path(repo_dir), Path(engine_dir)
    name = _engine_name(engine_dir)
    with _locked(repo, name, [engine_dir]) as repaired:
        if not (repo / GENERATOR / "config.pbtxt").is_file():
            plan = _prepare(
                [(version, engine_dir)],
                repo,
                target=None,
                version_policy=None,
                max_batch_size=None,
                preprocessing_instances=1,
                generator_instances=None,
                device=None,
                tree=None,
            )
            out = _emit_locked(repo, plan, link=False, overwrite=True)
        elif _has_version(repo, version, _manifest(engine_dir).get("build_id")):
            out = {"repo": str(repo), "added": None, "versions": _versions(repo), "note": "already present"}
        else:
            out = _add_locked(repo, version, engine_dir, link=False)
    return dict(out, repaired=repaired)
