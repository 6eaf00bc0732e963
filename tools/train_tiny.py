"""Regenerate the shipped tiny draft/verifier pair (models/tiny/{verifier,draft}) from scratch.

    .venv/bin/python tools/train_tiny.py              # full run, ~15-25 min on 2 (shared) CPU cores
    .venv/bin/python tools/train_tiny.py --eval-only  # recompute models/tiny/metrics.json from the committed models
    .venv/bin/python tools/train_tiny.py --quick      # smoke run into a temp dir (~1 min)

Steps: byte-level BPE tokenizer (vocab 4096) on the train split of `bpcompile.compiler.corpus`; four small
"tutor" models (2 layers, hidden 128) trained on next-token cross-entropy with different seeds; the
verifier (4 layers, hidden 256, GQA 4q/2kv, head_dim 64) distilled from the tutors' averaged
predictions (KL plus a little cross-entropy); then the draft (1 layer, hidden 128, 2q/1kv, tied
embeddings) distilled from the verifier. Why the detour: on ~82k training tokens a 5M-parameter model
trained on cross-entropy alone generalizes *worse* than a 0.9M one (held-out perplexity ~126-140 vs
~96-105, with or without dropout); the ensemble of small models is better than any one of them (~82-85),
and a verifier distilled from it keeps most of that. The draft is distilled from the verifier because
speculation needs it to agree with the verifier, not to be a good model on its own.

Deterministic: fixed seeds, a fixed thread count, torch deterministic algorithms. Bit-identical
re-runs need the same torch build, CPU ISA and Python version (the corpus comes from
`pydoc_data.topics`, which differs between Python versions; metrics.json records its fingerprint).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import tempfile
import time
from pathlib import Path

# Before tokenizers/torch start their thread pools.
THREADS = 2
os.environ.setdefault("RAYON_NUM_THREADS", str(THREADS))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
from bpcompile.compiler import corpus

SEED = 1234
VOCAB = 4096
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3
UNK, BOS, EOS, PAD = range(4)
SEQ = 256  # tokens per training sequence, BOS included

COMMON = dict(
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=PAD,
    hidden_act="silu",
)
SHAPES = {  # head_dim 64 and GQA are fixed: the KV-cache kernels depend on them
    "verifier": dict(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=704,
        tie_word_embeddings=False,
    ),
    "draft": dict(
        num_hidden_layers=1,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=384,
        tie_word_embeddings=True,
    ),
    "tutor": dict(
        num_hidden_layers=2,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=384,
        tie_word_embeddings=True,
    ),
}
TUTORS = 4  # ensemble size: 1 -> 4 tutors took held-out perplexity from ~96-105 to ~82-85
# Hyper-parameters chosen on the 2-core box (~82k train tokens). Tried for a verifier trained on
# cross-entropy alone and not kept: residual/attention/embedding dropout 0.1-0.3, weight decay 0.1,
# lr 1e-3/2e-3, tied embeddings, batch 4, KV-noise injection, born-again distillation: none brought its
# held-out perplexity below a 2-layer model's (see docs/benchmarks/tiny_pair.md).
TRAIN = {
    "tutor": dict(epochs=12, batch=8, lr=3e-3, min_lr_frac=0.05, warmup=40, wd=0.05),
    "verifier": dict(epochs=12, batch=4, lr=3e-3, min_lr_frac=0.05, warmup=80, wd=0.05, kl_weight=0.9),
    "draft": dict(epochs=12, batch=8, lr=3e-3, min_lr_frac=0.05, warmup=40, wd=0.05, kl_weight=0.9),
}
QUICK = {"tutor": dict(epochs=1), "verifier": dict(epochs=1), "draft": dict(epochs=1)}


def quiet_transformers() -> None:
    # Whole documents are tokenized at once (longer than model_max_length, never fed whole); save bars are noise.
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)


# ---- tokenizer -------------------------------------------------------------------------------


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.train_documents(), trainer=trainer)
    # tokenizer(text) yields "<s> text", as Llama tokenizers do; the models are trained that way.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    assert [tok.token_to_id(s) for s in SPECIALS] == [UNK, BOS, EOS, PAD]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=COMMON["max_position_embeddings"],
    )


def token_stream(tok, docs: list[str]) -> torch.Tensor:
    """All documents' ids back to back, each closed by EOS."""
    ids: list[int] = []
    for d in docs:
        ids += tok.encode(d, add_special_tokens=False) + [EOS]
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, phase: int = 0) -> torch.Tensor:
    """Non-overlapping rows of BOS + SEQ-1 tokens, the first one starting at `phase`."""
    body = SEQ - 1
    starts = range(phase, len(stream) - body + 1, body)
    rows = torch.stack([stream[s : s + body] for s in starts])
    return torch.cat([torch.full((len(rows), 1), BOS), rows], dim=1)


