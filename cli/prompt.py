"""Where the prompt comes from: -p TEXT, -f FILE, or standard input ('-'); and the system
message: -sys TEXT or -sysf FILE."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from speculative.errors import UsageError

_SIMPLE = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"'": b"'", b'"': b'"', b"\\": b"\\"}
_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)", re.DOTALL)


def process_escapes(text: str) -> str:
    """llama.cpp's escapes: \\n \\r \\t \\' \\" \\\\ and \\xHH; anything else stays as written."""

    def one(m: re.Match) -> bytes:
        code = m.group(1)
        if code[:1] == b"x" and len(code) == 3:
            return bytes([int(code[1:], 16)])
        return _SIMPLE.get(code, m.group(0))

    return _ESCAPE.sub(one, text.encode("utf-8", "surrogateescape")).decode("utf-8", "replace")


def read_prompt(prompt: str | None, file: str | None, escape: bool) -> str:
    """The prompt of -p or -f (standard input for '-'); an empty one is refused, as a mistake
    rather than something to generate from."""
    if prompt is not None and file is not None:
        raise UsageError("give the prompt with -p or -f, not both")
    if prompt is None and file is None:
        raise UsageError("no prompt: give -p TEXT, -f FILE, or -p - to read standard input (-cnv: a conversation)")
    if prompt == "-" or file == "-":
        text, source = _read_stdin(), "standard input gave nothing"
    elif file is not None:
        text, source = _read_file(file, "prompt file"), f"the prompt file {file} is empty"
    else:
        text, source = process_escapes(prompt) if escape else prompt, '-p ""'
    if not text:
        raise UsageError(f"the prompt is empty ({source}): give the text to generate from")
    return text


def read_system_prompt(text: str | None, file: Path | None, escape: bool) -> str | None:
    """-sys TEXT (escapes processed) or -sysf FILE (one trailing newline dropped, as llama.cpp)."""
    if text is not None and file is not None:
        raise UsageError("give the system message with -sys or -sysf, not both")
    if file is not None:
        return _read_file(str(file), "system prompt file").removesuffix("\n")
    return process_escapes(text) if text is not None and escape else text


def _read_file(file: str, what: str) -> str:
    try:
        return Path(file).read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise UsageError(f"cannot read {what} {file}: {e.strerror or e}") from None


def _read_stdin() -> str:
    if sys.stdin is None:
        raise UsageError("the prompt is '-' but there is no standard input")
    return sys.stdin.buffer.read().decode("utf-8", errors="replace")
