"""Qwen2 (transformers' Qwen2ForCausalLM: q/k/v biases, no o_proj bias, GQA, tied or untied head, rope theta 1e6)
through every stage, on small random pairs that transformers builds: logits against transformers at tp 1 and at
tp 2 (two processes, each reading only its own rank file), the rank files against what TensorRT-LLM 1.2's Qwen2
loader expects, a built engine (calibrated KV plan, ONNX graphs, Triton repository) whose greedy speculative
output equals verifier-only output, at tp 1 and tp 2, and generation stopping on every end id the checkpoint's
generation config lists. Two shapes: head size 128 (2 query heads over 1 KV head, untied head) and head size 24,
not a power of two (6 / 2, tied head). Each draft is its verifier plus noise, so drafts are accepted.

The real Qwen2.5-Coder 1.5B / 0.5B pair is tested where `.venv/bin/python tools/get_qwen.py` has fetched it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bpcompile.compiler.convert import convert_checkpoint
from bpcompile.compiler.pipeline import build
from bpcompile.core.checkpoint import pad_vocab_size
from bpcompile.runtime.generator import Generator, SamplingParams
from bpcompile.runtime.model import Llama
from tests.pairs import make_tokenizer, write_recipe

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "models" / "qwen2.5-coder"
FETCH = ".venv/bin/python tools/get_qwen.py"
TOL = 1e-4
REAL_TOL = 2.5e-4  # the real 24-28-layer models' float32 noise (test_real_qwen_logits_equal_transformers)
VOCAB = 300
SHAPES = {  # name: (query heads, KV heads, head size, tied head)
    "d128": (2, 1, 128, False),
    "d24": (6, 2, 24, True),
}


def make_qwen2(path: Path, heads: int, kv: int, head: int, tied: bool, seed: int = 0, noise: float = 0.0) -> Path:
    """A random Qwen2ForCausalLM saved with safetensors and a byte-level BPE tokenizer. Every tensor is random
    (biases and norms too, so a misplaced one moves the logits); noise > 0 adds relative Gaussian noise to the
    weights of the seed's model (a draft that mostly agrees with it). Two end ids: 1 (</s>, the tokenizer's
    eos_token) and 0 (<s>), as generation_config.json lists them."""
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=heads * head,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=512,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        use_sliding_window=False,
        bos_token_id=0,
        eos_token_id=[1, 0],
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "bias" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 * (2.0 if "lm_head" in name else 1.0))
        if noise:
            n = torch.Generator().manual_seed(seed + 1)
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn(p.shape, generator=n))
    model.save_pretrained(path)
    make_tokenizer(path, vocab=VOCAB)
    return path


def qwen2_pair(root: Path, shape: str) -> tuple[Path, Path]:
    h, kv, d, tied = SHAPES[shape]
    return make_qwen2(root / "verifier", h, kv, d, tied), make_qwen2(root / "draft", h, kv, d, tied, noise=0.15)


def _tokens(seed: int = 0, B: int = 2, T: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(ref).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        return ref(tokens).logits


# ---------------------------------------------------------------------------------------------------------------
# logits: tp 1 (one rank file) and tp 2 (each process reads only its own rank file)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_equal_transformers_at_tp1(tmp_path, shape):
    h, kv, d, tied = SHAPES[shape]
    hf = make_qwen2(tmp_path / "hf", h, kv, d, tied)
    convert_checkpoint(hf, tmp_path / "trt")
    tokens = _tokens()
    ref = hf_logits(hf, tokens)
    got = Llama.from_checkpoint(tmp_path / "trt")(tokens)
    assert ref.abs().max() > 1.0
    assert (got - ref).abs().max().item() <= TOL


def test_loaded_model_keeps_no_view_of_the_checkpoint_file(tmp_path):
    """A float32 rank file loads as views of safetensors' memory map; the model keeps its own copies (norms, biases
    and the untied embedding too), so the map is gone once it is loaded: one kept view would keep the whole file
    mapped and its pages resident beside the model's copies."""
    h, kv, d, tied = SHAPES["d128"]  # q/k/v biases, an untied head: an embedding kept as it is read
    hf = make_qwen2(tmp_path / "hf", h, kv, d, tied)
    convert_checkpoint(hf, tmp_path / "trt", dtype="float32")
    model = Llama.from_checkpoint(tmp_path / "trt")
    assert str(tmp_path / "trt") not in Path("/proc/self/maps").read_text()
    assert (model(_tokens()) - hf_logits(hf, _tokens())).abs().max().item() <= TOL


