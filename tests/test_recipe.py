"""Recipe validation: every bad input is exit 2 with a message naming file, line and key; nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from pairs import make_pair, make_tokenizer, write_recipe

from bpcompile.cli import main
from bpcompile.compiler.recipe import load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


def test_valid_recipe_loads_with_defaults(tmp_path, pair):
    loaded = load_recipe(write_recipe(tmp_path / "r.yaml", *pair))
    assert loaded.recipe.speculative.tree == "dynamic" and loaded.recipe.speculative.nodes == 5
    kv = loaded.recipe.kv_cache  # the recipe names only the format: every other key is its default
    assert kv.format == "fp16" and (kv.outlier_fraction, kv.group_size, kv.page_size) == (0.08, 64, 16)
    assert (kv.rotation, kv.outlier_precision, loaded.recipe.speculative.backoff) == ("auto", "fp8", True)
    code, out = run("validate", tmp_path / "r.yaml")
    assert code == 0, out


@pytest.mark.parametrize(
    "target,executor,fmt,extra,want",
    [
        # the default: a 10-position exact window, the keys of the first third of the layers KLT6 (INT6's bytes), of the
        # middle third KLT5, two thirds of the value units (those outside the middle third) INT3
        ("native", "torch", "int4-fp8-outlier", {}, (0, 10, 0.0, 0.0, "middle", "early", 0.6667, "klt")),
        (
            "native",
            "torch",
            "int4-fp8-outlier",
            {"key_transform": "klt"},
            (0, 10, 0.0, 0.0, "middle", "early", 0.6667, "klt"),
        ),
        # without KLT keys: the middle third's keys INT5, nothing else (the previous default)
        (
            "native",
            "torch",
            "int4-fp8-outlier",
            {"key_transform": "none"},
            (0, 10, 0.0, 0.0, "middle", "none", 0.0, "none"),
        ),
        (
            "native",
            "torch",
            "int4-fp8-outlier",
            {"int6_keys": "none"},
            (0, 10, 0.0, 0.0, "middle", "none", 0.0, "none"),
        ),
        # INT6 keys without the transform: window 11
        (
            "native",
            "torch",
            "int4-fp8-outlier",
            {"int6_keys": "early", "key_transform": "none"},
            (0, 11, 0.0, 0.0, "middle", "early", 0.6667, "none"),
        ),
        # KLT keys without INT6 ones: the middle third's as KLT5, window 10; without INT5 keys either: KLT4, window 7
        (
            "native",
            "torch",
            "int4-fp8-outlier",
            {"key_transform": "klt", "int6_keys": "none"},
            (0, 10, 0.0, 0.0, "middle", "none", 0.0, "klt"),
        ),
        (
            "native",
            "torch",
            "int4-fp8-outlier",
            {"key_transform": "klt", "int5_keys": "none"},
            (0, 7, 0.0, 0.0, "none", "none", 0.0, "klt"),
        ),
        # without INT5 keys: a 16-position window, 1% FP8 units, 1.5% of the units (retrieval heads' keys) INT8
        (
            "native",
            "torch",
            "int4-fp8-outlier",
            {"int5_keys": "none"},
            (0, 16, 0.01, 0.015, "none", "none", 0.0, "none"),
        ),
        # without a window: no KLT, INT5 or INT6 keys either (measured only next to exact recent keys)
        ("native", "torch", "int4-fp8-outlier", {"recent_window": 0}, (0, 0, 0.08, 0.0, "none", "none", 0.0, "none")),
        # the graphs do not read exact entries (nor INT6, INT3 or KLT units)
        ("native", "onnxruntime", "int4-fp8-outlier", {}, (0, 0, 0.08, 0.0, "none", "none", 0.0, "none")),
        ("tensorrt", "torch", "int4-fp8-outlier", {}, (0, 0, 0.08, 0.0, "none", "none", 0.0, "none")),  # nor the plugin
        (
            "native",
            "torch",
            "int8",
            {},
            (0, 0, 0.08, 0.0, "none", "none", 0.0, "none"),
        ),  # auto: for the INT4 format only
        ("native", "torch", "fp16", {}, (0, 0, 0.08, 0.0, "none", "none", 0.0, "none")),
    ],
)
def test_kv_cache_autos_resolve_per_target(target, executor, fmt, extra, want):
    from bpcompile.core.engine import EngineConfig

    e = EngineConfig.model_validate(
        {"name": "t", "target": target, "runtime": {"executor": executor}, "kv_cache": {"format": fmt, **extra}}
    )
    kv = e.kv_cache
    assert (
        kv.sink_tokens,
        kv.recent_window,
        kv.outlier_fraction,
        kv.retrieval_fraction,
        kv.int5_keys,
        kv.int6_keys,
        kv.int3_values,
        kv.key_transform,
    ) == want
    assert EngineConfig.model_validate_json(e.model_dump_json()).kv_cache == kv  # engine.json keeps them resolved


def test_shipped_recipes_parse():
    for name in ("tiny.yaml", "70b.yaml", "smollm2.yaml"):
        r, _ = parse_recipe(REPO / "recipes" / name)
        assert r.kv_cache.format == "int4-fp8-outlier"


def test_70b_recipe_resolves_to_the_default_plan_of_one_rank():
    """recipes/70b.yaml (tp 8, CUDA) names no KV setting but format, group and page size: they resolve as the same
    three do on one CPU rank (KLT6 / KLT5 keys, INT3 values, a window of 10; each rank its KV head's tables)."""
    import yaml

    from bpcompile.core.engine import EngineConfig

    raw = yaml.safe_load((REPO / "recipes" / "70b.yaml").read_text())
    assert set(raw["kv_cache"]) == {"format", "group_size", "page_size"}
    at8 = EngineConfig.from_sections(raw)
    at1 = EngineConfig.model_validate({"name": "t", "kv_cache": raw["kv_cache"]})
    assert (at8.parallel.tp, at8.runtime.device, at1.parallel.tp, at1.runtime.device) == (8, "cuda", 1, "cpu")
    assert at8.kv_cache == at1.kv_cache
    kv = at8.kv_cache
    assert (kv.key_transform, kv.int6_keys, kv.int5_keys, kv.int3_values, kv.recent_window) == (
        "klt",
        "early",
        "middle",
        0.6667,
        10,
    )


@pytest.mark.parametrize(
    "extra,key,line_of,expect",
    [
        ("kv_cache: {format: int3}\n", "kv_cache.format", "kv_cache", "int4-fp8-outlier"),
        ("speculative: {tree: dynamic, nodez: 5}\n", "speculative.nodez", "speculative", "unknown key"),
        ("limits: {max_batch_size: many}\n", "limits.max_batch_size", "limits", "integer"),
        ("speculative: {tree: static}\n", "speculative", "speculative", "needs 'choices'"),
        ("speculative: {tree: static, choices: [[0], [1, 0]]}\n", "speculative", "speculative", "no parent"),
        ("parallel: {tp: 3, pp: 1}\n", "parallel.tp", "parallel", "does not divide"),
        ("target: onnx\n", "target", "target", "native"),
        (
            "kv_cache: {format: int8, recent_window: 8}\nruntime: {executor: onnxruntime}\n",
            "kv_cache.recent_window",
            "kv_cache",
            "onnxruntime executor's step graphs do not read exact",
        ),
        (
            "kv_cache: {key_transform: klt, recent_window: 0}\nruntime: {executor: onnxruntime}\n",
            "kv_cache.key_transform",
            "kv_cache",
            "onnxruntime executor's step graphs do not read KLT4",
        ),
        ("kv_cache: {format: fp8, key_transform: klt}\n", "kv_cache", "kv_cache", "needs format int4-fp8-outlier"),
        ("kv_cache: {format: int8, int3_values: 0.5}\n", "kv_cache", "kv_cache", "int4-fp8-outlier"),
        ("kv_cache: {format: fp8, int5_keys: middle}\n", "kv_cache", "kv_cache", "needs format int4-fp8-outlier"),
    ],
)
def test_bad_values_exit_2_naming_key_and_line(tmp_path, pair, extra, key, line_of, expect):
    text = write_recipe(tmp_path / "r.yaml", *pair).read_text()
    # replace the default block of that section with the bad one
    lines = [l for l in text.splitlines() if not l.startswith(extra.split(":")[0] + ":")]
    path = tmp_path / "r.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    code, out = run("build", path)
    assert code == 2, out
    assert key in out and expect in out and "Traceback" not in out
    lineno = next(i for i, l in enumerate(path.read_text().splitlines(), 1) if l.startswith(line_of + ":"))
    assert f"r.yaml:{lineno}:" in out
    assert not (tmp_path / "engines").exists(), "a failed validation must write nothing"


def test_missing_paths_are_all_named(tmp_path):
    p = tmp_path / "r.yaml"
    write_recipe(p, tmp_path / "nope-verifier", tmp_path / "nope-draft")
    code, out = run("validate", p)
    assert code == 2
    assert "models.verifier.path" in out and "models.draft.path" in out
    assert "nope-verifier" in out and "nope-draft" in out


def test_70b_recipe_names_missing_checkpoints():
    code, out = run("validate", REPO / "recipes" / "70b.yaml")
    assert code == 2
    assert "/models/Meta-Llama-3.1-70B-Instruct" in out and "/models/Llama-3.2-1B-Instruct" in out


def test_missing_required_key(tmp_path, pair):
    p = write_recipe(tmp_path / "r.yaml", *pair)
    p.write_text(p.read_text().replace("name: t\n", ""))
    code, out = run("validate", p)
    assert code == 2 and "name: required key is missing" in out


def test_draft_with_different_tokenizer_is_refused(tmp_path, pair):
    v, d = pair
    d2 = tmp_path / "draft2"
    shutil.copytree(d, d2)
    make_tokenizer(d2, vocab=300, text_keys=9)  # same size, different merges/vocab
    code, out = run("validate", write_recipe(tmp_path / "r.yaml", v, d2))
    assert code == 2 and "models.draft.path" in out and "tokenizer" in out


def test_pickle_checkpoint_is_refused(tmp_path, pair):
    v, d = pair
    bad = tmp_path / "pickled"
    bad.mkdir()
    shutil.copy(v / "config.json", bad / "config.json")
    (bad / "pytorch_model.bin").write_bytes(b"not loaded")
    code, out = run("validate", write_recipe(tmp_path / "r.yaml", bad, d))
    assert code == 2 and "safetensors" in out and "pytorch_model.bin" in out


def test_not_yaml_and_not_a_mapping(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("name: [unclosed\n")
    code, out = run("validate", p)
    assert code == 2 and "r.yaml:" in out and "YAML" in out
    p.write_text("- just\n- a list\n")
    code, out = run("validate", p)
    assert code == 2 and "mapping" in out
    code, out = run("validate", tmp_path / "missing.yaml")
    assert code == 2
