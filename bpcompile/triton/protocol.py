"""The contract between the models of the emitted Triton repository, in plain Python (no Triton import).

The Python-backend models (`bpcompile/triton/models/*.py`) import this module; tests import it directly.

Streaming text correctly through an ensemble (DESIGN.md "Serving"): the postprocessing model is stateless
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
from pathlib import Path
from typing import Optional

import numpy as np

# Left context sent with each streamed response. vLLM uses 5; anything >= 4 covers a 4-byte character
# split over single-byte tokens, a few more cost nothing (the tiny detokenizer decodes ~10 ids).
CONTEXT_TOKENS = 8
REPLACEMENT = "\ufffd"


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
    return full[len(prefix):]


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
    arr = np.asarray(arr).reshape(2, -1)
    words, prev = [], 0
    for end in arr[1]:
        if end < 0:
            break
        words.append([int(t) for t in arr[0][prev:end]])
        prev = int(end)
    return [w for w in words if w]


def parse_words(values) -> list[str]:
    """stop_words / bad_words as a client sends them: a STRING tensor of words, or of comma-separated lists
    (what tensorrtllm_backend's clients send, e.g. ["foo,bar"]). Empty strings mean none."""
    out = []
    for v in np.asarray(values, dtype=object).reshape(-1):
        s = v.decode("utf-8") if isinstance(v, bytes) else str(v)
        out.extend(w for w in s.split(",") if w)
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