def stream_batches(stream: torch.Tensor, batch: int):
    """Verifier epochs: windows at a random phase each epoch (more distinct contexts), shuffled."""

    def epoch(gen):
        x = windows(stream, int(torch.randint(0, SEQ - 1, (1,), generator=gen)))
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x) - batch + 1, batch):
            yield x[order[i : i + batch]], None

    return epoch


@torch.no_grad()
def teacher_batches(teachers: list, stream: torch.Tensor, batch: int):
    """Distillation epochs: fixed windows with the teachers' log-probs (of their averaged probabilities:
    an ensemble) computed once (fp16, ~0.7 GB) rather than a teacher forward every step: on 2 shared
    cores that is most of the distillation cost."""
    x = windows(stream)
    p = 0.0
    for t in teachers:
        p = p + torch.cat(
            [F.softmax(t(input_ids=x[i : i + 16]).logits[:, :-1].float(), -1) for i in range(0, len(x), 16)]
        ) / len(teachers)
    lp = p.log().half()
    del p

    def epoch(gen):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x) - batch + 1, batch):
            idx = order[i : i + batch]
            yield x[idx], lp[idx].float()

    return epoch


def heldout_batches(stream: torch.Tensor, batch: int = 16):
    x = windows(stream)
    for i in range(0, len(x), batch):
        yield x[i : i + batch]


# ---- models ----------------------------------------------------------------------------------


def build(kind: str, **override):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**COMMON, **{**SHAPES[kind], **override})
    cfg.dtype = torch.float32
    model = LlamaForCausalLM(cfg).float()
    return model


def lr_at(step: int, total: int, hp: dict) -> float:
    if step < hp["warmup"]:
        return hp["lr"] * (step + 1) / hp["warmup"]
    t = (step - hp["warmup"]) / max(1, total - hp["warmup"])
    floor = hp["lr"] * hp["min_lr_frac"]
    return floor + (hp["lr"] - floor) * 0.5 * (1 + math.cos(math.pi * t))


def optimizer(model, hp: dict):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]  # norms: no weight decay
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp["wd"]}, {"params": other, "weight_decay": 0.0}],
        lr=hp["lr"],
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def train(kind: str, model, epoch_fn, held, hp: dict, seed: int) -> float:
    """Train `model` in place on `epoch_fn(gen)` batches of (ids, teacher log-probs or None).

    With teacher log-probs the loss is KL(teacher || model) blended with cross-entropy on the data."""
    gen = torch.Generator().manual_seed(seed)
    steps_per_epoch = sum(1 for _ in epoch_fn(torch.Generator().manual_seed(0)))
    total = steps_per_epoch * hp["epochs"]
    opt = optimizer(model, hp)
    t0, step = time.time(), 0
    log(f"{kind}: {sum(p.numel() for p in model.parameters()):,} params, {total} steps ({hp['epochs']} epochs)")
    for epoch in range(hp["epochs"]):
        model.train()
        for x, t_lp in epoch_fn(gen):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, hp)
            logits = model(input_ids=x).logits[:, :-1].float()
            ce = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            loss = ce
            if t_lp is not None:
                kl = F.kl_div(
                    F.log_softmax(logits, -1).reshape(-1, VOCAB),
                    t_lp.reshape(-1, VOCAB),
                    log_target=True,
                    reduction="batchmean",
                )
                loss = hp["kl_weight"] * kl + (1 - hp["kl_weight"]) * ce
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
        # Held-out loss is only logged (to see over/under-fitting), never used to pick a checkpoint.
        model.eval()
        log(
            f"{kind} epoch {epoch + 1}/{hp['epochs']}: train ce {ce.item():.3f} loss {loss.item():.3f} "
            f"held-out ppl {perplexity(model, held):.2f} ({time.time() - t0:.0f}s)"
        )
    model.eval()
    return time.time() - t0


