"""The text the shipped tiny pair is trained, calibrated and benchmarked on.

Source: Python's own `pydoc_data.topics.topics` (79 topics of language-reference prose, ~465k
chars), so it ships with every interpreter and needs no download. The text differs a little between
Python versions; `fingerprint()` names the exact corpus so metrics can say what they were measured on.

Split (deterministic), within topics rather than by topic: the topics overlap heavily (`specialnames`
contains `customization` verbatim, `compound` contains `if`/`for`/`try`), so first every paragraph is
kept once (its first occurrence in sorted-topic order); then each topic's paragraphs are grouped into
consecutive chunks of >= ~1500 chars and every 10th chunk, counted across the sorted corpus, is held
out (~10% of the text). Held-out text is thus unseen prose on topics the models know, which is what
prompts of a served model look like (a whole-topic split measured mostly transfer to unseen topics).

Token helpers accept a `transformers` tokenizer, a `tokenizers.Tokenizer`, or a path to a
directory/file holding `tokenizer.json`. Sequences start with the BOS token, as `tokenizer(text)`
of the shipped tokenizer does, and are cut out of one document (never across two).
"""

from __future__ import annotations

import functools
import hashlib
import random
from pathlib import Path

from bpcompile.core.errors import UserError

HOLDOUT_EVERY = 10
HOLDOUT_OFFSET = 5
CHUNK_CHARS = 1500
_MIN_DEDUP_CHARS = 40  # shorter paragraphs ("Changed in version 3.8.") are common phrasing, not content


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return topics


def _paragraphs(text: str) -> list[str]:
    return [p for p in text.strip().split("\n\n") if p.strip()]


@functools.lru_cache(maxsize=1)
def _split() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(train documents, held-out documents); a document never spans two topics."""
    topics = _topics()
    seen: set[str] = set()
    chunks: list[tuple[str, str]] = []  # (topic, text), in sorted-topic order
    for k in sorted(topics):
        cur: list[str] = []
        for p in _paragraphs(topics[k]):
            key = p.strip()
            if len(key) > _MIN_DEDUP_CHARS:
                if key in seen:
                    continue
                seen.add(key)
            cur.append(p)
            if sum(len(c) for c in cur) >= CHUNK_CHARS:
                chunks.append((k, "\n\n".join(cur)))
                cur = []
        if cur:
            chunks.append((k, "\n\n".join(cur)))

    train, held = [], []
    run_topic, run = None, []  # consecutive train chunks of one topic form one train document
    for i, (k, text) in enumerate(chunks):
        if i % HOLDOUT_EVERY == HOLDOUT_OFFSET or k != run_topic:
            if run:
                train.append("\n\n".join(run).strip())
            run_topic, run = k, []
        if i % HOLDOUT_EVERY == HOLDOUT_OFFSET:
            held.append(text.strip())
            run_topic = None
        else:
            run.append(text)
    if run:
        train.append("\n\n".join(run).strip())
    return tuple(train), tuple(held)


def train_documents() -> list[str]:
    return list(_split()[0])


def heldout_documents() -> list[str]:
    return list(_split()[1])


def train_text() -> str:
    return "\n\n".join(train_documents())


def heldout_text() -> str:
    return "\n\n".join(heldout_documents())


def fingerprint() -> str:
    """sha256 (first 16 hex) of the whole split: changes when the interpreter's topics text does."""
    h = hashlib.sha256()
    for part in (train_text(), "\0", heldout_text()):
        h.update(part.encode())
    return h.hexdigest()[:16]


# ---- token helpers ---------------------------------------------------------------------------


