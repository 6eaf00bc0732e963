"""ONNX export of each model's step graphs, with the KV cache and attention as custom-op nodes.

Two graphs per model (verifier, draft), both over the runtime's paged cache:
- prefill.onnx: prompts (right-padded) through the model; each layer appends its K/V to the cache and attends
  causally over the prompt's own unquantized K/V (as TensorRT-LLM's context phase does); logits of each
  prompt's last token.
- step.onnx: new tokens at given positions (a decode step, a draft round or a whole tree to verify); each layer
  appends its K/V and attends over the paged cache (committed context + tree region, packed tree mask).
Inputs, outputs and the custom ops are described in bpcompile/runtime/plugin_ops.py; the KV pools go in and
their updated versions come out (TensorRT aliases them). Weights are external data next to each graph.

The graphs are traced from the runtime's own module tree (`Llama`'s blocks and their `attend` seam) with the
TorchScript-based exporter: its autograd-Function `symbolic` hook emits a custom node in one line, where the
torch.export-based exporter needs a torch.library op, a fake kernel and an onnxscript translation per op.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch

from bpcompile.core.errors import UserError
from bpcompile.runtime import plugin_ops as ops
from bpcompile.runtime.kvcache import plan_support
from bpcompile.runtime.model import Llama, causal_attend, rms_norm

OPSET = 17


class _Node(torch.autograd.Function):
    """One custom-op node: runs the op's PyTorch reference while tracing, exports as `DOMAIN::op`."""

    @staticmethod
    def forward(ctx, op: str, attrs: tuple, n_out: int, *tensors):
        state = torch._C._get_tracing_state()  # the node is opaque: its reference runs untraced
        torch._C._set_tracing_state(None)
        try:
            out = ops.REFERENCE[op](*tensors, **dict(attrs))
        finally:
            torch._C._set_tracing_state(state)
        return tuple(out) if isinstance(out, list) else out

    @staticmethod
    def symbolic(g, op: str, attrs: tuple, n_out: int, *tensors):
        kw = {f"{k}_{'f' if k in ops.FLOAT_FIELDS else 'i'}": v for k, v in attrs}
        out = g.op(
            f"{ops.DOMAIN}::{op}",
            *tensors,
            plugin_version_s=ops.PLUGIN_VERSION,
            plugin_namespace_s=ops.PLUGIN_NAMESPACE,
            outputs=n_out,
            **kw,
        )
        outs = out if n_out > 1 else (out,)
        # appends return the pools (same types as their inputs); attention returns q's type
        like = tensors[3 : 3 + n_out] if n_out > 1 else tensors[:1]
        for o, t in zip(outs, like):
            o.setType(t.type())
        return out