# ---- metrics ---------------------------------------------------------------------------------


@torch.no_grad()
def perplexity(model, held: torch.Tensor) -> float:
    nll, n = 0.0, 0
    for x in heldout_batches(held):
        logits = model(input_ids=x).logits[:, :-1].float()
        nll += F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="sum").item()
        n += x[:, 1:].numel()
    return math.exp(nll / n)


@torch.no_grad()
def ensemble_perplexity(models: list, held: torch.Tensor) -> float:
    """Perplexity of the models' averaged next-token probabilities."""
    nll, n = 0.0, 0
    for x in heldout_batches(held):
        p = sum(F.softmax(m(input_ids=x).logits[:, :-1].float(), -1) for m in models) / len(models)
        nll += F.nll_loss(p.log().reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="sum").item()
        n += x[:, 1:].numel()
    return math.exp(nll / n)


@torch.no_grad()
def agreement(draft, verifier, held: torch.Tensor) -> float:
    """Teacher-forced top-1 agreement: share of held-out positions where both argmaxes match."""
    same, n = 0, 0
    for x in heldout_batches(held):
        a = draft(input_ids=x).logits.argmax(-1)
        b = verifier(input_ids=x).logits.argmax(-1)
        same += (a == b).sum().item()
        n += a.numel()
    return same / n


def greedy_sample(model, tok, held_tok_dir) -> dict:
    prompt = corpus.heldout_prompts(held_tok_dir, 1, prompt_tokens=24, seed=0)[0]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    return {
        "prompt": tok.decode(prompt, skip_special_tokens=True),
        "greedy_continuation": tok.decode(out[0, len(prompt) :], skip_special_tokens=True),
    }


def file_sizes(d: Path) -> dict:
    return {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}


