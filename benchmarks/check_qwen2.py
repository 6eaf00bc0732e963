"""The Qwen2.5-Coder pair (1.5B verifier, 0.5B draft) against transformers, and speculation against verifier-only.

    .venv/bin/python tools/get_qwen.py                                   # once: fetch and convert the pair
    .venv/bin/bpcompile build recipes/qwen2.5-coder.yaml
    .venv/bin/python benchmarks/check_qwen2.py parity                    # logits, tp 1 and tp 2, both models
    .venv/bin/python benchmarks/check_qwen2.py speculation [--engine engines/qwen2.5-coder/1]
    .venv/bin/python benchmarks/check_qwen2.py generate --json-out gen.json   # the same through `generate`
    .venv/bin/python benchmarks/check_qwen2.py triton --reference gen.json     # ... and through tritonserver
    .venv/bin/python benchmarks/check_qwen2.py speed [--engine ...]      # batch-1 decode, interleaved

parity: each model converted to float32 at tp 1 and at tp 2; bpcompile's forward (tp 1: the one rank file; tp 2:
two processes, each loading only its own rank file) against transformers' Qwen2ForCausalLM on the same 64-token
code prompt; prints the largest absolute logits difference. speculation: 30 prompts (15 code completions sent raw,
15 chat requests through the chat template) x 48 tokens, greedy, through the built engine's own KV plan and
tree, against the same verifier and cache without a draft; stops on every end id. Exit code 1 if a logits
difference exceeds 1e-4 or any output differs. generate: the same 30 prompts one at a time through `bpcompile
generate`'s code (--raw for code, chat template for requests), speculation vs --no-speculation, and --cli of them
through the command itself. triton: the same prompts as text through tritonserver's ensemble, served with the
engine's tree and verifier-only (--reference: also equal to a `generate` run's outputs). speed: decode tokens/s at
batch 1 (float32, --threads), verifier-only and speculation against transformers' assisted generation with the same
two models and its plain greedy generate; each repeat runs our rows in one process and transformers' in another
(one side's weights in memory at a time, the first side alternating), rows rotated within a process, --pause
between runs; per row and per ratio (taken per repeat) the median, min and max over --repeats, and each process's
peak resident memory.
"""

from __future__ import annotations

import os

# Before torch is imported (here and, inherited, in the server and the `generate` commands): OpenMP threads that
# spin while waiting collapse throughput on a busy machine; every row and mode runs with the same setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

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


def prompt_texts(tokenizer_dir: Path) -> list[str]:
    """The 30 prompts as text: code sent raw, chat requests through the chat template."""
    from bpcompile.runtime.text import chat_prompt

    return list(CODE) + [chat_prompt(tokenizer_dir, c) or c for c in CHAT]  # raw where there is no template


