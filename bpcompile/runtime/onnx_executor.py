"""The onnxruntime executor: a model's exported step graphs (bpcompile/compiler/onnx_export.py) run by ONNX Runtime
on the runtime's own paged cache, in place of the torch executor.

The custom-op nodes run their PyTorch reference implementations (runtime/plugin_ops.py) as onnxruntime-extensions
Python ops. That bridge declares one element type per input and has no 16-bit floats, so a float-cache op is
registered once per pool dtype, the graph this executor loads names the variant (`BpFloatKVAppend` ->
`BpFloatKVAppend_float16`) and fp16 edges cross the bridge as float32 (exact); the files on disk keep the
plugin names. The executor binds the store's pools on every call and writes the
updated pools back into the store (the bridge copies them: this is a correctness path, not a fast one)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from bpcompile.core.errors import MissingDependency, UserError
from bpcompile.kernels.tree_mask import pack_rows
from bpcompile.runtime import plugin_ops as ops
from bpcompile.runtime.executor import Executor
from bpcompile.runtime.kvcache import plan_support, reader_precisions
from bpcompile.runtime.model import Llama
from bpcompile.runtime.paged_kv import PagedKV
from bpcompile.runtime.request import Request

# registered op name -> (true input dtypes, true output dtypes); the bridge has no 16-bit floats, so those
# cross it as float32 (a Cast on each side in the loaded graph, exact) and the op gets its true dtype back
_REGISTERED: dict[str, tuple[list[torch.dtype], list[torch.dtype]]] = {}
_WIDE = (torch.float16, torch.bfloat16)


def _ort():
    try:
        import onnxruntime
        import onnxruntime_extensions
    except ImportError as e:
        raise MissingDependency(
            f"the onnxruntime executor needs onnxruntime and onnxruntime-extensions ({e}); "
            "pip install 'bpcompile[onnx]'",
            key="executor",
        ) from None
    return onnxruntime, onnxruntime_extensions


def _dt(dtype: torch.dtype):
    from onnxruntime_extensions import PyCustomOpDef as D

    return {
        torch.float32: D.dt_float,
        torch.uint8: D.dt_uint8,
        torch.int8: D.dt_int8,
        torch.int32: D.dt_int32,
        torch.int64: D.dt_int64,
    }[torch.float32 if dtype in _WIDE else dtype]


def _register(op: str, name: str, inputs: list[torch.dtype], outputs: list[torch.dtype]) -> None:
    """One Python custom op `name` running op's reference on the arrays (as torch tensors of their true dtype)."""
    if name in _REGISTERED:
        return
    _, ox = _ort()
    D = ox.PyCustomOpDef
    attrs = {f: (D.dt_float if f in ops.FLOAT_FIELDS else D.dt_int64) for f in ops.FIELDS[op]}
    attrs.update(plugin_version=D.dt_string, plugin_namespace=D.dt_string)
    ref = ops.REFERENCE[op]

    def run(*arrays, **kw):
        out = ref(*(torch.from_numpy(np.array(a)).to(t) for a, t in zip(arrays, inputs)), **kw)
        out = out if isinstance(out, list) else [out]
        res = tuple((t.float() if t.dtype in _WIDE else t).numpy() for t in out)
        return res if len(res) > 1 else res[0]

    ox.onnx_op(op_type=name, inputs=[_dt(t) for t in inputs], outputs=[_dt(t) for t in outputs], attrs=attrs)(run)
    _REGISTERED[name] = (inputs, outputs)


def _register_all() -> None:
    """Every variant, once, before the first session: an op registered after a session was made crashes the
    bridge when that session runs."""
    if _REGISTERED:
        return
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    pools = [
        p.payload_dtype if part == "payload" else torch.float16
        for p in reader_precisions("onnxruntime")
        for part in ("payload", "scales")
    ]
    tables = [torch.int8, i32, f32, f32]  # unit_precision, unit_index, k_channel_scale, int4_clip
    meta = [i32] * len(ops.ATTENTION_META)
    _register(ops.QUANT_APPEND, ops.QUANT_APPEND, [f32, f32, i64, *pools, *tables], pools)
    _register(ops.QUANT_ATTENTION, ops.QUANT_ATTENTION, [f32, *meta, *pools, *tables[:3]], [f32])
    for dt in (torch.float32, *_WIDE):
        _register(ops.FLOAT_APPEND, _variant(ops.FLOAT_APPEND, dt), [f32, f32, i64, dt, dt], [dt, dt])
        _register(ops.FLOAT_ATTENTION, _variant(ops.FLOAT_ATTENTION, dt), [f32, *meta, dt, dt], [f32])


def _variant(op: str, pool_dtype: torch.dtype) -> str:
    return f"{op}_{str(pool_dtype).removeprefix('torch.')}"


def _renames(store) -> dict[str, str]:
    """Op type in the files -> the registered op a graph over `store` runs."""
    if ops.is_quantized(store):
        return {ops.QUANT_APPEND: ops.QUANT_APPEND, ops.QUANT_ATTENTION: ops.QUANT_ATTENTION}
    dt = store.k.dtype
    return {ops.FLOAT_APPEND: _variant(ops.FLOAT_APPEND, dt), ops.FLOAT_ATTENTION: _variant(ops.FLOAT_ATTENTION, dt)}