def _load(tokenizer):
    """-> (encode(text) -> ids without special tokens, BOS id or None). The BOS is the special token the tokenizer
    itself puts before a text (tokenizer.json's post-processor; a slow tokenizer's add_special_tokens), so a
    tokenizer directory and the same tokenizer loaded by transformers give the same windows. SmolLM2's adds none
    (its bos_token, <|im_start|>, opens a chat turn, not a text); the tiny pair's and Llama's add theirs."""
    if isinstance(tokenizer, (str, Path)):
        path = Path(tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise UserError("expected a tokenizer.json", file=str(path))
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
    # transformers fast tokenizers: encode with the Rust backend (no max-length warnings on whole documents)
    rust = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(rust, "encode_batch"):
        encode = lambda text, special=False: rust.encode(text, add_special_tokens=special).ids  # noqa: E731
    else:
        encode = lambda text, special=False: list(tokenizer.encode(text, add_special_tokens=special))  # noqa: E731
    plain, full = encode("a"), encode("a", True)
    bos = full[0] if len(full) > len(plain) and full[1 : 1 + len(plain)] == plain else None
    return encode, bos


def _windows(tokenizer, docs: list[str], length: int, n: int, seed: int, what: str) -> list[list[int]]:
    """n distinct BOS-prefixed windows of `length` ids, each inside one document, chosen by `seed`."""
    if length < 2:
        raise UserError(f"{what}: expected a length >= 2 tokens, got {length}", key="length")
    if n < 0:
        raise UserError(f"{what}: expected a count n >= 0, got {n}", key="n")
    encode, bos = _load(tokenizer)
    body = length - 1 if bos is not None else length
    candidates = []
    for doc in docs:
        ids = encode(doc)
        # non-overlapping starts: windows cannot repeat each other's text
        candidates += [ids[s : s + body] for s in range(0, len(ids) - body + 1, body)]
    unique = list(dict.fromkeys(tuple(c) for c in candidates))
    if n > len(unique):
        raise UserError(
            f"{what}: asked for {n} windows of {length} tokens, only {len(unique)} distinct ones exist", key="n"
        )
    random.Random(seed).shuffle(unique)  # shuffle-then-take: the first k of n prompts are the k prompts
    return [([bos] if bos is not None else []) + list(w) for w in unique[:n]]


def heldout_prompts(tokenizer, n: int, prompt_tokens: int = 32, seed: int = 0) -> list[list[int]]:
    """n distinct prompts of exactly `prompt_tokens` ids (BOS first) from the held-out split."""
    return _windows(tokenizer, heldout_documents(), prompt_tokens, n, seed, "heldout_prompts")


def calibration_samples(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n distinct sequences of exactly `length` ids (BOS first) from the train split."""
    return _windows(tokenizer, train_documents(), length, n, seed, "calibration_samples")


def text_documents(path) -> list[str]:
    """A user's evaluation text file, read as one document (windows may span its paragraphs)."""
    p = Path(path)
    if not p.is_file():
        raise UserError("expected a UTF-8 text file to evaluate on", file=str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"not UTF-8 text ({e.reason} at byte {e.start})", file=str(p)) from None
    if not text.strip():
        raise UserError("the text file is empty", file=str(p))
    return [text]


def retrieval_probes(tokenizer, samples: list[list[int]], n: int = 4, length: int = 1024, seed: int = 0) -> list[dict]:
    """n needle-in-a-haystack prompts of about `length` ids for finding a model's retrieval heads: the samples'
    text (BOS dropped, cycled from a seeded start) with a line holding a random 5-digit key at depth (i + 0.5) / n,
    then a question and the answer with the key. Each: ids, needle (positions of the key's copies in the text)
    and answer (positions of the answer's key tokens). Pieces are encoded apart so that every position is known
    by construction (no search for the key's tokens)."""
    encode, bos = _load(tokenizer)
    body = [t for s in samples for t in (s[1:] if bos is not None and s and s[0] == bos else s)]
    if not body:
        raise UserError("retrieval probes need calibration samples", key="calibration.samples")
    rng = random.Random(f"retrieval:{seed}")
    out = []
    for i in range(n):
        key = encode(" " + str(rng.randint(10000, 99999)))
        head, mid, tail = encode(" The pass key is"), encode(". Remember it."), encode(" is the pass key.")
        question = encode("\nWhat is the pass key? The pass key is")
        room = max(1, length - len(head) - len(mid) - len(tail) - len(question) - 3 * len(key) - 1)
        start = rng.randrange(len(body))
        hay = [body[(start + j) % len(body)] for j in range(room)]
        cut = int(room * (i + 0.5) / n)
        ids = ([bos] if bos is not None else []) + hay[:cut] + head
        needle = list(range(len(ids), len(ids) + len(key)))
        ids += key + mid
        needle += range(len(ids), len(ids) + len(key))
        ids += key + tail + hay[cut:] + question
        answer = list(range(len(ids), len(ids) + len(key)))
        out.append({"ids": ids + key, "needle": needle, "answer": answer})
    return out


def text_windows(tokenizer, docs: list[str], length: int, n: int, seed: int = 0, what: str = "text") -> list[list[int]]:
    """n distinct sequences of exactly `length` ids (BOS first when the tokenizer has one) from `docs`."""
    return _windows(tokenizer, docs, length, n, seed, what)
