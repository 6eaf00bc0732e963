"""Prompts as text: a user turn through the engine tokenizer's chat template."""

from __future__ import annotations

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
