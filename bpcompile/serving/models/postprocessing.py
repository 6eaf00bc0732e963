"""Triton Python-backend model `postprocessing`: token ids -> text, stateless.

Copied by bpcompile.serving.emit into postprocessing/<version>/model.py, next to that version's tokenizer/.

native target: each generator response carries CONTEXT_IDS / READ_OFFSET / IS_FINAL (protocol.py), so its
text is computed from the response alone, whatever order responses arrive in; the statistics tensors pass
through unchanged.
tensorrt-llm target (parameter input_format = "trtllm"): decodes tensorrtllm's TOKENS_BATCH[0][:SEQUENCE_LENGTH]
the way tensorrtllm_backend's postprocessing does (exact for non-streamed requests; see docs/serving notes).
"""
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

from bpcompile.serving.drain import Instance
from bpcompile.serving.protocol import answer_each, delta_text

PASS_THROUGH = ["RESPONSE_INDEX", "FINISH_REASON", "acceptance_rate", "total_accepted_draft_tokens",
                "total_draft_tokens", "tokens_per_step", "verifier_steps", "engine_version", "cached_tokens"]


class TritonPythonModel:
    def initialize(self, args):
        tok_dir = Path(args["model_repository"]) / args["model_version"] / "tokenizer"
        self.tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        cfg = json.loads(args["model_config"])
        self.format = cfg.get("parameters", {}).get("input_format", {}).get("string_value", "native")
        self.decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        self.alive = Instance(args["model_name"])  # serve tells an unloaded instance from one that died (drain.py)

    def finalize(self):
        self.alive.close()

    def _native(self, request):
        def get(name):
            return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

        # one row per sequence: a unary repository answers a request's sequences in one response, their contexts
        # padded with -1 (models/generator.py)
        reads = get("READ_OFFSET").reshape(-1)
        ctxs = get("CONTEXT_IDS").reshape(len(reads), -1)
        finals = get("IS_FINAL").reshape(-1)
        texts, ids = [], []
        for ctx, read, final in zip(ctxs, reads, finals):
            ctx = ctx[ctx >= 0]
            texts.append(delta_text(self.decode, ctx, int(read), bool(final)).encode("utf-8"))
            ids.append(ctx[int(read):])
        width = max(len(i) for i in ids)
        # [batch] as tensorrtllm_backend's postprocessing returns it: its clients read text_output[0] as bytes
        outs = [pb_utils.Tensor("OUTPUT", np.array(texts, dtype=np.object_)),
                pb_utils.Tensor("OUTPUT_IDS", np.array([np.pad(i, (0, width - len(i)), constant_values=-1) for i in ids],
                                                       dtype=np.int32))]
        outs += [pb_utils.Tensor("OUT_" + n, get(n)) for n in PASS_THROUGH]
        return pb_utils.InferenceResponse(output_tensors=outs)

    def _trtllm(self, request):
        tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
        lens = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
        ids = tokens.reshape(tokens.shape[0], -1, tokens.shape[-1])[0][0][: int(lens.reshape(-1)[0])]
        text = self.decode([int(i) for i in ids])
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUTPUT", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("OUTPUT_IDS", ids.astype(np.int32).reshape(1, -1))])

    def execute(self, requests):
        # one instance, in arrival order: see emit.py on response ordering
        return answer_each(pb_utils, requests, self._trtllm if self.format == "trtllm" else self._native,
                           "postprocessing")
