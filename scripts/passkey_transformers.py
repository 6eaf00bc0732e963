"""The model's own passkey accuracy, as an oracle for `bpcompile eval --passkey`: transformers runs the
checkpoint in float32 with its own cache (nothing quantized, nothing stored in FP16) on exactly the trials
eval draws (same `passkey_trials`, same seed), scoring a trial as eval does: every key token is the argmax
after the answer prefix, teacher-forced.

    .venv/bin/python scripts/passkey_transformers.py --lengths 2k,4k --trials 100

Prints per length the accuracy, the seconds taken and one digit per trial (1: retrieved); --json writes them.
If eval's FP16-KV row matches this, the FP16 cache is the model's own behaviour and a plan's gap to it is the
plan's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bpcompile.eval.evaluate import passkey_trials  # noqa: E402


def length(text: str) -> int:
    t = text.strip().lower()
    return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models/smollm2/verifier"), help="a Hugging Face checkpoint folder")
    ap.add_argument("--lengths", default="2k,4k", help="comma-separated prompt lengths (512, 1k, 2k, 4k)")
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0, help="eval's --seed (the trials drawn)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    out = {"model": a.model, "trials": a.trials, "seed": a.seed, "accuracy": {}, "hits": {}}
    for L in (length(x) for x in a.lengths.split(",")):
        hits, t0 = [], time.perf_counter()
        for t in passkey_trials(tok, L, a.trials, a.seed):
            ids, ks = t["ids"], t["key_start"]
            with torch.inference_mode():
                logits = model(torch.tensor([ids[:-1]])).logits[0]
            hits.append(logits[ks - 1 :].argmax(-1).tolist() == ids[ks:])
        out["accuracy"][str(L)] = sum(hits) / len(hits)
        out["hits"][str(L)] = "".join("1" if h else "0" for h in hits)
        print(
            f"{L}: {out['accuracy'][str(L)]:.0%} ({time.perf_counter() - t0:.0f} s) {out['hits'][str(L)]}", flush=True
        )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