def evaluate(out: Path, extra: dict | None = None) -> dict:
    """Metrics of the pair as saved in `out` (loaded through transformers, as any consumer would)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seed_everything(SEED)
    ver_dir, dr_dir = out / "verifier", out / "draft"
    tok = AutoTokenizer.from_pretrained(ver_dir)
    verifier = AutoModelForCausalLM.from_pretrained(ver_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(dr_dir, dtype=torch.float32).eval()
    held = token_stream(tok, corpus.heldout_documents())
    metrics = {
        "heldout_perplexity": {
            "verifier": round(perplexity(verifier, held), 3),
            "draft": round(perplexity(draft, held), 3),
        },
        "teacher_forced_top1_agreement": round(agreement(draft, verifier, held), 4),
        "heldout_tokens": len(held),
        "eval_seq_len": SEQ,
        "params": {
            "verifier": sum(p.numel() for p in verifier.parameters()),
            "draft": sum(p.numel() for p in draft.parameters()),
        },
        "bytes": {"verifier": file_sizes(ver_dir), "draft": file_sizes(dr_dir)},
        "sample": greedy_sample(verifier, tok, ver_dir),
        "corpus": {
            "source": "pydoc_data.topics",
            "fingerprint": corpus.fingerprint(),
            "train_chars": len(corpus.train_text()),
            "heldout_chars": len(corpus.heldout_text()),
            "split": f"paragraph chunks, every {corpus.HOLDOUT_EVERY}th held out",
        },
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__,
            "threads": THREADS,
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
        },
    }
    if extra:
        metrics = {**metrics, **extra}
    return metrics


def save_tokenizer(tok, d: Path) -> None:
    tok.save_pretrained(d)
    # transformers 5 names its class "TokenizersBackend", which transformers 4 cannot resolve; the
    # old alias loads in both.
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def save_model(model, d: Path) -> None:
    import inspect

    kw = (
        {"safe_serialization": True}
        if "safe_serialization" in inspect.signature(model.save_pretrained).parameters
        else {}
    )
    model.config.dtype = torch.float32
    model.save_pretrained(d, **kw)  # transformers 5 always writes safetensors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "tiny")
    ap.add_argument("--eval-only", action="store_true", help="recompute metrics.json from the models in --out")
    ap.add_argument("--quick", action="store_true", help="1 epoch each into a temp dir (smoke run)")
    args = ap.parse_args()

    quiet_transformers()
    out: Path = args.out
    if args.quick and args.out == ap.get_default("out"):
        out = Path(tempfile.mkdtemp(prefix="tiny_pair_"))
    if args.eval_only:
        old = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
        keep = {k: old[k] for k in ("training", "seed") if k in old}
        m = evaluate(out, keep)
        (out / "metrics.json").write_text(json.dumps(m, indent=2) + "\n")
        print(json.dumps(m, indent=2))
        return

    hp = {k: {**v, **(QUICK[k] if args.quick else {})} for k, v in TRAIN.items()}
    t_all = time.time()
    seed_everything(SEED)
    tok = train_tokenizer()
    for kind in ("verifier", "draft"):
        save_tokenizer(tok, out / kind)  # identical tokenizer files in both dirs
    train_stream = token_stream(tok, corpus.train_documents())
    held = token_stream(tok, corpus.heldout_documents())
    log(f"tokenizer: {len(train_stream):,} train tokens, {len(held):,} held-out tokens")

    tutors, tutor_ppl, t_tutors = [], [], 0.0
    for i in range(TUTORS):
        seed_everything(SEED + 10 + i)
        tutor = build("tutor")
        t_tutors += train(
            f"tutor {i + 1}/{TUTORS}",
            tutor,
            stream_batches(train_stream, hp["tutor"]["batch"]),
            held,
            hp["tutor"],
            seed=SEED + 10 + i,
        )
        tutors.append(tutor.requires_grad_(False))
        tutor_ppl.append(round(perplexity(tutor, held), 3))
    ensemble_ppl = round(ensemble_perplexity(tutors, held), 3)
    log(f"tutors: held-out ppl {tutor_ppl}, their ensemble {ensemble_ppl}")

    seed_everything(SEED)
    t0 = time.time()
    epochs = teacher_batches(tutors, train_stream, hp["verifier"]["batch"])
    del tutors
    verifier = build("verifier")
    train("verifier", verifier, epochs, held, hp["verifier"], seed=SEED)
    t_ver = time.time() - t0  # teacher log-probs included
    save_model(verifier, out / "verifier")
    verifier.requires_grad_(False)

    seed_everything(SEED + 1)
    t0 = time.time()
    epochs = teacher_batches([verifier], train_stream, hp["draft"]["batch"])
    draft = build("draft")
    train("draft", draft, epochs, held, hp["draft"], seed=SEED + 1)
    t_draft = time.time() - t0
    save_model(draft, out / "draft")

    training = {
        "tutors": {"count": TUTORS, "heldout_perplexity": tutor_ppl, "ensemble_heldout_perplexity": ensemble_ppl},
        "seconds": {
            "tutors": round(t_tutors, 1),
            "verifier": round(t_ver, 1),
            "draft": round(t_draft, 1),
            "total_wall": round(time.time() - t_all, 1),
        },
        "train_tokens": len(train_stream),
        "hyperparameters": hp,
        "seq_len": SEQ,
        "quick": args.quick,
    }
    m = evaluate(out, {"training": training, "seed": SEED})
    (out / "metrics.json").write_text(json.dumps(m, indent=2) + "\n")
    print(json.dumps(m, indent=2))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
