"""Train the SmolLM2 feature draft (models/smollm2/feature_draft): one decoder layer on the verifier's features.

    .venv/bin/python tools/train_smollm2_feature_draft.py   # ~33 min on 2 CPU cores (AMD Zen 5): 17 for the
                                                              # verifier's answers and features (cached), 16 for
                                                              # 16 epochs; about twice that on an older AVX2 core
    .venv/bin/python tools/train_smollm2_feature_draft.py --quick --out /tmp/fd   # smoke run

What it is (`bpcompile.runtime.model.FeatureDraft`, the EAGLE idea): the row of token x_i reads
fc([embedding(x_i), f_{i-1}]), f being the verifier's final hidden state after its norm, goes through one decoder
layer of the verifier's shape and predicts f_i; the verifier's own (tied) head turns that into a guess of x_{i+1}.
A standalone draft has to redo the verifier's understanding of the context from tokens alone (the shipped
2-layer draft agrees with it on 25-28% of held-out tokens); this one starts from it.

Training data are the verifier's own answers (through its chat template) to the ~510 instruction prompts built
from the train split of the builtin pydoc corpus, greedy and `--sampled` more at `--temperature` (more varied text;
the targets at every position are still the verifier's own features and distribution), plus that split in
256-token windows: what it will draft for. The
verifier's features and answers are computed once (fp32) and cached under .cache/ (git-ignored). Loss per row:
smooth-L1 between the predicted and the true feature plus `--ce` x cross-entropy of the head's distribution
against the verifier's over the proposable ids (soft targets, on 1024 random rows per batch: the head is most of
the cost); the input features get uniform noise (±0.1) so that deeper tree nodes, which read the draft's own
predictions, stay in range.

Held-out figures (<out>/metrics.json), on the verifier's greedy answers to 48 prompts from the held-out split:
top-1 agreement of the first drafted token (the true features in), and the conditional agreement at depth 2 and 3
where the draft reads its own predicted features (a chain's acceptance).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
import distill_smollm2_draft as distill  # noqa: E402  (this folder: the draft distiller's data helpers)

from bpcompile.compiler import corpus  # noqa: E402
from bpcompile.runtime.model import apply_rope, causal_attend, rms_norm  # noqa: E402

log, cached = distill.log, distill.cached

VERIFIER = ROOT / "models" / "smollm2" / "verifier"
OUT = ROOT / "models" / "smollm2" / "feature_draft"
HP = dict(epochs=16, batch=8, lr=1e-3, min_lr_frac=0.05, warmup=30, clip=0.5, noise=0.2, ce_rows=1024)
SIZES = dict(train_prompts=512, heldout_prompts=48, answer_tokens=96)
SAMPLED = 1
QUICK = dict(epochs=1, train_prompts=32, heldout_prompts=8, answer_tokens=32)


class Trainable(torch.nn.Module):
    """The FeatureDraft's arithmetic with trainable parameters (the runtime's modules are inference-only): the
    same fused qkv and gate/up layouts, so the weights save under the runtime's TensorRT-LLM names."""

    def __init__(self, vc, layers: int, inter: int, embed: torch.Tensor, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.H, self.NH, self.KV, self.D = vc.hidden_size, vc.num_attention_heads, vc.num_key_value_heads, vc.head_dim
        self.eps, self.inter, self.embed = vc.rms_norm_eps, inter, embed
        H, D = self.H, self.D
        self.fc = torch.nn.Linear(2 * H, H)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            b = torch.nn.Module()
            b.attn_norm, b.mlp_norm = torch.nn.Parameter(torch.ones(H)), torch.nn.Parameter(torch.ones(H))
            b.qkv = torch.nn.Linear(H, (self.NH + 2 * self.KV) * D, bias=False)
            b.o = torch.nn.Linear(self.NH * D, H, bias=False)
            b.gate_up = torch.nn.Linear(H, 2 * inter, bias=False)
            b.down = torch.nn.Linear(inter, H, bias=False)
            self.blocks.append(b)
        theta = vc.rope_parameters["rope_theta"] if hasattr(vc, "rope_parameters") else vc.rope_theta
        inv = 1.0 / (theta ** (torch.arange(0, D, 2).float() / D))
        fr = torch.arange(4096).float()[:, None] * inv
        e, sign = torch.cat((fr, fr), -1), torch.cat((-torch.ones(D // 2), torch.ones(D // 2)))
        self.register_buffer("cos", e.cos(), persistent=False)
        self.register_buffer("sin", e.sin() * sign, persistent=False)

    def forward(self, f: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """f [B,T,H] (feature before each token), x [B,T] -> predicted features [B,T,H]."""
        B, T = x.shape
        NH, KV, D = self.NH, self.KV, self.D
        h = self.fc(torch.cat((F.embedding(x, self.embed), f), -1))
        cos, sin = self.cos[:T][None, :, None], self.sin[:T][None, :, None]
        for b in self.blocks:
            qkv = b.qkv(rms_norm(h, b.attn_norm, self.eps))
            qk = apply_rope(qkv[..., : (NH + KV) * D].view(B, T, NH + KV, D), cos, sin)
            v = qkv[..., (NH + KV) * D :].view(B, T, KV, D)
            h = h + b.o(causal_attend(qk[:, :, :NH], qk[:, :, NH:], v).reshape(B, T, NH * D))
            gate, up = b.gate_up(rms_norm(h, b.mlp_norm, self.eps)).chunk(2, -1)
            h = h + b.down(F.silu(gate) * up)
        return h

    def runtime_weights(self) -> dict[str, torch.Tensor]:
        w = {"fc.weight": self.fc.weight, "fc.bias": self.fc.bias}
        for i, b in enumerate(self.blocks):
            p = f"transformer.layers.{i}."
            w.update(
                {
                    p + "input_layernorm.weight": b.attn_norm,
                    p + "post_layernorm.weight": b.mlp_norm,
                    p + "attention.qkv.weight": b.qkv.weight,
                    p + "attention.dense.weight": b.o.weight,
                    p + "mlp.fc.weight": b.gate_up.weight[: self.inter],
                    p + "mlp.gate.weight": b.gate_up.weight[self.inter :],
                    p + "mlp.proj.weight": b.down.weight,
                }
            )
        return {k: v.detach().float().contiguous() for k, v in w.items()}


@torch.no_grad()
def sampled_answers(
    verifier, tok, prompts: list[str], max_new: int, batch: int, temperature: float, seed: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of the verifier's answers sampled at `temperature` (ends at its end-of-turn)."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    torch.manual_seed(seed)
    out = []
    for i in range(0, len(prompts), batch):
        ps = [distill.chat_ids(tok, p) for p in prompts[i : i + batch]]
        L = max(map(len, ps))
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps])
        g = verifier.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        for b, p in enumerate(ps):
            ans = g[b, L:].tolist()
            out.append((p, ans[: ans.index(eos) + 1] if eos in ans else ans))
        log(f"  sampled answers {min(i + batch, len(prompts))}/{len(prompts)}")
    return out


@torch.no_grad()
def features(verifier, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, the verifier's final hidden states after its norm [T, H] in float16) per sequence."""
    out = []
    for i, s in enumerate(seqs):
        out.append((torch.tensor(s), verifier.model(torch.tensor([s])).last_hidden_state[0].half()))
        if (i + 1) % 100 == 0:
            log(f"  features {i + 1}/{len(seqs)}")
    return out


def shifted(f: torch.Tensor) -> torch.Tensor:
    """Row i reads the feature at i - 1 (zeros before the first token)."""
    return torch.cat((torch.zeros_like(f[:, :1]), f[:, :-1]), 1)


@torch.no_grad()
def evaluate(m: Trainable, head: torch.Tensor, ids: torch.Tensor, held: list) -> dict:
    """Agreement with the verifier's greedy tokens on held-out answers: depth 1 (true features in) over every
    answer position; depth 2 and 3 (the draft's own features in, given the depths before agreed) from every
    third position."""
    m.eval()
    hit, n = [0, 0, 0], [0, 0, 0]
    for (ids, f16), P in held:
        f, x, T = f16.float()[None], ids[None], len(ids)
        fin = shifted(f)
        guess = ids[(m(fin, x)[0] @ head[ids].T).argmax(-1)]  # row i -> x_{i+1}, among the proposable ids
        truth = (f[0] @ head.T).argmax(-1)
        hit[0] += int((guess[P - 1 : T - 1] == truth[P - 1 : T - 1]).sum())
        n[0] += T - P
        for t in range(P - 1, T - 3, 3):
            if guess[t] != truth[t]:
                continue
            fs, xs, tok = fin[:, : t + 1], x[:, : t + 1], guess[t]
            fprev = m(fs, xs)[:, -1:]
            for depth in (1, 2):
                fs, xs = torch.cat((fs, fprev), 1), torch.cat((xs, tok.view(1, 1)), 1)
                fprev = m(fs, xs)[:, -1:]
                tok = ids[(fprev[0, 0] @ head[ids].T).argmax()]
                n[depth] += 1
                if tok != truth[t + depth]:
                    break
                hit[depth] += 1
    m.train()
    return {"positions": n, "agreement": [round(h / max(1, c), 4) for h, c in zip(hit, n)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", type=Path, default=VERIFIER)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--ce", type=float, default=0.25, help="weight of the cross-entropy term")
    ap.add_argument(
        "--vocab",
        type=int,
        default=4096,
        help="token ids the draft may propose (0: all): the training text's tokens by count, then the "
        "lowest unseen ids",
    )
    ap.add_argument("--epochs", type=int, default=HP["epochs"])
    ap.add_argument(
        "--train-prompts",
        type=int,
        default=SIZES["train_prompts"],
        help="instruction prompts from the train split (it yields about 510)",
    )
    ap.add_argument(
        "--sampled",
        type=int,
        default=SAMPLED,
        metavar="K",
        help="also K sampled answers per train prompt (temperature --temperature): more varied text "
        "whose every position still carries the verifier's own features and distribution",
    )
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=4, metavar="N", help="held-out figures every N epochs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smoke run: few prompts, one epoch")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    sizes, hp = dict(SIZES, train_prompts=a.train_prompts), dict(HP, epochs=a.epochs)
    if a.quick:
        sizes.update({k: v for k, v in QUICK.items() if k in sizes})
        hp["epochs"] = QUICK["epochs"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    distill.quiet_transformers()
    tok = AutoTokenizer.from_pretrained(a.verifier)
    verifier = AutoModelForCausalLM.from_pretrained(a.verifier, dtype=torch.float32).eval()
    stamp = json.loads((a.verifier / "bpcompile-source.json").read_text()).get("gguf_sha256", "?")
    key = {"verifier": stamp, "corpus": corpus.fingerprint(), "answer_tokens": sizes["answer_tokens"]}
    train_p = distill.instruction_prompts(corpus.train_documents(), sizes["train_prompts"], a.seed)
    held_p = distill.instruction_prompts(corpus.heldout_documents(), sizes["heldout_prompts"], a.seed + 1)
    ans = cached(
        "fd-train-answers",
        dict(key, n=len(train_p), seed=a.seed),
        lambda: [(p, x) for p, x, _, _ in distill.teacher_answers(verifier, tok, train_p, sizes["answer_tokens"], 32)],
    )
    held = cached(
        "fd-held-answers",
        dict(key, n=len(held_p), seed=a.seed + 1),
        lambda: [(p, x) for p, x, _, _ in distill.teacher_answers(verifier, tok, held_p, sizes["answer_tokens"], 32)],
    )
    for j in range(a.sampled if not a.quick else 0):
        ans = ans + cached(
            "fd-train-sampled",
            dict(key, n=len(train_p), seed=a.seed, draw=j, t=a.temperature),
            lambda: sampled_answers(
                verifier, tok, train_p, sizes["answer_tokens"], 32, a.temperature, a.seed * 100 + j
            ),
        )
    windows = distill.corpus_windows(tok, corpus.train_documents())
    train = cached(
        "fd-train-features",
        dict(
            key, n=len(train_p), seed=a.seed, windows=len(windows), sampled=0 if a.quick else a.sampled, t=a.temperature
        ),
        lambda: features(verifier, [p + x for p, x in ans] + windows),
    )
    held_f = cached(
        "fd-held-features",
        dict(key, n=len(held_p), seed=a.seed + 1),
        lambda: list(zip(features(verifier, [p + x for p, x in held]), [len(p) for p, _ in held])),
    )
    head = verifier.lm_head.weight.detach()  # tied: also the embedding
    V = head.shape[0]
    counts = torch.bincount(torch.cat([s for s, _ in train]), minlength=V)
    ranked = sorted(range(V), key=lambda t: (-int(counts[t]), t))
    ids = torch.tensor(sorted(ranked[: a.vocab]) if 0 < a.vocab < V else list(range(V)))
    held_tokens = torch.tensor([t for _, x in held for t in x])
    coverage = float(torch.isin(held_tokens, ids).float().mean())
    log(f"vocabulary: {len(ids)} token ids proposed, covering {coverage:.2%} of the held-out answers' tokens")
    sub = head[ids]
    m = Trainable(verifier.config, a.layers, a.intermediate, verifier.model.embed_tokens.weight.detach(), a.seed)
    log(f"train: {len(train)} sequences, {sum(len(s) for s, _ in train)} positions; held-out: {len(held_f)} answers")
    opt = torch.optim.AdamW(m.parameters(), lr=hp["lr"], weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(a.seed)
    steps, k, t0, losses = hp["epochs"] * math.ceil(len(train) / hp["batch"]), 0, time.time(), []
    for ep in range(hp["epochs"]):
        order = list(range(len(train)))
        random.Random(a.seed * 1000 + ep).shuffle(order)
        tot = 0.0
        for i in range(0, len(order), hp["batch"]):
            items = [train[j] for j in order[i : i + hp["batch"]]]
            L = max(len(s) for s, _ in items)
            x, f, mask = (
                torch.zeros(len(items), L, dtype=torch.long),
                torch.zeros(len(items), L, m.H),
                torch.zeros(len(items), L),
            )
            for b, (s, ff) in enumerate(items):
                x[b, : len(s)], f[b, : len(s)], mask[b, : len(s)] = s, ff.float(), 1
            lr = (
                hp["lr"]
                * min(1.0, (k + 1) / hp["warmup"])
                * (hp["min_lr_frac"] + (1 - hp["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * k / steps)))
            )
            for g in opt.param_groups:
                g["lr"] = lr
            fin = shifted(f)
            pred = m(fin + (torch.rand_like(fin) - 0.5) * hp["noise"], x)
            reg = (F.smooth_l1_loss(pred, f, reduction="none").mean(-1) * mask).sum() / mask.sum()
            rows = mask.view(-1).nonzero()[:, 0]  # the head's cross-entropy on a random subset of rows: the
            rows = rows[torch.randperm(len(rows), generator=gen)[: hp["ce_rows"]]]  # 49152-wide head dominates cost
            with torch.no_grad():  # the verifier's distribution over the proposable ids (renormalised)
                target = F.softmax(f.view(-1, m.H)[rows] @ sub.T, -1)
            ce = -(target * F.log_softmax(pred.view(-1, m.H)[rows] @ sub.T, -1)).sum(-1).mean()
            loss = reg + a.ce * ce
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), hp["clip"])
            opt.step()
            k += 1
            tot += float(loss.detach())
            if k % 25 == 0:
                log(
                    f"epoch {ep + 1} step {k}/{steps}: smooth-L1 {reg.item():.4f}, CE {ce.item():.3f}, "
                    f"{time.time() - t0:.0f}s"
                )
        losses.append(round(tot / math.ceil(len(order) / hp["batch"]), 4))
        if (ep + 1) % a.eval_every == 0 and ep + 1 < hp["epochs"]:
            log(f"epoch {ep + 1}: held-out {evaluate(m, head, ids, held_f)}")
    train_s = time.time() - t0
    ev = evaluate(m, head, ids, held_f)
    from safetensors.torch import save_file

    a.out.mkdir(parents=True, exist_ok=True)
    w = m.runtime_weights()
    if len(ids) < V:
        w["vocab_subset"] = ids.to(torch.int64)
    save_file(w, str(a.out / "model.safetensors"))
    (a.out / "config.json").write_text(
        json.dumps(
            {"architecture": "FeatureDraft", "num_layers": a.layers, "intermediate_size": a.intermediate}, indent=1
        )
        + "\n"
    )
    params = sum(p.numel() for p in m.parameters())
    metrics = {
        "verifier": str(a.verifier.relative_to(ROOT)) if a.verifier.is_relative_to(ROOT) else str(a.verifier),
        "verifier_gguf_sha256": stamp,
        "corpus_fingerprint": corpus.fingerprint(),
        "seed": a.seed,
        "layers": a.layers,
        "intermediate_size": a.intermediate,
        "params": params,
        "vocab_subset": len(ids),
        "heldout_answers": dict(ev, prompts=len(held_f), vocab_coverage=round(coverage, 4)),
        "training": {
            "sequences": len(train),
            "positions": sum(len(s) for s, _ in train),
            "loss_per_epoch": losses,
            "train_seconds": round(train_s),
            "hp": hp,
            "ce": a.ce,
            "sizes": sizes,
            "sampled_answers_per_prompt": a.sampled,
            "temperature": a.temperature,
        },
        "torch": torch.__version__,
    }
    (a.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    log(f"wrote {a.out}: {params / 1e6:.1f}M parameters, held-out agreement by depth {ev['agreement']}")


if __name__ == "__main__":
    main()
