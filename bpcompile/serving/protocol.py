"""The contract between the models of the emitted Triton repository, in plain Python (no Triton import).

The Python-backend models (`bpcompile/serving/models/*.py`) import this module; tests import it directly.

Streaming text correctly through an ensemble: the postprocessing model is stateless
and a decoupled model's responses may be delivered to it in any order, so every response the generator
sends carries what is needed to turn *its* tokens into *its* piece of text on its own:

    CONTEXT_IDS = out[c:b]      the response's new tokens out[a:b] plus up to CONTEXT_TOKENS tokens before them
    READ_OFFSET = a - c         where the new tokens start inside CONTEXT_IDS
    IS_FINAL                    the last response of the request: flush held-back bytes

and the text of a response is  stable(decode(out[c:b]))  minus  stable(decode(out[c:a])),  where `stable`
drops trailing U+FFFD (the bytes of a character that is not complete yet; they are emitted by the response
that completes the character, or by the final one). Byte-level BPE decoding is a pure function of the
concatenated bytes and UTF-8 resynchronises within 3 bytes, so the context window (>= 4 tokens, each >= 1
byte) makes the pieces telescope: concatenating them in response order gives exactly decode(out). This is
vLLM's prefix/read-offset incremental detokenizer, with the state carried in the message instead of kept
in the process. Order of delivery is a separate matter, handled in emit.py (one postprocessing instance)
and visible to clients through RESPONSE_INDEX.
"""

from __future__ import annotations

import json
import math
import traceback
from pathlib import Path
from typing import Callable, Optional

import numpy as np

# Left context sent with each streamed response. vLLM uses 5; anything >= 4 covers a 4-byte character
# split over single-byte tokens, a few more cost nothing (the tiny detokenizer decodes ~10 ids).
CONTEXT_TOKENS = 8
REPLACEMENT = "\ufffd"


# The repository API's access token (bpcompile serve --model-control explicit): the HTTP header, its gRPC metadata
# name as tritonserver sees it, and the environment variable that supplies it.
REPOSITORY_HEADER = "bpcompile-repository-token"
GRPC_REPOSITORY_HEADER = f"triton-grpc-protocol-{REPOSITORY_HEADER}"
TOKEN_ENV = "BPCOMPILE_REPOSITORY_TOKEN"


def context_window(out_ids: list[int], start: int, end: int) -> tuple[list[int], int]:
    """The slice of `out_ids` a response for new tokens out_ids[start:end] carries, and its read offset."""
    c = max(0, start - CONTEXT_TOKENS)
    return out_ids[c:end], start - c


def delta_text(decode, context_ids, read_offset: int, final: bool) -> str:
    """Text contributed by context_ids[read_offset:], given context_ids[:read_offset] were already streamed.

    `decode(ids) -> str` is the tokenizer's decode (special tokens skipped)."""
    ids = [int(i) for i in context_ids]
    prefix = decode(ids[:read_offset]).rstrip(REPLACEMENT)
    full = decode(ids)
    if not final:
        full = full.rstrip(REPLACEMENT)
    # For byte-level decoders `full` extends `prefix`; a decoder that rewrites earlier text (none we ship)
    # gets vLLM's behaviour: whatever lies beyond the prefix's length.
    return full[len(prefix) :]


# --- word lists (stop_words / bad_words) in TensorRT-LLM's [2, N] format ---------------------------------
# row 0: the token ids of all words concatenated; row 1: the exclusive end offset of each word, padded with
# -1. No words is [[0], [-1]], as tensorrtllm_backend's preprocessing writes it.


def pack_words(words: list[list[int]]) -> np.ndarray:
    flat, offsets = [], []
    for w in words:
        flat.extend(int(t) for t in w)
        offsets.append(len(flat))
    if not flat:
        return np.array([[0], [-1]], dtype=np.int32)
    offsets += [-1] * (len(flat) - len(offsets))
    return np.array([flat, offsets], dtype=np.int32)


def unpack_words(arr) -> list[list[int]]:
    """The words of a [2, N] (or [1, 2, N]) list; ValueError saying what is wrong with a malformed one (offsets
    past the ids, decreasing, or after the -1 padding): slicing by them would silently drop or merge words."""
    arr = np.asarray(arr)
    if arr.ndim not in (2, 3) or arr.shape[-2] != 2 or arr.ndim == 3 and arr.shape[0] != 1:
        raise ValueError(f"must be a [2, N] word list (token ids, then end offsets), got shape {list(arr.shape)}")
    arr = arr.reshape(2, -1)
    words, prev, padded = [], 0, False
    for i, end in enumerate(int(e) for e in arr[1]):
        if end == -1:
            padded = True
            continue
        if padded or end < prev or end > arr.shape[1]:
            why = (
                "follows the -1 padding"
                if padded
                else f"is below the previous one ({prev})"
                if end < prev
                else f"is beyond the {arr.shape[1]} token ids"
            )
            raise ValueError(f"end offset {end} (word {i}) {why}")
        words.append([int(t) for t in arr[0][prev:end]])
        prev = end
    return [w for w in words if w]


