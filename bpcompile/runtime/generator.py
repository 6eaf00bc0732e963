"""The native runtime's engine: in-flight batching with tree speculative decoding over paged KV caches.

`Generator` composes the parts, each in its own module:
- `Scheduler` (scheduler.py): admission into the running batch, KV pages reserved up front;
- `Executor` (executor.py): one model over its paged cache (paged_kv.py: paging, attention metadata, the
  attention function), tokens in, logits out;
- `SpeculativeStep` (speculative_step.py): draft a tree per request, verify all trees in one verifier forward,
  accept, compact both caches (the sequence-state conventions are documented there);
- `apply_stops` (request.py): end id, stop words and max_tokens on the committed tokens.
The in-flight loop that serves requests from other threads is inflight.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch

from bpcompile.core.engine import EXECUTORS, EngineConfig, resolve_device
from bpcompile.core.errors import UserError
from bpcompile.core.store import MANIFEST, verify_enabled, verify_version
from bpcompile.core.switches import CUDA_GRAPHS
from bpcompile.runtime.chunked import ChunkedPrefill
from bpcompile.runtime.executor import Executor
from bpcompile.runtime.kvcache import plan_support
from bpcompile.runtime.model import FeatureDraft, Llama, is_feature_draft
from bpcompile.runtime.paged_kv import (
    DenseKV,
    KVStoreFactory,
    PagedKV,
    RecentKV,
    cache_pages,
    float_store_factory,
    kernels_for,
)
from bpcompile.runtime.request import (
    Request,
    RequestStats,
    SamplingParams,
    StepOutput,
    apply_penalties,
    apply_stops,
    keep_logits,
    penalized,
)
from bpcompile.runtime.scheduler import Scheduler
from bpcompile.runtime.speculative import Sampling, TreeSpec, sample
from bpcompile.runtime.speculative_step import SpeculativeStep
from bpcompile.runtime.static_step import MODES as STATIC_MODES
from bpcompile.runtime.static_step import StaticStep, static_support, wants_static

__all__ = ["Generator", "SamplingParams", "StepOutput", "RequestStats", "TreeSpec"]


def _engine_salt(d: Path) -> str:
    """What names an engine version in its pages' block hashes: its directory and its manifest's digest."""
    m = d / "manifest.json"
    return f"{d.resolve()}|{hashlib.sha256(m.read_bytes()).hexdigest() if m.is_file() else ''}"


def _plan_key(store) -> str:
    """A store's KV plan as text, for block hashes (its tensors are the engine's, which the salt names)."""
    plan = getattr(store, "plan", None)
    return "" if plan is None else json.dumps(plan.to_json(), sort_keys=True, default=str)


def _prefix_reuse(given: Optional[bool], recipe) -> Optional[bool]:
    """The prefix-reuse setting: the caller's, else $BPCOMPILE_PREFIX_REUSE's, else the recipe's (auto: None)."""
    from bpcompile.core.switches import prefix_reuse_override

    for value in (given, prefix_reuse_override()):
        if value is not None:
            return value
    return None if recipe == "auto" else recipe


