"""llama.cpp's built-in chat formats (llama_chat_apply_template): what llama-server --no-jinja
formats chats with, and what --chat-template names one of. llama.cpp recognises the format by
its name, or in a Jinja template by the markers it writes (<|im_start|>, [INST], ...); the
formatting itself is C code, so it needs no sandbox."""

from __future__ import annotations

import ctypes
import functools

import llama_cpp as ll

from speculative.errors import ModelError


@functools.cache
def builtin_names() -> tuple[str, ...]:
    """The names of llama.cpp's built-in formats (chatml, llama3, ...), as it lists them."""
    n = ll.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    ll.llama_chat_builtin_templates(names, n)
    return tuple(name.decode() for name in names)


def apply(template: str, messages: list[dict[str, str]]) -> str:
    """A conversation, with the generation prompt for the reply, in the built-in format that
    `template` names or that llama.cpp recognises in it; ModelError when it recognises none."""
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]  # alive while llama.cpp reads them
    chat = (ll.llama_chat_message * len(keep))(*(ll.llama_chat_message(role, content) for role, content in keep))
    size = 2 * sum(len(role) + len(content) for role, content in keep) + 256
    for _ in range(2):  # llama.cpp says how much it needs when the buffer is too small
        buf = ctypes.create_string_buffer(size)
        n = ll.llama_chat_apply_template(template.encode(), chat, len(keep), True, buf, size)
        if n < 0:
            raise ModelError("llama.cpp's built-in chat formats do not recognise this chat template (--no-jinja); "
                             "use its Jinja template (--jinja) or name a format with --chat-template")
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n
    raise ModelError("llama.cpp's chat formatting grew between two calls")  # pragma: no cover
