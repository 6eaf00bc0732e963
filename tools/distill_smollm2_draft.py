"""Distil the shipped SmolLM2 draft (models/smollm2/draft) from the SmolLM2-135M-Instruct verifier.

    .venv/bin/python tools/get_smollm2.py                 # the verifier checkpoint, once
    .venv/bin/python tools/distill_smollm2_draft.py       # ~25 min on 2 (shared) CPU cores
    .venv/bin/python tools/distill_smollm2_draft.py --quick --out /tmp/d   # smoke run (~3 min)

The draft is a plain `LlamaForCausalLM` (the runtime needs nothing new): 2 layers, hidden 256, 4 query /
2 KV heads of size 64, tied embeddings, the verifier's tokenizer (vocab 49152). At this width the
output head (256 x 49152) is most of its cost, and a second layer is almost free next to it.
Its embedding starts as the verifier's embedding projected on its top-256 principal directions, so
the draft starts out speaking the verifier's output space and only has to learn to predict the
projected final hidden state.

Training text looks like what the draft will draft: (a) the train split of the builtin pydoc corpus
(`bpcompile.compiler.corpus.train_documents()`), in 256-token windows, and (b) the verifier's own greedy answers,
through its chat template, to instruction prompts built from that split ("Summarize ...",
"Explain ..."). The loss is KL(verifier || draft) on the verifier's top-k next-token distribution
(renormalised; the tail beyond k=32 holds ~1-3% of the mass on this text). Teacher logits and answers
are computed once (fp32 verifier) and cached under .cache/ (git-ignored): a rerun with the same
inputs and settings only retrains.

Held-out figures (written to <out>/metrics.json): top-1 agreement with the verifier on the pydoc
held-out split and on the verifier's greedy answers to prompts built from the held-out split, and
the draft's cost relative to one verifier forward (matmul FLOPs per token, and the measured time
of one 1-token decode step with a KV cache, transformers, fp32, 2 threads).

Deterministic given --seed: fixed thread count, torch deterministic algorithms, seeded shuffles.
Bit-identical reruns need the same torch build and CPU ISA (training runs under bf16 autocast).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

THREADS = 2
warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")
os.environ.setdefault("RAYON_NUM_THREADS", str(THREADS))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
from bpcompile.compiler import corpus

VERIFIER = ROOT / "models" / "smollm2" / "verifier"
OUT = ROOT / "models" / "smollm2" / "draft"
CACHE = ROOT / ".cache" / "smollm2_distill"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

SHAPE = dict(
    num_hidden_layers=2,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1024,
    tie_word_embeddings=True,
)
SEQ = 256  # tokens per corpus window
TOPK = 32  # teacher distribution kept per position
HP = dict(epochs=3, batch=8, lr=3e-3, min_lr_frac=0.05, warmup=40, wd=0.01, clip=1.0)
SIZES = dict(train_prompts=96, heldout_prompts=32, answer_tokens=96, gen_batch=32, heldout_windows=36)
QUICK = dict(epochs=1, train_prompts=16, heldout_prompts=8, answer_tokens=32, heldout_windows=4)

TEMPLATES = (
    "Summarize the following text in two or three sentences.\n\n{p}",
    "Explain the following passage from the Python documentation to a beginner.\n\n{p}",
    "What is the main point of this passage?\n\n{p}",
    "Rewrite this in plain words:\n\n{p}",
)
TOPIC_TEMPLATES = (
    "Explain {t} in Python.",
    "Give a short example of {t} in Python and explain it.",
    "What should a programmer know about {t}?",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---- text ------------------------------------------------------------------------------------


def _headings(doc: str) -> list[str]:
    """Section titles of a pydoc topic (a line underlined with *, = or -)."""
    lines = doc.splitlines()
    out = []
    for a, b in zip(lines, lines[1:]):
        if a.strip() and re.fullmatch(r"[*=\-]{3,}", b.strip()) and len(a) < 60:
            out.append(a.strip())
    return out


def _prose_paragraphs(doc: str) -> list[str]:
    """Paragraphs that read as prose (no indented code, 200..900 chars)."""
    return [
        p.strip()
        for p in doc.split("\n\n")
        if 200 <= len(p.strip()) <= 900 and not p.startswith("   ") and ">>>" not in p
    ]


def instruction_prompts(docs: list[str], n: int, seed: int) -> list[str]:
    paras = [p for d in docs for p in _prose_paragraphs(d)]
    heads = list(dict.fromkeys(h for d in docs for h in _headings(d)))
    rng = random.Random(seed)
    pool = []
    for i, p in enumerate(paras):
        pool.append(TEMPLATES[i % len(TEMPLATES)].format(p=p))
    for i, h in enumerate(heads):
        pool.append(TOPIC_TEMPLATES[i % len(TOPIC_TEMPLATES)].format(t=h))
    pool = sorted(set(pool))
    rng.shuffle(pool)
    return pool[:n]


def corpus_windows(tok, docs: list[str], n: int | None = None, seed: int = 0) -> list[list[int]]:
    """Non-overlapping SEQ-token windows, each inside one document (no BOS: SmolLM2's tokenizer adds none)."""
    out = []
    for d in docs:
        ids = tok(d, add_special_tokens=False).input_ids
        out += [ids[s : s + SEQ] for s in range(0, len(ids) - SEQ + 1, SEQ)]
    if n is not None:
        random.Random(seed).shuffle(out)
        out = out[:n]
    return out


def chat_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


# ---- teacher ---------------------------------------------------------------------------------


@torch.no_grad()
def teacher_windows(verifier, windows: list[list[int]], batch: int = 4):
    """-> list of (ids, topk_idx [T,K] int32, topk_logp [T,K] float16) for every window position."""
    out = []
    for i in range(0, len(windows), batch):
        x = torch.tensor(windows[i : i + batch])
        logp = F.log_softmax(verifier(x).logits.float(), -1)
        v, ix = logp.topk(TOPK, -1)
        for b in range(len(x)):
            out.append((windows[i + b], ix[b].int(), v[b].half()))
        log(f"  teacher windows {min(i + batch, len(windows))}/{len(windows)}")
    return out


@torch.no_grad()
def teacher_answers(verifier, tok, prompts: list[str], max_new: int, batch: int):
    """Greedy answers of the verifier -> list of (prompt_ids, answer_ids, topk_idx, topk_logp) where row j of
    the top-k tensors is the verifier's distribution for answer token j (from generate's own logits)."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    out = []
    for i in range(0, len(prompts), batch):
        ps = [chat_ids(tok, p) for p in prompts[i : i + batch]]
        L = max(map(len, ps))
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps])
        g = verifier.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
            return_dict_in_generate=True,
            output_logits=True,
        )
        logits = torch.stack(g.logits, 1).float()  # [B, steps, V]
        new = g.sequences[:, L:]
        for b, p in enumerate(ps):
            ans = new[b].tolist()
            n = ans.index(eos) + 1 if eos in ans else len(ans)  # keep the end-of-turn token: it is drafted too
            logp = F.log_softmax(logits[b, :n], -1)
            v, ix = logp.topk(TOPK, -1)
            out.append((p, ans[:n], ix.int(), v.half()))
        log(
            f"  answers {min(i + batch, len(prompts))}/{len(prompts)} (mean {sum(len(o[1]) for o in out) / len(out):.0f} tokens)"
        )
    return out


def cached(name: str, key: dict, fn):
    CACHE.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = CACHE / f"{name}-{h}.pt"
    if path.exists():
        log(f"{name}: cached {path.relative_to(ROOT)}")
        return torch.load(path)
    t0 = time.time()
    val = fn()
    torch.save(val, path)
    log(f"{name}: {time.time() - t0:.0f}s -> {path.relative_to(ROOT)}")
    return val


# ---- draft -----------------------------------------------------------------------------------


def build_draft(verifier, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    vc = verifier.config
    cfg = LlamaConfig(
        vocab_size=vc.vocab_size,
        max_position_embeddings=vc.max_position_embeddings,
        rms_norm_eps=vc.rms_norm_eps,
        rope_parameters=dict(vc.rope_parameters),
        bos_token_id=vc.bos_token_id,
        eos_token_id=vc.eos_token_id,
        pad_token_id=vc.pad_token_id,
        hidden_act="silu",
        **SHAPE,
    )
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(cfg).float()
    # Embedding = the verifier's embedding on its top principal directions (PCA of the rows).
    E = verifier.get_input_embeddings().weight.detach().float()
    _, _, Vh = torch.linalg.svd(E - E.mean(0), full_matrices=False)
    proj = E @ Vh[: cfg.hidden_size].T
    # unit mean row norm: with a unit-gain final norm (|h| ~ sqrt(256)) the initial logits stay in a sane range
    proj /= proj.norm(dim=1).mean()
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(proj)
    draft.tie_weights()
    return draft


def lr_at(step: int, total: int) -> float:
    if step < HP["warmup"]:
        return HP["lr"] * (step + 1) / HP["warmup"]
    t = (step - HP["warmup"]) / max(1, total - HP["warmup"])
    return HP["lr"] * (HP["min_lr_frac"] + (1 - HP["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * t)))


def examples(win_teacher, ans_teacher):
    """Training examples: (input ids, first target position, topk idx, topk logp) with targets at
    positions start..start+len(topk)-1 of the input."""
    ex = [(w, 0, ix, v) for w, ix, v in win_teacher]
    # answer: input = prompt + answer[:-1]; the distribution for answer token j sits at position len(prompt)-1+j
    ex += [(p + a[:-1], len(p) - 1, ix, v) for p, a, ix, v in ans_teacher]
    return ex


def kd_loss(draft, batch) -> torch.Tensor:
    L = max(len(e[0]) for e in batch)
    ids = torch.tensor([e[0] + [0] * (L - len(e[0])) for e in batch])  # right padding: causal, never attended
    tix = torch.cat([e[2] for e in batch]).long()
    tp = torch.cat([e[3].float() for e in batch]).softmax(-1)  # renormalised top-k teacher distribution
    with torch.autocast("cpu", dtype=torch.bfloat16):  # AMX/AVX512-BF16 matmuls; master weights stay fp32
        h = draft.model(input_ids=ids).last_hidden_state
        sel = torch.cat([h[b, s : s + len(ix)] for b, (_, s, ix, _) in enumerate(batch)])
        logits = draft.lm_head(sel)
    logq = F.log_softmax(logits.float(), -1)
    return -(tp * logq.gather(-1, tix)).sum(-1).mean()


def train(draft, ex: list, seed: int, epochs: int) -> list[float]:
    rng = random.Random(seed)
    decay = [p for n, p in draft.named_parameters() if p.dim() >= 2]
    other = [p for n, p in draft.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": HP["wd"]}, {"params": other, "weight_decay": 0.0}],
        lr=HP["lr"],
        betas=(0.9, 0.95),
    )
    steps_per_epoch = math.ceil(len(ex) / HP["batch"])
    total, step, losses = steps_per_epoch * epochs, 0, []
    draft.train()
    t0 = time.time()
    for ep in range(epochs):
        order = list(range(len(ex)))
        rng.shuffle(order)
        run = []
        for i in range(0, len(order), HP["batch"]):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total)
            loss = kd_loss(draft, [ex[j] for j in order[i : i + HP["batch"]]])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), HP["clip"])
            opt.step()
            run.append(loss.item())
            step += 1
            if step % 20 == 0 or step == 3:
                log(
                    f"  step {step}/{total} loss {statistics.fmean(run[-20:]):.3f} ({(time.time() - t0) / step:.2f}s/step)"
                )
        losses.append(statistics.fmean(run))
        log(f"epoch {ep + 1}/{epochs}: mean KD loss {losses[-1]:.4f}")
    draft.eval()
    return losses


# ---- metrics ---------------------------------------------------------------------------------


@torch.no_grad()
def window_agreement(draft, verifier, windows: list[list[int]]) -> list[float]:
    """Per window: share of positions where the draft's argmax equals the verifier's (teacher-forced)."""
    out = []
    for w in windows:
        x = torch.tensor([w])
        out.append((draft(x).logits.argmax(-1) == verifier(x).logits.argmax(-1)).float().mean().item())
    return out


@torch.no_grad()
def answer_agreement(draft, answers) -> tuple[int, int]:
    """Positions where the draft's argmax is the verifier's greedy answer token (what speculation accepts)."""
    hit = n = 0
    for p, a, _, _ in answers:
        x = torch.tensor([p + a[:-1]])
        pred = draft(x).logits[0, len(p) - 1 :].argmax(-1)
        hit += (pred == torch.tensor(a)).sum().item()
        n += len(a)
    return hit, n


def matmul_flops_per_token(cfg) -> int:
    """2 x parameters of every matmul a decoded token goes through (attention over the cache excluded)."""
    h, L, nq, nkv, d, ff = (
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    per_layer = h * (nq + 2 * nkv) * d + nq * d * h + 3 * h * ff
    return 2 * (L * per_layer + h * cfg.vocab_size)


@torch.no_grad()
def decode_step_seconds(model, context: int = 128, reps: int = 30) -> float:
    """Median time of one 1-token forward with a KV cache of `context` tokens (transformers, fp32)."""
    from transformers import DynamicCache

    x = torch.arange(100, 100 + context)[None]
    best = []
    for _ in range(3):
        cache = DynamicCache()
        model(input_ids=x, past_key_values=cache, use_cache=True)
        nxt = torch.tensor([[42]])
        for _ in range(reps):
            t = time.perf_counter()
            model(input_ids=nxt, past_key_values=cache, use_cache=True)
            best.append(time.perf_counter() - t)
    return statistics.median(best)


# ---- main ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--verifier", type=Path, default=VERIFIER)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    ap.add_argument("--eval-only", action="store_true", help="recompute metrics.json for the draft in --out")
    a = ap.parse_args()
    sizes = {**SIZES, **HP}
    if a.quick:
        sizes.update(QUICK)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    random.seed(a.seed)
    quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (a.verifier / "config.json").is_file():
        sys.exit(f"error: no verifier checkpoint at {a.verifier}; run tools/get_smollm2.py first")
    t_start = time.time()
    tok = AutoTokenizer.from_pretrained(a.verifier)
    verifier = AutoModelForCausalLM.from_pretrained(a.verifier, dtype=torch.float32).eval()
    stamp = json.loads((a.verifier / "bpcompile-source.json").read_text()).get("gguf_sha256", "?")
    key = {
        "verifier": stamp,
        "corpus": corpus.fingerprint(),
        "seq": SEQ,
        "topk": TOPK,
        "seed": a.seed,
        "torch": torch.__version__,
    }

    train_docs, held_docs = corpus.train_documents(), corpus.heldout_documents()
    train_prompts = instruction_prompts(train_docs, sizes["train_prompts"], a.seed)
    held_prompts = instruction_prompts(held_docs, sizes["heldout_prompts"], a.seed)
    held_windows = corpus_windows(tok, held_docs, sizes["heldout_windows"], a.seed)
    ans_key = {**key, "new": sizes["answer_tokens"], "batch": sizes["gen_batch"]}
    held_ans = cached(
        "heldout-answers",
        {**ans_key, "prompts": held_prompts},
        lambda: teacher_answers(verifier, tok, held_prompts, sizes["answer_tokens"], sizes["gen_batch"]),
    )

    if not a.eval_only:
        windows = corpus_windows(tok, train_docs)
        if a.quick:
            windows = windows[:16]
        # The training targets come from the verifier run in bf16 (its checkpoint's dtype, AMX matmuls):
        # ~2.5x faster on this CPU than fp32, and soft targets do not need fp32's last bits.
        # Held-out agreement is measured against the fp32 verifier.
        v16 = AutoModelForCausalLM.from_pretrained(a.verifier, dtype=torch.bfloat16).eval()
        win_t = cached(
            "train-windows", {**key, "n": len(windows), "dtype": "bf16"}, lambda: teacher_windows(v16, windows)
        )
        ans_t = cached(
            "train-answers",
            {**ans_key, "prompts": train_prompts, "dtype": "bf16"},
            lambda: teacher_answers(v16, tok, train_prompts, sizes["answer_tokens"], sizes["gen_batch"]),
        )
        del v16
        ex = examples(win_t, ans_t)
        n_targets = sum(len(e[2]) for e in ex)
        log(
            f"training on {len(ex)} sequences, {n_targets} target positions "
            f"({sum(len(e[2]) for e in examples([], ans_t))} in verifier answers)"
        )
        draft = build_draft(verifier, a.seed)
        t0 = time.time()
        losses = train(draft, ex, a.seed, sizes["epochs"])
        train_s = time.time() - t0
        draft = draft.to(torch.bfloat16)
        a.out.mkdir(parents=True, exist_ok=True)
        draft.config.dtype = torch.bfloat16
        draft.save_pretrained(a.out, safe_serialization=True)
        for f in TOKENIZER_FILES:
            if (a.verifier / f).exists():
                shutil.copyfile(a.verifier / f, a.out / f)
        if (a.verifier / "generation_config.json").exists():
            shutil.copyfile(a.verifier / "generation_config.json", a.out / "generation_config.json")
        train_info = {
            "sequences": len(ex),
            "target_positions": n_targets,
            "epochs": sizes["epochs"],
            "kd_loss_per_epoch": [round(x, 4) for x in losses],
            "train_seconds": round(train_s),
        }
    else:
        old = json.loads((a.out / "metrics.json").read_text()) if (a.out / "metrics.json").exists() else {}
        train_info = old.get("training", {})

    # What ships is what is measured: reload the saved bf16 draft, run it in fp32 like the verifier.
    draft = AutoModelForCausalLM.from_pretrained(a.out, dtype=torch.float32).eval()
    log("measuring held-out agreement")
    per_window = window_agreement(draft, verifier, held_windows)
    hit, n = answer_agreement(draft, held_ans)
    t_draft, t_ver = decode_step_seconds(draft), decode_step_seconds(verifier)
    f_draft, f_ver = matmul_flops_per_token(draft.config), matmul_flops_per_token(verifier.config)
    metrics = {
        "verifier": str(a.verifier.relative_to(ROOT)) if a.verifier.is_relative_to(ROOT) else str(a.verifier),
        "verifier_gguf_sha256": stamp,
        "corpus_fingerprint": corpus.fingerprint(),
        "seed": a.seed,
        "shape": SHAPE,
        "params": sum(p.numel() for p in draft.parameters()),
        "heldout_pydoc": {
            "windows": len(held_windows),
            "seq_len": SEQ,
            "window_seed": a.seed,
            "top1_agreement": round(statistics.fmean(per_window), 4),
            "per_window": [round(x, 4) for x in per_window],
        },
        "heldout_answers": {"prompts": len(held_ans), "answer_tokens": n, "top1_agreement": round(hit / n, 4)},
        "cost": {
            "flops_per_token": {"draft": f_draft, "verifier": f_ver, "ratio": round(f_draft / f_ver, 4)},
            "decode_step_ms": {
                "draft": round(1e3 * t_draft, 3),
                "verifier": round(1e3 * t_ver, 3),
                "ratio": round(t_draft / t_ver, 4),
                "how": "median 1-token forward, KV cache of 128 tokens, transformers fp32, 2 threads",
            },
        },
        "training": {**train_info, "sizes": {k: sizes[k] for k in SIZES}, "hp": HP, "topk": TOPK},
        "torch": torch.__version__,
    }
    (a.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    log(
        f"held-out top-1 agreement: pydoc {metrics['heldout_pydoc']['top1_agreement']:.4f}, "
        f"answers {metrics['heldout_answers']['top1_agreement']:.4f}; cost vs verifier: "
        f"FLOPs {f_draft / f_ver:.3f}, decode step {t_draft / t_ver:.3f} "
        f"({1e3 * t_draft:.2f} vs {1e3 * t_ver:.2f} ms); total {time.time() - t_start:.0f}s"
    )


if __name__ == "__main__":
    main()
