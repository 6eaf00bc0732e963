"""`bpcompile build`: recipe -> converted checkpoints, KV plan, kernels -> published engine version -> Triton repo.

Data flows one way through the stages. Each stage writes only into the staging directory of the
version being built; the version is published atomically at the end (see bpcompile/core/store.py). A stage that
cannot run here (TensorRT absent, say) is recorded as skipped with its reason, never faked.

A killed build leaves only a locked staging directory, which the next build removes (bpcompile/core/store.py); the
Triton repository is written under its own lock and switched to a new version as a whole (bpcompile/serving/emit.py).
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

import yaml

from bpcompile import __version__
from bpcompile.compiler.hf import INPUT_GLOBS, TOKENIZER_FILES
from bpcompile.compiler.recipe import LoadedRecipe, check_side_files, load_recipe
from bpcompile.core.engine import EngineConfig
from bpcompile.core.errors import MissingDependency, UserError
from bpcompile.core.store import EngineStore, HashCache, Version, fault_point

PKG_DIR = Path(__file__).resolve().parents[1]  # bpcompile/, plugin sources included (package data)


def code_version() -> str:
    """Hash of bpcompile's own source (package, kernels, plugin sources): a code change makes a new build id,
    and an installed wheel hashes the same files as a source checkout."""
    h = hashlib.sha256(__version__.encode())
    for f in sorted(PKG_DIR.rglob("*")):
        if f.is_file() and f.suffix in (".py", ".json", ".cpp", ".h", ".txt", ".cu") and "__pycache__" not in f.parts:
            h.update(str(f.relative_to(PKG_DIR)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def tool_versions() -> dict:
    out = {"python": platform.python_version(), "bpcompile": __version__}
    for pkg in (
        "torch",
        "transformers",
        "safetensors",
        "tokenizers",
        "triton",
        "pydantic",
        "tritonclient",
        "nvidia-pytriton",
    ):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def input_files(loaded: LoadedRecipe) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for role, d in (("verifier", loaded.verifier_dir), ("draft", loaded.draft_dir)):
        for pat in INPUT_GLOBS:
            for f in sorted(d.glob(pat)):
                files[f"{role}/{f.name}"] = f
    if loaded.calibration_file:
        files["calibration/" + loaded.calibration_file.name] = loaded.calibration_file
    return files


@dataclass
class StageRecord:
    name: str
    status: str  # "ran" | "skipped"
    seconds: float = 0.0
    detail: str = ""
    result: dict = field(default_factory=dict)


@dataclass
class BuildResult:
    name: str
    version: int
    path: Path
    created: bool
    build_id: str
    stages: list[StageRecord]
    triton_repo: Optional[Path] = None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "version": self.version,
            "path": str(self.path),
            "created": self.created,
            "build_id": self.build_id,
            "triton_repo": str(self.triton_repo) if self.triton_repo else None,
            "stages": [
                {"name": s.name, "status": s.status, "seconds": round(s.seconds, 3), "detail": s.detail}
                for s in self.stages
            ],
        }


Progress = Callable[[int, int], None]  # (done, total), e.g. tensors or bytes


class Reporter:
    """Stage bookkeeping and progress callbacks; `log` goes to the user (stderr in the CLI)."""

    def __init__(
        self, log: Callable[[str], None] = lambda s: None, progress: Optional[Callable[[str], Progress]] = None
    ):
        self.log, self._progress = log, progress
        self.stages: list[StageRecord] = []

    def progress(self, label: str) -> Optional[Progress]:
        return self._progress(label) if self._progress else None

    def run(self, name: str, fn: Callable[[], dict | None]) -> dict:
        t = time.perf_counter()
        result = fn() or {}
        # a stage function may find at run time that it cannot apply (e.g. kernels for an unsupported head size)
        status = "skipped" if result.get("status") == "skipped" else "ran"
        rec = StageRecord(name, status, time.perf_counter() - t, result.pop("detail", ""), result)
        self.stages.append(rec)
        self.log(
            f"[{'ok' if status == 'ran' else status}] {name} ({rec.seconds:.1f}s)"
            f"{': ' + rec.detail if rec.detail else ''}"
        )
        return result

    def skip(self, name: str, why: str):
        self.stages.append(StageRecord(name, "skipped", 0.0, why))
        self.log(f"[skipped] {name}: {why}")


def _dtype(spec: str) -> Optional[str]:
    return None if spec == "auto" else spec


def _check_outputs(loaded: LoadedRecipe) -> None:
    """Before any work: the repository must not overlap the store, and must be one bpcompile may write."""
    if not loaded.recipe.triton.emit:
        return
    s, t = loaded.store_dir.resolve(), loaded.triton_repo_dir.resolve()
    if s == t or s.is_relative_to(t) or t.is_relative_to(s):
        raise UserError(
            f"output.store ({s}) and output.triton_repo ({t}) overlap: emitting the repository would "
            f"write among engine versions; give them separate directories",
            file=str(loaded.file),
            key="output.triton_repo",
        )
    from bpcompile.serving.emit import check_repository

    check_repository(loaded.triton_repo_dir, loaded.recipe.name)


def build(recipe_path: str | Path, *, force: bool = False, reporter: Optional[Reporter] = None) -> BuildResult:
    """Build and publish one engine version (nothing is published when any stage fails)."""
    rep = reporter or Reporter()
    loaded = load_recipe(recipe_path)
    for note in loaded.notes:
        rep.log(f"warning: {note}")
    r = loaded.recipe
    if r.triton.emit:  # emission needs the [serve] extra: fail here, not after publishing a version
        try:
            from bpcompile.serving import emit  # noqa: F401  (fail early when serving deps are missing)
        except (ImportError, MissingDependency) as e:
            raise MissingDependency(
                f"triton.emit is true, but emitting a Triton repository needs the serve extra "
                f"({e}): pip install 'bpcompile[serve]', or set triton.emit: false",
                file=str(loaded.file),
                key="triton.emit",
            ) from None
    for role, d in (("verifier", loaded.verifier_dir), ("draft", loaded.draft_dir)):
        check_side_files(d, f"models.{role}.path")
    _check_outputs(loaded)
    store = EngineStore(loaded.store_dir)
    for p in store.clean_stale(r.name):
        rep.log(f"removed {p}: left by a build that was interrupted")
    for p, why in store.incomplete(r.name):
        rep.log(f"warning: {p} is not an engine version ({why}); skipped, and its number is not reused")

    hc = HashCache(loaded.store_dir / ".hash-cache.json")
    t = time.perf_counter()
    files = input_files(loaded)
    inputs = {k: hc.sha256(f) for k, f in files.items()}
    hc.save()
    hash_s = time.perf_counter() - t
    resolved = loaded.resolved_dict()
    # output locations do not change what is built, so they stay out of the build id
    identity = {k: v for k, v in resolved.items() if k != "output"}
    identity["models"] = {k: {"dtype": v["dtype"]} for k, v in identity["models"].items()}
    code = code_version()
    build_id = hashlib.sha256(
        json.dumps({"inputs": inputs, "recipe": identity, "code": code}, sort_keys=True).encode()
    ).hexdigest()[:20]

    existing = store.find_build(r.name, build_id)
    if existing and not force:
        rep.log(
            f"up to date: {existing.path} (version {existing.version}) was built from the same inputs, "
            f"recipe and code (build id {build_id}); use --force to rebuild"
        )
        return BuildResult(
            r.name,
            existing.version,
            existing.path,
            False,
            build_id,
            [],
            _emit_if_wanted(loaded, store, existing, rep, created=False),
        )

    if r.target == "tensorrt-llm":  # fail before hours of conversion, not after
        from bpcompile.compiler.trtllm import require_trtllm

        require_trtllm()
    if r.target == "tensorrt":
        from bpcompile.compiler.tensorrt import require_tensorrt

        require_tensorrt(r)

    from bpcompile.compiler.convert import convert_checkpoint

    tp, pp = r.parallel.tp, r.parallel.pp
    with store.staging(r.name) as stage:
        (stage / "recipe.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))  # provenance
        EngineConfig.from_sections(resolved).save(stage)  # what the runtime and the repository read

        def convert(role: str, src: Path, pp_: int) -> dict:
            out = convert_checkpoint(
                src,
                stage / role,
                tp=tp,
                pp=pp_,
                dtype=_dtype(getattr(r.models, role).dtype),
                progress=rep.progress(f"convert {role}"),
            )
            return dict(out, detail=f"tp={tp} pp={pp_}, {tp * pp_} rank files, {out['bytes'] / 1e6:.1f} MB")

        rep.run("convert verifier", lambda: convert("verifier", loaded.verifier_dir, pp))
        fault_point("convert")
        # The draft is small: it keeps the recipe's tp (so it can sit on the verifier's GPUs) but no pp.
        from bpcompile.compiler import hf

        if hf.is_feature_draft(loaded.draft_dir):  # runs as stored (the runtime casts to the verifier's dtype)
            rep.run(
                "copy feature draft",
                lambda: _copy_feature_draft(loaded.draft_dir, stage / "draft", loaded.verifier_dir),
            )
        else:
            rep.run("convert draft", lambda: convert("draft", loaded.draft_dir, 1))
        rep.run("tokenizer", lambda: _copy_tokenizer(loaded.verifier_dir, stage / "tokenizer"))

        fault_point("calibrate")
        _calibrate_stage(loaded, stage, rep)
        _kernels_stage(loaded, stage, rep)
        _onnx_stage(loaded, stage, rep)
        _target_stage(loaded, stage, rep)

        manifest = {
            "build_id": build_id,
            "code_version": code,
            "recipe_file": str(loaded.file),
            "inputs": {k: {"sha256": inputs[k], "path": str(f)} for k, f in files.items()},
            "tools": tool_versions(),
            "input_hash_seconds": round(hash_s, 3),
            "stages": [
                {
                    "name": s.name,
                    "status": s.status,
                    "seconds": round(s.seconds, 3),
                    "detail": s.detail,
                    **({"report": s.result} if s.result else {}),
                }
                for s in rep.stages
            ],
        }
        version, created = store.publish(r.name, stage, manifest, force=force)
    if created:
        rep.log(f"published {version.path} (version {version.version}, build id {build_id})")
    else:
        rep.log(f"a concurrent build published the same inputs first: {version.path}")
    repo = _emit_if_wanted(loaded, store, version, rep, created=created)
    return BuildResult(r.name, version.version, version.path, created, build_id, rep.stages, repo)


def _copy_feature_draft(src: Path, dst: Path, verifier_dir: Path) -> dict:
    """config.json and model.safetensors of a FeatureDraft, validated again (shapes against the verifier's
    config, from the strictly checked safetensors headers) and copied."""
    from bpcompile.compiler import hf

    # again: the files may have changed since validation
    spec = hf.read_feature_draft(src, hf.read_hf_config(verifier_dir))
    dst.mkdir(parents=True)
    n = 0
    for f in ("config.json", "model.safetensors"):
        shutil.copy2(src / f, dst / f)
        n += (dst / f).stat().st_size
    return {"detail": f"FeatureDraft, {spec['num_hidden_layers']} layer(s), {n / 1e6:.1f} MB", "bytes": n}


def _copy_tokenizer(src: Path, dst: Path) -> dict:
    check_side_files(src, "models.verifier.path")  # again: the checkpoint may have changed since the build began
    dst.mkdir(parents=True)
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file() and shutil.copy2(src / f, dst / f)]
    if "tokenizer.json" not in copied:
        raise UserError(
            f"{src} has no tokenizer.json (a fast tokenizer file is needed to serve)", key="models.verifier.path"
        )
    return {"detail": ", ".join(copied)}


def _calibrate_stage(loaded: LoadedRecipe, stage: Path, rep: Reporter):
    kv = loaded.recipe.kv_cache
    if kv.format == "fp16":
        rep.skip("calibrate", "kv_cache.format is fp16: nothing to calibrate")
        return
    from bpcompile.compiler.calibrate import calibrate_engine_stage
    from bpcompile.compiler.plan import tree_tokens

    rep.run(
        "calibrate",
        lambda: calibrate_engine_stage(
            stage / "verifier",
            stage / "tokenizer",
            kv.model_dump(),
            loaded.recipe.calibration.model_dump(),
            stage / "kv_plan",
            calibration_file=loaded.calibration_file,
            seq_len=loaded.recipe.limits.max_seq_len,
            lookahead=tree_tokens(loaded.recipe),
            sequences=loaded.recipe.limits.max_batch_size,
        ),
    )
    if loaded.recipe.target == "tensorrt-llm" and kv.format in ("fp8", "int8"):
        from bpcompile.compiler.trtllm import kv_scales_stage  # TensorRT-LLM's per-layer scales (no TensorRT needed)

        rep.run(
            "kv cache scales",
            lambda: kv_scales_stage(
                stage / "verifier",
                stage / "tokenizer",
                kv.format,
                loaded.recipe.calibration.model_dump(),
                loaded.calibration_file,
            ),
        )


def _kernels_stage(loaded: LoadedRecipe, stage: Path, rep: Reporter):
    k, target = loaded.recipe.kernels, loaded.recipe.target
    if not k.compile:
        rep.skip("compile kernels", "kernels.compile is false")
        return
    # The cubins are for the TensorRT plugin alone: the native runtime JIT-compiles its kernels on the device it
    # runs on (Triton's JIT specializes on run-time argument values, so a build cannot write the entries its cache
    # would look up) and does so when the engine loads; TensorRT-LLM runs its own attention kernels.
    if target != "tensorrt":
        why = {
            "native": "target native: the native runtime compiles its kernels on the GPU it runs on, when the "
            "engine loads; the sm_90a cubins are built for target tensorrt, whose plugin wraps them",
            "tensorrt-llm": "target tensorrt-llm: TensorRT-LLM runs its own attention kernels",
        }.get(target, f"target {target}: only target tensorrt's plugin loads the cubins")
        rep.skip("compile kernels", why)
        return
    try:
        from bpcompile.compiler.aot import compile_engine_kernels
    except ImportError as e:
        rep.skip("compile kernels", f"not available in this version ({e})")
        return
    rep.run("compile kernels", lambda: compile_engine_kernels(stage, loaded.recipe, stage / "kernels"))
    # the TensorRT plugin library wraps those kernels (required: the engine cannot run without it)
    from bpcompile.compiler.plugin import build_trt_plugin

    res = build_trt_plugin(stage / "kernels", stage / "trt_plugin", required=True)
    if res.get("status") == "skipped":
        rep.skip("tensorrt plugin", res["reason"])
    else:
        rep.stages.append(StageRecord("tensorrt plugin", "ran", res.get("seconds", 0.0), res.get("detail", "")))


def _onnx_stage(loaded: LoadedRecipe, stage: Path, rep: Reporter):
    if not (loaded.recipe.runtime.wants_onnx or loaded.recipe.target == "tensorrt"):
        return
    from bpcompile.compiler.onnx_export import export_engine

    rep.run("export onnx", lambda: export_engine(stage))


def _target_stage(loaded: LoadedRecipe, stage: Path, rep: Reporter):
    if loaded.recipe.target != "tensorrt-llm":
        return
    from bpcompile.compiler.trtllm import trtllm_stage  # the one boundary to TensorRT / TensorRT-LLM

    rep.run("tensorrt-llm engines", lambda: trtllm_stage(stage, loaded.recipe))


def _emit_if_wanted(
    loaded: LoadedRecipe, store: EngineStore, version: Version, rep: Reporter, created: bool
) -> Optional[Path]:
    if not loaded.recipe.triton.emit:
        return None
    try:
        from bpcompile.serving.emit import publish_version
    except ImportError as e:
        rep.skip("emit triton repository", f"not available in this version ({e})")
        return None
    t = time.perf_counter()
    repo = loaded.triton_repo_dir
    out = publish_version(repo, version.path, version.version, loaded.recipe)
    for line in out.get("repaired", []):
        rep.log(f"repaired {repo}: {line}")
    rep.log(f"[ok] triton repository {repo} has version {version.version} ({time.perf_counter() - t:.1f}s)")
    return repo