class Generator:
    """Single-threaded in-flight batching engine over a verifier and an optional draft: the scheduler admits
    requests, the executors run the models over their paged caches, the speculative step drafts, verifies and
    compacts, and `apply_stops` turns committed tokens into outputs."""

    def __init__(
        self,
        verifier: Llama,
        draft: Optional[Llama],
        tree: Optional[TreeSpec],
        *,
        max_batch_size: int = 8,
        max_seq_len: int = 512,
        page_size: int = 16,
        num_pages: Optional[int] = None,
        kv_store_factory: Optional[KVStoreFactory] = None,
        device: str = "cpu",
        draft_kv_store_factory: Optional[KVStoreFactory] = None,
        max_input_len: Optional[int] = None,
        dense_kv: bool = True,
        backoff: bool = True,
        executor: str = "torch",
        graphs: Optional[str | Path] = None,
        prefix_reuse: Optional[bool] = None,
        salt: str = "",
        cuda_graphs: str = "auto",
        prefill_chunk: int = 0,
        lookahead: int = 0,
    ):
        """kv_store_factory makes the verifier's KVStore; the draft's comes from draft_kv_store_factory (a KV
        plan describes one model's layers and heads); either defaults to a FloatKVStore in the model's dtype.
        max_input_len: longest prompt accepted (default max_seq_len - 1). dense_kv: where the kernels do not run,
        attend over a per-sequence DenseKV copy of the cache (False: gather from the store every time).
        backoff: draft less or not at all while speculation does not pay (speculative.BackOff).
        executor: "torch" (the models' modules) or "onnxruntime" (their exported step graphs, found in
        graphs/verifier and graphs/draft; bpcompile/compiler/onnx_export.py).
        prefix_reuse: start a prompt from the cached pages of its leading full pages where an earlier prompt
        computed them (`PagedKV` prefix reuse; never with the onnxruntime executor). None: on (outputs equal
        reuse off for every KV plan: the rest of a prompt attends to the prefix as it was computed).
        salt: what identifies the engine in the pages' block hashes.
        cuda_graphs: auto | on | off: steps after prefill from static per-bucket buffers (static_step.py),
        captured as CUDA graphs on CUDA and run eagerly on CPU; auto = on for CUDA where the configuration allows
        it; on where it does not is a UserError naming why.
        prefill_chunk: prompt tokens prefilled per step at most (chunked.py), interleaved with the running
        sequences' steps; 0: every admitted prompt prefills whole in the step that admits it.
        lookahead: entries one step may write per sequence when more than the tree's (eval feeds a text through
        `v_exec.forward` in chains of an engine's tree size without a draft); the caches are sized for it."""
        if executor not in EXECUTORS:
            raise UserError(f"unknown executor {executor!r}; expected one of {', '.join(EXECUTORS)}", key="executor")
        if executor == "onnxruntime" and graphs is None:
            raise UserError("the onnxruntime executor needs the exported graphs' directory", key="executor")
        self.device = torch.device(device)
        self.executor = executor
        self.tree = tree or TreeSpec("none")
        if self.tree.kind != "none" and draft is None:
            raise UserError(f"tree speculation ({self.tree.kind}) needs a draft model")
        if draft is not None and getattr(draft, "reads_features", False) and executor != "torch":
            raise UserError("a feature draft (FeatureDraft) runs with the torch executor only", key="executor")
        if draft is not None and draft.cfg.vocab_size != verifier.cfg.vocab_size:
            raise UserError(f"draft vocabulary {draft.cfg.vocab_size} != verifier vocabulary {verifier.cfg.vocab_size}")
        if max_batch_size < 1 or max_seq_len < 2 or page_size < 1:
            raise UserError("max_batch_size >= 1, max_seq_len >= 2 and page_size >= 1 are required")
        self.verifier = verifier.to(self.device)
        self.draft = draft.to(self.device) if (draft is not None and self.tree.kind != "none") else None
        self.max_batch_size, self.max_seq_len, self.page_size = max_batch_size, max_seq_len, page_size
        self.max_input_len = max_input_len or max_seq_len - 1
        self.g_max = max(self.tree.draft_tokens + 1, lookahead)
        self.num_pages = num_pages or cache_pages(max_batch_size, max_seq_len, self.g_max, page_size)
        if cuda_graphs not in STATIC_MODES:
            raise UserError(
                f"cuda_graphs {cuda_graphs!r}: expected one of {', '.join(STATIC_MODES)}", key="runtime.cuda_graphs"
            )
        self.cuda_graphs = cuda_graphs

        def make(model: Llama, factory: Optional[KVStoreFactory], role: str) -> Executor:
            store = (factory or float_store_factory(model.dtype))(
                model.cfg, self.num_pages, page_size, str(self.device)
            )
            plan = getattr(store, "plan", None)
            exact = plan is not None and plan.has_exact
            static = wants_static(cuda_graphs, self.device)
            if static:
                why = static_support(executor)
                if why is not None and cuda_graphs == "on":
                    raise UserError(f"runtime.cuda_graphs on: {why}; set it to auto or off", key="runtime.cuda_graphs")
                static = why is None
            if executor == "onnxruntime":
                why = plan_support(plan, "onnxruntime") if plan is not None else []
                if why:
                    raise UserError(f"{'; '.join(why)}: use the torch executor for this KV plan", key="executor")
                from bpcompile.runtime.onnx_executor import OnnxExecutor

                return OnnxExecutor(model, PagedKV(store, self.device), self.device, self.g_max, Path(graphs) / role)
            # without the kernels, exact entries are read on the DenseKV path (the static step: its reference)
            dense = (
                DenseKV(store, max_batch_size, max_seq_len + self.g_max + 1, model.dtype, self.device)
                if (dense_kv or exact) and kernels_for(store, self.device) is None and not static
                else None
            )
            recent = (
                RecentKV(store, max_batch_size, plan.sink_tokens, plan.recent_window, self.g_max, self.device)
                if exact
                else None
            )
            ex = Executor(model, PagedKV(store, self.device, dense, recent), self.device, self.g_max, role)
            if static:  # a sequence holds at most max_seq_len + a tree (the draft's: + its catch-up) entries
                ex.static = StaticStep(ex, max_batch_size, max_seq_len + 2 * self.g_max + 2, capture=True)
            return ex

        self.v_exec = make(self.verifier, kv_store_factory, "verifier")
        self.d_exec = make(self.draft, draft_kv_store_factory, "draft") if self.draft is not None else None
        self.vkv = self.v_exec.kv
        self.dkv = self.d_exec.kv if self.d_exec is not None else None
        self.scheduler = Scheduler(max_batch_size, self.vkv.capacity)
        self.spec = SpeculativeStep(self.v_exec, self.d_exec, self.tree, backoff=backoff)
        # A reused page brings the K/V its prefill computed (`PagedKV.raw_pages`) where the store keeps another
        # form, so the rest of the prompt attends as a full prefill does and a plan's exact copies (sink, recent
        # window) are the ones that prefill would write: outputs are identical for every KV plan.
        self.prefix_reuse = prefix_reuse is not False and executor == "torch"
        for ex in (self.v_exec, self.d_exec):
            if ex is not None:
                ex.reuse = self.prefix_reuse
        self._salts = {
            role: f"{salt}|{role}|{type(k.store).__name__}|{getattr(k.store, 'dtype', '')}|{_plan_key(k.store)}".encode()
            for role, k in (("verifier", self.vkv), ("draft", self.dkv))
            if k is not None
        }
        self.prefix_stats = {"prompt_tokens": 0, "reused_tokens": 0, "requests": 0, "hits": 0}
        self.outbox: list[StepOutput] = []
        if prefill_chunk < 0:
            raise UserError(f"prefill_chunk must be >= 0 (0: off), got {prefill_chunk}", key="prefill_chunk")
        self.chunks = ChunkedPrefill(self, prefill_chunk) if prefill_chunk else None
        self.tp, self.peers = 1, None  # from_engine sets them for a tensor-parallel engine

    # ------------------------------------------------------------------------------------------ API

    @classmethod
    def from_engine(
        cls,
        engine_dir,
        *,
        tree: Optional[TreeSpec] = None,
        device: Optional[str] = None,
        kv_store_factory: Optional[KVStoreFactory] = None,
        draft_kv_store_factory: Optional[KVStoreFactory] = None,
        executor: Optional[str] = None,
        tp: Optional[int] = None,
        pack: bool = True,
        verify: Optional[bool] = None,
        cuda_graphs: Optional[str] = None,
        prefix_reuse: Optional[bool] = None,
        prefill_chunk: Optional[int] = None,
        _rank: int = 0,
        _group=None,
    ) -> "Generator":
        """Load engine_dir/verifier, engine_dir/draft (converted checkpoints), the engine config
        (engine.json: speculative tree, limits, KV page size and format, executor) and, unless a factory is
        given, the verifier's KV plan in engine_dir/kv_plan (float cache without one). executor overrides the
        engine's runtime.executor; onnxruntime runs the graphs in engine_dir/onnx. The models compute in their
        checkpoints' dtype (the recipe's models.*.dtype).

        tp: tensor-parallel size to run at: 1 merges the rank files into one process; the checkpoint's own tp
        runs one process per rank (runtime/tp.py; call `close()` to stop them). Default: the engine's
        parallel.tp when its pp is 1, else 1. pack: on CPU with the torch executor, lay float32 models' weights
        out as the engine's runtime.cpu_weights says (`Llama.pack_for_cpu`; False keeps plain modules, e.g. for
        ONNX export). device: cpu, cuda, cuda:N or auto (default: the engine's runtime.device; UserError when it
        needs CUDA and torch sees none).
        verify: first check the version's files against its manifest.json (core/store.py `verify_version`:
        UserError naming a changed file; about 1-2 s per GB); default: yes unless $BPCOMPILE_VERIFY is 0. A
        directory without a manifest (assembled by hand, not published by a build) has nothing to check against.
        cuda_graphs: auto | on | off (see __init__); default: $BPCOMPILE_CUDA_GRAPHS (`--cuda-graphs`), else the
        engine's runtime.cuda_graphs.
        prefix_reuse: overrides the engine's runtime.prefix_reuse (None: $BPCOMPILE_PREFIX_REUSE, `--prefix-reuse`,
        else the engine's).
        prefill_chunk: prompt tokens prefilled per step (0: off), overriding the engine's runtime.prefill_chunk.
        _rank/_group: a worker rank's own load (runtime/tp.py)."""
        d = Path(engine_dir)
        if verify_enabled(verify) and _rank == 0 and (d / MANIFEST).is_file():  # before rank 0 starts the others
            verify_version(d)
        if not (d / "verifier" / "config.json").is_file():
            raise UserError(f"{d}: no converted verifier checkpoint (expected {d / 'verifier' / 'config.json'})")
        cfg = EngineConfig.load(d)
        device = resolve_device(device, cfg.runtime.device)
        if tp is None:
            tp = cfg.parallel.tp if cfg.parallel.pp == 1 else 1
        if tp != 1 and tp != cfg.parallel.tp:
            raise UserError(
                f"{d} was converted for tp={cfg.parallel.tp}: run it at tp {cfg.parallel.tp} or 1 "
                f"(merged), or rebuild with parallel.tp: {tp}",
                key="tp",
            )
        cuda_graphs = cuda_graphs or os.environ.get(CUDA_GRAPHS) or cfg.runtime.cuda_graphs
        if tp > 1:
            if cfg.parallel.pp != 1:
                raise UserError(
                    f"{d} has pp={cfg.parallel.pp}: the native runtime runs tensor parallelism only; "
                    "run it at tp 1 (ranks merged)",
                    key="tp",
                )
            if kv_store_factory is not None or draft_kv_store_factory is not None:
                raise UserError(
                    "tp > 1 runs the engine's own KV plan (each rank takes its heads' share); "
                    "custom KV store factories are for tp 1",
                    key="tp",
                )
            if _rank == 0:  # gloo on CPU, NCCL on CUDA (rank r on the r-th device from the requested one)
                from bpcompile.runtime.tp import rank_devices

                rank_devices(device, tp)
            if (executor or cfg.runtime.executor) != "torch":
                raise UserError(
                    "tensor parallelism runs with the torch executor (the ONNX graphs are exported unsplit)", key="tp"
                )
        spec, limits, kv = cfg.speculative, cfg.limits, cfg.kv_cache
        has_draft = (d / "draft" / "config.json").is_file()
        if tree is None:
            tree = TreeSpec(
                spec.tree if has_draft else "none", length=spec.length, choices=spec.choices, nodes=spec.nodes
            )
        if tree.kind != "none" and not has_draft:
            raise UserError(f"{d}: tree {tree.kind!r} needs a draft checkpoint at {d / 'draft'}")
        if kv_store_factory is None and (d / "kv_plan" / "plan.json").is_file():
            # the engine's calibrated KV plan (INT4/FP8 units) describes the verifier's cache
            from bpcompile.runtime.kvcache import KVPlan
            from bpcompile.runtime.kvcache import kv_store_factory as plan_factory

            plan = KVPlan.load(d / "kv_plan")
            kv_store_factory = plan_factory(plan.shard(_rank, tp) if tp > 1 else plan)
        elif kv_store_factory is None and kv.format == "fp16":
            kv_store_factory = float_store_factory(torch.float16)  # an FP16 cache whatever the model's dtype
        executor = executor or cfg.runtime.executor
        if executor == "onnxruntime" and not (d / "onnx" / "verifier" / "step.onnx").is_file():
            raise UserError(
                f"{d}: no exported graphs for the onnxruntime executor (expected {d / 'onnx'}); "
                "rebuild with runtime.onnx: true",
                key="executor",
            )
        group, peers = _group, None
        if tp > 1 and _rank == 0:
            from bpcompile.runtime import tp as tensor_parallel

            # every rank takes the static step or none: rank 0 sends its steps as run_static calls
            shared = {"tree": asdict(tree), "prefix_reuse": prefix_reuse, "cuda_graphs": cuda_graphs}
            peers = tensor_parallel.launch(d, tp, shared, device)
            group = peers.group
        try:
            load = (
                (lambda role: Llama.from_rank(d / role, _rank, tp, group, dtype=None))
                if tp > 1
                else (lambda role: Llama.from_checkpoint(d / role, dtype=None))
            )
            verifier = load("verifier")
            draft = None
            if tree.kind != "none":
                feature = is_feature_draft(d / "draft")
                if feature and tp > 1:
                    raise UserError(f"{d}: its feature draft runs at tp 1", key="tp")
                draft = FeatureDraft.from_dir(d / "draft", verifier) if feature else load("draft")
            layout = cfg.runtime.cpu_weights
            if pack and layout != "plain" and executor == "torch" and torch.device(device).type == "cpu":
                for m in (verifier, draft):
                    if m is not None:
                        m.pack_for_cpu(layout)
            gen = cls(
                verifier,
                draft,
                tree,
                max_batch_size=limits.max_batch_size,
                max_seq_len=limits.max_seq_len,
                page_size=kv.page_size,
                kv_store_factory=kv_store_factory,
                device=device,
                draft_kv_store_factory=draft_kv_store_factory,
                max_input_len=limits.max_input_len,
                backoff=spec.backoff,
                executor=executor,
                graphs=d / "onnx",
                # at tp > 1 rank 0 decides which pages a prompt reuses; every rank keeps and fills its own
                # heads' copies of them (Executor.adopt / publish over the tensor channel)
                prefix_reuse=_prefix_reuse(prefix_reuse, cfg.runtime.prefix_reuse),
                salt=_engine_salt(d),
                cuda_graphs=cuda_graphs,
                prefill_chunk=cfg.runtime.prefill_chunk if prefill_chunk is None else prefill_chunk,
            )
            if peers is not None:
                peers.wait_ready()
        except BaseException:
            if peers is not None:
                peers.kill()
            raise
        gen.tp = tp
        if peers is not None:
            gen.peers = peers
            for ex in (gen.v_exec, gen.d_exec):
                if ex is not None:
                    ex.peers = gen.peers
        return gen

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (no-op at tp 1). The engine cannot run after it."""
        if self.peers is not None:
            self.peers.close()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: Optional[str] = None) -> str:
        p, V = params, self.verifier.cfg.vocab_size
        if len(prompt_ids) > self.max_input_len:
            raise UserError(
                f"prompt has {len(prompt_ids)} tokens, more than limits.max_input_len ({self.max_input_len})",
                key="max_input_len",
            )
        if not prompt_ids or not all(isinstance(t, int) and 0 <= t < V for t in prompt_ids):
            raise UserError(f"prompt must be a non-empty list of token ids in [0, {V})")
        if p.max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1 (got {p.max_tokens})", key="max_tokens")
        if p.context_logits and self.executor != "torch":
            raise UserError(
                "context logits need the torch executor (the exported prefill graph returns the last "
                "position's logits only)",
                key="context_logits",
            )
        if len(prompt_ids) + p.max_tokens > self.max_seq_len:
            raise UserError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({p.max_tokens}) exceeds max_seq_len "
                f"({self.max_seq_len})",
                key="max_tokens",
            )
        # `not (x >= 0)` rather than `x < 0`: NaN fails every comparison and would slip through.
        if not (0 <= p.temperature < math.inf) or p.top_k < 0 or not (0 < p.top_p <= 1):
            raise UserError("a finite temperature >= 0, top_k >= 0 and 0 < top_p <= 1 are required")
        if not (0 < p.repetition_penalty < math.inf) or not all(
            math.isfinite(x) for x in (p.presence_penalty, p.frequency_penalty)
        ):
            raise UserError(
                "repetition_penalty must be a finite number > 0 (1 = off), presence_penalty and "
                "frequency_penalty finite numbers (0 = off)",
                key="repetition_penalty",
            )
        if not (0 <= p.min_tokens <= p.max_tokens):
            raise UserError(
                f"min_tokens must be in [0, max_tokens = {p.max_tokens}] (got {p.min_tokens})", key="min_tokens"
            )
        rid = request_id or uuid.uuid4().hex
        if rid in self.scheduler:
            raise UserError(f"request id {rid!r} is already in use")
        pages = -(-(len(prompt_ids) + p.max_tokens + self.g_max) // self.page_size)
        if pages > self.vkv.capacity:
            raise UserError(f"request needs {pages} KV pages, the cache has {self.vkv.capacity}")
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, ()).item())
        rng = torch.Generator().manual_seed(seed)
        s = Sampling(p.temperature, p.top_k, p.top_p, rng)
        self.scheduler.add(Request(rid, list(prompt_ids), p, s, tokens=list(prompt_ids), pages=pages))
        return rid

    def cancel(self, request_id: str) -> None:
        r = self.scheduler.drop_waiting(request_id)
        if r is not None:
            self.outbox.append(StepOutput(r.id, [], True, "cancelled", r.stats))
        r = self.scheduler.running.get(request_id)
        if r is not None:
            self._release(r)
            self.outbox.append(StepOutput(r.id, [], True, "cancelled", r.stats))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.outbox)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outs, self.outbox = self.outbox, []
        old = [r for r in self.scheduler.running.values() if r.v_len]  # prefilled (not part-way: chunked.py)
        new = self.scheduler.admit()
        if self.chunks is not None:
            outs += self.chunks.run(new)
        elif new:
            outs += self._prefill(new)
        if old:
            committed = self.spec.run(old)
            outs += [self._emit(r, toks) for r, toks in zip(old, committed)]
        return outs

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_token: Optional[Callable[[int, list[int]], None]] = None,
    ) -> list[tuple[list[int], RequestStats]]:
        """Run prompts to completion; on_token(prompt_index, new_tokens) streams."""
        index = {self.add_request(p, params): i for i, p in enumerate(prompts)}
        res: list = [None] * len(prompts)
        toks: list[list[int]] = [[] for _ in prompts]
        while self.has_work():
            for o in self.step():
                i = index.get(o.request_id)
                if i is None:
                    continue
                toks[i] += o.new_tokens
                if on_token and o.new_tokens:
                    on_token(i, o.new_tokens)
                if o.finished:
                    res[i] = (toks[i], o.stats)
        return res

    # views for callers and benchmarks

    @property
    def running(self) -> dict[str, Request]:
        return self.scheduler.running

    @property
    def reserved(self) -> int:
        return self.scheduler.reserved

    @property
    def forwards(self) -> dict[str, int]:
        """Batched forwards after prefill, per model."""
        return {"draft": self.d_exec.forwards if self.d_exec is not None else 0, "verifier": self.v_exec.forwards}

    # ------------------------------------------------------------------------------------ internals

    def _release(self, r: Request) -> None:
        if self.chunks is not None:
            self.chunks.drop(r.id)
        self.vkv.release(r.id)
        if self.dkv is not None:
            self.dkv.release(r.id)
        self.scheduler.finish(r)

    def _pick(self, r: Request, row: torch.Tensor) -> int:
        if r.sampling.greedy:
            return int(row.argmax())
        return sample(r.sampling.probs(row), r.sampling.rng)[0]

    def _prefill(self, reqs: list[Request]) -> list[StepOutput]:
        if not self.prefix_reuse:
            return self._prefill_group(reqs, [0] * len(reqs))
        # Rounds: a prompt whose next uncached block another prompt of this round computes waits for the next
        # round (same step), where it finds it cached: prompts admitted together share their prefix too.
        outs, pending = [], reqs
        while pending:
            now, later, coming = [], [], set()
            for r in pending:
                hv = self.vkv.block_hashes(r.prompt, self._salts["verifier"])
                hd = self.dkv.block_hashes(r.prompt, self._salts["draft"]) if self.dkv is not None else hv
                pv = self.vkv.match(hv)
                pd = self.dkv.match(hd) if self.dkv is not None else pv
                limit = self._reuse_limit(r)
                n = min(len(pv), len(pd), limit)
                if n < limit and hv[n] in coming:  # (a prompt its limit stops waits for nothing)
                    later.append(r)
                    continue
                coming.update(hv[n:])
                self.v_exec.adopt(r.id, pv[:n])
                if self.d_exec is not None:
                    self.d_exec.adopt(r.id, pd[:n])
                now.append((r, n * self.page_size, hv, hd))
            full = [x for x in now if x[1] == 0]
            cached = [x for x in now if x[1] > 0]
            for group in (full, cached):
                if group:
                    outs += self._prefill_group([x[0] for x in group], [x[1] for x in group], group)
            pending = later
        return outs

    def _reuse_limit(self, r: Request) -> int:
        """Full pages of r's prompt it may take from the cache: at least one token is computed (its logits
        pick the first output), and a request for every prompt position's logits computes them all."""
        if r.params.context_logits:
            return 0
        return (len(r.prompt) - 1) // self.page_size

    def _publish(self, group: list) -> None:
        """Cache the full prompt pages of a prefilled group; a feature draft's verifier pages keep their last
        token's feature (the draft's row after a reused prefix reads it)."""
        feats = self.spec.features and self.d_exec is not None
        h = self.v_exec.hidden if feats else None
        aux = None
        if feats:
            aux = lambda b: lambda i: h[b, (i + 1) * self.page_size - 1 - group[b][1]].clone()  # noqa: E731
        self.v_exec.publish([(r, start, hv) for r, start, hv, _ in group], aux)
        if self.d_exec is not None:
            self.d_exec.publish([(r, start, hd) for r, start, _, hd in group])
        for r, start, *_ in group:
            self.prefix_stats["requests"] += 1
            self.prefix_stats["prompt_tokens"] += len(r.prompt)
            self.prefix_stats["reused_tokens"] += start
            self.prefix_stats["hits"] += start > 0
            r.stats.reused_tokens = start
            r.stats.reused_blocks = start // self.page_size

    def _prefill_group(
        self, reqs: list[Request], starts: list[int], publish: Optional[list] = None
    ) -> list[StepOutput]:
        """Prefill prompts whose first starts[b] entries are cached (all 0: the plain prefill); publish: their
        pages' block hashes (`_publish`), with prefix reuse."""
        t0 = time.perf_counter()
        cached = any(starts)
        if cached:
            last = self.v_exec.prefill_cached(reqs, starts)
        elif any(r.params.context_logits for r in reqs):  # every prompt position's logits, not only the last
            full = self.v_exec.prefill(reqs, True, all_logits=True)
            for b, r in enumerate(reqs):
                if r.params.context_logits:
                    r.context_logits = full[b, : len(r.prompt)].float().cpu()
            last = full[torch.arange(len(reqs)), torch.tensor([len(r.prompt) - 1 for r in reqs])]
        else:
            last = self.v_exec.prefill(reqs, True)
        if any(penalized(r.params) for r in reqs):
            last = torch.stack(
                [
                    apply_penalties(last[b], r.params, r.prompt, 0) if penalized(r.params) else last[b]
                    for b, r in enumerate(reqs)
                ]
            )
        first = [self._pick(r, last[b]) for b, r in enumerate(reqs)]
        for b, (r, t) in enumerate(zip(reqs, first)):
            keep_logits(r, last[b : b + 1], [t])
        t1 = time.perf_counter()
        if self.d_exec is not None:
            feats = None
            if self.spec.features:  # the row of prompt token i reads the verifier's feature at i - 1
                h = self.v_exec.hidden
                if cached:  # the row after a reused prefix reads the feature its last page kept
                    first_feat = torch.stack(
                        [self.vkv.aux[self.vkv.tables[r.id][m // self.page_size - 1]] for r, m in zip(reqs, starts)]
                    )
                else:
                    first_feat = h.new_zeros(h.shape[0], h.shape[2])
                feats = torch.cat((first_feat[:, None].to(h.dtype), h[:, :-1]), 1)
                for b, (r, m) in enumerate(zip(reqs, starts)):
                    n = len(r.prompt) - m
                    r.feats = h[b, n - 1 : n].clone()
            if cached:
                self.d_exec.prefill_cached(reqs, starts, False, feats=feats)
            else:
                self.d_exec.prefill(reqs, False, feats=feats)
        if publish is not None:  # before a request that ends here releases its pages
            self._publish(publish)
        t2 = time.perf_counter()
        outs = []
        for r, t in zip(reqs, first):
            r.v_len = r.d_len = len(r.prompt)
            r.tokens.append(t)
            r.stats.verify_s += t1 - t0
            r.stats.draft_s += t2 - t1
            outs.append(self._emit(r, [t]))
        t3 = time.perf_counter()
        for r in reqs:
            r.stats.bookkeeping_s += t3 - t2
        return outs

    def _emit(self, r: Request, toks: list[int]) -> StepOutput:
        out = apply_stops(r, toks)
        if out.finished:
            self._release(r)
        return out
