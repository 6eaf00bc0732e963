"""The recipe: one YAML file that says what to build. Validated into typed models (pydantic).

Every problem is reported as a `UserError` naming the file, the line, the key and what was expected;
`load_recipe` collects all of them (a user fixing a recipe wants the whole list, not one per run).
Paths in a recipe are relative to the recipe file's directory.
"""

from __future__ import annotations

import codecs
import os
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, Field, ValidationError

from bpcompile.core.engine import EngineConfig, _Strict
from bpcompile.core.errors import UserError
from bpcompile.core.kv_support import unsupported


class ModelSpec(_Strict):
    path: str = Field(description="HF checkpoint directory (config.json, *.safetensors, tokenizer files)")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"


class Models(_Strict):
    verifier: ModelSpec
    draft: ModelSpec


class Calibration(_Strict):
    source: str = Field(
        "builtin:pydoc-topics", description="'builtin:pydoc-topics' (the tiny pair's training split) or a text file"
    )
    samples: int = Field(16, ge=1)
    length: int = Field(128, ge=8)


class Output(_Strict):
    store: str = "../engines"
    triton_repo: str = "../triton_repo"


class Kernels(_Strict):
    arch: str = Field("sm_90a", pattern=r"^sm_\d+a?$")
    compile: bool = True


class Recipe(EngineConfig):
    models: Models
    calibration: Calibration = Calibration()
    output: Output = Output()
    kernels: Kernels = Kernels()


class LoadedRecipe(BaseModel):
    """A validated recipe plus where it came from; paths resolved against the recipe's directory."""

    recipe: Recipe
    file: Path
    verifier_dir: Path
    draft_dir: Path
    store_dir: Path
    triton_repo_dir: Path
    calibration_file: Optional[Path] = None
    # warnings for the user that do not stop a build (validate and build print them), e.g. where a CUDA
    # recipe would run when this machine has no GPU
    notes: list[str] = []

    def resolved_dict(self) -> dict:
        """The recipe as built: defaults filled in, paths absolute. Stored in every engine version."""
        d = self.recipe.model_dump(mode="json")
        d["models"]["verifier"]["path"] = str(self.verifier_dir)
        d["models"]["draft"]["path"] = str(self.draft_dir)
        d["output"] = {"store": str(self.store_dir), "triton_repo": str(self.triton_repo_dir)}
        if self.calibration_file:
            d["calibration"]["source"] = str(self.calibration_file)
        return d


# --- locating problems in the YAML source ------------------------------------------------------


