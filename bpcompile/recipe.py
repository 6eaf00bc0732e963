"""The recipe: one YAML file that says what to build. Validated into typed models (pydantic).

Every problem is reported as a `UserError` naming the file, the line, the key and what was expected;
`load_recipe` collects all of them (a user fixing a recipe wants the whole list, not one per run).
Paths in a recipe are relative to the recipe file's directory.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import UserError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    path: str = Field(description="HF checkpoint directory (config.json, *.safetensors, tokenizer files)")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"


class Models(_Strict):
    verifier: ModelSpec
    draft: ModelSpec


class Parallel(_Strict):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)


class Limits(_Strict):
    max_batch_size: int = Field(8, ge=1)
    max_input_len: int = Field(256, ge=1)
    max_seq_len: int = Field(512, ge=2)

    @model_validator(mode="after")
    def _input_fits(self):
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(f"max_input_len ({self.max_input_len}) must be smaller than max_seq_len ({self.max_seq_len})")
        return self


class KVCache(_Strict):
    format: Literal["int4-fp8-outlier", "fp8", "int8", "fp16"] = "int4-fp8-outlier"
    outlier_fraction: float = Field(0.08, ge=0.0, le=1.0, description="share of (layer, head, K|V) units kept in FP8")
    group_size: int = Field(64, ge=8, description="INT4 elements per scale along the head dimension")
    page_size: int = Field(16, ge=1, description="tokens per KV page")
    quantize_draft: bool = False


class Speculative(_Strict):
    tree: Literal["dynamic", "static", "chain", "none"] = "dynamic"
    nodes: int = Field(5, ge=1, le=256, description="dynamic tree: node budget per step")
    length: int = Field(5, ge=1, le=64, description="chain: draft tokens per step")
    choices: Optional[list[list[int]]] = Field(None, description="static tree in Medusa/EAGLE notation")

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


class Calibration(_Strict):
    source: str = Field("builtin:pydoc-topics", description="'builtin:pydoc-topics' (the tiny pair's training split) or a text file")
    samples: int = Field(16, ge=1)
    length: int = Field(128, ge=8)


class Output(_Strict):
    store: str = "../engines"
    triton_repo: str = "../triton_repo"


class Triton(_Strict):
    emit: bool = True
    version_policy: Union[Literal["latest", "all"], dict] = "latest"
    generator_instances: int = Field(1, ge=1)


class Kernels(_Strict):
    arch: str = Field("sm_90a", pattern=r"^sm_\d+a?$")
    compile: bool = True


class Recipe(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    models: Models
    parallel: Parallel = Parallel()
    limits: Limits = Limits()
    kv_cache: KVCache = KVCache()
    speculative: Speculative = Speculative()
    target: Literal["native", "tensorrt-llm"] = "native"
    calibration: Calibration = Calibration()
    output: Output = Output()
    triton: Triton = Triton()
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
        root = yaml.compose(text)
    except yaml.YAMLError:
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


def parse_recipe(path: str | Path) -> tuple[Recipe, dict[tuple, int]]:
    """Read and validate the YAML (types only; no filesystem checks). Raises UserError listing every problem."""
    path = Path(path)
    if not path.is_file():
        raise UserError("recipe file not found", file=str(path))
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise UserError(f"not valid YAML: {getattr(e, 'problem', e)}", file=str(path),
                        line=mark.line + 1 if mark else None) from None
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


def load_recipe(path: str | Path, check_files: bool = True) -> LoadedRecipe:
    """Parse, validate types, then check the world: paths exist, checkpoints are safetensors,
    tokenizers match, tp/pp divide the model. All problems are reported together."""
    path = Path(path).resolve()
    recipe, lines = parse_recipe(path)
    base = path.parent

    def res(p: str) -> Path:
        return (base / p).resolve() if not Path(p).is_absolute() else Path(p)

    loaded = LoadedRecipe(
        recipe=recipe, file=path,
        verifier_dir=res(recipe.models.verifier.path), draft_dir=res(recipe.models.draft.path),
        store_dir=res(recipe.output.store), triton_repo_dir=res(recipe.output.triton_repo),
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

    if src.startswith("builtin:") and src != "builtin:pydoc-topics":
        problem(("calibration", "source"), f"unknown builtin source {src!r}; expected 'builtin:pydoc-topics' or a text file path")
    elif loaded.calibration_file and not loaded.calibration_file.is_file():
        problem(("calibration", "source"), f"calibration text file not found: {loaded.calibration_file}")

    from . import hf

    configs = {}
    for role in ("verifier", "draft"):
        d = getattr(loaded, f"{role}_dir")
        try:
            configs[role] = hf.read_hf_config(d)
            hf.weight_files(d)  # safetensors present (pickle refused)
        except UserError as e:
            problem(("models", role, "path"), str(e))

    if "verifier" in configs:
        cfg = configs["verifier"]
        heads = cfg["num_attention_heads"]
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
        gs = recipe.kv_cache.group_size
        if recipe.kv_cache.format == "int4-fp8-outlier" and hd % gs:
            problem(("kv_cache", "group_size"), f"group_size={gs} must divide the verifier's head size {hd}")
        if "draft" in configs:
            ok, why = hf.tokenizers_equal(loaded.verifier_dir, loaded.draft_dir)
            if not ok:
                problem(("models", "draft", "path"),
                        f"the draft's tokenizer differs from the verifier's ({why}); speculation needs the same vocabulary")
        maxpos = cfg.get("max_position_embeddings")
        if maxpos and recipe.limits.max_seq_len > maxpos * ((cfg.get("rope_scaling") or {}).get("factor", 1)):
            problem(("limits", "max_seq_len"), f"{recipe.limits.max_seq_len} exceeds the verifier's context ({maxpos})")

    if problems:
        problems.sort(key=lambda p: p[0] or 0)
        msg = "invalid recipe:\n  " + "\n  ".join(p for _, p in problems)
        err = UserError(msg)
        err.file, err.line = str(path), problems[0][0]
        raise err
    return loaded


def recipe_json_schema() -> str:
    return json.dumps(Recipe.model_json_schema(), indent=2)
