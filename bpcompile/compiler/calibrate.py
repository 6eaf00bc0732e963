"""KV calibration: decide which (layer, KV head, K|V) units stay FP8 and the static INT4 scales.

Runs the verifier over calibration text, captures post-RoPE q/k/v of every layer through the
`attend` seam of `Llama.forward`, and measures for every unit the error that quantizing *only that
unit* causes in the layer's attention output (after the output projection, relative to it): what
the next layer actually sees, not the K/V error itself (a key error matters as much as it moves the
softmax, a value error as much as the head is attended to).

The default (`rotation: hadamard`) stores every K and V vector rotated by an orthonormal Hadamard
matrix, which spreads outlier channels over the whole vector before per-token INT4 quantization.
Before the rotation keys are centered by their static per-channel mean (exact: q·(k - m) differs
from q·k by a constant per query, which softmax ignores; the store adds m back anyway) and divided by
a query-aware channel scale c = sqrt(rms(k - m) / rms(q)) per channel: it minimizes the quantization
error of the logits q·k (not of k) for isotropic error after the rotation, and the kernels fold c
into q. Per unit the search picks the scale exponent and the INT4 clip ratio with the smallest
layer-output error. Which units take the outlier precision is decided by what their INT4 error does to the
model's loss, not to one layer's output: one backward pass over the calibration samples gives the gradient g of
their next-token loss with respect to every post-RoPE K and V element, and a unit's `fisher_error` is
sum g^2 e^2 over its elements (e: its INT4 error with the settings chosen), the diagonal-Fisher estimate of the
loss increase its quantization causes (KVQuant's sensitivity weighting). On SmolLM2-135M it picks half of the units
the layer-output error picks and lowers the held-out KL of the plan by a tenth. The `round(outlier_fraction *
units)` units with the largest `fisher_error` take the outlier precision (FP8 by default; INT8 costs the same
bytes and was within calibration noise of it), at least one when the fraction is > 0; ties go to the lower unit
id, so the plan is a pure function of the model and the samples.
Retrieval units (`retrieval_fraction`): the keys of the KV heads that copy from far back (the ones that put the
most attention on a needle's key while the model repeats it, on needle-in-a-haystack prompts built from the
calibration text) are stored in INT8, chosen before the outlier units. Why: long-context retrieval on SmolLM2 moved
with any 4-bit-sized key noise (the plan retrieved a passkey at 4k tokens far more often than FP16 KV did) and the
departure came from a few such heads; FP8's noise moves it too, INT8's does not.
`rotation: none` is the previous recipe (pair-tied absmax key scale, FP8 outliers).
KLT keys (`key_transform: klt`, opt-in): the keys of the first two thirds of the layers are stored before RoPE as
coefficients of a per-unit basis fit here (`fit_klt`), each coefficient with the bits its variance is worth.
Format: docs/KV_FORMAT.md.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from bpcompile.core.errors import UserError
from bpcompile.runtime.kvcache import KLT_PRECISIONS, ROTATIONS, KVPlan, fake_quantize, rope_rotate
from bpcompile.runtime.model import Llama, causal_attend, rms_norm, rope_inv_freq

RETRIEVAL_PROBES, RETRIEVAL_PROBE_LENGTH = 4, 1024  # needle-in-a-haystack prompts for retrieval_scores
RECIPE_FORMATS = {"int4-fp8-outlier", "fp8", "int8", "fp16", "int4-naive"}


@dataclass
class KVCalibConfig:
    format: str = "int4-fp8-outlier"
    outlier_fraction: float = 0.08
    group_size: int = 64
    # key channel scale c_i = (pair-tied absmax_i)^alpha, searched per K unit; 0.0 = no scaling
    key_scale_alphas: tuple = (0.0, 0.5, 1.0)
    # static INT4 clip ratios searched per unit (1.0 = plain absmax)
    clip_ratios: tuple = (1.0, 0.95, 0.9, 0.85)
    rotation: str = "auto"  # "auto" (hadamard where the head size is a power of two) | "hadamard" | "none"
    key_centering: bool = True  # subtract the keys' static per-channel mean (with rotation only)
    outlier_precision: str = "fp8"  # "fp8" | "int8": what the most sensitive units are stored in
    # share of units (keys of retrieval heads, chosen by retrieval_scores) stored in INT8; needs probes
    retrieval_fraction: float = 0.0
    # exact entries (KVPlan.sink_tokens / recent_window), carried into the plan; the recipe resolves its autos
    sink_tokens: int = 0
    recent_window: int = 0
    # "middle": the keys of the middle third of the layers stored in INT5 (int5_key_layers); "none"
    int5_keys: str = "none"
    # "early": the keys of the first third of the layers stored in INT6 (int6_key_layers); "none"
    int6_keys: str = "none"
    # share of the value units stored in INT3, the least sensitive (fisher_error) first
    int3_values: float = 0.0
    # "klt": the INT4 / INT5 keys of the first two thirds of the layers (klt_key_layers) stored as KLT4 / KLT5
    # units, coefficients of a calibrated basis before RoPE at the same bytes (fit_klt); "none"
    key_transform: str = "none"

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "KVCalibConfig":
        """From the recipe's kv_cache section (unknown keys such as page_size are not ours: ignored)."""
        d = dict(d or {})
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names})
        for k in ("sink_tokens", "recent_window"):
            if getattr(cfg, k) == "auto":  # outside a recipe (which resolves them per target): none
                setattr(cfg, k, 0)
        if cfg.outlier_fraction == "auto":
            cfg.outlier_fraction = 0.01 if (cfg.sink_tokens or cfg.recent_window) else 0.08
        if cfg.retrieval_fraction == "auto":
            cfg.retrieval_fraction = 0.0
        if cfg.int5_keys == "auto":
            cfg.int5_keys = "none"
        if cfg.int5_keys not in ("middle", "none"):
            raise UserError(f"int5_keys must be middle or none, got {cfg.int5_keys!r}", key="kv_cache.int5_keys")
        if cfg.int6_keys == "auto":
            cfg.int6_keys = "none"
        if cfg.int6_keys not in ("early", "none"):
            raise UserError(f"int6_keys must be early or none, got {cfg.int6_keys!r}", key="kv_cache.int6_keys")
        if cfg.int3_values == "auto":
            cfg.int3_values = 0.0
        if cfg.key_transform == "auto":
            cfg.key_transform = "none"
        if cfg.key_transform not in ("klt", "none"):
            raise UserError(
                f"key_transform must be klt or none, got {cfg.key_transform!r}", key="kv_cache.key_transform"
            )
        if (
            isinstance(cfg.int3_values, bool)
            or not isinstance(cfg.int3_values, (int, float))
            or not 0.0 <= cfg.int3_values <= 1.0
        ):
            raise UserError(
                f"int3_values must be a share in [0, 1], got {cfg.int3_values!r}", key="kv_cache.int3_values"
            )
        if not 0.0 <= cfg.retrieval_fraction <= 0.5:  # keys are half the units
            raise UserError(
                f"retrieval_fraction must be in [0, 0.5], got {cfg.retrieval_fraction}",
                key="kv_cache.retrieval_fraction",
            )
        if cfg.format not in RECIPE_FORMATS:
            raise UserError(
                f"unknown format {cfg.format!r}; expected one of {sorted(RECIPE_FORMATS)}", key="kv_cache.format"
            )
        if not 0.0 <= cfg.outlier_fraction <= 1.0:
            raise UserError(
                f"outlier_fraction must be in [0, 1], got {cfg.outlier_fraction}", key="kv_cache.outlier_fraction"
            )
        if cfg.rotation not in ROTATIONS + ("auto",):
            raise UserError(
                f"unknown rotation {cfg.rotation!r}; expected one of {', '.join(ROTATIONS)}", key="kv_cache.rotation"
            )
        if cfg.outlier_precision not in ("int8", "fp8"):
            raise UserError(
                f"outlier_precision must be int8 or fp8, got {cfg.outlier_precision!r}",
                key="kv_cache.outlier_precision",
            )
        if not cfg.clip_ratios or not all(0 < r <= 1 for r in cfg.clip_ratios):
            raise UserError(f"clip_ratios must be in (0, 1], got {list(cfg.clip_ratios)}", key="kv_cache.clip_ratios")
        return cfg

    @property
    def outlier(self) -> str:
        return self.outlier_precision