def _for_bridge(graph, rename: dict[str, str]) -> None:
    """Point the custom nodes at their registered variants and put float32 casts around 16-bit float edges."""
    from onnx import TensorProto, helper

    to = {torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16}
    nodes = []
    for n in graph.node:
        if n.domain != ops.DOMAIN or n.op_type not in rename:
            nodes.append(n)
            continue
        n.op_type = rename[n.op_type]
        ins, outs = _REGISTERED[n.op_type]
        after = []
        for i, t in enumerate(ins):
            if t in _WIDE:
                nodes.append(helper.make_node("Cast", [n.input[i]], [f"{n.name}/in{i}_f32"], to=TensorProto.FLOAT))
                n.input[i] = f"{n.name}/in{i}_f32"
        for i, t in enumerate(outs):
            if t in _WIDE:
                after.append(helper.make_node("Cast", [f"{n.name}/out{i}_f32"], [n.output[i]], to=to[t]))
                n.output[i] = f"{n.name}/out{i}_f32"
        nodes += [n, *after]
    del graph.node[:]
    graph.node.extend(nodes)


def _session(path: Path, rename: dict[str, str]):
    import onnx

    ort, ox = _ort()
    if not path.is_file():
        raise UserError(
            f"{path}: no exported graph here (build with runtime.onnx: true, or export with "
            "bpcompile.compiler.onnx_export.export_generator)",
            file=str(path),
        )
    m = onnx.load(str(path))  # with its external weights
    _for_bridge(m.graph, rename)
    so = ort.SessionOptions()
    so.register_custom_ops_library(ox.get_library_path())
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


class OnnxExecutor(Executor):
    """`Executor`'s interface over ONNX Runtime sessions of one model's prefill and step graphs."""

    def __init__(self, model: Llama, kv: PagedKV, device: torch.device, lookahead: int, graphs: Path):
        super().__init__(model, kv, device, lookahead)
        if device.type != "cpu" or model.dtype != torch.float32:
            raise UserError(
                f"the onnxruntime executor runs float32 graphs on the CPU (model is {model.dtype} on {device})",
                key="executor",
            )
        if kv.dense is not None:
            raise ValueError("the onnxruntime executor reads the paged store, not a dense copy")
        why = plan_support(kv.store.plan, "onnxruntime") if ops.is_quantized(kv.store) else []
        if why:
            raise UserError(f"{'; '.join(why)}: use the torch executor for this KV plan", key="executor")
        _register_all()
        rename = _renames(kv.store)
        self.prefill_sess = _session(Path(graphs) / "prefill.onnx", rename)
        self.step_sess = _session(Path(graphs) / "step.onnx", rename)
        self.pool_names = ops.pool_names(kv.store)
        self.static = {k: v.numpy() for k, v in ops.tables_of(kv.store).items()}

    def _run(self, sess, feeds: dict) -> torch.Tensor:
        pools = ops.pools_of(self.kv.store)
        feeds.update({n: t.numpy() for n, t in zip(self.pool_names, pools)}, **self.static)
        outs = sess.run(None, feeds)
        for t, new in zip(pools, outs[1:]):
            t.copy_(torch.from_numpy(new))
        return torch.from_numpy(outs[0])

    def prefill(
        self, reqs: list[Request], last_logits: bool, feats: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        assert feats is None, "feature drafts run on the torch executor (the Generator refuses them here)"
        kv = self.kv
        lens = [len(r.prompt) for r in reqs]
        T = max(lens)
        for r in reqs:
            kv.ensure(r.id, len(r.prompt) + self.lookahead)
        tok = np.array([r.prompt + [0] * (T - len(r.prompt)) for r in reqs], dtype=np.int64)
        slots = np.array(
            [[kv.slot(r.id, i) for i in range(len(r.prompt))] + [0] * (T - len(r.prompt)) for r in reqs], dtype=np.int64
        ).reshape(-1)
        logits = self._run(
            self.prefill_sess, {"tokens": tok, "last_index": np.array(lens, dtype=np.int64) - 1, "slots": slots}
        )
        return logits if last_logits else None

    def forward(
        self,
        reqs: list[Request],
        tokens: list[list[int]],
        positions: list[list[int]],
        writes: list[list[int]],
        ctx: list[int],
        tree_lens: list[int],
        mask_rows: Optional[list[list[int]]] = None,
        feats: Optional[torch.Tensor] = None,
        logit_rows: Optional[list[int]] = None,
    ) -> torch.Tensor:
        assert feats is None and logit_rows is None, "feature drafts run on the torch executor"
        kv = self.kv
        T = max(len(t) for t in tokens)
        pad = lambda xs, v=0: [x + [v] * (T - len(x)) for x in xs]  # noqa: E731
        if mask_rows is None:  # causal over the new tokens, which are the whole tree region
            mask_rows = [[(1 << (i + 1)) - 1 for i in range(len(t))] for t in tokens]
        words = max(1, -(-max(max(tree_lens), T) // 32))
        mask = torch.stack([pack_rows(rows + [0] * (T - len(rows)), words) for rows in mask_rows])
        i32 = lambda xs: np.array(xs, dtype=np.int32)  # noqa: E731
        feeds = {
            "tokens": np.array(pad(tokens), dtype=np.int64),
            "positions": np.array(pad(positions), dtype=np.int64),
            "slots": np.array(
                pad([[kv.slot(r.id, i) for i in w] for r, w in zip(reqs, writes)]), dtype=np.int64
            ).reshape(-1),
            "block_tables": kv.block_tables([r.id for r in reqs], "cpu").numpy(),
            "context_lens": i32(ctx),
            "tree_lens": i32(tree_lens),
            "q_lens": i32([len(t) for t in tokens]),
            "tree_mask": mask.numpy(),
        }
        self.forwards += 1
        return self._run(self.step_sess, feeds)