def _line_index(text: str) -> dict[tuple, int]:
    """Map key paths (tuples of keys / list indices) to 1-based line numbers using yaml's node marks."""
    lines: dict[tuple, int] = {}

    def walk(node, path):
        # a key's line is where the key is written, not where its (possibly nested) value starts
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                lines[path + (k.value,)] = k.start_mark.line + 1
                walk(v, path + (k.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines.setdefault(path + (i,), v.start_mark.line + 1)
                walk(v, path + (i,))

    try:
        root = yaml.compose(text, Loader=_NoAliasLoader)
    except (yaml.YAMLError, RecursionError):
        return lines
    if root is not None:
        lines[()] = root.start_mark.line + 1
        walk(root, ())
    return lines


def _line_for(lines: dict[tuple, int], loc: tuple) -> Optional[int]:
    loc = tuple(loc)
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return lines.get(())


def _describe(err: dict) -> str:
    kind, msg, inp = err["type"], err["msg"], err.get("input")
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    if kind.startswith("value_error"):
        return msg.removeprefix("Value error, ")
    return f"{msg} (got {inp!r})" if not isinstance(inp, dict) else msg


def _key(loc) -> str:
    return ".".join(str(p) for p in loc)


MAX_RECIPE_BYTES = 1 << 20


class _NoAliasLoader(yaml.SafeLoader):
    """safe_load without aliases: `*name` references let a few hundred bytes expand into gigabytes
    ("billion laughs"); a recipe is short enough to write out in full."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            ev = self.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                f"YAML aliases (*{ev.anchor}) are not allowed in a recipe; write the value out",
                ev.start_mark,
            )
        return super().compose_node(parent, index)


def parse_recipe(path: str | Path) -> tuple[Recipe, dict[tuple, int]]:
    """Read and validate the YAML (types only; no filesystem checks). Raises UserError listing every problem."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            "recipe file not found" if not path.exists() else "recipe is not a regular file", file=str(path)
        )
    with open(path, "rb") as f:
        raw = f.read(MAX_RECIPE_BYTES + 1)
    if len(raw) > MAX_RECIPE_BYTES:
        raise UserError(f"recipe is larger than {MAX_RECIPE_BYTES} bytes", file=str(path))
    try:
        text = raw.decode("utf-8")
        data = yaml.load(text, Loader=_NoAliasLoader)
    except UnicodeDecodeError as e:
        raise UserError(f"not UTF-8 text: {e}", file=str(path)) from None
    except RecursionError:
        raise UserError("not valid YAML: nested too deeply", file=str(path)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise UserError(
            f"not valid YAML: {getattr(e, 'problem', e)}", file=str(path), line=mark.line + 1 if mark else None
        ) from None
    if not isinstance(data, dict):
        raise UserError("a recipe is a YAML mapping with at least 'name' and 'models'", file=str(path))
    lines = _line_index(text)
    try:
        return Recipe.model_validate(data), lines
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = tuple(p for p in err["loc"])
            line = _line_for(lines, loc)
            problems.append((line, f"{path}:{line}: {_key(loc)}: {_describe(err)}"))
        problems.sort(key=lambda p: p[0] or 0)
        first = e.errors()[0]
        raise _many(path, problems, first["loc"]) from None


def _many(path, problems, first_loc) -> UserError:
    msg = "invalid recipe:\n  " + "\n  ".join(p for _, p in problems)
    err = UserError(msg)
    err.file, err.line, err.key = str(path), problems[0][0], _key(first_loc)
    return err


def _not_text(f: Path) -> Optional[str]:
    """Why f cannot be a calibration text file, or None. The build reads it whole: /dev/zero would never end."""
    if not f.exists():
        return "not found"
    if not f.is_file():
        return "is not a regular file (a device, FIFO, socket or directory): give a UTF-8 text file"
    try:
        with open(f, "rb") as fh:
            head = fh.read(1 << 16)
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    except UnicodeDecodeError:
        return "is not UTF-8 text"
    return "is not text (it holds NUL bytes)" if b"\0" in head else None


def check_side_files(d: Path, key: str) -> None:
    """Tokenizer side files are copied into the engine and the Triton repository, so a symbolic link leading
    out of the checkpoint (special_tokens_map.json -> ~/.ssh/id_rsa) would publish what it points at. Links
    inside the checkpoint are fine, and so is the Hugging Face cache layout (snapshots/<rev>/f -> ../../blobs/)."""
    roots = [d.resolve()]
    if d.parent.name == "snapshots":
        roots.append(d.parent.parent.resolve() / "blobs")
    from bpcompile.compiler.hf import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        f = d / name
        if f.is_symlink() and not any(f.resolve().is_relative_to(r) for r in roots):
            raise UserError(
                f"{name} is a symbolic link to {f.resolve()}, outside the checkpoint directory "
                f"(it would be copied into the engine and the Triton repository); put the file itself "
                f"in the checkpoint",
                file=str(f),
                key=key,
            )


def load_recipe(path: str | Path, check_files: bool = True) -> LoadedRecipe:
    """Parse, validate types, then check the world: paths exist, checkpoints are safetensors,
    tokenizers match, tp/pp divide the model. All problems are reported together."""
    path = Path(path).resolve()
    recipe, lines = parse_recipe(path)
    base = path.parent

    def res(p: str) -> Path:
        return (base / p).resolve() if not Path(p).is_absolute() else Path(p)

    loaded = LoadedRecipe(
        recipe=recipe,
        file=path,
        verifier_dir=res(recipe.models.verifier.path),
        draft_dir=res(recipe.models.draft.path),
        store_dir=res(recipe.output.store),
        triton_repo_dir=res(recipe.output.triton_repo),
    )
    src = recipe.calibration.source
    if not src.startswith("builtin:"):
        loaded.calibration_file = res(src)
    if not check_files:
        return loaded

    problems: list[tuple[Optional[int], str]] = []

    def problem(loc: tuple, msg: str):
        line = _line_for(lines, loc)
        problems.append((line, f"{path}:{line}: {_key(loc)}: {msg}"))

    gpu = recipe.runtime.device != "cpu" and recipe.target == "native" and not recipe.runtime.wants_onnx
    for loc, msg in kernel_problems(recipe, None) if gpu else []:  # the cache's shape is checked with the configs
        problem(loc, msg)
    for loc, msg in kv_problems(recipe, recipe.kv_readers) if not gpu else []:
        problem(loc, msg)
    if recipe.target == "tensorrt-llm":  # what TensorRT-LLM 1.2's executor can hold, refused before any work
        kv = recipe.kv_cache.format
        if kv == "int4-fp8-outlier":
            problem(
                ("kv_cache", "format"),
                "TensorRT-LLM 1.2's executor allocates one dtype per KV pool and cannot "
                "hold the mixed INT4/FP8 cache: use target: native (or tensorrt) for it, or kv_cache.format: "
                "fp8, int8 or fp16 with this target",
            )
        if recipe.speculative.tree in ("dynamic", "static"):
            problem(
                ("speculative", "tree"),
                "TensorRT-LLM's draft_tokens_external verifies a chain of draft tokens, "
                "not a tree: use speculative: {tree: chain, length: N} (or none) with this target, or target: "
                "native for trees",
            )

    if src.startswith("builtin:") and src != "builtin:pydoc-topics":
        problem(
            ("calibration", "source"),
            f"unknown builtin source {src!r}; expected 'builtin:pydoc-topics' or a text file path",
        )
    elif loaded.calibration_file:
        why = _not_text(loaded.calibration_file)
        if why:
            problem(("calibration", "source"), f"calibration text {loaded.calibration_file} {why}")

    from bpcompile.compiler import hf
    from bpcompile.compiler.hf import INPUT_GLOBS

    configs = {}
    tokenizers_ok = True
    feature_draft = hf.is_feature_draft(loaded.draft_dir)
    for role in ("verifier", "draft"):
        d = getattr(loaded, f"{role}_dir")
        if role == "draft" and feature_draft:  # no tokenizer of its own: it reads the verifier's features
            where = ("models", "draft", "path")
            if recipe.target != "native" or recipe.runtime.wants_onnx or recipe.parallel.tp != 1:
                problem(
                    where,
                    "a feature draft (FeatureDraft) runs on the native target's torch executor at tp 1 "
                    "only (not in the ONNX graphs, TensorRT or TensorRT-LLM): use a standalone draft "
                    "checkpoint for this recipe",
                )
            if "verifier" in configs:
                try:
                    configs[role] = hf.read_feature_draft(d, configs["verifier"])
                except UserError as e:
                    problem(where, str(e))
            continue
        try:
            configs[role] = hf.read_hf_config(d)
            # every header validated and every tensor the config implies present: headers only, instant
            hf.check_weights(d, configs[role], hf.list_weights(d))
        except UserError as e:
            problem(("models", role, "path"), str(e))
            continue
        try:
            hf.check_tokenizer(d)
        except UserError as e:
            problem(("models", role, "path"), str(e))
            tokenizers_ok = False
        try:  # what the build refuses: a side file linked from outside the checkpoint
            check_side_files(d, f"models.{role}.path")
        except UserError as e:
            problem(("models", role, "path"), str(e))
        # the build hashes these: a link to /dev/zero or a FIFO would hang it
        for f in sorted({f for pat in INPUT_GLOBS for f in d.glob(pat)}):
            if not f.is_file():
                problem(("models", role, "path"), f"{f}: not a regular file")

    if "verifier" in configs:
        cfg = configs["verifier"]
        tp, pp = recipe.parallel.tp, recipe.parallel.pp
        for role, c in configs.items():
            h = c["num_attention_heads"]
            k = c["num_key_value_heads"]
            if h % tp:
                problem(("parallel", "tp"), f"tp={tp} does not divide the {role}'s {h} attention heads")
            elif k % tp and tp % k:
                problem(("parallel", "tp"), f"tp={tp} and the {role}'s {k} KV heads: one must divide the other")
            if role == "verifier" and c["num_hidden_layers"] < pp:  # the draft is not pipeline-split
                problem(("parallel", "pp"), f"pp={pp} exceeds the {role}'s {c['num_hidden_layers']} layers")
        hd = cfg["head_dim"]
        for loc, msg in kernel_problems(recipe, hd) if gpu else []:
            if loc[-1] == "group_size":
                problem(loc, msg)
        gs = recipe.kv_cache.group_size
        if recipe.kv_cache.format == "int4-fp8-outlier" and hd % gs:
            problem(("kv_cache", "group_size"), f"group_size={gs} must divide the verifier's head size {hd}")
        if "draft" in configs and tokenizers_ok and not feature_draft:
            ok, why = hf.tokenizers_equal(loaded.verifier_dir, loaded.draft_dir)
            if not ok:
                problem(
                    ("models", "draft", "path"),
                    f"the draft's tokenizer differs from the verifier's ({why}); speculation needs the same vocabulary",
                )
        ctx = context_length(cfg)
        if recipe.limits.max_seq_len > ctx:
            problem(("limits", "max_seq_len"), f"{recipe.limits.max_seq_len} exceeds the verifier's context ({ctx})")
        if recipe.target == "native" and recipe.runtime.device != "cpu":
            loaded.notes += device_notes(recipe, cfg, configs.get("draft"))
        elif recipe.target == "native":  # on the CPU the KV cache is in this machine's memory
            from bpcompile.compiler.plan import kv_pool_bytes

            need, have = kv_pool_bytes(recipe, cfg, configs.get("draft")), physical_memory()
            if have and need > have:
                problem(
                    ("limits", "max_batch_size"),
                    f"the native runtime's KV cache for max_batch_size={recipe.limits.max_batch_size} x "
                    f"max_seq_len={recipe.limits.max_seq_len} would take {need / 1e9:.1f} GB, more than this "
                    f"machine's {have / 1e9:.1f} GB of memory; lower limits.max_batch_size or limits.max_seq_len, or pass "
                    f"--kv-memory-limit (or set BPCOMPILE_KV_MEMORY_LIMIT) with the serving machine's memory in bytes "
                    f"(0: no check)",
                )

    if problems:
        problems.sort(key=lambda p: p[0] or 0)
        msg = "invalid recipe:\n  " + "\n  ".join(p for _, p in problems)
        if recipe.target == "native" and recipe.runtime.device != "cpu":  # what it would use, even so
            tp = recipe.parallel.tp
            msg += "\n" + "\n".join(
                f"note: {n}"
                for n in loaded.notes
                or [
                    f"runtime.device {recipe.runtime.device}: the engine would run at tp {tp} on {tp} "
                    f"GPU{'s' if tp > 1 else ''}{'' if cuda_devices() else '; no CUDA device on this machine'} "
                    "(per-GPU memory: bpcompile plan, which reads the models' config.json alone)"
                ]
            )
        err = UserError(msg)
        err.file, err.line = str(path), problems[0][0]
        raise err
    return loaded


def kv_problems(recipe: EngineConfig, readers, context: str = "") -> list[tuple[tuple, str]]:
    """What the recipe's KV settings ask for that one of `readers` (bpcompile.core.kv_support.READERS) does not
    read, as (key path, why) pairs: the KV features each setting brings, asked of the support table."""
    kv = recipe.kv_cache
    asked = []  # (feature, recipe key, the setting that turns it off)
    if kv.sink_tokens or kv.recent_window:
        key = "recent_window" if kv.recent_window else "sink_tokens"
        asked.append(("exact", key, f"{key}: 0"))
    if kv.key_transform == "klt":
        asked += [(f, "key_transform", "key_transform: none") for f in ("klt4", "klt5", "klt6")]
    if kv.int6_keys == "early":
        asked.append(("int6", "int6_keys", "int6_keys: none"))
    if kv.int3_values:
        asked.append(("int3", "int3_values", "int3_values: 0"))
    out, seen = [], set()
    for feature, key, fix in asked:
        for r in readers:
            for why in unsupported({feature}, r):
                if (key, r) not in seen:
                    seen.add((key, r))
                    out.append((("kv_cache", key), f"{context + ': ' if context else ''}{why}; set {fix}"))
    return out


def kernel_problems(recipe: EngineConfig, head_size: Optional[int]) -> list[tuple[tuple, str]]:
    """What in the recipe's KV plan the GPU's Triton kernels cannot read, as (key path, why) pairs; the cache's
    shape is checked where head_size is given. Empty on the CPU and for FP16 caches (PyTorch attends those on
    either device). On CUDA the kernels are the only attention path: a plan they cannot read is refused here
    rather than run on another path than the one validated. What they read: the support table,
    bpcompile.core.kv_support.SUPPORT (`kv_problems`)."""
    kv = recipe.kv_cache
    if recipe.runtime.device == "cpu" or kv.format == "fp16":
        return []
    on = f"runtime.device {recipe.runtime.device}: the GPU's Triton kernels"
    out = kv_problems(recipe, ("triton",), f"runtime.device {recipe.runtime.device}")
    if head_size is not None:
        from bpcompile.kernels.shapes import check_shape

        why = check_shape(head_size, min(kv.group_size, head_size))
        if why:
            out.append((("kv_cache", "group_size"), f"{on} cannot take this cache: {why}"))
    return out


def cuda_devices() -> list[tuple[str, int]]:
    """(name, memory in bytes) of each GPU torch sees on this machine."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [
        (p.name, p.total_memory)
        for p in (torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count()))
    ]


def device_notes(recipe: Recipe, verifier: dict, draft: Optional[dict]) -> list[str]:
    """What a GPU recipe would use (device, tp, per-GPU memory by `bpcompile plan`'s figures) and whether this
    machine has it. Notes, not problems: the build itself runs on the CPU, and the build box is often not the
    server."""
    from bpcompile.compiler.plan import DEVICES, GB, Device, plan

    gpus = cuda_devices()
    tp = recipe.parallel.tp
    dev = Device(gpus[0][0], gpus[0][1], DEVICES["h200"].bandwidth) if gpus else DEVICES["h200"]
    p = plan(recipe, verifier, draft, dev)
    use = (
        f"runtime.device {recipe.runtime.device}: the engine runs at tp {tp} on {tp} GPU{'s' if tp > 1 else ''}, "
        f"per GPU {p['total_bytes'] / GB:.1f} GB (weights {p['weights_bytes'] / GB:.1f} + KV caches "
        f"{p['kv_bytes'] / GB:.1f} + dense KV copies {p['dense_kv_bytes'] / GB:.1f} + a chunked prompt's K/V "
        f"{p['chunk_kv_bytes'] / GB:.1f} + activations {p['activations_bytes'] / GB:.1f}) of "
        f"{p['usable_bytes'] / GB:.1f} GB usable on {'this machine' if gpus else 'an'} {dev.name}"
        f"{'' if gpus else ' (bpcompile plan --device for another GPU)'}"
        f"{'' if p['fits'] else ': it does NOT fit (bpcompile plan shows the smallest tp that does)'}"
    )
    if not gpus:
        then = (
            "it would run on the CPU here (auto)"
            if recipe.runtime.device == "auto"
            else "this machine can build the engine, not run it (generate / serve --device cpu run it on the CPU)"
        )
        return [f"{use}; no CUDA device on this machine: {then}"]
    if len(gpus) < tp:
        return [f"{use}; this machine has {len(gpus)} GPU{'s' if len(gpus) > 1 else ''}, fewer than tp = {tp}"]
    return [use]


def context_length(cfg: dict) -> int:
    """Tokens a model (read_hf_config's form) can attend over. Linear RoPE scaling stretches the trained
    max_position_embeddings by its factor; llama3 scaling configs already state the extended context in
    max_position_embeddings (original_max_position_embeddings is the pre-extension one), as transformers reads them."""
    sc = cfg.get("rope_scaling") or {}
    if sc.get("rope_type") == "linear":
        return int(cfg["max_position_embeddings"] * sc["factor"])
    return cfg["max_position_embeddings"]


def physical_memory() -> Optional[int]:
    """The memory the native runtime's KV cache must fit in: this machine's RAM, unless
    $BPCOMPILE_KV_MEMORY_LIMIT (bytes) names the serving machine's (a build box is often not the server);
    0 turns the check off."""
    env = os.environ.get("BPCOMPILE_KV_MEMORY_LIMIT")
    if env is not None:
        try:
            return int(env)
        except ValueError:
            raise UserError(f"BPCOMPILE_KV_MEMORY_LIMIT must be a number of bytes, got {env!r}") from None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
