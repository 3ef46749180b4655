"""Reading and validating GGUF headers without loading a model.

A small reader over a memory map: it walks the header and the key/value section
with explicit bounds (every length is checked against the file before it is
used) and materialises only what is asked for, so reading the tokenizer of a
1 GB model takes a fraction of a second and never allocates for a value the
caller did not ask for. Value type numbers follow the GGUF spec via `gguf`.

`read_metadata` returns the values of some keys (speculative/models/vocab.py).

`preflight` validates the whole header before llama.cpp sees a file. GGUF files
come from strangers, and llama.cpp's parser has had heap overflows; this check
refuses, with a one-line ModelError naming the file, the field and the byte
offset, everything llama.cpp's `gguf_init_from_file_impl` (ggml/src/gguf.cpp)
refuses, and a little more:

* header: magic "GGUF"; version 2 or 3 (0, 1, byte-swapped and future ones
  refused); tensor and key/value counts under MAX_TENSORS / MAX_KVS and
  plausible for the file size (each pair or tensor info takes some bytes);
* key/value pairs: keys non-empty, at most MAX_KEY_LENGTH bytes, UTF-8 without
  NUL, unique; value types known, arrays of scalars or strings only (gguf.cpp
  refuses arrays of arrays); every string and array bounded by the bytes left
  in the file and by gguf.cpp's 2^30 limits, walked without materialising;
  `general.alignment` a uint32 power of two;
* tensor infos: names non-empty, shorter than GGML_MAX_NAME (64), UTF-8
  without NUL, unique; 1..4 dimensions, each at least 1, an element count that
  fits int64; a ggml type known to `gguf` (removed ones such as Q4_2 refused);
  rows a whole number of blocks; offsets multiples of the alignment;
* data: the data section starts at the header's end padded to the alignment;
  each tensor lies inside the file, and tensors are packed in order, each at
  the padded end of the one before (as gguf.cpp requires: this also rules out
  overlapping and duplicated tensor data);
* what makes llama.cpp abort (GGML_ASSERT, a crash) rather than refuse the
  file, found by fuzzing it (tests/test_gguf_preflight.py): duplicate token
  texts; `<arch>.block_count` outside 1..512; more KV heads than heads, or a
  head size x heads that wraps around 32 bits; a negative or NaN norm epsilon;
  an unknown RoPE scaling type; inconsistent expert counts (load_hparams's
  asserts);
* a split model (`split.count` > 1, first split named like
  `NAME-00001-of-00003.gguf`): the other splits llama.cpp will open, too.

`preflight_adapter` does the same for a LoRA adapter and checks that it fits the
model it is for (architecture, tensor names and shapes): llama.cpp's adapter loader
only logs why it refuses one, and aborts on a few malformed adapters.

Memory stays bounded for hostile headers: counts are capped, keys are
remembered as 16-byte digests, tensors as four integers and a short name.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import stat
import struct
from array import array
from bisect import bisect_right
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from speculative.errors import ModelError

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
MAX_KEY_LENGTH = 1 << 16
OnTensor = Callable[[str, tuple, int], None]  # a tensor info's name, dimensions and offset
_U64 = struct.Struct("<Q")
MAX_STRING_LENGTH = MAX_ARRAY_LENGTH = 1 << 30  # gguf.cpp's GGUF_MAX_STRING_LENGTH / _ARRAY_ELEMENTS


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: Path, kind: str = "invalid GGUF metadata"):
        self.buf = buf
        self.pos = 0
        self.path = path
        self.kind = kind

    def fail(self, what: str, at: int | None = None) -> ModelError:
        return ModelError(f"{self.path}: {self.kind}: {what} (at byte {self.pos if at is None else at})")

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
        limit = MAX_STRING_LENGTH if limit is None else limit
        if n > limit:
            raise self.fail(f"{what} length {n} is larger than {limit}", self.pos - 8)
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
            at = pos
            if pos + 8 > end:
                break
            (n,) = unpack(buf, pos)
            pos += 8
            if n > end - pos or n > MAX_STRING_LENGTH:
                break
            if keep:
                out.append(buf[pos : pos + n])
            pos += n
        else:
            self.pos = pos
            return out if keep else None
        self.pos = at
        raise self.fail(f"{what}: a string runs past the end of the file")

    def name(self, what: str, noun: str, limit: int) -> tuple[bytes, str]:
        """A key or tensor name: non-empty, at most `limit` bytes, UTF-8 without NUL."""
        at = self.pos
        n = self.scalar("<Q", f"{what}: {noun} length")
        if n == 0:
            raise self.fail(f"{what}: empty {noun}", at)
        if n > limit:
            raise self.fail(f"{what}: {noun} length {n} is larger than {limit}", at)
        raw = bytes(self.buf[self.take(n, f"{what}: {noun}") : self.pos])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what}: {noun} is not valid UTF-8", at) from None
        if "\0" in text:
            raise self.fail(f"{what}: {noun} contains a NUL byte", at)
        return raw, text

    def skip_string(self, what: str) -> None:
        n = self.scalar("<Q", f"{what} length")
        if n > MAX_STRING_LENGTH:
            raise self.fail(f"{what}: string length {n} is larger than {MAX_STRING_LENGTH}", self.pos - 8)
        self.take(n, what)

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
            if count > MAX_ARRAY_LENGTH:
                raise self.fail(f"{key}: array of {count} elements is longer than {MAX_ARRAY_LENGTH}", self.pos - 8)
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
            if etype == GGUFValueType.ARRAY:
                raise self.fail(f"{key}: arrays of arrays are not supported", self.pos - 12)
            raise self.fail(f"{key}: unknown array element type {etype}", self.pos - 12)
        raise self.fail(f"{key}: unknown value type {vtype}", self.pos - 4)


def read_metadata(path: Path, keys: Iterable[str]) -> dict[str, Any]:
    """The values of `keys` (those present) from a GGUF file's metadata.

    Strings come back as str; arrays of strings as lists of raw bytes (token
    texts are compared byte for byte); other arrays as lists of numbers.
    """
    wanted = set(keys)
    return _mapped(Path(path), "invalid GGUF metadata", lambda cur: _read(cur, wanted))


def nextn_kind(path: Path) -> str:
    """What a (pre-flighted) model file holds of NextN (multi-token prediction) layers, from one
    walk of its tensor infos: "none"; "layers" that can draft for it, as llama.cpp tells
    (common_speculative_types_from_gguf: a tensor blk.{block_count - 1}.nextn.eh_proj.weight);
    or "head", those layers without the trunk (no blk.0.attn_norm.weight, as llama.cpp's loaders
    tell), an MTP head as `convert_hf_to_gguf.py --mtp` publishes one to draft for its model."""
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    if arch == "gemma4-assistant":  # an MTP assistant: NextN layers alone, reading the target's cache
        return "head"
    count = read_metadata(path, [f"{arch}.block_count"]).get(f"{arch}.block_count") if isinstance(arch, str) else None
    if type(count) is not int or count < 1:
        return "none"
    nextn, trunk = f"blk.{count - 1}.nextn.eh_proj.weight", "blk.0.attn_norm.weight"
    found = _model_tensors(Path(path), {nextn, trunk})[1]
    return "none" if nextn not in found else "layers" if trunk in found else "head"


def tensor_names(path: Path) -> list[str]:
    """The names of a model's tensors, from all of its files if it is split."""
    names: list[str] = []

    def walk(cur: _Cursor) -> int:
        return _split_count(cur, _walk(cur, lambda name, dims, at: names.append(name)))

    for part in _other_splits(path, _mapped(Path(path), "invalid GGUF", walk)):
        _mapped(part, "invalid GGUF", walk)
    return names


