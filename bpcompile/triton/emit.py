"""Emit a Triton model repository from engine store versions.

Layout (native target):

    repo/
      ensemble/config.pbtxt        platform "ensemble": preprocessing -> generator -> postprocessing
      ensemble/1/                  (an ensemble has no artifacts; its steps use model_version -1 = newest loaded)
      preprocessing/config.pbtxt   python backend
      preprocessing/<N>/           model.py + tokenizer/            (N = engine store version)
      generator/config.pbtxt       python backend, decoupled
      generator/<N>/               model.py + engine/ (a copy of engines/<name>/<N>/) + engine_source.json
      postprocessing/config.pbtxt  python backend, ONE instance (response order, see below)
      postprocessing/<N>/          model.py + tokenizer/
      bpcompile_repository.json    what was emitted from where (for people and for add_version)

Decisions:
* Version directories are the engine store's version numbers, for the three models that carry a version's
  files; the same version policy is written into all three, so they always serve the same engine version.
* The engine version is *copied* into generator/<N>/engine/: the repository is self-contained (it can be
  rsynced to a server, and the engine store can be cleaned without breaking what is served). The tiny pair is
  ~20 MB; for a 70B verifier pass `link=True` to symlink instead. engine_source.json names the origin and its
  build id either way.
* Publishing a version copies it into hidden staging directories and renames them into place, generator last,
  so a server never sees a half-written version; configs are not touched, so nothing being served changes until
  the models are (re)loaded (explicit mode: load API; poll mode: the next poll). Rollback = set_version_policy
  (repo, {"specific": [old]}) and reload.
* Response order: a decoupled generator's responses travel through postprocessing independently; with several
  postprocessing instances they can overtake each other (seen with 2.51: A C D B E). Each response is decodable
  on its own (protocol.py), and postprocessing runs as exactly one instance, so it handles one request's
  responses first-in first-out and they leave in the order the generator sent them. RESPONSE_INDEX
  (`response_index` output) numbers them so a client can check, or reorder defensively.
* Every config is a ModelConfig protobuf written with text_format: valid by construction, parsed back in tests.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable, Optional, Union

import yaml
from google.protobuf import text_format

from ..errors import UserError

try:
    from tritonclient.grpc import model_config_pb2 as mc
except ImportError as e:  # pragma: no cover - the [serve] extra
    from ..errors import MissingDependency
    raise MissingDependency("emitting a Triton repository needs tritonclient (pip install 'bpcompile[serve]')") from e

MODELS_DIR = Path(__file__).parent / "models"
VERSIONED = ("preprocessing", "generator", "postprocessing")
SUMMARY = "bpcompile_repository.json"
T = mc.DataType

# (name, type, dims, optional) — ensemble inputs as tensorrtllm_backend's ensemble names them (§4.3)
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
STATS = [  # generator -> postprocessing -> client, unchanged; the first three are TRT-LLM's names
    ("acceptance_rate", T.TYPE_FP32), ("total_accepted_draft_tokens", T.TYPE_INT32),
    ("total_draft_tokens", T.TYPE_INT32), ("tokens_per_step", T.TYPE_FP32), ("verifier_steps", T.TYPE_INT32),
    ("engine_version", T.TYPE_INT32),
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
            raise UserError(f"version_policy latest needs a positive number of versions, got {n!r}",
                            key="triton.version_policy")
        p.latest.num_versions = n
    elif isinstance(policy, dict) and len(policy) == 1 and "specific" in policy:
        vs = policy["specific"]
        vs = vs.get("versions", []) if isinstance(vs, dict) else vs
        if not vs or not all(isinstance(v, int) and v > 0 for v in vs):
            raise UserError(f"version_policy specific needs a list of positive versions, got {vs!r}",
                            key="triton.version_policy")
        p.specific.versions.extend(vs)
    else:
        raise UserError(f"version_policy must be 'latest', 'all', {{latest: n}} or {{specific: [..]}}, got {policy!r}",
                        key="triton.version_policy")
    return p


def write_config(path: Path, cfg: mc.ModelConfig) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text_format.MessageToString(cfg))
    os.replace(tmp, path)  # a poller never reads half a config


def read_config(path: Path) -> mc.ModelConfig:
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig())


# --- the four configs -------------------------------------------------------------------------------------

def preprocessing_config(max_batch_size: int, policy, instances: int = 1) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name="preprocessing", backend="python", max_batch_size=max_batch_size,
                         version_policy=version_policy_proto(policy))
    _inputs(cfg, [("QUERY", T.TYPE_STRING, [1], True), ("REQUEST_OUTPUT_LEN", T.TYPE_INT32, [1], True),
                  ("STOP_WORDS_DICT", T.TYPE_STRING, [-1], True), ("BAD_WORDS_DICT", T.TYPE_STRING, [-1], True),
                  ("END_ID", T.TYPE_INT32, [1], True)])
    _outputs(cfg, [("INPUT_ID", T.TYPE_INT32, [-1]), ("REQUEST_INPUT_LEN", T.TYPE_INT32, [1]),
                   ("REQUEST_OUTPUT_LEN", T.TYPE_INT32, [1]), ("STOP_WORDS_IDS", T.TYPE_INT32, [2, -1]),
                   ("BAD_WORDS_IDS", T.TYPE_INT32, [2, -1]), ("OUT_END_ID", T.TYPE_INT32, [1])])
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=instances)
    return cfg


GENERATOR_INPUTS = [
    ("input_ids", T.TYPE_INT32, [-1], False), ("input_lengths", T.TYPE_INT32, [1], False),
    ("request_output_len", T.TYPE_INT32, [1], False), ("end_id", T.TYPE_INT32, [1], True),
    ("stop_words_list", T.TYPE_INT32, [2, -1], True), ("bad_words_list", T.TYPE_INT32, [2, -1], True),
    ("streaming", T.TYPE_BOOL, [1], True), ("temperature", T.TYPE_FP32, [1], True),
    ("runtime_top_k", T.TYPE_INT32, [1], True), ("runtime_top_p", T.TYPE_FP32, [1], True),
    ("seed", T.TYPE_UINT64, [1], True),
]


def generator_config(max_batch_size: int, policy, instances: int = 1, device: str = "cpu",
                     tree: Optional[dict] = None) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name="generator", backend="python", max_batch_size=max_batch_size,
                         version_policy=version_policy_proto(policy))
    cfg.model_transaction_policy.decoupled = True
    _inputs(cfg, GENERATOR_INPUTS)
    _outputs(cfg, [("CONTEXT_IDS", T.TYPE_INT32, [-1]), ("READ_OFFSET", T.TYPE_INT32, [1]),
                   ("IS_FINAL", T.TYPE_BOOL, [1]), ("RESPONSE_INDEX", T.TYPE_INT32, [1]),
                   ("FINISH_REASON", T.TYPE_STRING, [1])] + [(n, t, [1]) for n, t in STATS])
    # One instance = one runtime = one in-flight batch; more instances are more model copies, each its own batch.
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=instances)
    _params(cfg, device=device, tree=json.dumps(tree) if tree else "")
    return cfg


def postprocessing_config(max_batch_size: int, policy, target: str = "native") -> mc.ModelConfig:
    cfg = mc.ModelConfig(name="postprocessing", backend="python", max_batch_size=max_batch_size,
                         version_policy=version_policy_proto(policy))
    if target == "tensorrt-llm":
        _inputs(cfg, [("TOKENS_BATCH", T.TYPE_INT32, [-1, -1], False), ("SEQUENCE_LENGTH", T.TYPE_INT32, [-1], False)])
        _outputs(cfg, [("OUTPUT", T.TYPE_STRING, [-1]), ("OUTPUT_IDS", T.TYPE_INT32, [-1])])
        _params(cfg, input_format="trtllm")
    else:
        _inputs(cfg, [("CONTEXT_IDS", T.TYPE_INT32, [-1], False), ("READ_OFFSET", T.TYPE_INT32, [1], False),
                      ("IS_FINAL", T.TYPE_BOOL, [1], False), ("RESPONSE_INDEX", T.TYPE_INT32, [1], False),
                      ("FINISH_REASON", T.TYPE_STRING, [1], False)] + [(n, t, [1], False) for n, t in STATS])
        _outputs(cfg, [("OUTPUT", T.TYPE_STRING, [-1]), ("OUTPUT_IDS", T.TYPE_INT32, [-1]),
                       ("OUT_RESPONSE_INDEX", T.TYPE_INT32, [1]), ("OUT_FINISH_REASON", T.TYPE_STRING, [1])]
                 + [("OUT_" + n, t, [1]) for n, t in STATS])
        _params(cfg, input_format="native")
    # Exactly one instance: responses of one request are processed first-in first-out (see module doc).
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    return cfg


def trtllm_generator_config(max_batch_size: int, engine_path: str, *, kv_cache_free_gpu_mem_fraction=0.9,
                            batch_scheduler_policy="guaranteed_no_evict", max_queue_delay_microseconds=0,
                            gpu_device_ids: str = "", tokenizer_dir: str = "") -> mc.ModelConfig:
    """The generator as the C++ `tensorrtllm` backend (reference §4.2). Model versions do not apply to it: the
    engine is named by gpt_model_path, which add_version points at the newest version."""
    cfg = mc.ModelConfig(name="generator", backend="tensorrtllm", max_batch_size=max_batch_size)
    cfg.model_transaction_policy.decoupled = True  # needed for streaming
    cfg.dynamic_batching.preferred_batch_size.append(max_batch_size)
    cfg.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_microseconds
    inp = [("input_ids", T.TYPE_INT32, [-1], False), ("input_lengths", T.TYPE_INT32, [1], False),
           ("request_output_len", T.TYPE_INT32, [1], False), ("end_id", T.TYPE_INT32, [1], True),
           ("stop_words_list", T.TYPE_INT32, [2, -1], True), ("bad_words_list", T.TYPE_INT32, [2, -1], True),
           ("streaming", T.TYPE_BOOL, [1], True), ("temperature", T.TYPE_FP32, [1], True),
           ("runtime_top_k", T.TYPE_INT32, [1], True), ("runtime_top_p", T.TYPE_FP32, [1], True),
           ("seed", T.TYPE_UINT64, [1], True), ("return_perf_metrics", T.TYPE_BOOL, [1], True)]
    _inputs(cfg, inp)
    for i in cfg.input:
        if i.name == "input_ids":
            i.allow_ragged_batch = True
        if i.name in ("input_lengths", "request_output_len") or (i.dims == [1] and i.name != "input_ids"):
            i.reshape.SetInParent()  # [1] -> scalar, as tensorrtllm_backend declares them
    _outputs(cfg, [("output_ids", T.TYPE_INT32, [-1, -1]), ("sequence_length", T.TYPE_INT32, [-1]),
                   ("acceptance_rate", T.TYPE_FP32, [1]), ("total_accepted_draft_tokens", T.TYPE_INT32, [1]),
                   ("total_draft_tokens", T.TYPE_INT32, [1])])
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    _params(cfg, gpt_model_path=engine_path, gpt_model_type="inflight_fused_batching",
            batch_scheduler_policy=batch_scheduler_policy,
            kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction, max_beam_width=1,
            exclude_input_in_output="true", enable_kv_cache_reuse="false", decoupled_mode="true",
            cancellation_check_period_ms=100, stats_check_period_ms=100, FORCE_CPU_ONLY_INPUT_TENSORS="no",
            **({"gpu_device_ids": gpu_device_ids} if gpu_device_ids else {}),
            **({"tokenizer_dir": tokenizer_dir} if tokenizer_dir else {}))
    return cfg


def ensemble_config(max_batch_size: int, target: str = "native") -> mc.ModelConfig:
    cfg = mc.ModelConfig(name="ensemble", platform="ensemble", max_batch_size=max_batch_size)
    ins = ENSEMBLE_INPUTS + ([("return_perf_metrics", T.TYPE_BOOL, [1], True)] if target == "tensorrt-llm" else [])
    _inputs(cfg, ins)
    outs = [("text_output", T.TYPE_STRING, [-1]), ("output_ids", T.TYPE_INT32, [-1])]
    if target == "native":
        outs += [("response_index", T.TYPE_INT32, [1]), ("finish_reason", T.TYPE_STRING, [1])]
        outs += [(n, t, [1]) for n, t in STATS]
    else:
        outs += [(n, t, [1]) for n, t in STATS[:3]]
    _outputs(cfg, outs)

    def step(model, inputs, outputs):
        s = cfg.ensemble_scheduling.step.add(model_name=model, model_version=-1)
        s.input_map.update(inputs)
        s.output_map.update(outputs)

    step("preprocessing",
         {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "STOP_WORDS_DICT": "stop_words",
          "BAD_WORDS_DICT": "bad_words", "END_ID": "end_id"},
         {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
          "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
          "BAD_WORDS_IDS": "_BAD_WORDS_IDS", "OUT_END_ID": "_PREPROCESSOR_END_ID"})
    gen_in = {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
              "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_PREPROCESSOR_END_ID",
              "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS", "streaming": "stream",
              "temperature": "temperature", "runtime_top_k": "top_k", "runtime_top_p": "top_p", "seed": "seed"}
    if target == "native":
        mid = ["CONTEXT_IDS", "READ_OFFSET", "IS_FINAL", "RESPONSE_INDEX", "FINISH_REASON"] + [n for n, _ in STATS]
        step("generator", gen_in, {n: "_" + n.upper() for n in mid})
        post_out = {"OUTPUT": "text_output", "OUTPUT_IDS": "output_ids", "OUT_RESPONSE_INDEX": "response_index",
                    "OUT_FINISH_REASON": "finish_reason"}
        post_out.update({"OUT_" + n: n for n, _ in STATS})
        step("postprocessing", {n: "_" + n.upper() for n in mid}, post_out)
    else:
        gen_in["return_perf_metrics"] = "return_perf_metrics"
        gen_out = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"}
        gen_out.update({n: n for n, _ in STATS[:3]})
        step("generator", gen_in, gen_out)
        step("postprocessing", {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
             {"OUTPUT": "text_output", "OUTPUT_IDS": "output_ids"})
    return cfg


# --- engine versions --------------------------------------------------------------------------------------

def _engine_recipe(engine_dir: Path) -> dict:
    f = engine_dir / "recipe.yaml"
    if not f.is_file():
        raise UserError(f"{engine_dir} is not an engine version: recipe.yaml is missing", file=str(f))
    for need in ("tokenizer/tokenizer.json",):
        if not (engine_dir / need).is_file():
            raise UserError(f"engine version {engine_dir} has no {need}", file=str(engine_dir / need))
    return yaml.safe_load(f.read_text()) or {}


def _manifest(engine_dir: Path) -> dict:
    try:
        return json.loads((engine_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _tokenizer_hash(engine_dir: Path) -> str:
    return hashlib.sha256((engine_dir / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()[:16]


def _stage_dir(model_dir: Path, version: int, fill) -> None:
    """Build model_dir/<version>/ in a hidden sibling (Triton ignores non-numeric names), then rename it in."""
    final = model_dir / str(version)
    tmp = model_dir / f".staging-{version}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_version(repo: Path, version: int, engine_dir: Path, target: str, link: bool) -> dict:
    engine_dir = Path(engine_dir).resolve()
    existing = [m for m in VERSIONED if (repo / m / str(version)).exists()]
    if existing:
        raise UserError(f"{repo} already has version {version} of {', '.join(existing)}; "
                        f"versions are immutable (publish a new engine version instead)", file=str(repo))
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
        (d / "engine_source.json").write_text(json.dumps(
            {"engine_dir": str(engine_dir), "copied": not link, "name": m.get("name"),
             "version": m.get("version"), "build_id": m.get("build_id")}, indent=2) + "\n")

    for model in ("preprocessing", "postprocessing"):
        _stage_dir(repo / model, version, copy_tokenizer(model))
    _stage_dir(repo / "generator", version, fill_generator)  # last: its appearance completes the version
    return {"version": version, "engine_dir": str(engine_dir), "build_id": _manifest(engine_dir).get("build_id"),
            "tokenizer": _tokenizer_hash(engine_dir)}


def _versions(repo: Path) -> list[int]:
    d = repo / "generator"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and not p.name.startswith("0")) \
        if d.is_dir() else []


def _summary(repo: Path) -> dict:
    try:
        return json.loads((repo / SUMMARY).read_text())
    except (OSError, ValueError):
        return {}


def _save_summary(repo: Path, summary: dict) -> None:
    tmp = repo / f".{SUMMARY}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, repo / SUMMARY)


def emit_repository(engine_dirs: Iterable[tuple[int, Union[str, Path]]], repo_dir: Union[str, Path], *,
                    target: Optional[str] = None, version_policy=None, max_batch_size: Optional[int] = None,
                    preprocessing_instances: int = 1, generator_instances: Optional[int] = None,
                    device: str = "cpu", tree: Optional[dict] = None, link: bool = False,
                    overwrite: bool = False) -> dict:
    """Write a complete repository holding the given engine versions. Defaults come from the newest engine's
    recipe (target, triton.version_policy, triton.generator_instances, limits.max_batch_size).

    `tree` overrides the recipe's speculation for the served generator (e.g. {"kind": "none"}).
    An existing repository is refused unless overwrite=True (use add_version to add to one)."""
    engines = sorted((int(v), Path(p)) for v, p in engine_dirs)
    if not engines:
        raise UserError("emit needs at least one engine version")
    for v, p in engines:
        if v <= 0:
            raise UserError(f"engine version numbers are positive integers (Triton's rule), got {v}")
        _engine_recipe(p)
    repo = Path(repo_dir)
    if repo.exists() and any(p.name in VERSIONED + ("ensemble",) for p in repo.iterdir()):
        if not overwrite:
            raise UserError(f"{repo} already holds a model repository; use add_version, or overwrite=True",
                            file=str(repo))
        for m in VERSIONED + ("ensemble",):
            shutil.rmtree(repo / m, ignore_errors=True)
    recipe = _engine_recipe(engines[-1][1])
    rt = recipe.get("triton", {}) or {}
    target = target or recipe.get("target", "native")
    if target not in ("native", "tensorrt-llm"):
        raise UserError(f"target must be 'native' or 'tensorrt-llm', got {target!r}", key="target")
    policy = version_policy if version_policy is not None else rt.get("version_policy", "latest")
    mbs = int(max_batch_size or (recipe.get("limits", {}) or {}).get("max_batch_size", 8))
    gen_inst = int(generator_instances or rt.get("generator_instances", 1))

    repo.mkdir(parents=True, exist_ok=True)
    for m in VERSIONED + ("ensemble",):
        (repo / m).mkdir(exist_ok=True)
    (repo / "ensemble" / "1").mkdir(exist_ok=True)
    written = [_write_version(repo, v, p, target, link) for v, p in engines]

    configs = {
        "preprocessing": preprocessing_config(mbs, policy, preprocessing_instances),
        "postprocessing": postprocessing_config(mbs, policy, target),
        "ensemble": ensemble_config(mbs, target),
    }
    if target == "native":
        configs["generator"] = generator_config(mbs, policy, gen_inst, device, tree)
    else:
        v, _ = engines[-1]
        configs["generator"] = trtllm_generator_config(
            mbs, str((repo / "generator" / str(v) / "engine" / "trtllm" / "verifier").resolve()),
            tokenizer_dir=str((repo / "preprocessing" / str(v) / "tokenizer").resolve()))
    for name, cfg in configs.items():
        write_config(repo / name / "config.pbtxt", cfg)
    summary = {"target": target, "version_policy": policy, "max_batch_size": mbs, "device": device,
               "tree": tree, "versions": written, "models": sorted(configs)}
    _save_summary(repo, summary)
    return dict(summary, repo=str(repo))


def add_version(repo_dir: Union[str, Path], version: int, engine_dir: Union[str, Path], *, link: bool = False) -> dict:
    """Add one engine version to an emitted repository without touching what is being served (configs are
    unchanged; the server picks the version up on its next load of the models, or poll)."""
    repo = Path(repo_dir)
    summary = _summary(repo)
    if not (repo / "generator" / "config.pbtxt").is_file():
        raise UserError(f"{repo} is not an emitted repository (no generator/config.pbtxt); run emit first",
                        file=str(repo))
    recipe = _engine_recipe(Path(engine_dir))
    target = summary.get("target", "native")
    if recipe.get("target", "native") != target:
        raise UserError(f"engine {engine_dir} is for target {recipe.get('target')!r} but {repo} serves {target!r}",
                        key="target")
    w = _write_version(repo, int(version), Path(engine_dir), target, link)
    note = None
    old_tok = {v.get("tokenizer") for v in summary.get("versions", [])}
    if old_tok and w["tokenizer"] not in old_tok:
        note = ("this version has a different tokenizer: load preprocessing, generator and postprocessing together "
                "(unload the ensemble first) so no request mixes tokenizers")
    if target == "tensorrt-llm":  # the C++ backend takes its engine from a parameter, not a version dir
        cfg = read_config(repo / "generator" / "config.pbtxt")
        cfg.parameters["gpt_model_path"].string_value = str(
            (repo / "generator" / str(version) / "engine" / "trtllm" / "verifier").resolve())
        write_config(repo / "generator" / "config.pbtxt", cfg)
    summary.setdefault("versions", []).append(w)
    _save_summary(repo, summary)
    return {"repo": str(repo), "added": w, "versions": _versions(repo), "note": note}


def set_version_policy(repo_dir: Union[str, Path], policy) -> dict:
    """Point the served version(s) somewhere else (rollback = {'specific': [old]}); takes effect on reload."""
    repo = Path(repo_dir)
    proto = version_policy_proto(policy)
    have = set(_versions(repo))
    if proto.HasField("specific") and not set(proto.specific.versions) <= have:
        raise UserError(f"version_policy names versions {sorted(set(proto.specific.versions) - have)} that "
                        f"{repo} does not have (it has {sorted(have)})", key="triton.version_policy")
    for m in VERSIONED:
        cfg = read_config(repo / m / "config.pbtxt")
        if m == "generator" and cfg.backend == "tensorrtllm":
            continue
        cfg.version_policy.CopyFrom(proto)
        write_config(repo / m / "config.pbtxt", cfg)
    summary = _summary(repo)
    summary["version_policy"] = policy
    _save_summary(repo, summary)
    return {"repo": str(repo), "version_policy": policy, "versions": sorted(have)}


def publish_version(repo_dir: Union[str, Path], engine_dir: Union[str, Path], version: int, recipe=None) -> dict:
    """Called by `bpcompile build`: emit the repository if there is none, else add the version (a no-op if the
    repository already has this version from the same build)."""
    repo, engine_dir = Path(repo_dir), Path(engine_dir)
    if not (repo / "generator" / "config.pbtxt").is_file():
        return emit_repository([(version, engine_dir)], repo, overwrite=True)
    if (repo / "generator" / str(version)).exists():
        src = repo / "generator" / str(version) / "engine_source.json"
        have = json.loads(src.read_text()).get("build_id") if src.is_file() else None
        if have and have == _manifest(engine_dir).get("build_id"):
            return {"repo": str(repo), "added": None, "versions": _versions(repo), "note": "already present"}
    return add_version(repo, version, engine_dir)
