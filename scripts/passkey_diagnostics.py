"""Which part of the KV cache's error moves SmolLM2's passkey retrieval at 4k? Diagnostic experiments behind
docs/benchmarks/smollm2_pair.md §2 ("What moves the 4k departure"); each prints per-trial running counts, then
every row against FP16 KV on the same trials (paired difference, 95% paired-bootstrap interval).

    .venv/bin/python scripts/passkey_diagnostics.py sensitivity --engine ENGINE --length 4096 --trials 50 --seed 1
    .venv/bin/python scripts/passkey_diagnostics.py calibration --engine ENGINE --length 4096 --trials 50 --seed 1
    .venv/bin/python scripts/passkey_diagnostics.py noise --engine ENGINE --length 4096 --trials 50 --seed 1
    .venv/bin/python scripts/passkey_diagnostics.py heads --engine ENGINE --length 4096 --trials 50 --seed 1   # and --seed 2
    .venv/bin/python scripts/passkey_diagnostics.py candidates --engine ENGINE --length 4096 --trials 100 --seed 0   # and 2048, ...
    .venv/bin/python scripts/passkey_diagnostics.py window --engine engines/smollm2/1 --length 4096 --trials 50 --seed 0
    .venv/bin/python scripts/passkey_diagnostics.py budget --engine engines/smollm2/1 --length 4096 --trials 50 --seed 0
    .venv/bin/python scripts/passkey_diagnostics.py lowbits --engine engines/smollm2/1 --length 4096 --trials 50 --seed 0
    .venv/bin/python scripts/passkey_diagnostics.py lowbits-bands --engine engines/smollm2/1 --length 4096 --trials 50 --seed 0
    .venv/bin/python scripts/passkey_diagnostics.py lowbits-window --engine engines/smollm2/1 --trials 0
    .venv/bin/python scripts/passkey_diagnostics.py lowbits-drop --engine engines/smollm2/1 --length 4096 --trials 50 --seed 0
    .venv/bin/python scripts/passkey_diagnostics.py midbits --engine engines/smollm2/1 --length 4096 --trials 50 --seed 0
    .venv/bin/python scripts/passkey_diagnostics.py midbits-budget --engine engines/smollm2/1 --length 4096 --trials 50 --seed 0
    .venv/bin/python scripts/passkey_diagnostics.py int5-2k --engine engines/smollm2/2 --length 2048 --trials 200 --seed 0 --depth 0.2:0.6
    .venv/bin/python scripts/passkey_diagnostics.py two-bands --engine engines/smollm2/2 --length 2048 --trials 200 --seed 0 --depth 0.2:0.6 --no-fidelity
    .venv/bin/python scripts/passkey_diagnostics.py values-bands --engine engines/smollm2/3 --length 4096 --trials 48 --seed 0
    .venv/bin/python scripts/passkey_diagnostics.py engines --engine ENGINE --compare ENGINE2,ENGINE3 --length 4096 --trials 48 --seed 0

For the first five, the engine's plan is the one before retrieval units: build a version of recipes/smollm2.yaml with
`kv_cache: {outlier_fraction: 0.02, retrieval_fraction: 0}` (the rest auto: INT4 with 4 FP8 units and a
16-position window) and pass it with --engine; a plan with INT8 units is refused.

sensitivity: the engine's plan with parts (keys, values, a third of the layers) kept and the rest stored in INT8.
calibration: plans recalibrated on 8 x 1024 tokens and/or without INT4 clipping (outlier fraction 0.02, window 16).
noise: FP16 keys plus the plan's key error with random signs (same size, no structure), and the plan with each
stored key's logit lowered by half its noise variance (the softmax's bias under noise, E[exp(s+n)] = exp(s+var/2)).
The noise rows use their own attention over the plan's store (`NoiseDecoder`); its plain mode equals
`greedy_answer` through the plan (checked at 512 tokens).
heads: units ranked by retrieval_scores on 16 of eval's passkey prompts at 2k (seed 7, key teacher-forced); the
plan with the keys of the top 3 / 6 / 10 stored in INT8, with all, none or 2 of its FP8 units kept.
candidates: the top 3's keys in INT8 with 4, 3 or 2 FP8 units and windows 12, 14, 16 (each >= 3.5x allocated);
the last is what `bpcompile build recipes/smollm2.yaml` now calibrates (the same codes). Run with --seed 0, the
trials `bpcompile eval` draws. Seed 1 keeps these trials apart from `bpcompile eval`'s.

window and budget start from the default engine of the fifteenth to seventeenth sessions (INT8 retrieval keys, FP16
window 16; `bpcompile build recipes/smollm2.yaml` with `kv_cache: {int5_keys: none}` builds it)
and first print each row's fidelity on eval's 16 x 256 held-out windows (--trials 0: fidelity only):
window: the plan's exact window read for the keys only or for the values only (the other half read as stored), the
keys' window shortened to 4 or 8 positions, and the keys' window in one band of layers only (values' window
everywhere; fidelity only).
budget: plans recalibrated as the build does (its samples and retrieval probes) that trade the window against FP8
and INT8 units within 3.5x: window 32 / 24 / 16 / 14 / 12 with none, 2 FP8 or 3-7 INT8 units.

The lowbits experiments (also from that engine) ask whether the middle layers' keys in INT8, which the
thirteenth session's rows say keep the model's 4k behaviour, can be paid for by values below 4 bits. The format,
kernels and plugin have no such precision: `register_lowbit_values` adds 2- and 3-bit value codecs to the store's
registry in this process only, so these plans run through eval's own oracle (`greedy_answer`, `evaluate`).
lowbits: the keys of layers 10-19 in INT8 alone, with values in INT3, with INT3 and the least sensitive in INT2 to
3.5x, with INT2 to 3.5x (and those INT2 values under the default's keys; fidelity only for the INT2-only rows).
lowbits-bands: a narrower band of INT8 keys (11-18, 12-17, 13-16) paid for by INT3 values, each at 3.5x.
lowbits-window: the 10-19 band with INT3 values (absmax scale) and a window of 0, 2 or 4 positions to reach 3.5x.
lowbits-drop: the 10-19 band with INT3 values, the fewest of its keys back in INT4 that 3.5x takes, chosen by the
lowest retrieval score or the lowest Fisher error.
midbits: the keys of layers 10-19 in INT6 or INT5 instead of INT8 (values as the plan has them), and in INT5 with the
lowest-retrieval-score ones back in INT4 to 3.5x. INT5 is a precision of the format (code 3); INT6 is registered
here, process-local, like the 2- and 3-bit codecs.
midbits-budget: the keys of layers 10-19 in INT5 within 3.5x: with or without the plan's FP8 values, its other INT8
keys in INT5 or INT4, and the longest exact window that 3.5x leaves (`int5_band`). The second row (no FP8 values,
the other keys INT4, window 10) is what `bpcompile build recipes/smollm2.yaml` now calibrates (the same codes).
These two start from the engine of the previous default (3 INT8 retrieval keys, 2 FP8 units, window 16), built
with `kv_cache: {int5_keys: none}`.

int5-2k starts from the default engine with INT5 keys (`engines/smollm2/2`, what `bpcompile build
recipes/smollm2.yaml` builds now) and asks which keys move its 2k shortfall: the top 3 retrieval keys (by the
calibration's scores: L21.k2, L18.k2, L23.k0) in INT8, or only some of them, or L18.k2 in INT8 with the other two
in INT5, each with the longest window that keeps >= 3.5x (`finer_keys`); and, as diagnostics above 3.5x (window
10), the keys of layers 0-9, 10-19 or 20-29, or all values, in INT8, the keys of layers 0-9 in INT5, and those of
layers 0-4 or 5-9 in INT8.

--length takes several lengths (comma-separated) and --rows keeps only the named rows besides fp16. --depth A:B
keeps only the trials whose key lies at a depth in [A, B) of the filler (at 2k, the trials where FP16 KV and the
plans disagree lie at depths 0.3-0.6; nearer the end all retrieve, nearer the start nearly none do), so that a
screen costs half the trials; a count on those trials is not an accuracy over all of them.

values-bands starts from the twentieth session's default (`engines/smollm2/3`: the keys of layers 0-9 INT6 and
10-19 INT5, the 68 least sensitive values INT3, window 16), which over-retrieved at 4k, and asks whether its INT3
values are why: the values of layers 10-19 back in INT4 and every other value in INT3 (the longest window that keeps
3.5x), and, as a diagnostic, its values under the INT5-keys default's keys (layers 0-9 INT4).

late-keys starts from the INT5-keys default (`engines/smollm2/2`) and pays for the first third's keys in INT6 with
the last third's keys in INT3 (4k and 2k retrieval did not move with those keys in INT8) and a third of the values
in INT3 (those of layers 0-9 or 20-29), with the longest window that keeps 3.5x.

engines: rows are whole plans as `bpcompile build` calibrated them: the --engine version's and those of the
versions named by --compare (e.g. recipes/smollm2.yaml with another `recent_window` or `int3_values`), so that a
screen measures exactly what a recipe would ship.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from copy import deepcopy
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bpcompile.compiler.calibrate import KVCalibConfig, measure_units, plan_from_measurement, retrieval_scores  # noqa: E402
from bpcompile.compiler.corpus import calibration_samples  # noqa: E402
from bpcompile.eval import evaluate as E  # noqa: E402
from bpcompile.runtime.kvcache import KVPlan, make_kv_store  # noqa: E402
from bpcompile.runtime.model import Llama  # noqa: E402


def passkey_probes(tok, length: int, trials: int, seed: int) -> list[dict]:
    """eval's passkey prompts with the key teacher-forced, as retrieval probes (calibrate.retrieval_scores): the
    key's copies in the prompt are found by search."""
    out = []
    for t in E.passkey_trials(tok, length, trials, seed):
        ids, P, ks = t["ids"], t["prompt_len"], t["key_start"]
        key = ids[ks:]
        needle = sorted({j + i for j in range(P - len(key)) if ids[j : j + len(key)] == key for i in range(len(key))})
        out.append({"ids": ids, "needle": needle, "answer": list(range(ks, len(ids)))})
    return out


