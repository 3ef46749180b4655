"""The template families whose tool-call and reasoning formats are read, and which one a chat
template writes (`detect`), in the pinned llama.cpp's order of checks
(common_chat_try_specialized_template, then what its autoparser finds in the template).

Each module defines FORMAT, a format.Format subclass. A template matching none of them is read
as plain content (generic.py: the pinned llama.cpp has no generic JSON form for tools any more),
and it cannot be asked for a required or named call.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from speculative.chat.format import Format

# First match wins: the more specific markers before the common ones.
FAMILIES = ("gpt_oss", "functionary", "deepseek", "qwen3_coder", "command_r7b", "granite", "gemma4",
            "mistral", "llama3", "hermes")
FALLBACK = "generic"


def family(name: str) -> type[Format]:
    return importlib.import_module(f"{__name__}.{name}").FORMAT


@lru_cache(maxsize=8)
def detect(source: str) -> Format:
    """The format of the chat template whose Jinja source is `source`."""
    for name in FAMILIES:
        cls = family(name)
        if cls.matches(source):
            return cls()
    return family(FALLBACK)()
