"""Triton Python-backend model `preprocessing`: text -> token ids, request checks.

Copied by bpcompile.triton.emit into preprocessing/<version>/model.py, next to that version's tokenizer/.
Tensor names follow tensorrtllm_backend's preprocessing (QUERY, REQUEST_OUTPUT_LEN, ... -> INPUT_ID, ...).
Each request is answered on its own: a malformed one gets an error response, the others are unaffected.
"""
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

from bpcompile.triton.protocol import eos_id, pack_words, parse_words

DEFAULT_MAX_TOKENS = 64


class BadRequest(Exception):
    pass


def _optional(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        tok_dir = Path(args["model_repository"]) / args["model_version"] / "tokenizer"
        self.tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        self.eos = eos_id(tok_dir, self.tokenizer)

    def _one(self, request):
        q = _optional(request, "QUERY")
        if q is None:
            raise BadRequest("text_input is missing: send the prompt as text_input")
        if q.size != 1:
            raise BadRequest(f"text_input must hold exactly one string, got {q.size}")
        raw = q.reshape(-1)[0]
        if not isinstance(raw, bytes):
            raw = str(raw).encode("utf-8")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest(f"text_input is not valid UTF-8 ({e.reason} at byte {e.start})")
        if not text.strip():
            raise BadRequest("text_input is empty: give a prompt")
        ids = self.tokenizer.encode(text).ids

        n = _optional(request, "REQUEST_OUTPUT_LEN")
        max_tokens = DEFAULT_MAX_TOKENS if n is None else int(n.reshape(-1)[0])
        if max_tokens <= 0:
            raise BadRequest(f"max_tokens must be > 0 (got {max_tokens})")

        def words(name):
            v = _optional(request, name)
            ws = [] if v is None else parse_words(v)
            return pack_words([self.tokenizer.encode(w, add_special_tokens=False).ids for w in ws])

        end = _optional(request, "END_ID")
        end_id = int(end.reshape(-1)[0]) if end is not None else (self.eos if self.eos is not None else -1)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("INPUT_ID", np.array([ids], dtype=np.int32)),
            pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(ids)]], dtype=np.int32)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", np.array([[max_tokens]], dtype=np.int32)),
            pb_utils.Tensor("STOP_WORDS_IDS", words("STOP_WORDS_DICT")[None]),
            pb_utils.Tensor("BAD_WORDS_IDS", words("BAD_WORDS_DICT")[None]),
            pb_utils.Tensor("OUT_END_ID", np.array([[end_id]], dtype=np.int32)),
        ])

    def execute(self, requests):
        out = []
        for r in requests:
            try:
                out.append(self._one(r))
            except BadRequest as e:
                out.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
        return out