def parse_words(values, what: str = "stop_words") -> list[str]:
    """stop_words / bad_words as a client sends them: a STRING tensor of words, or of comma-separated lists
    (what tensorrtllm_backend's clients send, e.g. ["foo,bar"]). Empty strings mean none."""
    out = []
    for v in np.asarray(values, dtype=object).reshape(-1):
        out.extend(w for w in utf8(v, what).split(",") if w)
    return out


def eos_id(tokenizer_dir: Path, tokenizer) -> Optional[int]:
    """The end-of-sequence id named by tokenizer_config.json (eos_token), if any."""
    try:
        cfg = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    tok = cfg.get("eos_token")
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tokenizer.token_to_id(tok) if tok else None


# --- request checks shared by the preprocessing model and the generator's text interface ------------------

DEFAULT_MAX_TOKENS = 64


class BadRequest(ValueError):
    """A request the server refuses; the message is what the client reads (it names the input, never a path)."""


def utf8(value, what: str) -> str:
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def byte_size(values) -> int:
    """Bytes of a STRING tensor's elements (what tokenizing it would have to read)."""
    return sum(
        len(v) if isinstance(v, (bytes, str)) else len(str(v)) for v in np.asarray(values, dtype=object).reshape(-1)
    )


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """NaN passes every comparison and inf turns sampling into noise: both are refused, like negatives."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise BadRequest(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise BadRequest(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not (math.isfinite(top_p) and 0.0 <= top_p <= 1.0):
        raise BadRequest(f"top_p must be in [0, 1] (1 = off; 0 = off with top_k > 0, greedy with top_k 0), got {top_p}")


class TextInterface:
    """Text -> token ids with one engine version's tokenizer, and the checks every text request passes first.

    Tokenizing is the expensive part of a request that has not been admitted yet (a 10 MB prompt takes tens of
    seconds and holds the model instance meanwhile), so its size is checked on the raw bytes before: no prompt
    of at most max_input_len tokens is longer than max_input_len times the longest token of the vocabulary
    (counted in UTF-8 bytes of its vocabulary entry, which is never fewer than the text bytes it stands for in
    a byte-level or metaspace vocabulary), and anything longer is refused without reading it."""

    def __init__(self, tokenizer_dir: Path, max_input_len: int):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        self.eos = eos_id(tokenizer_dir, self.tokenizer)
        from bpcompile.runtime.text import end_ids

        # every end id the model's generation config lists: a request that ends on one ends on each (see ends)
        self.eos_ids = end_ids(tokenizer_dir, self.tokenizer)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        longest = max((len(t.encode("utf-8")) for t in vocab), default=1)
        self.max_input_len = int(max_input_len)
        self.max_bytes = self.max_input_len * longest

    def ends(self, end_id: Optional[int]) -> tuple[int, ...]:
        """The other ids that end a request ending on `end_id`: the model's other end ids when end_id is one of
        them (a chat turn of an instruct model ends on <|im_end|> or <|endoftext|>, whichever comes), else none:
        a client that names an end id of its own gets exactly that one."""
        return tuple(i for i in self.eos_ids if i != end_id) if end_id in self.eos_ids else ()

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def _fits(self, values, what: str) -> None:
        n = byte_size(values)
        if n > self.max_bytes:
            raise BadRequest(
                f"{what} is {n} bytes, more than this engine can take ({self.max_bytes} bytes: "
                f"limits.max_input_len is {self.max_input_len} tokens); send a shorter one"
            )

    def prompt(self, values) -> list[int]:
        """The token ids of a text_input tensor (exactly one string)."""
        if values is None:
            raise BadRequest("text_input is missing: send the prompt as text_input")
        values = np.asarray(values, dtype=object)
        if values.size != 1:
            raise BadRequest(f"text_input must hold exactly one string, got {values.size}")
        self._fits(values, "text_input")
        text = utf8(values.reshape(-1)[0], "text_input")
        if not text.strip():
            raise BadRequest("text_input is empty: give a prompt")
        return self.tokenizer.encode(text).ids

    def words(self, values, what: str) -> list[list[int]]:
        """stop_words / bad_words (see parse_words) as token sequences."""
        if values is None:
            return []
        self._fits(values, what)
        return [self.tokenizer.encode(w, add_special_tokens=False).ids for w in parse_words(values, what)]


def scalar(get: Callable[[str], Optional[np.ndarray]], name: str, default=None, kind=None):
    """One value of input `name` (get(name) -> array or None), converted by `kind`."""
    a = get(name)
    if a is None:
        return default
    a = np.asarray(a).reshape(-1)
    if a.size != 1:
        raise BadRequest(f"{name} must hold one value, got {a.size}")
    try:
        return kind(a[0]) if kind else a[0]
    except (TypeError, ValueError, OverflowError):
        raise BadRequest(f"{name} must be a number, got {a[0]!r}") from None


def answer_each(pb_utils, requests, one, model: str) -> list:
    """The responses of a non-decoupled Python-backend model, in request order: one(request), a BadRequest as
    an INVALID_ARG error with its reason, anything else as an INTERNAL error whose details (paths, code) go to
    the server log, not to the client. pb_utils: the backend's module (only importable inside tritonserver)."""
    out = []
    for r in requests:
        try:
            out.append(one(r))
        except BadRequest as e:
            out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
        except Exception:
            pb_utils.Logger.log_error(f"{model} failed: {traceback.format_exc()}")
            out.append(
                pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(
                        f"{model} failed (an internal error; the server log has the details)",
                        pb_utils.TritonError.INTERNAL,
                    )
                )
            )
    return out


