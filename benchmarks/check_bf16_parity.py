"""The runtime in bf16 against transformers' bf16 greedy on the tiny pair (issue figures: 50 prompts x 32 tokens):
identical prompts per tree, and for each divergence transformers' own top-2 logit gap at the first differing
token in bf16 ulps of its top logit (<= 1: a tie that rounding decides).

    .venv/bin/python benchmarks/check_bf16_parity.py --prompts 50 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from bpcompile.compiler.convert import convert_checkpoint  # noqa: E402
from bpcompile.compiler.corpus import heldout_prompts  # noqa: E402
from bpcompile.eval.hf_parity import check_near_ties, greedy_parity  # noqa: E402
from bpcompile.runtime.model import Llama  # noqa: E402
from bpcompile.runtime.speculative import TreeSpec  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", type=Path, default=ROOT / "models" / "tiny")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for which in ("verifier", "draft"):
            convert_checkpoint(a.pair / which, Path(tmp) / which)
            models[which] = Llama.from_checkpoint(Path(tmp) / which, dtype=torch.bfloat16)
        prompts = heldout_prompts(Tokenizer.from_file(str(a.pair / "verifier" / "tokenizer.json")), a.prompts, 16)
        report = greedy_parity(
            a.pair / "verifier",
            models["verifier"],
            models["draft"],
            prompts,
            a.tokens,
            {"verifier only": TreeSpec("none"), "dynamic tree": TreeSpec("dynamic", nodes=5)},
        )
    print(json.dumps(report, indent=1))
    bad = check_near_ties(report)
    for b in bad:
        print(b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