RANK_SCRIPT = textwrap.dedent("""
    import sys, torch
    from datetime import timedelta
    import torch.distributed as dist
    from safetensors.torch import save_file
    from bpcompile.runtime.model import Llama
    port, rank, ckpt, out, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=120))
    model = Llama.from_rank(ckpt, rank, 2, group)
    tokens = torch.randint(0, int(sys.argv[6]), (2, 24), generator=torch.Generator().manual_seed(seed))
    save_file({"logits": model(tokens).contiguous()}, out)
    # both ranks done before either leaves, then no interpreter teardown: destroying gloo's threads and the TCPStore
    # at exit raced (a rank aborted with "terminate called without an active exception" after writing its file)
    group.barrier().wait()
    sys.stdout.flush()
    import os
    os._exit(0)
""")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp2_logits(ckpt: Path, out: Path, seed: int = 0) -> list[torch.Tensor]:
    """Both ranks' logits, each rank a process of its own that loads only rank{r}.safetensors (Llama.from_rank)."""
    from safetensors.torch import load_file

    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(port), str(r), str(ckpt), str(out / f"{r}.st"), str(seed), "300"],
            cwd=REPO,
        )
        for r in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    return [load_file(out / f"{r}.st")["logits"] for r in range(2)]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_equal_transformers_at_tp2_from_unmerged_rank_files(tmp_path, shape):
    h, kv, d, tied = SHAPES[shape]
    hf = make_qwen2(tmp_path / "hf", h, kv, d, tied)
    convert_checkpoint(hf, tmp_path / "trt", tp=2)
    ref = hf_logits(hf, _tokens())
    for got in tp2_logits(tmp_path / "trt", tmp_path):
        assert (got - ref).abs().max().item() <= TOL


# ---------------------------------------------------------------------------------------------------------------
# the rank files TensorRT-LLM 1.2 loads