def with_units(plan: KVPlan, units, precision: str = "int8", keep_fp8: int | None = None) -> KVPlan:
    """plan with the keys of each (layer, head) in units stored in `precision`; keep_fp8: only that many of its
    FP8 units (the first by the calibration's loss-based order) stay FP8, the others go to INT4 at the clip
    ratio calibration found for them."""
    p = deepcopy(plan)
    if keep_fp8 is not None:
        fp8 = sorted(
            (
                (u["fisher_error"], lay["layer"], u["kind"], u["head"], u["clip"])
                for lay in plan.calibration["layers"]
                for u in lay["units"]
                if u["precision"] == "fp8"
            ),
            reverse=True,
        )
        for _, layer, kv, head, clip in fp8[keep_fp8:]:
            p.precision[layer][kv][head] = "int4"
            p.int4_clip[layer, 0 if kv == "k" else 1, head] = clip
    for layer, head in units:
        p.precision[layer]["k"][head] = precision
    return p


def keep_only(plan: KVPlan, pred) -> KVPlan:
    """plan with the units where pred(layer, 'k'|'v') holds as they are, the others stored in INT8."""
    p = deepcopy(plan)
    for layer in range(p.num_layers):
        for kv in ("k", "v"):
            if not pred(layer, kv):
                p.precision[layer][kv] = ["int8"] * p.num_kv_heads
    return p


