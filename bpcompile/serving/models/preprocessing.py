"""Triton Python-backend model `preprocessing`: text -> token ids, request checks.

Copied by bpcompile.serving.emit into preprocessing/<version>/model.py, next to that version's tokenizer/.
Tensor names follow tensorrtllm_backend's preprocessing (QUERY, REQUEST_OUTPUT_LEN, ... -> INPUT_ID, ...).
Each request is answered on its own: a malformed one gets an error response, the others are unaffected.
Oversized text is refused before it is tokenized (protocol.TextInterface).
"""
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from bpcompile.core.engine import EngineConfig
from bpcompile.serving.drain import Instance
from bpcompile.serving.protocol import (DEFAULT_MAX_TOKENS, BadRequest, TextInterface, answer_each, pack_words,
                                       scalar)


# the backend's preprocessing inputs bpcompile declares (its BLS model may send them) but does not implement
UNSUPPORTED = ("DECODER_QUERY", "IMAGE_BYTES", "IMAGE_URL", "IMAGES", "VIDEO_BYTES", "EMBEDDING_BIAS_WORDS",
               "EMBEDDING_BIAS_WEIGHTS", "PROMPT_TABLE_EXTRA_ID")


def _optional(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        version = Path(args["model_repository"]) / args["model_version"]
        # The engine version this one serves is the repository's tensorrt_llm/<version>/engine/ (emit.py's
        # layout); its limits say how long a prompt can be.
        engine = Path(args["model_repository"]).parent / "tensorrt_llm" / args["model_version"] / "engine"
        self.text = TextInterface(version / "tokenizer", EngineConfig.load(engine).limits.max_input_len)
        self.alive = Instance(args["model_name"])  # serve tells an unloaded instance from one that died (drain.py)

    def finalize(self):
        self.alive.close()

    def _one(self, request):
        """A request of B rows (tensorrtllm_backend's clients batch prompts with --batch-inputs): each row
        tokenized on its own, the rows' ids right-padded to the longest (REQUEST_INPUT_LEN says where each ends;
        word lists padded with id 0 / offset -1, which ends a list), as the backend's preprocessing pads them."""
        query = _optional(request, "QUERY")
        rows = int(np.asarray(query).shape[0]) if query is not None and np.asarray(query).ndim > 1 else 1
        if rows == 1:
            return self._row(lambda name: _optional(request, name))
        outs = []
        for i in range(rows):
            def get(name, i=i):
                a = _optional(request, name)
                return a[i:i + 1] if a is not None and a.ndim and a.shape[0] == rows else a
            outs.append({t.name(): t.as_numpy() for t in self._row(get).output_tensors()})
        merged = []
        for name, fill in (("INPUT_ID", None), ("REQUEST_INPUT_LEN", 0), ("REQUEST_OUTPUT_LEN", 0),
                           ("STOP_WORDS_IDS", 0), ("BAD_WORDS_IDS", 0), ("OUT_END_ID", 0), ("OUT_PAD_ID", 0),
                           ("OUT_EXCLUDE_INPUT_IN_OUTPUT", 0)):
            parts = [o[name] for o in outs]
            width = max(p.shape[-1] for p in parts)
            padded = []
            for o, p in zip(outs, parts):
                pad = [(0, 0)] * (p.ndim - 1) + [(0, width - p.shape[-1])]
                if name.endswith("WORDS_IDS"):  # row 0 (ids) with 0, row 1 (offsets) with -1
                    p = np.concatenate([np.pad(p[:, :1], pad), np.pad(p[:, 1:], pad, constant_values=-1)], axis=1)
                else:
                    p = np.pad(p, pad, constant_values=o["OUT_PAD_ID"].item() if fill is None else fill)
                padded.append(p)
            merged.append(pb_utils.Tensor(name, np.concatenate(padded).astype(parts[0].dtype)))
        return pb_utils.InferenceResponse(output_tensors=merged)

    def _row(self, get):
        ids = self.text.prompt(get("QUERY"))
        max_tokens = scalar(get, "REQUEST_OUTPUT_LEN", DEFAULT_MAX_TOKENS, int)
        if max_tokens <= 0:
            raise BadRequest(f"max_tokens must be > 0 (got {max_tokens})")
        stop = pack_words(self.text.words(get("STOP_WORDS_DICT"), "stop_words"))
        bad = pack_words(self.text.words(get("BAD_WORDS_DICT"), "bad_words"))
        eos = self.text.eos if self.text.eos is not None else -1
        end_id = scalar(get, "END_ID", eos, int)
        pad_id = scalar(get, "PAD_ID", end_id, int)  # the backend's default pad is a real token too
        for name in UNSUPPORTED:
            a = get(name)
            if a is not None and np.asarray(a).size and any(
                    x not in (b"", "") for x in np.asarray(a, dtype=object).reshape(-1)):
                raise BadRequest(f"{name} is not supported by bpcompile's preprocessing (encoder-decoder and "
                                 "multimodal inputs, embedding bias and prompt tables are not implemented): leave it out")
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("INPUT_ID", np.array([ids], dtype=np.int32)),
            pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(ids)]], dtype=np.int32)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", np.array([[max_tokens]], dtype=np.int32)),
            pb_utils.Tensor("STOP_WORDS_IDS", stop[None]),
            pb_utils.Tensor("BAD_WORDS_IDS", bad[None]),
            pb_utils.Tensor("OUT_END_ID", np.array([[end_id]], dtype=np.int32)),
            pb_utils.Tensor("OUT_PAD_ID", np.array([[pad_id]], dtype=np.int32)),
            # the ensemble answers the generated text only unless the client asks for the prompt too (emit.py)
            pb_utils.Tensor("OUT_EXCLUDE_INPUT_IN_OUTPUT",
                            np.array([[scalar(get, "EXCLUDE_INPUT_IN_OUTPUT", True, bool)]], dtype=np.bool_)),
        ])

    def execute(self, requests):
        return answer_each(pb_utils, requests, self._one, "preprocessing")
