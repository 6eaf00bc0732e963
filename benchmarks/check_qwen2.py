"""The Qwen2.5-Coder pair (1.5B verifier, 0.5B draft) against transformers, and speculation against verifier-only.

    .venv/bin/python tools/get_qwen.py                                   # once: fetch and convert the pair
    .venv/bin/bpcompile build recipes/qwen2.5-coder.yaml
    .venv/bin/python benchmarks/check_qwen2.py parity                    # logits, tp 1 and tp 2, both models
    .venv/bin/python benchmarks/check_qwen2.py speculation [--engine engines/qwen2.5-coder/1]
    .venv/bin/python benchmarks/check_qwen2.py speed [--engine ...]      # batch-1 decode, interleaved

parity: each model converted to float32 at tp 1 and at tp 2; bpcompile's forward (tp 1: the one rank file; tp 2:
two processes, each loading only its own rank file) against transformers' Qwen2ForCausalLM on the same 64-token
code prompt; prints the largest absolute logits difference. speculation: 30 prompts (15 code completions sent raw,
15 chat requests through the chat template) x 48 tokens, greedy, through the built engine's own KV plan and
tree, against the same verifier and cache without a draft; stops on every end id. Exit code 1 if a logits
difference exceeds 1e-4 or any output differs. speed: decode tokens/s at batch 1 (float32), verifier-only,
speculation and transformers' assisted generation with the same two models, interleaved prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models" / "qwen2.5-coder"
TOL = 1e-4

CODE = [
    "def quicksort(arr):\n",
    "import numpy as np\n\ndef moving_average(x, w):\n",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "# Read a CSV file and print the sum of the second column\nimport csv\n\n",
    "def is_prime(n: int) -> bool:\n",
    "function debounce(fn, ms) {\n",
    "#include <stdio.h>\n\nint main(void) {\n",
    "SELECT name, COUNT(*) FROM orders\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "fn main() {\n    let v = vec![3, 1, 2];\n",
    "async def fetch_all(urls):\n",
    "def binary_search(a, x):\n    lo, hi = 0, len(a)\n",
    "public class Stack<T> {\n",
    "def parse_args():\n    import argparse\n",
    "def flatten(nested):\n",
]
CHAT = [
    "Write a Python function that reverses a linked list.",
    "Explain what a Python generator is, with a short example.",
    "How do I read a JSON file in Python?",
    "Write a bash one-liner that counts the lines of every .py file in a directory.",
    "What is the difference between a list and a tuple in Python?",
    "Write a SQL query that returns the ten most recent orders.",
    "Fix this code: for i in range(10) print(i)",
    "Write a function that checks whether a string is a palindrome.",
    "Explain Big-O notation in two sentences.",
    "Write a Python class for a 2D point with a distance method.",
    "How do I sort a dictionary by value in Python?",
    "Write a regular expression that matches an email address.",
    "What does the `with` statement do in Python?",
    "Write a JavaScript function that debounces another function.",
    "Write a unit test for a function add(a, b) using pytest.",
]


def prompts(tokenizer_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    from bpcompile.runtime.text import chat_prompt

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return [tok.encode(p).ids for p in CODE] + [tok.encode(chat_prompt(tokenizer_dir, c)).ids for c in CHAT]


# ---------------------------------------------------------------------------------------------------------------
# parity


def _rank(port: int, rank: int, ckpt: str, tokens: str, out: str) -> None:
    """One tensor-parallel rank of `ckpt` (tp 2), loading only its own rank file; writes its logits."""
    from datetime import timedelta

    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from bpcompile.runtime.model import Llama

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=600))
    group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=600))
    model = Llama.from_rank(ckpt, rank, 2, group)
    save_file({"logits": model(load_file(tokens)["tokens"]).contiguous()}, out)


def parity(which: str, work: Path) -> dict:
    import transformers
    from safetensors.torch import load_file, save_file

    from bpcompile.compiler.convert import convert_checkpoint
    from bpcompile.runtime.model import Llama

    hf = MODELS / which
    ps = prompts(hf)
    tokens = torch.tensor([ps[0][:8] + ps[15][:56]])  # code, then a chat turn: 64 tokens
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    arch = type(ref_model).__name__
    with torch.no_grad():
        ref = ref_model(tokens).logits
    del ref_model
    out = {"model": which, "transformers": arch, "tokens": tokens.shape[1]}
    for tp in (1, 2):
        ckpt = work / f"{which}-tp{tp}"
        convert_checkpoint(hf, ckpt, tp=tp, dtype="float32")
        if tp == 1:
            got = Llama.from_checkpoint(ckpt)(tokens)
            out["tp1"] = (got - ref).abs().max().item()
            del got
        else:
            save_file({"tokens": tokens}, work / "tokens.st")
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "rank",
                        str(port),
                        str(r),
                        str(ckpt),
                        str(work / "tokens.st"),
                        str(work / f"rank{r}.st"),
                    ]  # fmt: skip
                )
                for r in range(2)
            ]
            if [p.wait() for p in procs] != [0, 0]:
                raise SystemExit("a tp 2 rank failed")
            out["tp2"] = max((load_file(work / f"rank{r}.st")["logits"] - ref).abs().max().item() for r in range(2))
        subprocess.run(["rm", "-rf", str(ckpt)], check=True)
    out["logits_absmax"] = ref.abs().max().item()
    return out


# ---------------------------------------------------------------------------------------------------------------
# speculation = verifier only, and decode speed


def generators(engine: Path):
    """The engine as it runs (its KV plan, tree and CPU weight layout), and a verifier-only generator over the same
    verifier modules and the same KV plan (one copy of the weights in memory)."""
    from bpcompile.core.engine import EngineConfig
    from bpcompile.runtime.generator import Generator
    from bpcompile.runtime.kvcache import KVPlan, kv_store_factory
    from bpcompile.runtime.paged_kv import float_store_factory
    from bpcompile.runtime.speculative import TreeSpec

    spec = Generator.from_engine(engine)
    if (engine / "kv_plan" / "plan.json").is_file():
        factory = kv_store_factory(KVPlan.load(engine / "kv_plan"))
    elif EngineConfig.load(engine).kv_cache.format == "fp16":  # as Generator.from_engine makes it
        factory = float_store_factory(torch.float16)
    else:
        factory = None
    plain = Generator(
        spec.verifier,
        None,
        TreeSpec("none"),
        max_batch_size=spec.max_batch_size,
        max_seq_len=spec.max_seq_len,
        page_size=spec.page_size,
        kv_store_factory=factory,
        max_input_len=spec.max_input_len,
    )
    return spec, plain


def speculation(engine: Path, max_tokens: int) -> dict:
    from bpcompile.runtime.generator import SamplingParams
    from bpcompile.runtime.text import end_ids

    ps = prompts(engine / "tokenizer")
    ends = end_ids(engine / "tokenizer")
    params = SamplingParams(max_tokens=max_tokens, end_id=ends[0], end_ids=tuple(ends[1:]))
    spec, plain = generators(engine)
    t0 = time.perf_counter()
    want = plain.generate(ps, params)
    t1 = time.perf_counter()
    got = spec.generate(ps, params)
    t2 = time.perf_counter()
    same = [a[0] == b[0] for a, b in zip(want, got)]
    first_diff = [
        next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), min(len(a[0]), len(b[0])))
        for a, b, s in zip(want, got, same)
        if not s
    ]
    steps = sum(s.verifier_steps for _, s in got)
    return {
        "prompts": len(ps),
        "max_tokens": max_tokens,
        "end_ids": ends,
        "identical": sum(same),
        "differing_first_token": first_diff,
        "tokens": sum(len(t) for t, _ in got),
        "stopped_on_end_id": sum(len(t) < max_tokens for t, _ in got),
        "tau": round(sum(s.committed for _, s in got) / max(steps, 1), 3),
        "tree": spec.tree.kind,
        "verifier_only_s": round(t1 - t0, 1),
        "speculation_s": round(t2 - t1, 1),
    }


def speed(engine: Path, n: int, max_tokens: int) -> dict:
    """Batch-1 decode tokens/s (generated tokens / wall time after the prompt), interleaved prompt by prompt."""
    import transformers

    from bpcompile.runtime.generator import SamplingParams

    ps = prompts(engine / "tokenizer")
    ps = [ps[i] for i in range(0, len(ps), max(len(ps) // n, 1))][:n]
    spec, plain = generators(engine)
    hf_v = transformers.AutoModelForCausalLM.from_pretrained(MODELS / "verifier", dtype=torch.float32).eval()
    hf_d = transformers.AutoModelForCausalLM.from_pretrained(MODELS / "draft", dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=max_tokens)  # no end id: every run decodes max_tokens
    times = {"verifier only": 0.0, "speculation": 0.0, "transformers assisted": 0.0}
    toks = dict.fromkeys(times, 0)
    for p in ps:
        for name, gen in (("verifier only", plain), ("speculation", spec)):
            t0 = time.perf_counter()
            ((out, _),) = gen.generate([p], params)
            times[name] += time.perf_counter() - t0
            toks[name] += len(out)
        ids = torch.tensor([p])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf_v.generate(ids, assistant_model=hf_d, do_sample=False, max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=151643)  # fmt: skip
        times["transformers assisted"] += time.perf_counter() - t0
        toks["transformers assisted"] += out.shape[1] - len(p)
    rate = {k: round(toks[k] / times[k], 2) for k in times}
    return {
        "prompts": len(ps),
        "max_tokens": max_tokens,
        "tokens_per_s": rate,
        "speculation_vs_verifier": round(rate["speculation"] / rate["verifier only"], 2),
        "speculation_vs_assisted": round(rate["speculation"] / rate["transformers assisted"], 2),
        "threads": torch.get_num_threads(),
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        _rank(int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["parity", "speculation", "speed"])
    ap.add_argument("--engine", type=Path, default=ROOT / "engines" / "qwen2.5-coder" / "1")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=6, help="speed: how many of the 30 prompts")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for which in ("verifier", "draft"):
        if not (MODELS / which / "model.safetensors").is_file():
            raise SystemExit(f"{MODELS / which} is missing: run `.venv/bin/python tools/get_qwen.py`")
    if a.what == "parity":
        ok = True
        with tempfile.TemporaryDirectory(dir=ROOT / ".cache") as work:
            for which in ("draft", "verifier"):
                res = parity(which, Path(work))
                print(json.dumps(res), flush=True)
                ok &= res["tp1"] <= TOL and res["tp2"] <= TOL
        return 0 if ok else 1
    if a.what == "speculation":
        res = speculation(a.engine, a.max_tokens)
        print(json.dumps(res))
        return 0 if res["identical"] == res["prompts"] else 1
    print(json.dumps(speed(a.engine, a.prompts, a.max_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