def prompts(tokenizer_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return [tok.encode(t).ids for t in prompt_texts(tokenizer_dir)]


def spread(n: int, limit: int) -> list[int]:
    """Indices of `limit` of n prompts spread over code and chat alike (all of them for limit 0)."""
    if not limit or limit >= n:
        return list(range(n))
    return [i * n // limit for i in range(limit)]


def compare(want: list[list[int]], got: list[list[int]]) -> dict:
    """How many outputs are identical, and for the others the first position that differs."""
    same = [a == b for a, b in zip(want, got)]
    first = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b, s in zip(want, got, same)
        if not s
    ]
    return {"prompts": len(want), "identical": sum(same), "differing_first_token": first}


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


def via_generate(engine: Path, max_tokens: int, cli: int, limit: int) -> dict:
    """Each prompt alone (batch 1) through `bpcompile generate`'s own code (`commands.generate_loaded`: --raw for code,
    the chat template for chat requests, every end id), with speculation and with --no-speculation, over one load
    of the engine; and the first `cli` prompts also through the `bpcompile generate` command itself (one process
    per prompt and mode, before the in-process run so that one copy of the weights is in memory at a time)."""
    import contextlib
    import io

    from tokenizers import Tokenizer

    from bpcompile.commands import generate_loaded
    from bpcompile.runtime.text import end_ids

    texts = list(CODE) + list(CHAT)  # as a user types them: `generate` applies the template itself
    raw = [True] * len(CODE) + [False] * len(CHAT)
    pick = spread(len(texts), limit)
    texts, raw = [texts[i] for i in pick], [raw[i] for i in pick]
    command: dict[str, list[list[int]]] = {"speculation": [], "verifier only": []}
    for i in range(cli):
        for name, flag in (("speculation", []), ("verifier only", ["--no-speculation"])):
            cmd = [str(Path(sys.executable).parent / "bpcompile"), "generate", str(engine), "--json", "--no-verify"]
            cmd += ["--max-tokens", str(max_tokens), "--prompt", texts[i], "--raw" if raw[i] else "--chat", *flag]
            run = subprocess.run(cmd, capture_output=True, text=True, check=True)
            command[name].append(json.loads(run.stdout[run.stdout.index("{") :])["tokens"])
    tok = Tokenizer.from_file(str(engine / "tokenizer" / "tokenizer.json"))
    ends = end_ids(engine / "tokenizer", tok)
    spec, plain = generators(engine)
    out: dict[str, list] = {"speculation": [], "verifier only": []}
    wall = dict.fromkeys(out, 0.0)
    steps = committed = 0
    for text, r in zip(texts, raw):
        for name, gen in (("verifier only", plain), ("speculation", spec)):
            with contextlib.redirect_stdout(io.StringIO()):
                res = generate_loaded(gen, engine, tok, text, max_tokens, 0.0, None, ends, True, not r)
            out[name].append(res["tokens"])
            wall[name] += res["wall_s"]
            if name == "speculation":
                steps += res["verifier_steps"]
                committed += res["tau"] * res["verifier_steps"]
        print(f"{len(out['speculation'])}/{len(texts)}", file=sys.stderr, flush=True)
    cmp = compare(out["verifier only"], out["speculation"])
    return {
        **cmp,
        "max_tokens": max_tokens,
        "end_ids": ends,
        "tokens": sum(map(len, out["speculation"])),
        "stopped_on_end_id": sum(len(t) < max_tokens for t in out["speculation"]),
        "tau": round(committed / max(steps, 1), 3),
        "command_prompts": cli,
        "command_identical_to_in_process": all(command[k][i] == out[k][i] for k in command for i in range(cli)),
        "verifier_only_s": round(wall["verifier only"], 1),
        "speculation_s": round(wall["speculation"], 1),
        "picked": pick,
        "outputs": out,
    }


def via_triton(engine: Path, max_tokens: int, concurrency: int, reference: Path | None, limit: int) -> dict:
    """The 30 prompts through tritonserver (gRPC, streaming, the emitted ensemble: the server tokenizes the text
    and stops on every end id the engine lists), served once with the engine's tree and once verifier-only,
    `concurrency` requests at a time (the server batches them); reference: a `generate` run's JSON to compare with."""
    from concurrent.futures import ThreadPoolExecutor

    from bpcompile.serving.client import generate_remote
    from bpcompile.serving.emit import emit_repository
    from bpcompile.serving.serve import ServerProcess

    texts = prompt_texts(engine / "tokenizer")
    pick = spread(len(texts), limit)
    texts = [texts[i] for i in pick]
    out: dict[str, list] = {}
    wall = {}
    with tempfile.TemporaryDirectory(dir=ROOT / ".cache") as tmp:
        for name, tree in (("verifier only", {"kind": "none"}), ("speculation", None)):
            repo = Path(tmp) / name.replace(" ", "-")
            emit_repository([(1, engine)], repo, tree=tree)
            with ServerProcess(repo, log_file=Path(tmp) / f"{repo.name}.log", startup_timeout=900) as s:
                t0 = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as ex:
                    res = list(
                        ex.map(lambda t: generate_remote(s.grpc_url, t, max_tokens=max_tokens, timeout=3600), texts)
                    )
                wall[name] = time.perf_counter() - t0
            out[name] = [r["token_ids"] for r in res]
            taus = [(r.get("tokens_per_step") or 0, r.get("verifier_steps") or 0) for r in res]  # the last: speculation
    cmp = compare(out["verifier only"], out["speculation"])
    steps = sum(n for _, n in taus)
    result = {
        **cmp,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "tokens": sum(map(len, out["speculation"])),
        "stopped_on_end_id": sum(len(t) < max_tokens for t in out["speculation"]),
        "tau": round(sum(t * n for t, n in taus) / max(steps, 1), 3),
        "verifier_only_s": round(wall["verifier only"], 1),
        "speculation_s": round(wall["speculation"], 1),
        "picked": pick,
        "outputs": out,
    }
    if reference is not None:
        ref = json.loads(reference.read_text())
        at = {i: j for j, i in enumerate(ref["picked"])}
        both = [(at[i], j) for j, i in enumerate(pick) if i in at]  # the prompts both runs had
        result["compared_with_generate"] = len(both)
        result["identical_to_generate"] = {k: sum(ref["outputs"][k][a] == out[k][b] for a, b in both) for k in out}
    return result


def _memory() -> dict[str, float]:
    """This process's resident set now (VmRSS; RssAnon: its anonymous part, without mapped files' pages) and at
    its peak so far (VmHWM), in MB: torch's allocations are invisible to tracemalloc, the kernel's counts are not."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def speed_side(cfg: dict) -> dict:
    """One side of a `speed` repeat, in a process of its own so that only that side's weights are in memory: "ours"
    (verifier-only and speculation over one copy of the verifier) or "transformers" (assisted generation and plain
    greedy `generate`, float32, the same checkpoints). After a warm-up run of each row (first-call allocations and
    the one-row layout's timing stay out), each row runs every prompt, the rows in an order rotated by the repeat,
    `pause` seconds before each run. A run's time is its whole generate call (prompt included); every run decodes
    max_tokens (no end id)."""
    torch.set_num_threads(cfg["threads"])
    ps, max_tokens, t0 = cfg["prompts"], cfg["max_tokens"], time.perf_counter()
    if cfg["side"] == "ours":
        from bpcompile.runtime.generator import SamplingParams
        from bpcompile.runtime.model import cpu_layout

        spec, plain = generators(Path(cfg["engine"]))
        params = SamplingParams(max_tokens=max_tokens)
        ours = lambda gen: lambda p: len(gen.generate([p], params)[0][0])  # noqa: E731
        rows = {"verifier only": ours(plain), "speculation": ours(spec)}
        info = {"cpu_weights": cpu_layout(spec.verifier), "tree": spec.tree.kind}
    else:
        import transformers

        load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
        hf_v, hf_d = load(Path(cfg["hf"]) / "verifier"), load(Path(cfg["hf"]) / "draft")

        def hf(**kw):
            def run(p):
                with torch.no_grad():
                    out = hf_v.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_tokens,
                                        min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=cfg["pad"], **kw)  # fmt: skip
                return out.shape[1] - len(p)

            return run

        rows = {"transformers assisted": hf(assistant_model=hf_d), "transformers greedy": hf()}
        info = {"transformers": transformers.__version__}
    load_s, loaded = time.perf_counter() - t0, _memory()
    for f in rows.values():
        f(ps[0][:16])
    names = list(rows)
    k = cfg["repeat"] % len(names)
    order = names[k:] + names[:k]
    n, t = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
    for p in ps:
        for name in order:
            time.sleep(cfg["pause"])
            t0 = time.perf_counter()
            n[name] += rows[name](p)
            t[name] += time.perf_counter() - t0
    short = [x for x in names if n[x] != len(ps) * max_tokens]
    if short:  # tokens/s over runs of unequal length would not compare
        raise SystemExit(
            f"speed: {', '.join(short)} generated {[n[x] for x in short]} tokens, not {len(ps) * max_tokens}"
        )
    return {
        "side": cfg["side"],
        "order": order,
        "threads": torch.get_num_threads(),
        "load_s": round(load_s, 1),
        "memory_mb": {"after_load": loaded, "end": _memory()},
        "rows": {x: {"tokens": n[x], "seconds": round(t[x], 3), "tokens_per_s": round(n[x] / t[x], 3)} for x in names},
        **info,
    }


def _stats(xs: list[float]) -> dict:
    import statistics

    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


BARS = {"speculation_vs_verifier": 1.3, "speculation_vs_assisted": 1.2}


def speed(engine: Path, n: int, max_tokens: int, repeats: int, pause: float, threads: int, hf: Path = MODELS) -> dict:
    """Batch-1 decode tokens/s of four rows: ours (verifier-only, speculation) and transformers' (assisted
    generation with the same two checkpoints, plain greedy generate). Each repeat runs each side in a process of its
    own (`speed_side`: one side's weights in memory at a time, the same threads), the side that goes first
    alternating per repeat. Per row: every repeat's tokens/s, their median, min and max; the ratios are taken per
    repeat (speculation / verifier-only within one process, speculation / assisted and verifier-only / transformers
    greedy between the repeat's two processes) and summarized alike; each process's resident set after loading and
    at its peak."""
    from bpcompile.runtime.text import end_ids

    ps = prompts(engine / "tokenizer")
    ps = [ps[i] for i in spread(len(ps), n)]
    base = {"engine": str(engine), "hf": str(hf), "prompts": ps, "max_tokens": max_tokens, "pause": pause,
            "threads": threads, "pad": end_ids(engine / "tokenizer")[0]}  # fmt: skip
    load = [round(x, 1) for x in os.getloadavg()]
    runs = []
    for r in range(repeats):
        got = {}
        for side in ("ours", "transformers")[:: 1 if r % 2 == 0 else -1]:
            cmd = [sys.executable, __file__, "speed-side"]
            proc = subprocess.run(cmd, input=json.dumps({**base, "side": side, "repeat": r}), stdout=subprocess.PIPE,
                                  text=True)  # fmt: skip
            if proc.returncode:
                raise SystemExit(f"speed: the {side} process of repeat {r} failed (exit {proc.returncode})")
            got[side] = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(got)
        rates = {x: v["tokens_per_s"] for s in got.values() for x, v in s["rows"].items()}
        print(json.dumps({"repeat": r, "first": next(iter(got)), **rates}), file=sys.stderr, flush=True)
    side_of = {"verifier only": "ours", "speculation": "ours", "transformers assisted": "transformers",
               "transformers greedy": "transformers"}  # fmt: skip
    rate = lambda g, row: g[side_of[row]]["rows"][row]["tokens_per_s"]  # noqa: E731
    per = {x: [rate(g, x) for g in runs] for x in side_of}
    ratios = {
        "speculation_vs_verifier": [rate(g, "speculation") / rate(g, "verifier only") for g in runs],
        "speculation_vs_assisted": [rate(g, "speculation") / rate(g, "transformers assisted") for g in runs],
        "verifier_vs_transformers_greedy": [rate(g, "verifier only") / rate(g, "transformers greedy") for g in runs],
    }
    ratio = {k: _stats(v) for k, v in ratios.items()}
    return {
        "prompts": len(ps),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "pause_s": pause,
        "tokens_per_s": {x: _stats(v) for x, v in per.items()},
        "tokens_per_s_each_repeat": per,
        "ratios": ratio,
        "ratios_each_repeat": {k: [round(x, 3) for x in v] for k, v in ratios.items()},
        "bars": {
            k: {"need": b, "median_met": ratio[k]["median"] >= b, "every_repeat_met": ratio[k]["min"] >= b}
            for k, b in BARS.items()
        },  # fmt: skip
        "first_side_each_repeat": [next(iter(g)) for g in runs],
        "memory_mb": {  # per side and repeat: resident after loading and at the end, its anonymous part, the peak
            s: {
                "after_load": [g[s]["memory_mb"]["after_load"]["VmRSS"] for g in runs],
                "anon_after_load": [g[s]["memory_mb"]["after_load"]["RssAnon"] for g in runs],
                "end": [g[s]["memory_mb"]["end"]["VmRSS"] for g in runs],
                "peak": [g[s]["memory_mb"]["end"]["VmHWM"] for g in runs],
            }
            for s in ("ours", "transformers")
        },
        "load_s": {s: [g[s]["load_s"] for g in runs] for s in ("ours", "transformers")},
        "threads": sorted({g[s]["threads"] for g in runs for s in g}),
        "dtype": "float32",
        "cpu_weights": runs[0]["ours"]["cpu_weights"],
        "tree": runs[0]["ours"]["tree"],
        "transformers": runs[0]["transformers"]["transformers"],
        "load_average": {"before": load, "after": [round(x, 1) for x in os.getloadavg()]},
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        _rank(int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "speed-side":  # JSON in on stdin, JSON out on stdout's last line
        print(json.dumps(speed_side(json.loads(sys.stdin.read()))), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["parity", "speculation", "generate", "triton", "speed"])
    ap.add_argument("--engine", type=Path, default=ROOT / "engines" / "qwen2.5-coder" / "1")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=6, help="speed: how many of the 30 prompts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="speed: rounds over the prompts")
    ap.add_argument("--pause", type=float, default=1.0, help="speed: seconds between runs")
    ap.add_argument("--limit", type=int, default=0, help="generate, triton: only this many prompts (0: all 30)")
    ap.add_argument("--cli", type=int, default=2, help="generate: prompts also run as `bpcompile generate` commands")
    ap.add_argument("--concurrency", type=int, default=8, help="triton: requests in flight")
    ap.add_argument("--reference", type=Path, help="triton: a `generate --json-out` file to compare with")
    ap.add_argument("--hf", type=Path, default=MODELS, help="speed: the transformers pair (verifier/, draft/)")
    ap.add_argument("--json-out", type=Path, help="also write the result here (generate: with every output)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    pair = a.hf if a.what == "speed" else MODELS
    bad = [f"{pair / w} is missing: run `.venv/bin/python tools/get_qwen.py`" for w in ("verifier", "draft")
           if not (pair / w / "model.safetensors").is_file()]  # fmt: skip
    if a.what != "parity" and not (a.engine / "engine.json").is_file():
        bad.append(f"--engine {a.engine}: no engine version there (no engine.json); build recipes/qwen2.5-coder.yaml")
    if a.repeats < 1 or a.prompts < 0 or a.max_tokens < 1:
        bad.append("--repeats and --max-tokens must be >= 1, --prompts >= 0")
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 2
    if a.what == "parity":
        ok = True
        with tempfile.TemporaryDirectory(dir=ROOT / ".cache") as work:
            for which in ("draft", "verifier"):
                res = parity(which, Path(work))
                print(json.dumps(res), flush=True)
                ok &= res["tp1"] <= TOL and res["tp2"] <= TOL
        return 0 if ok else 1
    if a.what == "speed":
        res = speed(a.engine, a.prompts, a.max_tokens, a.repeats, a.pause, a.threads, a.hf)
    elif a.what == "speculation":
        res = speculation(a.engine, a.max_tokens)
    elif a.what == "generate":
        res = via_generate(a.engine, a.max_tokens, a.cli, a.limit)
    else:
        res = via_triton(a.engine, a.max_tokens, a.concurrency, a.reference, a.limit)
    if a.json_out:
        a.json_out.write_text(json.dumps(res))
    print(json.dumps({k: v for k, v in res.items() if k != "outputs"}))
    if a.what == "speed":
        return 0
    ok = res["identical"] == res["prompts"] and res.get("command_identical_to_in_process", True)
    agree = all(v == res.get("compared_with_generate") for v in res.get("identical_to_generate", {}).values())
    return 0 if ok and agree else 1


if __name__ == "__main__":
    sys.exit(main())