def head_sizes(path: Path) -> tuple[set[int], set[int]] | None:
    """The sizes of a model's attention heads, K's and V's (each layer's: head_count may be per
    layer), as llama.cpp's hparams read them (key_length, value_length, else the embedding
    length over the heads); None where the metadata does not say."""
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    if not isinstance(arch, str):
        return None
    keys = [f"{arch}.{k}" for k in ("attention.key_length", "attention.value_length", "embedding_length",
                                    "attention.head_count")]
    meta = read_metadata(path, keys)
    k, v, embd, heads = (meta.get(key) for key in keys)
    counts = [h for h in (heads if isinstance(heads, list) else [heads]) if isinstance(h, int) and h > 0]
    default = {embd // h for h in counts} if isinstance(embd, int) and counts else set()
    sizes = ({k} if isinstance(k, int) else default, {v} if isinstance(v, int) else default)
    return sizes if sizes[0] and sizes[1] else None


def kv_cache_bytes(path: Path, cells: int, type_k: str, type_v: str) -> int | None:
    """What llama.cpp allocates for a KV cache of `cells` cells of these types: per attention
    layer (a hybrid's recurrent layers, whose head_count_kv is 0, hold none) a row of K
    (key_length x head_count_kv values) and one of V per cell. None where the metadata does not
    say, or the attention is of another kind (MLA's compressed rows)."""
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    if not isinstance(arch, str):
        return None
    keys = [f"{arch}.{k}" for k in ("block_count", "attention.head_count", "attention.head_count_kv",
                                    "attention.key_length", "attention.value_length", "embedding_length",
                                    "attention.kv_lora_rank", "nextn_predict_layers")]
    n_layer, heads, heads_kv, k_len, v_len, embd, mla, nextn = (read_metadata(path, keys).get(k) for k in keys)
    if not isinstance(n_layer, int) or mla is not None:
        return None
    n_layer -= nextn if isinstance(nextn, int) else 0  # NextN layers: their own context's, if loaded

    def per_layer(value) -> list:
        return value[:n_layer] if isinstance(value, list) else [value] * n_layer

    total = 0
    for h, h_kv in zip(per_layer(heads), per_layer(heads if heads_kv is None else heads_kv)):
        if not h_kv:
            continue
        if not (isinstance(h, int) and h > 0 and isinstance(h_kv, int)):
            return None
        for length, kind in ((k_len, type_k), (v_len, type_v)):
            width = (length if isinstance(length, int) else embd // h if isinstance(embd, int) else 0) * h_kv
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind.upper()]]  # values, bytes
            if not width or width % block:
                return None
            total += cells * width // block * size
    return total