class NoiseDecoder:
    """Greedy decode after a prefilled prompt through `plan`'s store, with the attention written out so that the
    key logits can be changed. mode: 'plain' (what the plan reads), 'corr' (each non-exact logit lowered by
    half of sum_d (q_d / sqrt(D))^2 e_jd^2, e = stored key - exact key), 'signflip' (the exact key plus e with
    random signs; values as stored)."""

    def __init__(self, verifier, prefix_kv, plan, max_new, mode):
        self.v, self.plan, self.mode, self.n = verifier, plan, mode, prefix_kv[0][0].shape[0]
        self.store = make_kv_store(plan, verifier.cfg, math.ceil((self.n + max_new) / E.PAGE), E.PAGE, "cpu")
        self.g = torch.Generator().manual_seed(1234)
        pr = torch.arange(self.n)
        self.kv, self.rd = [], []
        for layer, (k, v) in enumerate(prefix_kv):
            self.store.write(layer, pr, k, v, pr)
            self.kv.append([k, v])
            self.rd.append(list(self._read(layer, pr, k)))

    def _read(self, layer, slots, k):
        kh, vh = (x.float() for x in self.store.read(layer, slots))
        if self.mode == "signflip":
            e = kh - k
            kh = k + e * (torch.randint(0, 2, e.shape, generator=self.g).float() * 2 - 1)
        return kh, vh

    def step(self, tokens):
        N = self.n + len(tokens)
        slots, new = torch.arange(N), torch.arange(self.n, N)
        visible = slots[None, :] <= new[:, None]
        ex = E.exact_reads(new, slots, self.plan.sink_tokens, self.plan.recent_window) & visible  # [T, N]

        def attend(layer, q, k, v):
            self.store.write(layer, new, k[0], v[0], new)
            kv, rd = self.kv[layer], self.rd[layer]
            kv[0], kv[1] = torch.cat([kv[0], k[0]]), torch.cat([kv[1], v[0]])
            kh, vh = self._read(layer, new, k[0])
            rd[0], rd[1] = torch.cat([rd[0], kh]), torch.cat([rd[1], vh])
            H, D = q.shape[2], q.shape[3]
            rep = H // kv[0].shape[1]
            R = lambda x: x.repeat_interleave(rep, 1)  # noqa: E731  [N, KV, D] -> [N, H, D]
            ke, ve = (x.half().float() for x in kv)  # the exact copies are FP16
            qs = q[0] * D**-0.5
            s_q = torch.einsum("thd,nhd->htn", qs, R(rd[0]))
            if self.mode == "corr":
                s_q = s_q - 0.5 * torch.einsum("thd,nhd->htn", qs * qs, R((rd[0] - ke) ** 2))
            s_e = torch.einsum("thd,nhd->htn", qs, R(ke))
            p = torch.softmax(torch.where(ex[None], s_e, s_q).masked_fill(~visible[None], float("-inf")), -1)
            return (
                torch.einsum("htn,nhd->thd", p * ~ex[None], R(rd[1]))
                + torch.einsum("htn,nhd->thd", p * ex[None], R(ve))
            )[None]

        out = self.v.forward(torch.tensor([tokens]), new[None], attend=attend)[0]
        self.n = N
        return out


def noise_answer(verifier, kv, prefix, plan, mode, tokens=E.PASSKEY_ANSWER_TOKENS):
    dec = NoiseDecoder(verifier, kv, plan, len(prefix) + tokens, mode)
    out = [int(dec.step(prefix)[-1].argmax())]
    while len(out) < tokens:
        out.append(int(dec.step(out[-1:])[-1].argmax()))
    return out


def split_window(keys, values, key_window=None):
    """A stand-in for eval's attend_exact (the reference attention over a plan with exact entries) that reads the
    exact copies for the keys only where keys(layer) holds and for the values only where values(layer) holds; the
    other half of each window entry is read as stored. key_window: the keys' window is only that many positions
    (the values' stays the plan's). eval calls attention once per layer in order (prefill of
    a batch, then each decode step), so a call counter modulo the layer count is the layer."""
    calls = [0]

    def attend(q, kh, vh, k, v, plan, q_pos, k_pos, visible):
        layer = calls[0] % plan.num_layers
        calls[0] += 1
        ex = E.exact_reads(q_pos, k_pos, plan.sink_tokens, plan.recent_window) & visible  # [T, N]
        exk = E.exact_reads(q_pos, k_pos, plan.sink_tokens, key_window) & visible if key_window is not None else ex
        exk, exv = (x if use(layer) else torch.zeros_like(x) for x, use in ((exk, keys), (ex, values)))
        rep = q.shape[2] // k.shape[2]
        R = lambda x: x.repeat_interleave(rep, 2)  # noqa: E731  [B, N, KV, D] -> [B, N, H, D]
        ke, ve = (x.half().to(q.dtype) for x in (k, v))  # the exact copies are FP16
        qs = q * q.shape[-1] ** -0.5
        s = torch.where(
            exk[None], torch.einsum("bthd,bnhd->bhtn", qs, R(ke)), torch.einsum("bthd,bnhd->bhtn", qs, R(kh))
        )
        p = torch.softmax(s.masked_fill(~visible[None], float("-inf")), -1)
        return (
            torch.einsum("bhtn,bnhd->bthd", p * ~exv[None], R(vh))
            + torch.einsum("bhtn,bnhd->bthd", p * exv[None], R(ve))
        ).to(q.dtype)

    return attend