def int5_key_layers(mode: str, num_layers: int) -> range:
    """The layers whose keys an int5_keys mode stores in INT5: "middle" = the middle third, [L/3, 2L/3) rounded
    (layers 10-19 of SmolLM2's 30: there, with INT4 keys, the model's 4k passkey retrieval departs from FP16
    KV's; with INT5 or finer keys it does not, and the other layers' keys do not move it)."""
    if mode == "none":
        return range(0)
    return range(round(num_layers / 3), round(2 * num_layers / 3))


def int6_key_layers(mode: str, num_layers: int) -> range:
    """The layers whose keys an int6_keys mode stores in INT6: "early" = the first third, [0, L/3) rounded
    (layers 0-9 of SmolLM2's 30: there, INT4 or INT5 noise in those keys is what lowered the model's 2k passkey
    retrieval; in INT8 or INT6 it retrieves what FP16 KV does, and the other layers' keys do not move it)."""
    if mode == "none":
        return range(0)
    return range(0, round(num_layers / 3))


def n_outlier_units(fraction: float, units: int) -> int:
    """round(fraction * units), half up, at least 1 when fraction > 0."""
    if fraction <= 0:
        return 0
    return min(units, max(1, math.floor(fraction * units + 0.5)))


def capture_qkv(verifier: Llama, samples: list[list[int]], batch: int = 8):
    """Yields (layer, q, k, v): post-RoPE, each [N, T, heads, D] float32 on the CPU over all samples (equal
    lengths), one layer at a time. Between layers only the hidden states of the samples are kept ([N, T, hidden]
    in the model's dtype), so memory holds one layer's q/k/v, not every layer's (80 layers of a 70B model's
    64 x 512 samples would be ~107 GB)."""
    lens = {len(s) for s in samples}
    if len(lens) != 1 or min(lens) < 2:
        raise UserError(
            f"calibration samples must be non-empty and of one length >= 2, got lengths {sorted(lens)}",
            key="calibration.length",
        )
    dev, T = verifier.device, len(samples[0])
    with torch.inference_mode():
        batches = [
            torch.tensor(samples[i : i + batch], dtype=torch.long, device=dev) for i in range(0, len(samples), batch)
        ]
        ropes = [verifier.rope(torch.arange(T, device=dev).expand(len(b), T)) for b in batches]
        hidden = [F.embedding(b, verifier.embed) for b in batches]
        for layer, blk in enumerate(verifier.layers):
            parts = []

            def attend(_, q, k, v):
                parts.append((q.float().cpu(), k.float().cpu(), v.float().cpu()))
                return causal_attend(q, k, v)

            hidden = [blk(h, cos, sin, layer, attend) for h, (cos, sin) in zip(hidden, ropes)]
            yield (layer, *(torch.cat(x, 0) for x in zip(*parts)))