def trtllm_qwen2_expected(hf: dict[str, torch.Tensor], cfg: dict, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What TensorRT-LLM 1.2 puts in rank `rank`'s file for a Qwen2 checkpoint, restated from its source
    (tensorrt_llm/models/qwen/convert.py load_weights_from_hf_model, qwen_type 'qwen2', no quantization, pp 1):
    key list self_attn. / self_attn.o_proj / mlp.up_proj -> mlp.gate / mlp.gate_proj -> mlp.fc / mlp.down_proj /
    input_layernorm / post_attention_layernorm / model.embed_tokens / model.norm; q, k, v (KV heads duplicated up
    to tp when fewer: dup_kv_weight repeats each head tp // KV times) each split in tp row blocks and concatenated
    q, k, v per rank, their biases alike; o_proj and down_proj split on dim 1, gate/up on dim 0; lm_head (the
    embedding when tied) zero-padded to a multiple of tp rows and split on dim 0; the embedding whole."""
    KV, D = cfg["num_key_value_heads"], cfg["head_size"]

    def split(t, dim=0):
        return t.chunk(tp, dim=dim)[rank]

    def dup(t):  # dup_kv_weight / dup_kv_bias
        if KV >= tp:
            return t
        return t.reshape(KV, 1, D, -1).repeat(1, tp // KV, 1, 1).reshape(KV * (tp // KV) * D, *t.shape[1:])

    out = {"transformer.vocab_embedding.weight": hf["model.embed_tokens.weight"]}
    for layer in range(cfg["num_hidden_layers"]):
        p, t = f"model.layers.{layer}.", f"transformer.layers.{layer}."
        for kind in ("weight", "bias"):
            q, k, v = (hf[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
            out[t + f"attention.qkv.{kind}"] = torch.cat((split(q), split(dup(k)), split(dup(v))))
        out[t + "attention.dense.weight"] = split(hf[p + "self_attn.o_proj.weight"], 1)
        out[t + "mlp.gate.weight"] = split(hf[p + "mlp.up_proj.weight"])
        out[t + "mlp.fc.weight"] = split(hf[p + "mlp.gate_proj.weight"])
        out[t + "mlp.proj.weight"] = split(hf[p + "mlp.down_proj.weight"], 1)
        out[t + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[t + "post_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
    head = hf["model.embed_tokens.weight" if cfg["tie_word_embeddings"] else "lm_head.weight"]
    V = cfg["vocab_size"]
    out["lm_head.weight"] = split(torch.nn.functional.pad(head, (0, 0, 0, pad_vocab_size(V, tp) - V)))
    out["transformer.ln_f.weight"] = hf["model.norm.weight"]
    return out


def trtllm_qwen2_shapes(cfg: dict, tp: int) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of TensorRT-LLM 1.2's QWenForCausalLM (models/qwen/model.py) on one rank: Attention
    with bias=attn_bias and dense_bias=False (its qkv a ColumnLinear of (H/tp + 2 * ceil(KV/tp)) * D rows),
    GatedMLP with bias=mlp_bias, RmsNorms, an unsplit Embedding, the lm_head a ColumnLinear over the padded vocab."""
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]
    h, inter, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    qkv = (H // tp + 2 * -(-KV // tp)) * D
    out = {"transformer.vocab_embedding.weight": (V, h), "transformer.ln_f.weight": (h,)}
    out["lm_head.weight"] = (pad_vocab_size(V, tp) // tp, h)
    for layer in range(cfg["num_hidden_layers"]):
        t = f"transformer.layers.{layer}."
        out.update(
            {
                t + "input_layernorm.weight": (h,),
                t + "attention.qkv.weight": (qkv, h),
                t + "attention.qkv.bias": (qkv,),
                t + "attention.dense.weight": (h, H * D // tp),
                t + "mlp.fc.weight": (inter // tp, h),
                t + "mlp.gate.weight": (inter // tp, h),
                t + "mlp.proj.weight": (h, inter // tp),
                t + "post_layernorm.weight": (h,),
            }
        )
    return out


@pytest.mark.parametrize("shape,tp", [("d128", 1), ("d128", 2), ("d24", 2)])  # d128 at tp 2: its KV head on both
def test_rank_files_hold_what_trtllm_qwen2_loader_expects(tmp_path, shape, tp):
    from safetensors.torch import load_file

    h, kv, d, tied = SHAPES[shape]
    hf_dir = make_qwen2(tmp_path / "hf", h, kv, d, tied)
    convert_checkpoint(hf_dir, tmp_path / "trt", tp=tp)
    cfg = json.loads((tmp_path / "trt" / "config.json").read_text())
    # the fields QWenForCausalLM reads: MODEL_MAP's key, qwen_type, biases, rope, sizes
    assert cfg["architecture"] == "Qwen2ForCausalLM" and cfg["qwen_type"] == "qwen2"
    assert (cfg["attn_bias"], cfg["mlp_bias"], cfg["tie_word_embeddings"]) == (True, False, tied)
    assert (cfg["rotary_base"], cfg["rotary_scaling"], cfg["position_embedding_type"]) == (1e6, None, "rope_gpt_neox")
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]) == (h, kv, d)
    assert cfg["mapping"]["tp_size"] == tp and cfg["mapping"]["world_size"] == tp
    hf = load_file(hf_dir / "model.safetensors")
    shapes = trtllm_qwen2_shapes(cfg, tp)
    for r in range(tp):
        got = load_file(tmp_path / "trt" / f"rank{r}.safetensors")
        assert {k: tuple(v.shape) for k, v in got.items()} == shapes
        want = trtllm_qwen2_expected(hf, cfg, tp, r)
        assert want.keys() == got.keys()
        for name, t in want.items():
            assert torch.equal(got[name], t), f"rank {r}: {name}"


def test_reader_refuses_sliding_window_and_accepts_model_type(tmp_path):
    from bpcompile.compiler.hf import read_hf_config
    from bpcompile.core.errors import UserError

    hf = make_qwen2(tmp_path / "hf", 4, 2, 24, False)
    spec = read_hf_config(hf)
    assert (spec["qkv_bias"], spec["o_bias"], spec["mlp_bias"], spec["rope_theta"]) == (True, False, False, 1e6)
    raw = json.loads((hf / "config.json").read_text())
    del raw["architectures"]  # model_type alone names the architecture
    (hf / "config.json").write_text(json.dumps(raw))
    assert read_hf_config(hf)["architecture"] == "Qwen2ForCausalLM"
    raw.update(use_sliding_window=True, sliding_window=64)
    (hf / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="sliding-window"):
        read_hf_config(hf)


# ---------------------------------------------------------------------------------------------------------------
# a built engine: calibrated KV plan, ONNX graphs, Triton repository; speculation = verifier only


def _build(root: Path, shape: str, tp: int, serve: bool = False) -> Path:
    v, d = qwen2_pair(root, shape)
    group = SHAPES[shape][2] if SHAPES[shape][2] < 64 else 64
    recipe = write_recipe(root / "r.yaml", v, d, extra="speculative: {tree: dynamic, nodes: 5, backoff: false}\n")
    recipe.write_text(
        recipe.read_text()
        .replace("parallel: {tp: 1, pp: 1}", f"parallel: {{tp: {tp}, pp: 1}}")
        .replace("max_batch_size: 4,", "max_batch_size: 16,")
        .replace(
            "kv_cache: {format: fp16}", f"kv_cache: {{format: int4-fp8-outlier, group_size: {group}, page_size: 8}}"
        )
        + "calibration: {source: 'builtin:pydoc-topics', samples: 4, length: 64}\n"
    )
    if serve:  # a Triton repository as well
        recipe.write_text(recipe.read_text().replace("triton: {emit: false}", "triton: {emit: true}"))
    return build(recipe).path


@pytest.fixture(scope="module")
def engine_d128(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("qwen2-d128"), "d128", 1, serve=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, VOCAB, (int(torch.randint(3, 30, (), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def _speculation_equals_verifier_only(engine: Path, tp: int, n: int = 12, tokens: int = 16) -> None:
    from bpcompile.runtime.speculative import TreeSpec

    prompts = _prompts(n)
    params = SamplingParams(max_tokens=tokens)
    plain = Generator.from_engine(engine, tree=TreeSpec("none"), tp=tp)
    spec = Generator.from_engine(engine, tp=tp)
    try:
        want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    finally:
        plain.close()
        spec.close()
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(len(t) == tokens for t, _ in want)
    steps, committed = sum(s.verifier_steps for _, s in got), sum(len(t) for t, _ in got)
    assert committed > steps + n  # drafts were accepted: speculation really ran


def test_built_engine_speculation_equals_verifier_only(engine_d128):
    cfg = json.loads((engine_d128 / "verifier" / "config.json").read_text())
    assert cfg["qwen_type"] == "qwen2" and cfg["head_size"] == 128
    assert (engine_d128 / "kv_plan" / "plan.json").is_file()
    _speculation_equals_verifier_only(engine_d128, 1)


def test_onnx_graphs_of_the_built_models_run_to_the_torch_tokens(engine_d128, tmp_path):
    """Both models' step graphs (an FP16 cache) pass onnx's checker with full shape inference, and the onnxruntime
    executor generates the torch executor's tokens, speculation on."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime_extensions")
    from bpcompile.compiler.onnx_export import export_generator
    from bpcompile.runtime.paged_kv import float_store_factory
    from bpcompile.runtime.speculative import TreeSpec

    v, d = Llama.from_checkpoint(engine_d128 / "verifier"), Llama.from_checkpoint(engine_d128 / "draft")
    kw = dict(max_batch_size=4, max_seq_len=64, kv_store_factory=float_store_factory(torch.float16), backoff=False)
    tree = TreeSpec("dynamic", nodes=5)
    ref = Generator(v, d, tree, **kw)
    export_generator(ref, tmp_path / "graphs")
    for role in ("verifier", "draft"):
        for kind in ("prefill", "step"):
            onnx.checker.check_model(str(tmp_path / "graphs" / role / f"{kind}.onnx"), full_check=True)
    ort = Generator(v, d, tree, executor="onnxruntime", graphs=tmp_path / "graphs", **kw)
    prompts, params = _prompts(4, seed=7), SamplingParams(max_tokens=12)
    want, got = ref.generate(prompts, params), ort.generate(prompts, params)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert sum(sum(s.accepted_per_depth) for _, s in got) > 0  # drafts verified through the graphs


def test_built_engine_triton_repository_and_end_ids(engine_d128):
    from bpcompile.runtime.text import end_ids

    repo = engine_d128.parents[2] / "triton_repo"
    assert (repo / "ensemble" / "config.pbtxt").is_file() and (repo / "tensorrt_llm" / "1" / "engine").exists()
    # generation_config.json lists two end ids; the tokenizer's eos_token (</s>, 1) comes first
    assert end_ids(engine_d128 / "tokenizer") == [1, 0]
    # the served generator: a request ending on one of them ends on the other too; a client's own end id stays alone
    from bpcompile.serving.protocol import TextInterface

    text = TextInterface(engine_d128 / "tokenizer", 64)
    assert (text.eos, text.ends(1), text.ends(0), text.ends(7), text.ends(None)) == (1, (0,), (1,), (), ())


def test_generation_stops_on_every_end_id(engine_d128):
    """A request stops at whichever listed end id comes first, the second one included."""
    gen = Generator.from_engine(engine_d128)
    prompts = _prompts(3, seed=3)
    free = gen.generate(prompts, SamplingParams(max_tokens=24))
    # the end id each output would stop at: its third generated token, given as the second of two end ids
    for (toks, _), prompt in zip(free, prompts):
        stop = toks[2]
        other = next(t for t in range(2, VOCAB) if t not in toks)
        ((got, _),) = gen.generate([prompt], SamplingParams(max_tokens=24, end_id=other, end_ids=(stop,)))
        assert got == toks[: toks.index(stop)]


def test_tp2_engine_speculation_equals_verifier_only_head_size_24(tmp_path):
    engine = _build(tmp_path, "d24", 2)
    cfg = json.loads((engine / "verifier" / "config.json").read_text())
    assert cfg["mapping"]["tp_size"] == 2 and cfg["head_size"] == 24 and cfg["tie_word_embeddings"]
    _speculation_equals_verifier_only(engine, 2)
    # and tp 2 gives the tokens tp 1 gives
    prompts, params = _prompts(8, seed=5), SamplingParams(max_tokens=16)
    one, two = Generator.from_engine(engine, tp=1), Generator.from_engine(engine)
    try:
        assert [t for t, _ in two.generate(prompts, params)] == [t for t, _ in one.generate(prompts, params)]
    finally:
        two.close()


# ---------------------------------------------------------------------------------------------------------------
# the real pair


def _real(which: str) -> Path:
    d = QWEN / which
    if not (d / "model.safetensors").is_file():
        pytest.skip(f"the Qwen2.5-Coder {which} is not fetched: run `{FETCH}`")
    return d


@pytest.mark.slow
@pytest.mark.parametrize("which", ["verifier", "draft"])
def test_real_qwen_logits_equal_transformers(tmp_path, which):
    hf = _real(which)
    convert_checkpoint(hf, tmp_path / "trt", dtype="float32")
    # a real chat prompt. Float32 rounding alone (products summed in another order than transformers') moves these
    # 24-28-layer models' logits (|logit| up to ~30) by 0.7-1.9e-4 depending on the input: measured 6.7e-5 (draft,
    # this prompt), 1.13e-4 (verifier, this prompt), 1.9e-4 (draft, random ids). 1e-4 is that noise's edge, so the
    # bar here is REAL_TOL; the small random pairs above hold 1e-4.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    msg = [
        {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number, with a docstring."}
    ]
    tokens = torch.tensor([tok(tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True))["input_ids"]])
    got = Llama.from_checkpoint(tmp_path / "trt")(tokens)
    ref = hf_logits(hf, tokens)
    assert (got - ref).abs().max().item() <= REAL_TOL