class StepGraph(torch.nn.Module):
    """One model's prefill or step graph over its KV store (the store's kind and plan fix the custom ops and the
    graph arithmetic around them; the pools themselves are inputs)."""

    def __init__(self, model: Llama, store, kind: str, max_positions: int):
        super().__init__()
        self.model, self.store, self.kind = model, store, kind
        self.cos, self.sin = model.rope_tables(max_positions)
        c = model.cfg
        self.quant = ops.is_quantized(store)
        self.n_pools = len(ops.pool_names(store))
        base = {"num_kv_heads": c.num_kv_heads, "head_size": c.head_size, "page_size": store.page_size}
        if self.quant:
            base["group_size"] = store.G
        self.append_op = ops.QUANT_APPEND if self.quant else ops.FLOAT_APPEND
        self.attn_op = ops.QUANT_ATTENTION if self.quant else ops.FLOAT_ATTENTION
        self.base = base

    def input_names(self) -> list[str]:
        head = (
            ["tokens", "last_index", "slots"]
            if self.kind == "prefill"
            else ["tokens", "positions", "slots", *ops.ATTENTION_META]
        )
        return head + list(ops.pool_names(self.store)) + list(ops.tables_of(self.store))

    def output_names(self) -> list[str]:
        return ["logits"] + [f"{n}_out" for n in ops.pool_names(self.store)]

    def _attrs(self, op: str, layer: int) -> tuple:
        vals = {**self.base, "layer": layer, "num_splits": 0, "sm_scale": self.model.cfg.head_size**-0.5}
        return tuple((k, vals[k]) for k in ops.FIELDS[op])

    def forward(self, *inputs):
        names = self.input_names()
        x = dict(zip(names, inputs))
        pools = [x[n] for n in ops.pool_names(self.store)]
        tables = [x[n] for n in ops.tables_of(self.store)]
        model, store, c = self.model, self.store, self.model.cfg
        tokens, slots = x["tokens"], x["slots"]
        B, T = tokens.shape
        positions = x.get("positions")
        if positions is None:
            positions = torch.arange(T).expand(B, T)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]

        def append(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            k, v = k.reshape(-1, c.num_kv_heads, c.head_size), v.reshape(-1, c.num_kv_heads, c.head_size)
            if self.quant and store.transformed:  # centering, channel scale, rotation: plain graph arithmetic
                k, v = (t.to(k.dtype) for t in store.transform(layer, k, v))
            extra = tables if self.quant else []
            pools[:] = _Node.apply(
                self.append_op, self._attrs(self.append_op, layer), self.n_pools, k, v, slots, *pools, *extra
            )

        def attend_prefill(layer, q, k, v):
            append(layer, k, v)
            return causal_attend(q, k, v)

        def attend_step(layer, q, k, v):
            append(layer, k, v)
            meta = [x[n] for n in ops.ATTENTION_META]
            qq = store.kernel_query(layer, q).to(q.dtype) if self.quant and store.transformed else q
            extra = tables[:3] if self.quant else []
            out = _Node.apply(self.attn_op, self._attrs(self.attn_op, layer), 1, qq, *meta, *pools, *extra)
            return store.kernel_output(out).to(q.dtype) if self.quant and store.transformed else out

        attend = attend_prefill if self.kind == "prefill" else attend_step
        h = torch.nn.functional.embedding(tokens, model.embed)
        for i, blk in enumerate(model.layers):
            h = blk(h, cos, sin, i, attend)
        if self.kind == "prefill":
            h = h[torch.arange(B), x["last_index"]][:, None]
        logits = model.head(rms_norm(h, model.norm, c.norm_eps))[..., : c.vocab_size].float()
        return (logits[:, 0] if self.kind == "prefill" else logits, *pools)


def _example(graph: StepGraph) -> tuple:
    """Inputs to trace with: two sequences of three tokens on pages 1 and 2 (any valid values do)."""
    store = graph.store
    ps = store.page_size
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    slots = torch.tensor([ps, ps + 1, ps + 2, 2 * ps, 2 * ps + 1, 2 * ps + 2])
    head = (
        [tokens, torch.tensor([2, 2]), slots]
        if graph.kind == "prefill"
        else [
            tokens,
            torch.tensor([[0, 1, 2], [0, 1, 2]]),
            slots,
            torch.tensor([[1], [2]], dtype=torch.int32),
            torch.tensor([0, 0], dtype=torch.int32),
            torch.tensor([3, 3], dtype=torch.int32),
            torch.tensor([3, 3], dtype=torch.int32),
            torch.tensor([[[1], [3], [7]]] * 2, dtype=torch.int32),
        ]
    )
    return tuple(head + ops.pools_of(store) + list(ops.tables_of(store).values()))


def _dynamic_axes(graph: StepGraph) -> dict:
    pages = 0 if graph.quant else 1  # quantized pools [P, U, S, X]; float pools [L, P, KV, S, D]
    ax = {
        "tokens": {0: "batch", 1: "tokens"},
        "positions": {0: "batch", 1: "tokens"},
        "slots": {0: "entries"},
        "last_index": {0: "batch"},
        "block_tables": {0: "batch", 1: "pages_per_sequence"},
        "context_lens": {0: "batch"},
        "tree_lens": {0: "batch"},
        "q_lens": {0: "batch"},
        "tree_mask": {0: "batch", 1: "tokens", 2: "mask_words"},
        "logits": {0: "batch"} if graph.kind == "prefill" else {0: "batch", 1: "tokens"},
    }
    for n in ops.pool_names(graph.store):
        ax[n] = ax[f"{n}_out"] = {pages: "pages"}
    names = set(graph.input_names()) | set(graph.output_names())
    return {k: v for k, v in ax.items() if k in names}


def export_model(model: Llama, store, out_dir: Path, max_positions: int) -> dict:
    """prefill.onnx and step.onnx (each with its weights as external data) for one model over its store."""
    import onnx

    # the graphs' ops take only what the support table says the step graphs read (a KLT unit's keys need their
    # positions, exact entries their copies): refuse before tracing rather than fail inside it
    why = plan_support(store.plan, "onnxruntime") if ops.is_quantized(store) else []
    if why:
        raise UserError(f"cannot export ONNX step graphs for this KV plan: {'; '.join(why)}", key="kv_cache")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for kind in ("prefill", "step"):
        graph = StepGraph(model, store, kind, max_positions).eval()
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notes
            raw = Path(tmp) / "graph.onnx"
            torch.onnx.export(
                graph,
                _example(graph),
                str(raw),
                dynamo=False,
                opset_version=OPSET,
                input_names=graph.input_names(),
                output_names=graph.output_names(),
                dynamic_axes=_dynamic_axes(graph),
                custom_opsets={ops.DOMAIN: 1},
            )
            m = onnx.load(str(raw))
        m.doc_string = f"bpcompile {kind} graph: custom ops per bpcompile/runtime/plugin_ops.py"
        path = out_dir / f"{kind}.onnx"
        onnx.save_model(
            m,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=f"{kind}.weights",
            size_threshold=1024,
        )
        (out_dir / f"{kind}.weights").chmod(0o644)  # onnx creates it owner-only; the version is read by servers
        files[kind] = path.name
    return files


def export_generator(gen, out_dir: str | Path) -> dict:
    """The step graphs of a Generator's models over the caches it built (its plan, page size, dtypes) into
    out_dir/verifier and out_dir/draft; what the onnxruntime executor of an identically configured Generator
    loads."""
    out_dir = Path(out_dir)
    max_positions = max(gen.verifier.cfg.max_position_embeddings, gen.max_seq_len + gen.g_max + 1)
    roles = {"verifier": gen.v_exec}
    if gen.d_exec is not None:
        roles["draft"] = gen.d_exec
    return {role: export_model(ex.model, ex.kv.store, out_dir / role, max_positions) for role, ex in roles.items()}


def export_engine(engine_dir: str | Path) -> dict:
    """export_generator for the Generator an engine version makes (its limits, KV plan, tree), into
    engine_dir/onnx; each graph checked by onnx.checker with full shape inference."""
    import onnx

    from bpcompile.runtime.generator import Generator

    d = Path(engine_dir)
    gen = Generator.from_engine(d, executor="torch", pack=False)  # the exporter traces plain linears
    files = export_generator(gen, d / "onnx")
    nodes, size = {}, 0
    for role, graphs in files.items():
        for kind, name in graphs.items():
            path = d / "onnx" / role / name
            onnx.checker.check_model(str(path), full_check=True)
            m = onnx.load(str(path), load_external_data=False)
            custom = sorted({n.op_type for n in m.graph.node if n.domain == ops.DOMAIN})
            nodes[f"{role}/{kind}"] = custom
            size += sum(f.stat().st_size for f in path.parent.glob(f"{kind}.*"))
    return {
        "detail": f"{sum(len(g) for g in files.values())} graphs, {size / 1e6:.1f} MB, custom ops "
        f"{sorted({o for v in nodes.values() for o in v})}",
        "graphs": nodes,
    }