# tensorrtllm_backend's request inputs beyond bpcompile's own (its ensemble's names; emit.BACKEND_INPUTS declares
# them). The native runtime decodes one beam with tree speculation: each is honoured, ignored where it cannot
# change a single-beam result, or refused per request, never an unknown-input error.
OFF_VALUES = {  # refused unless one of these values (what the backend treats as "off")
    "beam_width": (1,),
}
ABSENT_ONLY = (
    "decoder_text_input",
    "prompt_embedding_table",
    "prompt_table_extra_id",
    "prompt_vocab_size",
    "embedding_bias_words",
    "embedding_bias_weights",
    "lora_task_id",
    "lora_weights",
    "lora_config",
    "guided_decoding_guide_type",
    "guided_decoding_guide",
    # the tensorrt_llm model's own: external drafts, encoder-decoder and multimodal inputs, top-p decay,
    # disaggregated serving, KV retention, lookahead decoding
    "draft_input_ids",
    "draft_logits",
    "draft_acceptance_threshold",
    "encoder_input_features",
    "encoder_output_lengths",
    "decoder_input_ids",
    "decoder_input_lengths",
    "embedding_bias",
    "runtime_top_p_min",
    "runtime_top_p_decay",
    "runtime_top_p_reset_ids",
    "prompt_table_extra_ids",
    "cross_attention_mask",
    "mrope_rotary_cos_sin",
    "mrope_position_deltas",
    "context_phase_params",
    "skip_cross_attn_blocks",
    "retention_token_range_starts",
    "retention_token_range_ends",
    "retention_token_range_priorities",
    "retention_token_range_durations_ms",
    "retention_decode_priority",
    "retention_decode_duration_ms",
    "lookahead_window_size",
    "lookahead_ngram_size",
    "lookahead_verification_set_size",
)
# no padding in our outputs; the penalties, early stopping and diversity act on beam search only (one beam here)
IGNORED = ("pad_id", "length_penalty", "len_penalty", "early_stopping", "beam_search_diversity_rate")


def backend_options(get, exclude_default: bool = True) -> bool:
    """Check a request's tensorrtllm_backend inputs (get(name) -> array or None); returns exclude_input_in_output
    (when absent, `exclude_default`: for a token request the model's `exclude_input_in_output` parameter, as the
    backend does)."""
    for name, ok in OFF_VALUES.items():
        kind = type(ok[0])
        v = scalar(get, name, ok[0], kind)
        if v not in ok:
            raise BadRequest(
                f"{name}={v} is not supported by bpcompile's runtime (one beam, tree speculation): "
                f"send {ok[0]} or leave it out"
            )
    for name in ABSENT_ONLY:
        a = get(name)
        if (
            a is not None
            and np.asarray(a).size
            and not all(isinstance(x, (bytes, str)) and not x for x in np.asarray(a, dtype=object).reshape(-1))
        ):
            raise BadRequest(
                f"{name} is not supported by bpcompile's runtime (LoRA, prompt tables, embedding bias, "
                f"guided decoding and encoder-decoder models are not implemented): leave it out"
            )
    if scalar(get, "stop", False, bool):
        raise BadRequest(
            "stop=true (stopping a request by a second request) is not supported: cancel the request "
            "(the client's cancel, or closing its stream) instead"
        )
    return scalar(get, "exclude_input_in_output", exclude_default, bool)
