"""Reading GGUF metadata without loading a model.

A small reader over a memory map: it walks the header and the key/value section
with explicit bounds (every length is checked against the file before it is
used) and materialises only the keys asked for, so reading the tokenizer of a
1 GB model takes a fraction of a second and never allocates for a value the
caller did not ask for. Value type numbers follow the GGUF spec via `gguf`.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, Iterable

from gguf import GGUFValueType

from .errors import ModelError

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
MAX_KEY_LENGTH = 1 << 16
_U64 = struct.Struct("<Q")
MAX_KV_COUNT = 1 << 20


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def fail(self, what: str) -> ModelError:
        return ModelError(f"{self.path}: invalid GGUF metadata: {what} (at byte {self.pos})")

    def take(self, n: int, what: str) -> int:
        """Reserve n bytes; return where they start."""
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"{what} runs past the end of the file")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int | None = None) -> bytes:
        n = self.scalar("<Q", f"{what} length")
        if limit is not None and n > limit:
            raise self.fail(f"{what} length {n} is larger than {limit}")
        start = self.take(n, what)
        return bytes(self.buf[start : start + n])

    def strings(self, count: int, what: str, keep: bool) -> list[bytes] | None:
        """An array of `count` strings; the hot path for 150k-token vocabularies."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        if count > (end - pos) // 8:
            raise self.fail(f"{what}: array of {count} strings runs past the end of the file")
        unpack = _U64.unpack_from
        out: list[bytes] = []
        for _ in range(count):
            if pos + 8 > end:
                break
            (n,) = unpack(buf, pos)
            pos += 8
            if n > end - pos:
                break
            if keep:
                out.append(buf[pos : pos + n])
            pos += n
        else:
            self.pos = pos
            return out if keep else None
        self.pos = pos
        raise self.fail(f"{what}: a string runs past the end of the file")

    def skip_string(self, what: str) -> None:
        self.take(self.scalar("<Q", f"{what} length"), what)

    def value(self, vtype: int, key: str, keep: bool) -> Any:
        if vtype in _SCALARS:
            v = self.scalar(_SCALARS[GGUFValueType(vtype)], key)
            return v if keep else None
        if vtype == GGUFValueType.STRING:
            if not keep:
                return self.skip_string(key)
            return self.string(key).decode("utf-8", errors="replace")
        if vtype == GGUFValueType.ARRAY:
            etype = self.scalar("<I", f"{key} element type")
            count = self.scalar("<Q", f"{key} element count")
            if etype in _SCALARS:
                size = struct.calcsize(_SCALARS[GGUFValueType(etype)])
                if count > (len(self.buf) - self.pos) // size:
                    raise self.fail(f"{key}: array of {count} elements runs past the end of the file")
                start = self.take(count * size, key)
                if not keep:
                    return None
                return list(struct.unpack_from(f"<{count}{_SCALARS[GGUFValueType(etype)][1]}", self.buf, start))
            if etype == GGUFValueType.STRING:
                return self.strings(count, key, keep)
            raise self.fail(f"{key}: unsupported array element type {etype}")
        raise self.fail(f"{key}: unknown value type {vtype}")


def read_metadata(path: Path, keys: Iterable[str]) -> dict[str, Any]:
    """The values of `keys` (those present) from a GGUF file's metadata.

    Strings come back as str; arrays of strings as lists of raw bytes (token
    texts are compared byte for byte); other arrays as lists of numbers.
    """
    wanted = set(keys)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _read(_Cursor(buf, Path(path)), wanted)
    except ValueError:  # mmap of an empty file
        raise ModelError(f"{path}: invalid GGUF metadata: the file is empty") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror or e}") from None


def _read(cur: _Cursor, wanted: set[str]) -> dict[str, Any]:
    if bytes(cur.buf[cur.take(4, "magic") : 4]) != b"GGUF":
        raise cur.fail("bad magic (not a GGUF file)")
    version = cur.scalar("<I", "version")
    if version not in (2, 3):
        raise cur.fail(f"unsupported GGUF version {version}")
    cur.scalar("<Q", "tensor count")
    n_kv = cur.scalar("<Q", "key/value count")
    if n_kv > MAX_KV_COUNT:
        raise cur.fail(f"key/value count {n_kv} is larger than {MAX_KV_COUNT}")
    found: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("key", limit=MAX_KEY_LENGTH).decode("utf-8", errors="replace")
        vtype = cur.scalar("<I", f"{key} value type")
        value = cur.value(vtype, key, keep=key in wanted)
        if key in wanted:
            found[key] = value
            if len(found) == len(wanted):
                break
    return found