def kv_loss_grad_sq(
    verifier: Llama, samples: list[list[int]], batch: int = 4
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (g_k^2, g_v^2), each [N, T, KV, D] float32 on the CPU: the squared gradient of the samples'
    summed next-token loss with respect to the layer's post-RoPE K and V (the diagonal of the empirical Fisher).
    One forward and backward pass per `batch` samples; activations of every layer are held for the backward,
    so `batch` bounds them (the gradients kept are twice the K/V of all samples)."""
    c, dev = verifier.cfg, verifier.device
    out: list[list[list[torch.Tensor]]] = [[[], []] for _ in range(c.num_layers)]
    for i in range(0, len(samples), batch):
        b = torch.tensor(samples[i : i + batch], dtype=torch.long, device=dev)
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []

        def attend(_, q, k, v):
            k.retain_grad()
            v.retain_grad()
            kv.append((k, v))
            return causal_attend(q, k, v)

        with torch.enable_grad():  # Llama.forward runs in inference mode: the layers are walked here instead
            cos, sin = verifier.rope(torch.arange(b.shape[1], device=dev).expand(*b.shape))
            h = F.embedding(b, verifier.embed).requires_grad_(True)
            for layer, blk in enumerate(verifier.layers):
                h = blk(h, cos, sin, layer, attend)
            logits = verifier.head(rms_norm(h, verifier.norm, c.norm_eps))[..., : c.vocab_size].float()
            F.cross_entropy(logits[:, :-1].flatten(0, 1), b[:, 1:].flatten(), reduction="sum").backward()
        for layer, (k, v) in enumerate(kv):
            out[layer][0].append(k.grad.float().pow(2).cpu())
            out[layer][1].append(v.grad.float().pow(2).cpu())
    return [(torch.cat(gk), torch.cat(gv)) for gk, gv in out]


def retrieval_scores(verifier: Llama, probes: list[dict]) -> torch.Tensor:
    """[L, KV]: per KV unit, the largest share of attention one of its query heads puts on the needle's key
    tokens while the answer's key tokens are predicted, averaged over the probes (corpus.retrieval_probes). The
    units that score high are the retrieval heads that copy from far back; noise in their keys moves long-range
    retrieval (in either direction) more than any other units' does."""
    c = verifier.cfg
    score = torch.zeros(c.num_layers, c.num_heads)
    dev = verifier.device
    for p in probes:
        needle = torch.tensor(p["needle"], device=dev)
        qpos = torch.tensor(p["answer"], device=dev) - 1  # the positions that predict the answer's key tokens

        def attend(layer, q, k, v):
            qs = q[0, qpos].float() * q.shape[-1] ** -0.5
            s = torch.einsum("thd,nhd->htn", qs, k[0].float().repeat_interleave(q.shape[2] // k.shape[2], 1))
            s = s.masked_fill(torch.arange(k.shape[1], device=dev)[None, None] > qpos[None, :, None], float("-inf"))
            score[layer] += (torch.softmax(s, -1)[:, :, needle].sum(-1).mean(-1) / len(probes)).cpu()
            return causal_attend(q, k, v)

        with torch.inference_mode():
            verifier.forward(torch.tensor([p["ids"]], device=dev), attend=attend, last_only=True)
    return score.reshape(c.num_layers, c.num_kv_heads, -1).amax(-1)


def key_channel_scale(k: torch.Tensor, alpha: float) -> torch.Tensor:
    """Static per-channel key scale for one KV head from post-RoPE keys k [..., D].

    RoPE rotates channel pairs (i, i + D/2) into each other, so both get the same scale (the max of
    their absmax): the scale then commutes with RoPE and means the same before and after it.
    Normalized to geometric mean 1 (only ratios matter under per-token scaling).
    """
    d = k.shape[-1]
    amax = k.abs().reshape(-1, d).amax(0).double()
    m = torch.maximum(amax[: d // 2], amax[d // 2 :]).clamp(min=1e-6)
    c = torch.cat((m, m)) ** alpha
    return (c / torch.exp(torch.log(c).mean())).float()


def query_aware_key_scale(q: torch.Tensor, k: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Static key channel scale for one KV head from its queries q [..., R, D] (the GQA group) and its
    (centered) keys k [..., D]: c_i = (rms(k_i) / rms(q_i))^(alpha/2), geometric mean 1.

    Storing k/c and attending with q∘c leaves q·k unchanged; with error of equal size in every channel
    of k/c (what the rotation gives) the logit error is sum_i (q_i c_i e_i)^2, and sum_i q_i^2 c_i^2 times
    sum_i k_i^2 / c_i^2 (the size of that error) is smallest at c_i^2 = |k_i| / |q_i| (Cauchy-Schwarz)."""
    d = k.shape[-1]
    kr = k.reshape(-1, d).double().pow(2).mean(0).sqrt()
    qr = q.reshape(-1, d).double().pow(2).mean(0).sqrt()
    c = (kr.clamp(min=1e-6) / qr.clamp(min=1e-6)) ** (alpha / 2)
    return (c / torch.exp(torch.log(c).mean())).float()


class LayerProbe:
    """Error of one layer's attention output (after the output projection) when one unit is perturbed."""

    def __init__(self, verifier: Llama, layer: int, q, k, v):
        c = verifier.cfg
        self.q, self.k, self.v, self.D = q, k, v, c.head_size
        self.rep = c.num_heads // c.num_kv_heads
        self.w = verifier.w[f"transformer.layers.{layer}.attention.dense.weight"].float().cpu()
        o = causal_attend(q, k, v)
        self.o = o
        out = o.reshape(*o.shape[:2], -1) @ self.w.T
        self.ref_norm = out.double().norm().item()

    def error(self, head: int, k_new=None, v_new=None) -> float:
        """Relative error of the layer output with KV head `head`'s K or V replaced."""
        g = slice(head * self.rep, (head + 1) * self.rep)
        k = self.k[:, :, head : head + 1] if k_new is None else k_new[:, :, None]
        v = self.v[:, :, head : head + 1] if v_new is None else v_new[:, :, None]
        o = causal_attend(self.q[:, :, g], k, v)
        d = (o - self.o[:, :, g]).reshape(*o.shape[:2], -1)
        w = self.w[:, head * self.rep * self.D : (head + 1) * self.rep * self.D]
        return (d @ w.T).double().norm().item() / max(self.ref_norm, 1e-30)


def measure_units(verifier: Llama, samples: list[list[int]], cfg: KVCalibConfig) -> dict:
    """Per-unit errors and the best static INT4 settings; independent of the outlier fraction."""
    c = verifier.cfg
    G = min(cfg.group_size, c.head_size)
    pow2 = not c.head_size & (c.head_size - 1)
    if cfg.rotation == "auto":  # a Sylvester Hadamard matrix exists for powers of two only
        cfg = replace(cfg, rotation="hadamard" if pow2 else "none")
    rotate = cfg.rotation == "hadamard"
    if rotate and not pow2:
        raise UserError(
            f"rotation: hadamard needs a power-of-two head size, the model has {c.head_size}", key="kv_cache.rotation"
        )
    center = rotate and cfg.key_centering
    rep = c.num_heads // c.num_kv_heads
    units = []  # in global unit id order: (layer * 2 + kv) * KV + head
    kcs = torch.ones(c.num_layers, c.num_kv_heads, c.head_size)
    k_mean = torch.zeros(c.num_layers, c.num_kv_heads, c.head_size) if center else None
    grad_sq = kv_loss_grad_sq(verifier, samples)
    tokens = sum(len(s) for s in samples)
    for layer, q, k, v in capture_qkv(verifier, samples):
        probe = LayerProbe(verifier, layer, q, k, v)
        for kv, name in ((0, "k"), (1, "v")):
            for h in range(c.num_kv_heads):
                x = (k if kv == 0 else v)[:, :, h]
                mean = None
                if kv == 0 and center:
                    mean = k_mean[layer, h] = x.reshape(-1, c.head_size).double().mean(0).float()
                put = (lambda y: probe.error(h, k_new=y)) if kv == 0 else (lambda y: probe.error(h, v_new=y))
                naive = put(fake_quantize(x, "int4", c.head_size))

                def scale(alpha):
                    if not alpha:
                        return None
                    if rotate:
                        return query_aware_key_scale(
                            q[:, :, h * rep : (h + 1) * rep], x - (mean if mean is not None else 0), alpha
                        )
                    return key_channel_scale(x, alpha)

                best = None  # (error, alpha, clip): first minimum in grid order wins
                for alpha in cfg.key_scale_alphas if kv == 0 else (0.0,):
                    cs = scale(alpha)
                    for clip in cfg.clip_ratios:
                        e = put(fake_quantize(x, "int4", G, cs, clip, mean, rotate))
                        if best is None or e < best[0]:
                            best = (e, alpha, clip)
                cs = scale(best[1])
                if kv == 0 and cs is not None:
                    kcs[layer, h] = cs
                err = fake_quantize(x, "int4", G, cs, best[2], mean, rotate) - x
                fisher = (err.pow(2) * grad_sq[layer][kv][:, :, h]).sum().item() / tokens
                # the outlier precision keeps the unit's mean, scale and rotation (without a rotation FP8 has
                # per-element exponents: channel scaling buys nothing, and its units get c = 1)
                out_cs = cs if rotate else None
                units.append(
                    {
                        "layer": layer,
                        "kind": name,
                        "head": h,
                        "int4_error": best[0],
                        "fisher_error": fisher,
                        "outlier_error": put(fake_quantize(x, cfg.outlier, G, out_cs, 1.0, mean, rotate)),
                        "naive_int4_error": naive,
                        "key_scale_alpha": best[1],
                        "clip": best[2],
                    }
                )
    return {
        "units": units,
        "k_channel_scale": kcs,
        "group_size": cfg.group_size,
        "rotation": cfg.rotation,
        "k_mean": k_mean,
        "outlier_precision": cfg.outlier,
    }


def plan_from_measurement(
    m: dict,
    model_cfg,
    fraction: float,
    fmt: str = "int4-fp8-outlier",
    sink_tokens: int = 0,
    recent_window: int = 0,
    seq_len: int = 2048,
    lookahead: int = 6,
    retrieval: Optional[torch.Tensor] = None,
    retrieval_fraction: float = 0.0,
    int5_keys: str = "none",
    int6_keys: str = "none",
    int3_values: float = 0.0,
):
    """KVPlan + per-layer report for one outlier fraction from `measure_units` output. int5_keys / int6_keys: the
    keys of int5_key_layers(int5_keys) are stored in INT5 and those of int6_key_layers(int6_keys) in INT6, first.
    retrieval: [L, KV] scores (retrieval_scores); the keys of the round(retrieval_fraction * units) highest of the
    rest go to INT8. Then the round(int3_values * value units) values with the smallest sensitivity go to INT3,
    those of the INT5 keys' layers last, and the outlier units are chosen among the rest."""
    c = model_cfg
    units = m["units"]
    band = {
        u: p
        for p, layers in (
            ("int5", int5_key_layers(int5_keys, c.num_layers)),
            ("int6", int6_key_layers(int6_keys, c.num_layers)),
        )
        for u, r in enumerate(units)
        if r["kind"] == "k" and r["layer"] in layers
    }  # unit -> its key precision
    int5 = {u for u, p in band.items() if p == "int5"}
    n_ret = n_outlier_units(retrieval_fraction, len(units)) if retrieval is not None else 0
    by_score = (
        sorted(
            (u for u, r in enumerate(units) if r["kind"] == "k" and u not in band),
            key=lambda u: (-float(retrieval[units[u]["layer"], units[u]["head"]]), u),
        )
        if n_ret
        else []
    )
    ret = set(by_score[:n_ret])
    # plans measured before the loss-based selection have no fisher_error: they keep the layer-output order
    key = "fisher_error" if all("fisher_error" in u for u in units) else "int4_error"
    values = [u for u in range(len(units)) if units[u]["kind"] == "v"]
    # The values of the layers whose keys are INT5 go to INT3 last: on SmolLM2 INT3 values there made the model
    # retrieve from 4k tokens back what it does not with FP16 KV (the layers where that retrieval happens).
    middle = set(int5_key_layers(int5_keys, c.num_layers))
    int3 = set(
        sorted(values, key=lambda u: (units[u]["layer"] in middle, units[u][key], u))[
            : n_outlier_units(int3_values, len(values))
        ]
    )
    taken = set(band) | ret | int3
    n_fp8 = min(n_outlier_units(fraction, len(units)), len(units) - len(taken))
    order = [u for u in sorted(range(len(units)), key=lambda u: (-units[u][key], u)) if u not in taken]
    fp8 = set(order[:n_fp8])
    outlier, rotation = m.get("outlier_precision", "fp8"), m.get("rotation", "none")
    prec = [{"k": [], "v": []} for _ in range(c.num_layers)]
    clip = torch.ones(c.num_layers, 2, c.num_kv_heads)
    kcs = m["k_channel_scale"].clone()
    layers = [{"layer": i, "units": []} for i in range(c.num_layers)]
    for u, r in enumerate(units):
        p = band.get(u) or ("int8" if u in ret else "int3" if u in int3 else outlier if u in fp8 else "int4")
        prec[r["layer"]][r["kind"]].append(p)
        kv = 0 if r["kind"] == "k" else 1
        if p == "int4":
            clip[r["layer"], kv, r["head"]] = r["clip"]
        elif kv == 0 and rotation == "none" and p not in ("int5", "int6"):
            kcs[r["layer"], r["head"]] = 1.0  # FP8 has per-element exponents: channel scaling buys nothing
        layers[r["layer"]]["units"].append(
            {**r, "precision": p}
            | (
                {"retrieval_score": float(retrieval[r["layer"], r["head"]]), "retrieval": u in ret}
                if retrieval is not None and r["kind"] == "k"
                else {}
            )
        )
    plan = KVPlan(
        fmt,
        c.num_layers,
        c.num_kv_heads,
        c.head_size,
        m["group_size"],
        prec,
        k_channel_scale=kcs,
        int4_clip=clip,
        outlier_fraction=fraction,
        rotation=rotation,
        sink_tokens=sink_tokens,
        recent_window=recent_window,
        k_mean=m.get("k_mean"),
    )
    report = {
        "format": fmt,
        "outlier_fraction": fraction,
        "units": len(units),
        "fp8_units": n_fp8,
        "outlier_precision": outlier,
        "retrieval_units": len(ret),
        "rotation": rotation,
        "int5_keys": int5_keys,
        "int5_units": len(int5),
        "int6_keys": int6_keys,
        "int6_units": len(band) - len(int5),
        "int3_values": int3_values,
        "int3_units": len(int3),
        "key_centering": m.get("k_mean") is not None,
        "group_size": plan.effective_group_size,
        "bytes_per_token": plan.bytes_per_token(),
        "compression_vs_fp16": round(plan.compression_vs_fp16(seq_len, lookahead), 4),
        "compression_at": {"max_seq_len": seq_len, "lookahead": lookahead},
        "sink_tokens": sink_tokens,
        "recent_window": recent_window,
        "error_metric": "relative error of the layer's attention output (after o_proj), only that unit quantized",
        "outlier_selection": key,
        "layers": layers,
    }
    plan.calibration = {k: v for k, v in report.items() if k != "layers"} | {"layers": _compact(layers)}
    return plan, report


def _compact(layers: list) -> list:
    """The per-layer table as stored in plan.json (rounded: the plan file stays small and stable)."""
    return [
        {
            "layer": l["layer"],
            "units": [
                {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in u.items() if k != "layer"}
                for u in l["units"]
            ],
        }
        for l in layers
    ]


def calibrate(
    verifier: Llama,
    samples: list[list[int]],
    kv_config=None,
    seq_len: int = 2048,
    lookahead: int = 6,
    probes: Optional[list[dict]] = None,
    tokenizer=None,
) -> tuple[KVPlan, dict]:
    """(KVPlan, report) for the verifier. kv_config: KVCalibConfig or the recipe's kv_cache dict. seq_len,
    lookahead: what the reported compression is for (a plan with exact entries spreads them over a sequence).
    When the config's retrieval_fraction > 0: probes (corpus.retrieval_probes), or the tokenizer (a directory
    or a tokenizer object) to build the default ones from the samples."""
    cfg = kv_config if isinstance(kv_config, KVCalibConfig) else KVCalibConfig.from_dict(kv_config)
    c = verifier.cfg
    if cfg.format != "int4-fp8-outlier":
        plan = KVPlan.uniform(cfg.format, c.num_layers, c.num_kv_heads, c.head_size, cfg.group_size)
        if cfg.format != "fp16":
            plan.sink_tokens, plan.recent_window = cfg.sink_tokens, cfg.recent_window
        report = {
            "format": cfg.format,
            "units": c.num_layers * c.num_kv_heads * 2,
            "compression_vs_fp16": round(plan.compression_vs_fp16(seq_len, lookahead), 4),
            "layers": [],
        }
        plan.calibration = report
        return plan, report
    retrieval = None
    if cfg.retrieval_fraction > 0:
        if not probes and tokenizer is not None:
            from bpcompile.compiler.corpus import retrieval_probes

            # no longer than the model's positions: a probe past them would measure extrapolation, not retrieval
            probes = retrieval_probes(
                tokenizer, samples, RETRIEVAL_PROBES, min(RETRIEVAL_PROBE_LENGTH, c.max_position_embeddings)
            )
        if not probes:
            raise UserError(
                "retrieval_fraction > 0 needs retrieval probes (corpus.retrieval_probes) or a tokenizer",
                key="kv_cache.retrieval_fraction",
            )
        retrieval = retrieval_scores(verifier, probes)
    plan, report = plan_from_measurement(
        measure_units(verifier, samples, cfg),
        c,
        cfg.outlier_fraction,
        sink_tokens=cfg.sink_tokens,
        recent_window=cfg.recent_window,
        seq_len=seq_len,
        lookahead=lookahead,
        retrieval=retrieval,
        retrieval_fraction=cfg.retrieval_fraction,
        int5_keys=cfg.int5_keys,
        int6_keys=cfg.int6_keys,
        int3_values=cfg.int3_values,
    )
    if cfg.key_transform == "klt":
        plan, report = with_klt_keys(plan, report, verifier, samples, klt_key_layers(c.num_layers))
    return plan, report


def klt_key_layers(num_layers: int) -> range:
    """The layers whose keys key_transform: klt stores as KLT units: the first two thirds, [0, round(2L/3)).
    Why: on SmolLM2 passkey retrieval at 2k tokens needs the first third's keys fine and at 4k the middle third's
    (INT5 there, INT8 in the first third brought each back), and the last third's barely move either; the basis is
    a D x D float16 table per unit, which at one 2048-token sequence of a 64-wide head costs about an eighth of the
    unit's cache, so it goes where it buys retrieval."""
    return range(0, round(2 * num_layers / 3))


KLT_SPAN = 4096  # relative distances (query position - key position) the logit-error metric averages over
KLT_QUERY_SAMPLES = 8192  # (query, distance) pairs drawn per unit for that metric
KLT_MAX_BITS = 8


def water_filling_bits(variances: torch.Tensor, total: int, max_bits: int = KLT_MAX_BITS) -> torch.Tensor:
    """Integer bits per coefficient summing to `total`: each bit in turn to the coefficient whose expected squared
    error (variance * 4^-bits) is largest (ties: the lower index), at most max_bits each."""
    b = torch.zeros(len(variances), dtype=torch.long)
    lam = variances.double()
    for _ in range(total):
        err = torch.where(b < max_bits, lam * 4.0 ** (-b.double()), -1.0)
        b[int(err.argmax())] += 1
    return b


def fit_klt(verifier: Llama, samples: list[list[int]], unit_bits: dict) -> dict:
    """The KLT tables (KVPlan.klt) for the key units in unit_bits {(layer, head): payload bits per token}.

    Per unit, on the calibration samples' keys before RoPE (y, mean m): the logit error of a key error e is (R q)·e
    for a query q (before RoPE) rotated by the distance between them; averaged over the unit's queries and distances
    uniform in [0, KLT_SPAN) (a fixed-seed sample) its metric E[(R q)(R q)^T] is nearly diagonal (the rotations
    average out what couples channels), with diagonal w. So x = (y - m) * sqrt(w) has plain squared error as logit
    error, and its principal axes V (an orthonormal matrix: decoding multiplies by its transpose) make the
    coefficients z = x V uncorrelated. Bits per coefficient by water-filling on their variances lam;
    a coefficient's step is sqrt(lam) / 2^bits (times the token's scale); a 1-bit one stores a sign and its mean
    magnitude on the samples. The basis is stored in float16 (KVPlan.klt)."""
    c = verifier.cfg
    L, KV, D = c.num_layers, c.num_kv_heads, c.head_size
    inv = rope_inv_freq(c).float()
    t = {
        "mean": torch.zeros(L, KV, D),
        "weight": torch.ones(L, KV, D),
        "basis": torch.zeros(L, KV, D, D, dtype=torch.float16),
        "bits": torch.zeros(L, KV, D, dtype=torch.int8),
        "step": torch.zeros(L, KV, D),
        "level": torch.zeros(L, KV, D),
        "inv_freq": inv.clone(),
    }
    layers = {layer for layer, _ in unit_bits}
    for layer, q, k, _ in capture_qkv(verifier, samples):
        if layer not in layers:
            continue
        N, T, H = q.shape[:3]
        pos = torch.arange(T).repeat(N)
        kp = rope_rotate(k.reshape(N * T, KV, D), pos, inv, -1.0)
        qp = rope_rotate(q.reshape(N * T, H, D), pos, inv, -1.0)
        rep = H // KV
        for h in range(KV):
            if (layer, h) not in unit_bits:
                continue
            y = kp[:, h].double()
            mean = y.mean(0)
            qh = qp[:, h * rep : (h + 1) * rep].reshape(-1, D)
            g = torch.Generator().manual_seed(layer * 7 + h)
            idx = torch.randint(0, len(qh), (KLT_QUERY_SAMPLES,), generator=g)
            dist = torch.randint(0, KLT_SPAN, (KLT_QUERY_SAMPLES,), generator=g)
            w = rope_rotate(qh[idx], dist, inv, 1.0).double().pow(2).mean(0)
            weight = w.clamp_min(1e-8 * float(w.max())).sqrt()
            x = (y - mean) * weight
            _, V = torch.linalg.eigh(x.T @ x / len(x))
            t["basis"][layer, h] = V.flip(1).to(torch.float16)
            Vq = t["basis"][layer, h].double()
            z = x @ Vq
            lam = z.pow(2).mean(0).clamp_min(1e-12)
            bits = water_filling_bits(lam, unit_bits[layer, h])
            t["mean"][layer, h], t["weight"][layer, h], t["bits"][layer, h] = (
                mean.float(),
                weight.float(),
                bits.to(torch.int8),
            )
            t["step"][layer, h] = (lam.sqrt() / 2.0 ** bits.double()).float()
            t["level"][layer, h] = torch.where(bits == 1, z.abs().mean(0), 0.0).float()
    return t


def with_klt_keys(
    plan: KVPlan, report: dict, verifier: Llama, samples: list[list[int]], layers: range
) -> tuple[KVPlan, dict]:
    """The plan with the INT4 / INT5 / INT6 key units of `layers` stored as KLT4 / KLT5 / KLT6 units (the same
    payload bytes: 4, 5 or 6 bits an element; one fp16 scale per token, whatever the group size), their tables fit
    on the samples; report and calibration table updated."""
    D = plan.head_size
    to = {"int4": "klt4", "int5": "klt5", "int6": "klt6"}
    unit_bits = {
        (layer, h): KLT_PRECISIONS[to[x]] * D
        for layer, p in enumerate(plan.precision)
        for h, x in enumerate(p["k"])
        if x in to and layer in layers
    }
    klt = fit_klt(verifier, samples, unit_bits)
    prec = [
        {"k": [to[x] if (layer, h) in unit_bits else x for h, x in enumerate(p["k"])], "v": list(p["v"])}
        for layer, p in enumerate(plan.precision)
    ]
    plan = replace(plan, precision=prec, klt=klt)
    for lay in report["layers"]:
        for u in lay["units"]:
            if u["kind"] == "k" and (lay["layer"], u["head"]) in unit_bits:
                u["precision"] = to[u["precision"]]
    report = report | {
        "key_transform": "klt",
        "klt_units": len(unit_bits),
        "klt_layers": [layers.start, layers.stop],
        "bytes_per_token": plan.bytes_per_token(),
    }
    plan.calibration = {k: v for k, v in report.items() if k != "layers"} | {"layers": _compact(report["layers"])}
    return plan, report


def text_file_samples(tokenizer_dir: str | Path, text_file: str | Path, n: int, length: int) -> list[list[int]]:
    """n non-overlapping BOS-prefixed windows of `length` ids from a user's calibration text file."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    try:
        text = Path(text_file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read calibration text: {e}", file=str(text_file), key="calibration.source") from None
    ids = tok.encode(text, add_special_tokens=False).ids
    bos = tok.token_to_id("<s>")
    body = length - 1 if bos is not None else length
    wins = [ids[s : s + body] for s in range(0, len(ids) - body + 1, body)][:n]
    if len(wins) < n:
        raise UserError(
            f"calibration text has {len(ids)} tokens: not enough for {n} samples of {length}",
            file=str(text_file),
            key="calibration.samples",
        )
    return [([bos] if bos is not None else []) + w for w in wins]


def recipe_samples(tokenizer_dir, calibration_cfg: dict, calibration_file=None) -> list[list[int]]:
    """The recipe's calibration windows (`calibration: {samples, length}`): from its text file, else the builtin
    corpus's train split."""
    n, length = int(calibration_cfg.get("samples", 16)), int(calibration_cfg.get("length", 128))
    if calibration_file:
        return text_file_samples(tokenizer_dir, calibration_file, n, length)
    from bpcompile.compiler.corpus import calibration_samples

    return calibration_samples(tokenizer_dir, n, length)


def calibrate_engine_stage(
    verifier_ckpt_dir,
    tokenizer_dir,
    kv_cache_cfg: dict,
    calibration_cfg: dict,
    out_dir,
    calibration_file=None,
    seq_len: int = 2048,
    lookahead: int = 6,
    sequences: int = 1,
) -> dict:
    """Build stage: calibrate the converted verifier and write `out_dir` (= <version>/kv_plan/). seq_len,
    lookahead, sequences: the recipe's max_seq_len, largest tree and max_batch_size (the reported compression's
    allocation: the runtime's pool)."""
    cfg = KVCalibConfig.from_dict(kv_cache_cfg)
    cal = dict(calibration_cfg or {})
    length = int(cal.get("length", 128))
    verifier = Llama.from_checkpoint(verifier_ckpt_dir, dtype=None)  # the recipe's dtype
    samples = recipe_samples(tokenizer_dir, cal, calibration_file) if cfg.format == "int4-fp8-outlier" else []
    plan, report = calibrate(verifier, samples, cfg, seq_len, lookahead, tokenizer=tokenizer_dir)
    plan.calibration["samples"] = {
        "n": len(samples),
        "length": length,
        "source": str(calibration_file) if calibration_file else cal.get("source"),
    }
    plan.save(out_dir)
    fp8 = [
        f"L{u['layer']}.{u['kind']}{u['head']}"
        for l in report["layers"]
        for u in l["units"]
        if u["precision"] in ("fp8", "int8") and not u.get("retrieval")
    ]
    ret = [f"L{u['layer']}.{u['kind']}{u['head']}" for l in report["layers"] for u in l["units"] if u.get("retrieval")]
    int5 = int5_key_layers(report.get("int5_keys", "none"), plan.num_layers)
    int6 = int6_key_layers(report.get("int6_keys", "none"), plan.num_layers)
    rss = peak_rss_bytes()
    klt = report.get("klt_layers")
    band_klt = bool(int5 and klt and klt[0] <= int5.start and int5.stop <= klt[1])  # the INT5 band stored as KLT5
    early_klt = bool(int6 and klt and klt[0] <= int6.start and int6.stop <= klt[1])  # the INT6 band stored as KLT6
    if plan.has_klt:  # the D x D tables are per engine, not per token: say what the runtime's pool comes to
        from bpcompile.runtime.paged_kv import allocated_compression

        report["allocated_compression"] = round(
            allocated_compression(plan, verifier.cfg, seq_len, lookahead, sequences=sequences), 4
        )
        report["allocated_compression_one_sequence"] = round(
            allocated_compression(plan, verifier.cfg, seq_len, lookahead), 4
        )
    return {
        "detail": f"{report['format']}: {report.get('fp8_units', 0)}/{report['units']} units "
        f"{report.get('outlier_precision', 'fp8').upper()}{' ' + ' '.join(fp8) if fp8 else ''}"
        f"{', rotated' if report.get('rotation') == 'hadamard' else ''}"
        + (f", retrieval keys INT8 {' '.join(ret)}" if ret else "")
        + (f", keys of layers {int6.start}-{int6.stop - 1} INT6" if int6 and not early_klt else "")
        + (f", keys of layers {int5.start}-{int5.stop - 1} INT5" if int5 and not band_klt else "")
        + (
            f", keys of layers {klt[0]}-{klt[1] - 1} KLT (before RoPE"
            + (f"; layers {int6.start}-{int6.stop - 1} KLT6" if early_klt else "")
            + (f"; layers {int5.start}-{int5.stop - 1} KLT5" if band_klt else "")
            + ")"
            if klt
            else ""
        )
        + (f", {report['int3_units']} value units INT3" if report.get("int3_units") else "")
        + (f", exact sink {plan.sink_tokens} + window {plan.recent_window}" if plan.has_exact else "")
        + f", {report['compression_vs_fp16']:.2f}x vs FP16"
        + (f" at {seq_len} tokens" if plan.has_exact else "")
        + (
            f" ({report['allocated_compression']:.2f}x with the KLT tables in the runtime's pool of "
            f"{sequences} x {seq_len} tokens, {report['allocated_compression_one_sequence']:.2f}x at one "
            "sequence)"
            if "allocated_compression" in report
            else ""
        )
        + (f"; build peak RSS so far {rss / 2**20:.0f} MiB" if rss else ""),
        "compression_vs_fp16": report["compression_vs_fp16"],
        "fp8_units": fp8,
        "retrieval_units": ret,
        "peak_rss_bytes": rss,
    }


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (Linux reports kilobytes, macOS bytes); None elsewhere."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
