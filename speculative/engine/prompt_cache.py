"""--prompt-cache FILE: the models' KV caches for a prompt, kept on disk between runs.

After the prompt is processed, each model's cache (llama.cpp's sequence state) is
written with the tokens it holds and the identity of what produced it: the model
file (path, size, mtime), its LoRA adapters, where its layers ran, flash attention,
the llama.cpp build and its kernels (LlamaModel.cache_identity). A later run restores every part whose identity still matches, and
the engine then keeps the prefix its prompt shares with the restored tokens, as it
does between two runs in one process. A part that does not match, a damaged file or
one of another format is ignored with a notice: it only costs the time it would
have saved.

The file: MAGIC, a little-endian u32 format version and u64 header length, the JSON
header ({"parts": [{role, identity, tokens, bytes, sha256}]}), then each part's
state bytes in order. A part's sha256 covers its tokens (as JSON) and its state, so a
changed token list cannot claim a prefix the state does not hold. Writes go to a temporary file that replaces the old one, so a
cache is whole or absent; an existing file that is not a prompt cache is never
overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from speculative.files import check_ours, write_atomic

MAGIC = b"speculate prompt cache\n"
VERSION = 2  # 2: the checksum covers the tokens too
_FIXED = struct.Struct("<IQ")     # version, header length
MAX_HEADER = 64 << 20             # tokens as JSON: far beyond any context's worth


@dataclass(frozen=True)
class Part:
    """One model's cache: `state` (llama.cpp's bytes) holds `tokens` from position 0."""
    role: str        # "target", "draft", or "target-nextn" (the target's NextN rows, for draft-mtp)
    identity: dict
    tokens: tuple[int, ...]
    state: bytes


class Unusable(Exception):
    """The file cannot be used; the message says why (for a notice)."""


def check_writable(path: Path) -> None:
    """Refuse, before any work, to later replace a file that is not a prompt cache."""
    check_ours(path, "--prompt-cache", _stranger)


def _stranger(f) -> str | None:
    head = f.read(len(MAGIC))
    return "not a speculate prompt cache" if head and head != MAGIC else None  # an empty file holds nothing to lose


def read(path: Path, wanted: dict[str, dict]) -> tuple[list[Part], list[str]]:
    """The parts whose role and identity are in `wanted` (role -> identity), checksums
    verified, and a notice for each part left out. Raises Unusable for a whole file that
    cannot be used, FileNotFoundError when there is none."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise Unusable("not a speculate prompt cache")
        fixed = f.read(_FIXED.size)
        if len(fixed) != _FIXED.size:
            raise Unusable("cut short")
        version, size = _FIXED.unpack(fixed)
        if version != VERSION:
            raise Unusable(f"format version {version}, this speculate reads {VERSION}")
        if size > MAX_HEADER:
            raise Unusable("damaged header")
        entries = _header(f.read(size))
        parts, notices, offset = [], [], f.tell()
        file_size = os.fstat(f.fileno()).st_size
        for entry in entries:
            role, n = entry["role"], entry["bytes"]
            if role not in wanted:
                pass  # e.g. a draft part when this run loads no draft model
            elif entry["identity"] != wanted[role]:
                notices.append(f"the {role} part was saved for another model or settings "
                               f"({_differences(entry['identity'], wanted[role])}); ignored")
            else:
                if offset + n > file_size:  # before reading: a damaged length must not allocate it
                    raise Unusable(f"the {role} part is damaged (cut short)")
                f.seek(offset)
                state = f.read(n)
                if _digest(entry["tokens"], state) != entry["sha256"]:
                    raise Unusable(f"the {role} part is damaged (changed)")
                parts.append(Part(role, entry["identity"], tuple(entry["tokens"]), state))
            offset += n
    return parts, notices


def _header(raw: bytes) -> list[dict]:
    """The header's parts, every field type-checked: a damaged header is Unusable."""
    try:
        entries = json.loads(raw.decode("utf-8"))["parts"]
        for e in entries:
            ok = (isinstance(e["role"], str) and isinstance(e["identity"], dict)
                  and isinstance(e["bytes"], int) and e["bytes"] >= 0 and isinstance(e["sha256"], str)
                  and isinstance(e["tokens"], list) and all(type(t) is int for t in e["tokens"]))
            if not ok:
                raise ValueError
        return entries
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise Unusable("damaged header") from None


def _digest(tokens, state: bytes) -> str:
    return hashlib.sha256(json.dumps(list(tokens)).encode() + state).hexdigest()


def _differences(saved: dict, now: dict) -> str:
    keys = sorted(k for k in {*saved, *now} if saved.get(k) != now.get(k))
    return "differs in " + ", ".join(keys)


def write(path: Path, parts: list[Part]) -> None:
    """Replace the cache file with `parts`, atomically."""
    check_writable(path)
    header = json.dumps({"parts": [
        {"role": p.role, "identity": p.identity, "tokens": list(p.tokens), "bytes": len(p.state),
         "sha256": _digest(p.tokens, p.state)} for p in parts]}).encode()
    write_atomic(path, [MAGIC + _FIXED.pack(VERSION, len(header)) + header, *(p.state for p in parts)])