def has_nextn_layers(path: Path) -> bool:
    return nextn_kind(path) != "none"


def is_mtp_head(path: Path) -> bool:
    return nextn_kind(path) == "head"


def feature_drafter_kind(path: Path) -> str | None:
    """The --spec-type of a drafter file that reads its target's layer inputs: "draft-eagle3"
    (architecture eagle3), "draft-dspark" (a dflash file with a Markov head, markov_w1, as
    llama.cpp's common_speculative_types_from_gguf tells), "draft-dflash"; None for any other."""
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    if arch == "eagle3":
        return "draft-eagle3"
    if arch != "dflash":
        return None
    return "draft-dspark" if "markov_w1.weight" in _model_tensors(Path(path), {"markov_w1.weight"})[1] else "draft-dflash"


def _mapped(path: Path, kind: str, walk):
    """`walk(cursor)` over a memory map of the GGUF file at `path`; a path that is not
    a readable, non-empty regular file is a one-line ModelError (a FIFO is never opened)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelError(f"{path}: is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return walk(_Cursor(buf, path, kind))
    except ValueError:  # mmap of an empty file
        raise ModelError(f"{path}: {kind}: the file is empty") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror or e}") from None


def _read(cur: _Cursor, wanted: set[str]) -> dict[str, Any]:
    _, n_kv = _header(cur)
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


# -- preflight ---------------------------------------------------------------

MAX_KVS = 1 << 16  # real models have tens of keys
MAX_TENSORS = 1 << 16  # and hundreds to a few thousand tensors
MAX_TENSOR_NAME = 63  # ggml's GGML_MAX_NAME (64) with its NUL
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
_MIN_KV = 8 + 1 + 4 + 1  # key length, a 1-byte key, value type, a 1-byte value
_MIN_TENSOR = 8 + 1 + 4 + 8 + 4 + 8  # name length, a 1-byte name, n_dims, one dim, type, offset
_INT64_MAX = (1 << 63) - 1
_WATCHED = {"general.architecture", "split.count", "tokenizer.ggml.tokens",
            "general.type", "adapter.type", "adapter.lora.alpha"}
# `<arch>.` hyperparameters llama.cpp asserts on (an abort, not an error) or overflows with
_HPARAMS = {"block_count", "nextn_predict_layers", "attention.head_count", "attention.head_count_kv",
            "attention.key_length", "attention.value_length", "attention.layer_norm_epsilon",
            "attention.layer_norm_rms_epsilon", "expert_count", "expert_used_count",
            "expert_group_count", "expert_group_used_count", "rope.scaling.type"}
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


def _q(text: str) -> str:
    """A name quoted for a one-line message (escapes newlines; long names cut)."""
    return repr(text if len(text) <= 80 else text[:80] + "...")


def _type_name(vtype: int) -> str:
    try:
        return GGUFValueType(vtype).name.lower()
    except ValueError:
        return f"unknown type {vtype}"


def preflight(path: Path) -> None:
    """Validate a GGUF file's whole header before llama.cpp parses it (see the module
    docstring for the checks); raise ModelError with a one-line message on the first
    problem. Also checks the other files of a split model."""
    path = Path(path)
    for part in _other_splits(path, _preflight_file(path)):
        _preflight_file(part)


def _other_splits(path: Path, split_count: int) -> list[Path]:
    """The existing other files of a split model whose first file is `path` (a missing
    one is llama.cpp's clean error)."""
    postfix = f"-00001-of-{split_count:05d}.gguf"
    if split_count <= 1 or not str(path).endswith(postfix):
        return []
    prefix = str(path)[: -len(postfix)]
    parts = (Path(f"{prefix}-{i:05d}-of-{split_count:05d}.gguf") for i in range(2, split_count + 1))
    return [part for part in parts if part.exists()]


def _preflight_file(path: Path) -> int:
    """Validate one file; return its split count."""
    return _mapped(path, "invalid GGUF", lambda cur: _split_count(cur, _check(cur)))


def _check(cur: _Cursor, on_tensor: OnTensor | None = None) -> dict[str, int]:
    """Walk and validate the header (tensor infos also through `on_tensor`); return where
    the watched values are."""
    where = _walk(cur, on_tensor)
    if "tokenizer.ggml.tokens" in where:
        _check_tokens(cur, where["tokenizer.ggml.tokens"])
    _check_hparams(cur, where)
    return where


def _walk(cur: _Cursor, on_tensor: OnTensor | None = None) -> dict[str, int]:
    """Header, key/value pairs and tensor infos, each checked as it is read."""
    n_tensors, n_kv = _header(cur)
    alignment, where = _check_kvs(cur, n_kv)
    _check_tensors(cur, n_tensors, alignment, on_tensor)
    return where


def _split_count(cur: _Cursor, where: dict[str, int]) -> int:
    """split.count (0 when not split)."""
    split_count = _small_value(cur, where.get("split.count"))
    return split_count if type(split_count) is int else 0


def _header(cur: _Cursor) -> tuple[int, int]:
    """Magic, version and counts (bounded, and plausible for the file's size):
    (tensor count, key/value count)."""
    buf, size = cur.buf, len(cur.buf)
    magic = bytes(buf[cur.take(4, "header: magic") : 4])
    if magic != b"GGUF":
        raise cur.fail(f"header: not a GGUF file (magic {magic!r}, expected b'GGUF')", 0)
    version = cur.scalar("<I", "header: version")
    if version not in (2, 3):
        why = ("GGUF v1 is no longer supported" if version == 1 else
               "byte-swapped: a big-endian file?" if version and not version & 0xFFFF else
               "only versions 2 and 3 are supported")
        raise cur.fail(f"header: version {version} ({why})", 4)
    n_tensors = cur.scalar("<Q", "header: tensor count")
    n_kv = cur.scalar("<Q", "header: key/value count")
    if n_tensors > MAX_TENSORS:
        raise cur.fail(f"header: tensor count {n_tensors} is larger than {MAX_TENSORS}", 8)
    if n_kv > MAX_KVS:
        raise cur.fail(f"header: key/value count {n_kv} is larger than {MAX_KVS}", 16)
    need = n_kv * _MIN_KV + n_tensors * _MIN_TENSOR
    if need > size - cur.pos:
        raise cur.fail(f"header: {n_kv} key/value pairs and {n_tensors} tensor infos need at least "
                       f"{need} bytes, but only {size - cur.pos} follow", 8)
    return n_tensors, n_kv


def _check_kvs(cur: _Cursor, n_kv: int) -> tuple[int, dict[str, int]]:
    """The key/value section; returns the alignment and where the values of the keys
    checked later (_WATCHED, `<arch>.` hyperparameters) are."""
    seen: set[bytes] = set()
    alignment, where = DEFAULT_ALIGNMENT, {}
    for i in range(n_kv):
        at = cur.pos
        raw, key = cur.name(f"key/value pair {i}", "key", MAX_KEY_LENGTH)
        label = f"key {_q(key)}"
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        if digest in seen:
            raise cur.fail(f"{label}: duplicate key", at)
        seen.add(digest)
        if key in _WATCHED or (len(raw) <= 256 and key.partition(".")[2] in _HPARAMS):
            where[key] = cur.pos
        vat = cur.pos
        vtype = cur.scalar("<I", f"{label}: value type")
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise cur.fail(f"{label}: must be of type uint32, not {_type_name(vtype)}", vat)
            alignment = cur.scalar("<I", label)
            if alignment == 0 or alignment & (alignment - 1):
                raise cur.fail(f"{label}: alignment {alignment} is not a power of two", vat + 4)
        else:
            cur.value(vtype, label, keep=False)
    return alignment, where


def _check_tensors(cur: _Cursor, n_tensors: int, alignment: int, on_tensor: OnTensor | None = None) -> None:
    """The tensor infos (names, shapes, types, offsets), then where their data lies."""
    names: set[bytes] = set()
    # per tensor: where its info starts, where its offset field is, its offset and byte size
    info_at, offset_at, offsets, sizes = array("Q"), array("Q"), array("Q"), array("Q")
    for i in range(n_tensors):
        at = cur.pos
        raw, name = cur.name(f"tensor info {i}", "tensor name", MAX_TENSOR_NAME)
        label = f"tensor {_q(name)}"
        if raw in names:
            raise cur.fail(f"{label}: duplicate tensor name", at)
        names.add(raw)
        dims, nbytes = _check_shape_and_type(cur, label)
        offset = cur.scalar("<Q", f"{label}: offset")
        if offset % alignment:
            raise cur.fail(f"{label}: offset {offset} is not a multiple of the alignment {alignment}", cur.pos - 8)
        for arr, v in ((info_at, at), (offset_at, cur.pos - 8), (offsets, offset), (sizes, nbytes)):
            arr.append(v)
        if on_tensor is not None:
            on_tensor(name, dims, at)
    if n_tensors:
        _check_tensor_data(cur, alignment, info_at, offset_at, offsets, sizes)


def _check_shape_and_type(cur: _Cursor, label: str) -> tuple[tuple[int, ...], int]:
    """A tensor info's dimensions and ggml type; returns the dimensions and the data's byte size."""
    buf, size = cur.buf, len(cur.buf)
    n_dims = cur.scalar("<I", f"{label}: dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"{label}: {n_dims} dimensions (must be 1 to {MAX_DIMS})", cur.pos - 4)
    dims_at = cur.take(8 * n_dims, f"{label}: dimensions")
    dims = struct.unpack_from(f"<{n_dims}q", buf, dims_at)
    count = 1
    for j, d in enumerate(dims):
        if d < 1:
            raise cur.fail(f"{label}: dimension {j} is {d} (must be at least 1)", dims_at + 8 * j)
        count *= d
    if count > _INT64_MAX:
        raise cur.fail(f"{label}: shape {list(dims)} has more than 2^63-1 elements", dims_at)

    ttype = cur.scalar("<I", f"{label}: type")
    try:
        qtype = GGMLQuantizationType(ttype)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cur.fail(f"{label}: unknown ggml type {ttype}", cur.pos - 4) from None
    if dims[0] % block:
        raise cur.fail(f"{label}: {dims[0]} elements per row is not a multiple of the "
                       f"{qtype.name} block size {block}", dims_at)
    nbytes = count // block * type_size
    if nbytes > size:
        raise cur.fail(f"{label}: {nbytes} bytes of {qtype.name} data do not fit in the file "
                       f"({size} bytes)", dims_at)
    return dims, nbytes


def _check_tensor_data(cur: _Cursor, alignment: int, info_at: array, offset_at: array, offsets: array,
                       sizes: array) -> None:
    """The tensors' data, after the header (cur.pos) padded to the alignment: inside the file,
    packed in order, as gguf.cpp wants them. Per tensor: where its info starts, where its
    offset field is, its offset and byte size."""
    buf, size = cur.buf, len(cur.buf)
    header_end = cur.pos
    data_start = -(-header_end // alignment) * alignment
    if data_start > size:
        raise cur.fail(f"data section: starts at byte {data_start} (end of the header padded to "
                       f"{alignment}), past the end of the file ({size} bytes)", header_end)

    def name_of(i: int) -> str:
        n = _U64.unpack_from(buf, info_at[i])[0]
        return _q(bytes(buf[info_at[i] + 8 : info_at[i] + 8 + n]).decode("utf-8"))

    expected = 0  # gguf.cpp: each tensor starts where the one before ends, padded
    for i in range(len(offsets)):
        offset, nbytes, at = offsets[i], sizes[i], offset_at[i]
        start = data_start + offset
        if start >= size:
            raise cur.fail(f"tensor {name_of(i)}: offset {offset} is outside the file ({size} bytes)", at)
        if start + nbytes > size:
            raise cur.fail(f"tensor {name_of(i)}: data [{start}, {start + nbytes}) runs past the end "
                           f"of the file ({size} bytes)", at)
        if offset < expected:
            j = bisect_right(offsets, offset, 0, i) - 1
            what = ("has the same offset as" if offsets[j] == offset else
                    f"overlaps the data of (offset {offsets[j]}, {sizes[j]} bytes)")
            raise cur.fail(f"tensor {name_of(i)}: offset {offset} {what} tensor {name_of(j)}", at)
        if offset > expected:
            raise cur.fail(f"tensor {name_of(i)}: offset {offset} leaves a gap after the tensor "
                           f"before it (expected {expected}: tensors must be packed in order)", at)
        expected += -(-nbytes // alignment) * alignment


def _small_value(cur: _Cursor, at: int | None) -> Any:
    """The (already validated) value at `at`: a number, a string of at most 256 bytes,
    or a list of at most LLAMA_MAX_LAYERS numbers; None for anything else."""
    if at is None:
        return None
    c = _Cursor(cur.buf, cur.path, cur.kind)
    c.pos = at
    vtype = c.scalar("<I", "value type")
    if vtype == GGUFValueType.STRING:
        n = _U64.unpack_from(cur.buf, c.pos)[0]
        return c.string("value").decode("utf-8", errors="replace") if n <= 256 else None
    if vtype == GGUFValueType.ARRAY:
        etype, count = struct.unpack_from("<IQ", cur.buf, c.pos)
        if etype not in _SCALARS or count > LLAMA_MAX_LAYERS:
            return None
    return c.value(vtype, "value", keep=True)


def _check_tokens(cur: _Cursor, at: int) -> None:
    """Token texts must be unique: llama.cpp's vocabulary loader asserts (aborts) on a
    duplicate. A walk keeps an 8-byte hash a token; only if two hashes are equal does a
    second walk compare those texts."""
    buf, unpack = cur.buf, _U64.unpack_from
    etype, count = struct.unpack_from("<IQ", buf, at + 4)
    if struct.unpack_from("<I", buf, at)[0] != GGUFValueType.ARRAY or etype != GGUFValueType.STRING:
        return

    def texts():  # (index, where its length is, its text as llama.cpp names it)
        pos = at + 16
        for i in range(count):
            (n,) = unpack(buf, pos)
            yield i, pos, buf[pos + 8 : pos + 8 + n] if n else b"[EMPTY_%d]" % i
            pos += 8 + n

    hashes = array("q", (hash(text) for _, _, text in texts()))
    h = np.sort(np.frombuffer(hashes, dtype=np.int64))
    suspects = set(h[1:][h[1:] == h[:-1]].tolist())
    first: dict[bytes, int] = {}
    for i, pos, text in texts() if suspects else ():
        if hash(text) in suspects:
            if text in first:
                raise cur.fail(f"key 'tokenizer.ggml.tokens': tokens {first[text]} and {i} are both "
                               f"{_q(text.decode('utf-8', errors='replace'))}", pos)
            first[text] = i


def _check_hparams(cur: _Cursor, where: dict[str, int]) -> None:
    """Hyperparameters that make llama.cpp abort (GGML_ASSERT) or overflow instead of
    refusing the file: llama_model_base::load_hparams's generic asserts, head counts
    whose products wrap around uint32, negative or NaN norm epsilons. Values of an
    unexpected type are left to llama.cpp, which refuses them cleanly."""
    arch = _small_value(cur, where.get("general.architecture"))
    if not isinstance(arch, str):
        return

    def get(name: str, kind: type = int) -> list | None:
        value = _small_value(cur, where.get(f"{arch}.{name}"))
        values = value if isinstance(value, list) else [value]
        return values if values and all(type(v) is kind for v in values) else None

    def bad(name: str, why: str) -> ModelError:
        return cur.fail(f"key {_q(f'{arch}.{name}')}: {why}", where[f"{arch}.{name}"])

    n_layer = get("block_count")
    if n_layer is not None and not 1 <= n_layer[0] <= LLAMA_MAX_LAYERS:
        raise bad("block_count", f"{n_layer[0]} layers (llama.cpp supports 1 to {LLAMA_MAX_LAYERS})")
    nextn = get("nextn_predict_layers")
    if nextn and n_layer and nextn[0] > n_layer[0]:
        raise bad("nextn_predict_layers", f"{nextn[0]} is more than the {n_layer[0]} layers")

    heads, heads_kv = get("attention.head_count"), get("attention.head_count_kv")
    if heads and heads_kv and len(heads) in (1, len(heads_kv)) and len(heads_kv) in (1, len(heads)):
        for h, kv in zip(heads * len(heads_kv) if len(heads) == 1 else heads,
                         heads_kv * len(heads) if len(heads_kv) == 1 else heads_kv):
            if kv > h:
                raise bad("attention.head_count_kv", f"{kv} KV heads is more than the {h} heads")
    for name in ("attention.key_length", "attention.value_length"):
        size = get(name)
        if heads and size and size[0] * max(heads) >= 1 << 32:
            raise bad(name, f"{size[0]} x {max(heads)} heads overflows 32 bits")
    for name in ("attention.layer_norm_epsilon", "attention.layer_norm_rms_epsilon"):
        eps = get(name, float)
        if eps and not (math.isfinite(eps[0]) and eps[0] >= 0):
            raise bad(name, f"epsilon {eps[0]} is not a finite number >= 0")

    rope = _small_value(cur, where.get(f"{arch}.rope.scaling.type"))
    if isinstance(rope, str) and rope not in ROPE_SCALING_TYPES:
        raise bad("rope.scaling.type", f"unknown RoPE scaling type {_q(rope)}")

    n_expert, used = max(get("expert_count") or [0]), max(get("expert_used_count") or [0])
    groups, group_used = max(get("expert_group_count") or [0]), max(get("expert_group_used_count") or [0])
    for name, ok, why in (
        ("expert_count", n_expert <= LLAMA_MAX_EXPERTS, f"llama.cpp supports at most {LLAMA_MAX_EXPERTS}"),
        ("expert_used_count", used <= n_expert, f"{used} experts used of {n_expert}"),
        ("expert_count", used > 0 or not n_expert, f"{n_expert} experts, none used"),
        ("expert_group_count", groups < n_expert or not groups, f"{groups} groups of {n_expert} experts"),
        ("expert_group_count", groups <= 1 or (n_expert % groups == 0 and 0 < group_used < groups),
         f"{groups} groups ({group_used} used) of {n_expert} experts"),
    ):
        if not ok:
            raise bad(name, why)


# -- LoRA adapters -------------------------------------------------------------

# llama.cpp's adapter loader reads these with gguf_get_val_str / gguf_get_val_f32, which
# assert (abort the process) on a value of any other type instead of refusing the file.
_ADAPTER_KEYS = {"general.type": GGUFValueType.STRING, "general.architecture": GGUFValueType.STRING,
                 "adapter.type": GGUFValueType.STRING, "adapter.lora.alpha": GGUFValueType.FLOAT32}
_LORA_SUFFIXES = (".lora_a", ".lora_b")


def preflight_adapter(path: Path, model_path: Path) -> None:
    """Validate a LoRA adapter for the model at `model_path` before llama.cpp sees it.

    The adapter's header is checked as `preflight` checks a model; then what llama.cpp's
    adapter loader requires, with a message that says what does not fit: a GGUF that is
    not a LoRA adapter, one for another architecture, matrices for tensors the model does
    not have or of shapes that do not fit them. Also refused: what would make llama.cpp
    abort instead of refusing the file: a key of _ADAPTER_KEYS of the wrong type, and
    matrices whose expert dimension or rank the loader does not compare with the model's
    (the first decode's ggml_mul_mat asserts). Raises ModelError with a one-line message.
    """
    path = Path(path)
    arch, pairs = _mapped(path, "invalid LoRA adapter", _read_adapter)
    model_arch, shapes = _model_tensors(Path(model_path), set(pairs))
    model = Path(model_path).name

    def refuse(why: str) -> ModelError:
        return ModelError(f"{path}: {why}")

    if arch != model_arch:
        raise refuse(f"a LoRA adapter for architecture {_shown(arch)}, but {model} is {_shown(model_arch)}")
    for base, (a, b) in pairs.items():
        if a is None or b is None:
            raise refuse(f"LoRA tensor {_q(base)} has no {'lora_a' if a is None else 'lora_b'}")
        if base not in shapes:
            raise refuse(f"LoRA tensor {_q(base)} is not in {model} (an adapter for another model?)")
        if not _fits(base, a, b, shapes[base]):
            raise refuse(f"LoRA matrices for {_q(base)} of shapes {list(a)} and {list(b)} do not fit its "
                         f"shape {list(shapes[base])} in {model} (an adapter for another model?)")


def _read_adapter(cur: _Cursor) -> tuple[Any, dict[str, list]]:
    """Check the header and the adapter's keys; return its architecture and its matrices'
    dimensions by the tensor they change: {base name: [A dims, B dims]}, paired as
    llama.cpp pairs them."""
    pairs: dict[str, list] = {}
    strays: list[tuple[str, int]] = []  # tensors llama.cpp refuses, named after the keys are checked

    def matrix(name: str, dims: tuple, at: int) -> None:
        for i, suffix in enumerate(_LORA_SUFFIXES):
            if name.endswith(suffix):
                pairs.setdefault(name.replace(suffix, ""), [None, None])[i] = dims
                return
        if not name.endswith("_norm.weight") and not strays:  # llama.cpp skips norms
            strays.append((name, at))

    where = _check(cur, matrix)
    values = {}
    for key, vtype in _ADAPTER_KEYS.items():
        at = where.get(key)
        found = None if at is None else struct.unpack_from("<I", cur.buf, at)[0]
        if found is not None and found != vtype:
            raise cur.fail(f"key {_q(key)}: must be of type {_type_name(vtype)}, not {_type_name(found)}", at)
        values[key] = _small_value(cur, at)
    for key, expected in (("general.type", "adapter"), ("adapter.type", "lora")):
        if values[key] != expected:  # a model file given as an adapter, or a control vector
            raise ModelError(f"{cur.path}: not a LoRA adapter ({key} is {_shown(values[key])}, not {expected!r})")
    alpha = values["adapter.lora.alpha"]
    if alpha is not None and not math.isfinite(alpha):
        raise cur.fail(f"key 'adapter.lora.alpha': {alpha} is not a finite number", where["adapter.lora.alpha"])
    if strays:
        name, at = strays[0]
        raise cur.fail(f"tensor {_q(name)}: not a LoRA matrix (named *.lora_a or *.lora_b)", at)
    return values["general.architecture"], pairs


def _model_tensors(path: Path, names: set[str]) -> tuple[Any, dict[str, tuple]]:
    """A model's general.architecture and the dimensions of its tensors in `names`,
    from all of its files if it is split."""
    shapes: dict[str, tuple] = {}

    def walk(cur: _Cursor) -> tuple[Any, int]:
        where = _walk(cur, lambda name, dims, at: shapes.update({name: dims}) if name in names else None)
        return _small_value(cur, where.get("general.architecture")), _split_count(cur, where)

    arch, split_count = _mapped(path, "invalid GGUF", walk)
    for part in _other_splits(path, split_count):
        _mapped(part, "invalid GGUF", walk)
    return arch, shapes


def _fits(name: str, a: tuple, b: tuple, model: tuple) -> bool:
    """Whether A and B fit the model tensor they change (ggml dimension order: a weight
    is [inputs, outputs(, experts)]; A [inputs, rank(, experts)], B [rank, outputs(, experts)])."""
    a, b, model = ((*dims, *(1,) * (MAX_DIMS - len(dims))) for dims in (a, b, model))
    if name.endswith("token_embd.weight"):  # A's rows are picked by token, then B applies: llm_build_inp_embd
        return model[1] == a[1] and model[0] == b[1] and a[0] == b[0] and a[2:] == b[2:] == model[2:]
    return model[0] == a[0] and model[1] == b[1] and a[1] == b[0] and a[2:] == b[2:] == model[2:]


def _shown(value: Any) -> str:
    return "missing" if value is None else _q(str(value))
