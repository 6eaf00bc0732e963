"""Prompts as text: a user turn through the engine tokenizer's chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from bpcompile.core.errors import UserError


def chat_turn(tok, user: str) -> Optional[str]:
    """`user` as one user turn through a transformers tokenizer's chat template, ending where the assistant's
    answer starts; None when the tokenizer has no template."""
    if not getattr(tok, "chat_template", None):
        return None
    return tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)


def chat_prompt(tokenizer_dir: Path, user: str) -> Optional[str]:
    """chat_turn with the engine's tokenizer directory (transformers renders the template, helpers included)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        return chat_turn(tok, user)
    except Exception as e:  # a template that does not render is the user's input, not our crash
        raise UserError(f"the chat template does not render: {e} (use --raw)", file=str(tokenizer_dir)) from None


def end_ids(tokenizer_dir: Path, tokenizer=None) -> list[int]:
    """The ids that end a generation: the id of tokenizer_config.json's eos_token first, then every id that
    generation_config.json's eos_token_id names (an int or a list: instruct models list the end of a chat turn
    and the end of a document, and either ends the answer). Missing or unreadable files add none. tokenizer: the
    directory's `tokenizers.Tokenizer`, when the caller has it loaded."""
    d = Path(tokenizer_dir)

    def read(name: str) -> dict:
        try:
            raw = json.loads((d / name).read_text())
        except (OSError, ValueError):
            return {}
        return raw if isinstance(raw, dict) else {}

    ids: list[int] = []
    eos = read("tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and (tokenizer is not None or (d / "tokenizer.json").is_file()):
        if tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        i = tokenizer.token_to_id(eos)
        if i is not None:
            ids.append(i)
    listed = read("generation_config.json").get("eos_token_id")
    for i in listed if isinstance(listed, list) else [listed]:
        if isinstance(i, int) and not isinstance(i, bool) and i >= 0 and i not in ids:
            ids.append(i)
    return ids