def register_lowbit_values() -> None:
    """Register 2- and 3-bit unit precisions in the store's registry for this process only: a uniform grid without
    a zero, (n - (2^b - 1) / 2) * s, n = 0 .. 2^b - 1, packed (3 bytes per 8 levels for 3 bits), one fp16 scale per
    group set from the group's RMS to the step that minimizes a Gaussian's squared error (0.996 and 0.586 sigma):
    "int2" and "int3-rms" (the seventeenth session's "int3"). After the Hadamard rotation a value group of 64 is
    close to Gaussian, so an RMS scale beats an absmax one at so few levels. "int3-absmax": the 3-bit grid with
    s = 0.8 absmax / 3.5 instead, the same squared error on a Gaussian group of 64 (0.035 sigma^2) and the form a
    kernel can compute bit for bit (a maximum does not depend on the order of a reduction). The format's own "int3"
    (code 5) is that grid too, rounding to the nearest level by floor(x / s) + 4 (equal but on cell boundaries) with
    s = fp16(0.8 amax / 3.5) (int3-absmax multiplies amax by 0.8 / 3.5: the same but in the last bit); "int6" is
    the format's (code 4)."""
    from bpcompile.runtime import kvcache as C

    def codec(bits, step):
        top = 2**bits - 1

        def encode(x, group_size, clip, decoded):
            xg = C._groups(x.float(), group_size)
            if step is None:  # absmax x 0.8 / 3.5: as good on a Gaussian group of 64, and order-exact in a kernel
                s = C.fp16_scale(xg.abs().amax(-1) * (0.8 / (top / 2)))
            else:
                s = C.fp16_scale(xg.pow(2).mean(-1).sqrt() * step)
            n = (C._divide(xg, s) + top / 2).round().clamp(0, top).reshape(x.shape).to(torch.int32)
            payload = pack(n)
            return payload, s, decode(payload, s, group_size) if decoded else None

        def pack(n):
            if bits == 2:
                h = n.shape[-1] // 4
                return (n[..., :h] | n[..., h : 2 * h] << 2 | n[..., 2 * h : 3 * h] << 4 | n[..., 3 * h :] << 6).to(
                    torch.uint8
                )
            w = (n.reshape(*n.shape[:-1], -1, 8) << (3 * torch.arange(8, device=n.device))).sum(-1)
            return torch.stack([(w >> (8 * i)) & 255 for i in range(3)], -1).reshape(*n.shape[:-1], -1).to(torch.uint8)

        def decode(payload, scales, group_size):
            b = payload.to(torch.int32)
            if bits == 2:
                n = torch.cat([(b >> (2 * i)) & 3 for i in range(4)], -1)
            else:
                w = (b.reshape(*b.shape[:-1], -1, 3) << (8 * torch.arange(3, device=b.device))).sum(-1)
                n = torch.stack([(w >> (3 * i)) & 7 for i in range(8)], -1).reshape(*b.shape[:-1], -1)
            q = n.float() - top / 2
            return (C._groups(q, group_size) * scales.float()[..., None]).reshape(q.shape)

        return encode, decode

    if "int2" in C.PRECISION_CODES:
        return
    new = []
    for code, (name, bits, step) in enumerate(
        (("int2", 2, 0.996), ("int3-rms", 3, 0.586), ("int3-absmax", 3, None)), start=len(C.PRECISIONS)
    ):
        enc, dec = codec(bits, step)
        new.append(C.UnitPrecision(name, code, torch.uint8, lambda d, b=bits: d * b // 8, enc, dec))
    C.PRECISIONS = C.PRECISIONS + tuple(new)
    for prec in new:
        C.BY_CODE[prec.code], C.PRECISION_CODES[prec.name] = prec, prec.code


def lowbit_values(
    plan: KVPlan, cfg, key_layers, precision: str, base: str = "int4", window: int | None = None, keep_fp8: bool = True
) -> KVPlan:
    """plan with the keys of key_layers in INT8, its INT4 value units in `base` and, least sensitive first (the
    calibration's fisher_error at INT4), as many of them in `precision` as it takes to get back to >= 3.5x
    allocated. window: another exact window; keep_fp8=False: its FP8 units in INT4 (keys) or `base` (values)."""
    p = with_units(
        plan, [(layer, h) for layer in key_layers for h in range(plan.num_kv_heads)], keep_fp8=None if keep_fp8 else 0
    )
    if window is not None:
        p.recent_window = window
    for layer in p.precision:
        layer["v"] = [base if x == "int4" else x for x in layer["v"]]
    if precision == base:
        return p
    values = sorted(
        (u["fisher_error"], lay["layer"], u["head"])
        for lay in plan.calibration["layers"]
        for u in lay["units"]
        if u["kind"] == "v" and u["precision"] == "int4"
    )
    for _, layer, head in values:
        if E.allocated_compression(p, cfg) >= 3.5:
            break
        p.precision[layer]["v"][head] = precision
    return p


def int5_band(plan: KVPlan, cfg, extra_keys=(), fp8_values: bool = True) -> KVPlan:
    """plan with the keys of layers 10-19 and of extra_keys [(layer, head)] in INT5; its other INT8 keys in INT4
    (at the clip calibration found for them) and, unless fp8_values, its FP8 values too; then the longest exact
    window (multiple of 2, at most 16) that keeps >= 3.5x allocated."""
    band = [(layer, h) for layer in range(10, 20) for h in range(plan.num_kv_heads)]
    p = with_units(plan, band + list(extra_keys), "int5")
    for lay in plan.calibration["layers"]:
        for u in lay["units"]:
            layer, kv, h = lay["layer"], u["kind"], u["head"]
            if p.precision[layer][kv][h] == "int8" or (p.precision[layer][kv][h] == "fp8" and not fp8_values):
                p.precision[layer][kv][h] = "int4"
                p.int4_clip[layer, 0 if kv == "k" else 1, h] = u["clip"]
    return longest_window(p, cfg, step=2)


def longest_window(p: KVPlan, cfg, step: int = 1) -> KVPlan:
    """p with the longest exact window (at most 16, a multiple of step) that keeps >= 3.5x allocated (in place)."""
    for window in range(16, -1, -step):
        p.recent_window = window
        if E.allocated_compression(p, cfg) >= 3.5:
            break
    return p


def finer_keys(plan: KVPlan, cfg, keys) -> KVPlan:
    """plan with each (layer, head, precision) of keys stored in that precision, then the longest exact window
    (at most 16) that keeps >= 3.5x allocated."""
    p = deepcopy(plan)
    for layer, head, prec in keys:
        p.precision[layer]["k"][head] = prec
    return longest_window(p, cfg)


def patched(attend, fn):
    """fn with eval's attend_exact replaced by `attend` while it runs."""

    def run(*args):
        orig, E.attend_exact = E.attend_exact, attend
        try:
            return fn(*args)
        finally:
            E.attend_exact = orig

    return run


def fidelity(v, tok_dir, plans: dict, attends: dict) -> None:
    """eval's fidelity rows (16 x 256 held-out windows, FP16 KV the reference) of each plan, through its attention."""
    from bpcompile.compiler.corpus import text_windows

    windows = text_windows(tok_dir / "tokenizer.json", E._text(None)[0], 256, 16, 0, "eval text")
    base = E.evaluate(v, {"fp16": "fp16"}, windows)["rows"][0]["ppl"]
    for name, p in plans.items():
        r = patched(attends.get(name, E.attend_exact), E.evaluate)(v, {name: p}, windows)
        x = r["rows"][-1]
        print(
            f"{name}: {E.allocated_compression(p, v.cfg):.3f}x, ppl {x['ppl']:.3f} ({x['ppl'] / base - 1:+.2%} vs FP16 KV), "
            f"top-1 {x['top1_agreement']:.2%}, KL {x['kl_vs_fp16']:.5f}",
            flush=True,
        )


# the experiments that start from the previous default engine (INT8 retrieval keys and an exact window)
FROM_DEFAULT = (
    "window",
    "budget",
    "lowbits",
    "lowbits-bands",
    "lowbits-window",
    "lowbits-drop",
    "midbits",
    "midbits-budget",
)
# the experiments that start from the default with INT5 keys
FROM_INT5 = ("int5-2k", "two-bands")
# the experiment whose rows are other engine versions' own plans (as `bpcompile build` calibrated them)
ENGINES = ("engines",)
# the experiment that starts from the default with INT6 keys and INT3 values
FROM_INT3 = ("values-bands",)
# the experiment that starts from the INT5-keys default and pays for INT6 keys in the first third with 3-bit units
FROM_INT5_INT3 = ("late-keys",)


def depth_range(text: str) -> tuple[float, float]:
    """--depth A:B -> (A, B), with 0 <= A < B <= 1 (B = 1 takes the trials at depth 1 too)."""
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (two depths in [0, 1]), got {text!r}") from None
    if not 0.0 <= lo < hi <= 1.0:
        raise argparse.ArgumentTypeError(f"expected 0 <= A < B <= 1, got {text!r}")
    return lo, hi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "experiment",
        choices=("sensitivity", "calibration", "noise", "heads", "candidates")
        + FROM_DEFAULT
        + FROM_INT5
        + ENGINES
        + FROM_INT3
        + FROM_INT5_INT3,
    )
    ap.add_argument(
        "--engine",
        required=True,
        help="engine version: the plan before retrieval units (window, budget: the default engine)",
    )
    ap.add_argument("--length", default="4096", help="prompt length in tokens, or several, comma-separated")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first SKIP of the trials (run earlier)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default=None, help="only these rows besides fp16 (exact names, ;-separated)")
    ap.add_argument("--no-fidelity", dest="fidelity", action="store_false", help="skip the held-out fidelity rows")
    ap.add_argument(
        "--depth", default=None, type=depth_range, help="only the trials whose key depth is in [A, B), as A:B"
    )
    ap.add_argument(
        "--compare", default="", help="engines: more engine versions whose plans are rows (comma-separated)"
    )
    ap.add_argument("--out", default=None, help="write the per-trial outcomes here (JSON)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    d = Path(a.engine)
    v = Llama.from_checkpoint(d / "verifier", dtype=None)
    tok = AutoTokenizer.from_pretrained(d / "tokenizer")
    plan = KVPlan.load(d / "kv_plan")
    has_int8 = any(x == "int8" for layer in plan.precision for x in layer["k"] + layer["v"])
    if a.experiment in FROM_DEFAULT and not (has_int8 and plan.recent_window):
        ap.error(
            f"{d}: {a.experiment} starts from the plan before INT5 keys (INT8 retrieval keys and an exact window: "
            "build recipes/smollm2.yaml with kv_cache: {int5_keys: none})"
        )
    has_int5 = any(x == "int5" for layer in plan.precision for x in layer["k"])
    if a.experiment in FROM_INT3 and not any(x == "int3" for layer in plan.precision for x in layer["v"]):
        ap.error(f"{d}: {a.experiment} starts from the default plan with INT3 values (engines/smollm2/3)")
    if a.experiment not in ENGINES + FROM_INT3 and (a.experiment in FROM_INT5 + FROM_INT5_INT3) != has_int5:
        ap.error(
            f"{d}: {a.experiment} "
            + (
                "starts from the default plan with INT5 keys (engines/smollm2/2)"
                if a.experiment in FROM_INT5
                else "starts from a plan without INT5 keys"
            )
        )
    if a.experiment not in FROM_DEFAULT + FROM_INT5 + ENGINES + FROM_INT3 and has_int8:
        ap.error(f"{d}: its plan already has INT8 (retrieval) units; the experiments start from the plan before them")
    show = fidelity if a.fidelity else (lambda *args: None)
    greedy = lambda p: lambda kv, prefix: E.greedy_answer(v, kv, prefix, p, E.PASSKEY_ANSWER_TOKENS)  # noqa: E731
    rows = {"fp16": greedy(E._as_plans(v, {"f": "fp16"})["f"])}

    def screen(plans: dict) -> None:
        """Each plan's allocation and window, its held-out rows (unless --no-fidelity), then a passkey row."""
        for name, p in plans.items():
            print(f"{name}: {E.allocated_compression(p, v.cfg):.3f}x, window {p.recent_window}", flush=True)
        show(v, d / "tokenizer", plans, {})
        for name, p in plans.items():
            rows[name] = greedy(p)

    if a.experiment == "sensitivity":
        for name, p in {
            "int8": "int8",
            "plan": plan,
            "plan, keys only": keep_only(plan, lambda layer, kv: kv == "k"),
            "plan, values only": keep_only(plan, lambda layer, kv: kv == "v"),
            "plan, layers 0-9 only": keep_only(plan, lambda layer, kv: layer < 10),
            "plan, layers 10-19 only": keep_only(plan, lambda layer, kv: 10 <= layer < 20),
            "plan, layers 20-29 only": keep_only(plan, lambda layer, kv: layer >= 20),
        }.items():
            rows[name] = greedy(E._as_plans(v, {name: p})[name])
    elif a.experiment == "candidates":  # the plans within the 3.5x budget that keep the top 3's keys in INT8
        top = [(21, 2), (18, 2), (23, 0)]  # "heads" order on SmolLM2-135M-Instruct
        for name, p in {
            "4 FP8 units, window 12": replace(with_units(plan, top), recent_window=12),
            "3 FP8 units, window 14": replace(with_units(plan, top, keep_fp8=3), recent_window=14),
            "2 FP8 units, window 16": with_units(plan, top, keep_fp8=2),
        }.items():
            print(f"{name}: {E.allocated_compression(p, v.cfg):.3f}x", flush=True)
            rows[name] = greedy(p)
    elif a.experiment == "window":
        every = lambda layer: True  # noqa: E731
        parts = {
            "plan, window for keys only": split_window(every, lambda layer: False),
            "plan, window for values only": split_window(lambda layer: False, every),
            "plan, keys' window 4 positions": split_window(every, every, key_window=4),
            "plan, keys' window 8 positions": split_window(every, every, key_window=8),
        }
        bands = {
            f"plan, keys' window in layers {lo}-{hi - 1} only": split_window(
                lambda layer, lo=lo, hi=hi: lo <= layer < hi, every
            )
            for lo, hi in ((0, 10), (10, 20), (20, 30), (0, 15), (15, 30))
        }
        show(v, d / "tokenizer", {"plan": plan} | {n: plan for n in parts | bands}, parts | bands)
        rows["plan"] = greedy(plan)
        for name, att in parts.items():
            rows[name] = patched(att, greedy(plan))
    elif a.experiment == "budget":  # recalibrated as the build does, other trades within 3.5x
        from bpcompile.compiler.calibrate import RETRIEVAL_PROBE_LENGTH, RETRIEVAL_PROBES, recipe_samples
        from bpcompile.compiler.corpus import retrieval_probes

        samples = recipe_samples(d / "tokenizer", {"samples": 16, "length": 128})
        sc = retrieval_scores(
            v,
            retrieval_probes(
                d / "tokenizer", samples, RETRIEVAL_PROBES, min(RETRIEVAL_PROBE_LENGTH, v.cfg.max_position_embeddings)
            ),
        )
        m = measure_units(v, samples, KVCalibConfig(outlier_fraction=0.01, group_size=64))
        plans, U = {}, 2 * v.cfg.num_layers * v.cfg.num_kv_heads
        for window, fp8, int8 in (
            (16, 0.01, 3),
            (32, 0, 0),
            (24, 0.01, 0),
            (24, 0, 3),
            (16, 0, 5),
            (14, 0, 6),
            (12, 0, 7),
        ):
            name = f"window {window}, {round(fp8 * U)} FP8, {int8} INT8 units"
            plans[name] = plan_from_measurement(
                m, v.cfg, fp8, recent_window=window, retrieval=sc, retrieval_fraction=int8 / U
            )[0]
        show(v, d / "tokenizer", plans, {})
        for name, p in plans.items():
            rows[name] = greedy(p)
    elif a.experiment == "lowbits":  # near-INT8 keys where retrieval moves, paid for by values below 4 bits
        register_lowbit_values()
        middle, K = range(10, 20), "plan, keys of layers 10-19 in INT8"
        plans = {
            K: lowbit_values(plan, v.cfg, middle, "int4"),
            f"{K}, values in INT3": lowbit_values(plan, v.cfg, middle, "int3-rms", base="int3-rms"),
            f"{K}, values in INT3, the least sensitive in INT2 to 3.5x": lowbit_values(
                plan, v.cfg, middle, "int2", base="int3-rms"
            ),
            f"{K}, values in INT2 to 3.5x": lowbit_values(plan, v.cfg, middle, "int2"),
        }
        controls = deepcopy(plan)  # the last row's values, the default plan's keys
        for layer, lay in enumerate(plans[f"{K}, values in INT2 to 3.5x"].precision):
            controls.precision[layer]["v"] = list(lay["v"])
        plans["plan, values in INT2 as in the last row, keys as stored"] = controls
        for name, p in plans.items():
            n = {c: sum(x == c for layer in p.precision for x in layer["v"]) for c in ("int3-rms", "int2")}
            print(f"{name}: value units {n}", flush=True)
        show(v, d / "tokenizer", plans, {})
        rows["plan"] = greedy(plan)
        for name in list(plans)[:3]:  # the INT2-only rows fail the held-out bars
            rows[name] = greedy(plans[name])
    elif a.experiment == "lowbits-bands":  # within 3.5x: INT8 keys in a narrower band, values INT3 to pay
        register_lowbit_values()
        plans = {}
        for lo, hi in ((11, 19), (12, 18), (13, 17)):
            p = plans[f"plan, keys of layers {lo}-{hi - 1} in INT8, values in INT3 to 3.5x"] = lowbit_values(
                plan, v.cfg, range(lo, hi), "int3-rms"
            )
            print(
                f"layers {lo}-{hi - 1}: value units in INT3",
                sum(x == "int3-rms" for layer in p.precision for x in layer["v"]),
                flush=True,
            )
        show(v, d / "tokenizer", plans, {})
        for name, p in plans.items():
            rows[name] = greedy(p)
    elif (
        a.experiment == "lowbits-window"
    ):  # within 3.5x: the keys of layers 10-19 in INT8, values in INT3, a shorter window
        register_lowbit_values()
        K = "plan, keys of layers 10-19 in INT8, values in INT3"
        plans = {f"{K} (absmax scale)": lowbit_values(plan, v.cfg, range(10, 20), "int3-absmax", base="int3-absmax")}
        for window, fp8 in ((0, True), (2, False), (4, False)):
            plans[f"{K} (absmax scale), window {window}{'' if fp8 else ', no FP8 units'}"] = lowbit_values(
                plan, v.cfg, range(10, 20), "int3-absmax", base="int3-absmax", window=window, keep_fp8=fp8
            )
        show(v, d / "tokenizer", plans, {})
        for name in list(plans)[1:]:
            rows[name] = greedy(plans[name])
    elif a.experiment == "lowbits-drop":  # within 3.5x: values in INT3, the keys of layers 10-19 in INT8 but the
        # fewest of them back in INT4 that it takes, the least retrieving or the least sensitive first
        register_lowbit_values()
        units = {
            (lay["layer"], u["head"]): u
            for lay in plan.calibration["layers"]
            for u in lay["units"]
            if u["kind"] == "k" and 10 <= lay["layer"] < 20
        }
        plans = {}
        for by in ("retrieval_score", "fisher_error"):
            p = lowbit_values(plan, v.cfg, range(10, 20), "int3-absmax", base="int3-absmax")
            dropped = []
            for key in sorted(units, key=lambda x: units[x][by]):
                if E.allocated_compression(p, v.cfg) >= 3.5:
                    break
                if plan.precision[key[0]]["k"][key[1]] == "int4":  # the plan's own FP8 / INT8 keys stay
                    p.precision[key[0]]["k"][key[1]] = "int4"
                    dropped.append(f"L{key[0]}.k{key[1]}")
            print(f"by {by}: keys back in INT4", dropped, flush=True)
            plans[
                f"plan, keys of layers 10-19 in INT8 but the lowest {by} back in INT4, values in INT3 (absmax scale)"
            ] = p
        show(v, d / "tokenizer", plans, {})
        for name, p in plans.items():
            rows[name] = greedy(p)
    elif a.experiment == "midbits":  # the keys of layers 10-19 in 5 or 6 bits instead of 8, values as they are
        register_lowbit_values()
        band = [(layer, h) for layer in range(10, 20) for h in range(plan.num_kv_heads)]
        plans = {f"plan, keys of layers 10-19 in {b.upper()}": with_units(plan, band, b) for b in ("int6", "int5")}
        score = {
            (lay["layer"], u["head"]): u["retrieval_score"]
            for lay in plan.calibration["layers"]
            for u in lay["units"]
            if u["kind"] == "k"
        }
        p, dropped = with_units(plan, band, "int5"), []
        for key in sorted((k for k in band if plan.precision[k[0]]["k"][k[1]] == "int4"), key=score.get):
            if E.allocated_compression(p, v.cfg) >= 3.5:
                break
            p.precision[key[0]]["k"][key[1]] = "int4"
            dropped.append(f"L{key[0]}.k{key[1]}")
        plans["plan, keys of layers 10-19 in INT5 but the lowest retrieval scores back in INT4 to 3.5x"] = p
        print("keys back in INT4:", dropped, flush=True)
        for name, p in plans.items():
            print(f"{name}: {E.allocated_compression(p, v.cfg):.3f}x", flush=True)
        show(v, d / "tokenizer", plans, {})
        for name, p in plans.items():
            rows[name] = greedy(p)
    elif a.experiment == "midbits-budget":  # INT5 keys in layers 10-19 within 3.5x: what else stays, which window
        register_lowbit_values()
        plans = {}
        for extra, fp8, what in (
            ((), True, "FP8 values kept"),
            ((), False, "no FP8 values"),
            (((21, 2), (23, 0)), True, "retrieval keys L21.k2 L23.k0 in INT5, FP8 values kept"),
            (((21, 2), (23, 0)), False, "retrieval keys L21.k2 L23.k0 in INT5, no FP8 values"),
        ):
            p = int5_band(plan, v.cfg, extra, fp8)
            plans[f"keys of layers 10-19 in INT5, {what}, window {p.recent_window}"] = p
        for name, p in plans.items():
            print(f"{name}: {E.allocated_compression(p, v.cfg):.3f}x", flush=True)
        show(v, d / "tokenizer", plans, {})
        for name, p in plans.items():
            rows[name] = greedy(p)
    elif a.experiment == "int5-2k":  # which keys move the INT5 default's 2k shortfall
        top3 = [(21, 2), (18, 2), (23, 0)]  # the calibration's retrieval order on SmolLM2-135M-Instruct
        plans = {
            "plan": plan,
            "top 3 retrieval keys INT8": finer_keys(plan, v.cfg, [(x, h, "int8") for x, h in top3]),
            "L21.k2 L23.k0 INT8": finer_keys(plan, v.cfg, [(21, 2, "int8"), (23, 0, "int8")]),
            "L18.k2 INT8": finer_keys(plan, v.cfg, [(18, 2, "int8")]),
            "L18.k2 L21.k2 INT8": finer_keys(plan, v.cfg, [(18, 2, "int8"), (21, 2, "int8")]),
            "L18.k2 INT8, L21.k2 L23.k0 INT5": finer_keys(
                plan, v.cfg, [(18, 2, "int8"), (21, 2, "int5"), (23, 0, "int5")]
            ),
        }
        for name, (layers, kv, prec) in {
            "keys of layers 0-9 INT8": (range(0, 10), "k", "int8"),
            "keys of layers 10-19 INT8": (range(10, 20), "k", "int8"),
            "keys of layers 20-29 INT8": (range(20, 30), "k", "int8"),
            "values INT8": (range(30), "v", "int8"),
            "keys of layers 0-9 INT5": (range(0, 10), "k", "int5"),
            "keys of layers 0-4 INT8": (range(0, 5), "k", "int8"),
            "keys of layers 5-9 INT8": (range(5, 10), "k", "int8"),
        }.items():
            p = deepcopy(plan)
            for layer in layers:
                p.precision[layer][kv] = [prec] * p.num_kv_heads
            plans[name] = p
        screen(plans)
    elif a.experiment == "two-bands":  # both bands of finer keys (2k: layers 0-9, 4k: 10-19), paid for by INT3 values
        plans = {"plan": plan}
        for name, bands in {
            "keys of layers 0-19 INT6, values INT3": ((range(0, 20), "int6"),),
            "keys of layers 0-9 INT6, values INT3": ((range(0, 10), "int6"),),
            "keys of layers 0-9 INT5, values INT3": ((range(0, 10), "int5"),),
        }.items():
            p = finer_keys(
                plan, v.cfg, [(x, h, prec) for layers, prec in bands for x in layers for h in range(plan.num_kv_heads)]
            )
            for layer in p.precision:
                layer["v"] = ["int3" if x == "int4" else x for x in layer["v"]]
            plans[name] = longest_window(p, v.cfg)
        p = finer_keys(plan, v.cfg, [(x, h, "int6") for x in range(10) for h in range(plan.num_kv_heads)])
        p.recent_window = 16  # then the least sensitive values (fisher_error at INT4) in INT3 until 3.5x
        values = sorted(
            (u["fisher_error"], lay["layer"], u["head"])
            for lay in plan.calibration["layers"]
            for u in lay["units"]
            if u["kind"] == "v" and u["precision"] == "int4"
        )
        for _, layer, head in values:
            if E.allocated_compression(p, v.cfg) >= 3.5:
                break
            p.precision[layer]["v"][head] = "int3"
        n3 = sum(x == "int3" for layer in p.precision for x in layer["v"])
        plans[f"keys of layers 0-9 INT6, the {n3} least sensitive values INT3"] = p
        p = deepcopy(plan)  # diagnostic above 3.5x: is INT6 fine enough for the first third's keys?
        p.precision[:10] = [dict(layer, k=["int6"] * p.num_kv_heads) for layer in p.precision[:10]]
        plans["keys of layers 0-9 INT6"] = p
        screen(plans)
    elif a.experiment == "engines":  # the engine's plan and --compare's, each as its build calibrated it
        plans = {str(d): plan} | {x: KVPlan.load(Path(x) / "kv_plan") for x in a.compare.split(",") if x}
        screen(plans)
    elif a.experiment == "values-bands":  # does 4k over-retrieve because of the INT3 values, and which layers'?

        def values(p, int3_layers):
            p = deepcopy(p)
            for layer, lay in enumerate(p.precision):
                lay["v"] = ["int3" if layer in int3_layers else "int4" for _ in lay["v"]]
            return p

        outside = set(range(10)) | set(range(20, 30))
        plans = {"values of layers 10-19 INT4, the others INT3": longest_window(values(plan, outside), v.cfg)}
        p = deepcopy(plan)  # diagnostic: the INT5-keys default's keys (layers 0-9 INT4) under this plan's values
        for lay in p.precision[:10]:
            lay["k"] = ["int4" if x == "int6" else x for x in lay["k"]]
        plans["diagnostic: keys of layers 0-9 INT4, values as the plan"] = p
        screen(plans)
    elif a.experiment == "late-keys":  # INT6 keys in the first third paid for by the last third's keys in INT3

        def bands(p, precisions):
            p = deepcopy(p)
            for (lo, hi), kv, prec in precisions:
                for layer in range(lo, hi):
                    p.precision[layer][kv] = [prec] * p.num_kv_heads
            return longest_window(p, v.cfg)

        plans = {
            "keys of layers 0-9 INT6 and 20-29 INT3, values of layers 0-9 INT3": bands(
                plan, [((0, 10), "k", "int6"), ((20, 30), "k", "int3"), ((0, 10), "v", "int3")]
            ),
            "keys of layers 0-9 INT6 and 20-29 INT3, values of layers 20-29 INT3": bands(
                plan, [((0, 10), "k", "int6"), ((20, 30), "k", "int3"), ((20, 30), "v", "int3")]
            ),
        }
        screen(plans)
    elif a.experiment == "heads":
        t0 = time.perf_counter()
        sc = retrieval_scores(v, passkey_probes(tok, 2048, 16, 7))
        order = [(int(i) // sc.shape[1], int(i) % sc.shape[1]) for i in torch.argsort(sc.flatten(), descending=True)]
        print(f"retrieval scores ({time.perf_counter() - t0:.0f}s):", [(u, round(float(sc[u]), 3)) for u in order[:12]])
        variants = {
            "plan": plan,
            "plan, keys of layers 10-19 in INT8": with_units(plan, [(x, h) for x in range(10, 20) for h in range(3)]),
        }
        for k in (3, 6, 10):
            variants[f"plan, keys of the top {k} retrieval units in INT8"] = with_units(plan, order[:k])
            variants[f"plan without FP8, keys of the top {k} retrieval units in INT8"] = with_units(
                plan, order[:k], keep_fp8=0
            )
        variants["plan with 2 FP8 units, keys of the top 3 retrieval units in INT8"] = with_units(
            plan, order[:3], keep_fp8=2
        )
        for name, p in variants.items():
            print(f"{name}: {E.allocated_compression(p, v.cfg):.3f}x", flush=True)
            rows[name] = greedy(p)
    else:
        variants = [("8x1024, no clipping", 8, 1024, {"clip_ratios": (1.0,)})]
        if a.experiment == "calibration":
            rows["plan"] = greedy(plan)
            variants = (
                [("8x1024", 8, 1024, {})] + variants + [("16x128, no clipping", 16, 128, {"clip_ratios": (1.0,)})]
            )
        for name, n, length, extra in variants:
            m = measure_units(v, calibration_samples(tok, n, length), KVCalibConfig(group_size=64, **extra))
            p, rep = plan_from_measurement(m, v.cfg, 0.02, recent_window=16)
            print(f"{name}: {rep['compression_vs_fp16']}x", flush=True)
            if a.experiment == "calibration":
                rows[name] = greedy(p)
            else:
                rows[name] = lambda kv, prefix, p=p: noise_answer(v, kv, prefix, p, "plain")
                rows[name + ", logits corrected"] = lambda kv, prefix, p=p: noise_answer(v, kv, prefix, p, "corr")
        if a.experiment == "noise":
            rows["plan"] = lambda kv, prefix: noise_answer(v, kv, prefix, plan, "plain")
            rows["plan, logits corrected"] = lambda kv, prefix: noise_answer(v, kv, prefix, plan, "corr")
            rows["fp16 keys + plan's key error, random signs"] = lambda kv, prefix: noise_answer(
                v, kv, prefix, plan, "signflip"
            )
    if a.rows:
        rows = {n: f for n, f in rows.items() if n == "fp16" or n in a.rows.split(";")}
    if a.trials == 0:
        return 0
    outcomes = {}  # length -> row -> per-trial 0/1
    for length in (int(x) for x in a.length.split(",")):
        hits = outcomes[length] = {n: [] for n in rows}
        t0 = time.perf_counter()
        lo, hi = a.depth or (0.0, 1.0)
        for i, t in enumerate(E.passkey_trials(tok, length, a.trials, a.seed)):
            if i < a.skip or not (lo <= t["depth"] < hi or (hi == 1.0 and t["depth"] == 1.0)):
                continue
            ids, P, ks = t["ids"], t["prompt_len"], t["key_start"]
            kv = E._prefix_kv(v, ids[:P])
            for name, answer in rows.items():
                hits[name].append(int(E.key_in(tok.decode(answer(kv, ids[P:ks])), t["key"])))
            print(length, i, f"{time.perf_counter() - t0:.0f}s", {n: sum(h) for n, h in hits.items()}, flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(outcomes))
        for name, h in hits.items():
            print(
                f"{length} tokens, {name}: {sum(h)}/{len(h)}",
                E.paired_difference(h, hits["fp16"], a.seed) if name != "fp16" else "",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
