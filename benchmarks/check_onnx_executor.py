"""Greedy parity of the onnxruntime executor with the torch executor on an engine version built with
runtime.onnx: true (its exported graphs), speculation on, for the engine's own KV cache (its calibrated plan,
or FP16).

    .venv/bin/python benchmarks/check_onnx_executor.py engines/smollm2/1 --prompts 8 --tokens 32

Both Generators use small limits (the Python-op bridge copies the whole pool on every call) and the engine's
tree; prompts are the chat-templated builtin pydoc held-out questions' openings. Prints per prompt whether the
tokens are identical and, where not, the first differing position; exit 1 on any difference."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bpcompile.core.engine import EngineConfig  # noqa: E402
from bpcompile.runtime.generator import Generator, SamplingParams  # noqa: E402
from bpcompile.runtime.kvcache import KVPlan, kv_store_factory  # noqa: E402
from bpcompile.runtime.model import Llama  # noqa: E402
from bpcompile.runtime.speculative import TreeSpec  # noqa: E402

SUBJECTS = [
    "the import statement",
    "exceptions",
    "the with statement",
    "generators",
    "list comprehensions",
    "decorators",
    "the global statement",
    "string formatting",
    "dictionaries",
    "classes",
    "modules",
    "the yield keyword",
    "lambda expressions",
    "slicing",
    "the for loop",
    "integer division",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", type=Path)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    from tokenizers import Tokenizer

    from bpcompile.runtime.text import chat_prompt

    cfg = EngineConfig.load(a.engine)
    v, d = Llama.from_checkpoint(a.engine / "verifier"), Llama.from_checkpoint(a.engine / "draft")
    plan = a.engine / "kv_plan" / "plan.json"
    factory = kv_store_factory(KVPlan.load(plan.parent)) if plan.is_file() else None
    spec = cfg.speculative
    tree = TreeSpec(spec.tree, length=spec.length, choices=spec.choices, nodes=spec.nodes)
    kw = dict(
        max_batch_size=4, max_seq_len=256, page_size=cfg.kv_cache.page_size, kv_store_factory=factory, backoff=False
    )
    tok = Tokenizer.from_file(str(a.engine / "tokenizer" / "tokenizer.json"))
    texts = [
        chat_prompt(a.engine / "tokenizer", f"Explain {s} in Python briefly.") or s for s in (SUBJECTS * 4)[: a.prompts]
    ]
    prompts = [tok.encode(t).ids for t in texts]
    params = SamplingParams(max_tokens=a.tokens)
    out = {}
    for name, extra in (("torch", {}), ("onnxruntime", {"executor": "onnxruntime", "graphs": a.engine / "onnx"})):
        gen = Generator(v, d, tree, **kw, **extra)
        t = time.perf_counter()
        res = gen.generate(prompts, params)
        out[name] = {
            "tokens": [r[0] for r in res],
            "seconds": time.perf_counter() - t,
            "accepted": sum(sum(r[1].accepted_per_depth) for r in res),
        }
    same = 0
    for i, (x, y) in enumerate(zip(out["torch"]["tokens"], out["onnxruntime"]["tokens"])):
        if x == y:
            same += 1
        else:
            k = next(j for j in range(min(len(x), len(y)) + 1) if j >= min(len(x), len(y)) or x[j] != y[j])
            print(f"prompt {i}: first difference at token {k}")
    print(
        json.dumps(
            {
                "engine": str(a.engine),
                "prompts": len(prompts),
                "tokens": a.tokens,
                "identical": same,
                "kv": "plan" if factory else "float",
                "tree": spec.tree,
                **{f"{n}_seconds": round(o["seconds"], 1) for n, o in out.items()},
                **{f"{n}_accepted_draft_tokens": o["accepted"] for n, o in out.items()},
            }
        )
    )
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
