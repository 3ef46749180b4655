"""GGUF files built byte by byte for the pre-flight tests, every field overridable.

`build` writes header, key/value pairs, tensor infos, padding and data, and
returns the bytes with the offsets of its section boundaries, so each hostile
case (and each truncation point) is generated exactly; no binaries are
committed. `int_fields` lists where the integer fields of a valid file are, for
the mutation tests; `write_tiny_llama` writes a model llama.cpp really loads, and
`write_lora` a LoRA adapter for a model.
"""

from __future__ import annotations

import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFValueType as V

SCALAR_FMT = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I",
              V.INT32: "<i", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT32: "<f", V.FLOAT64: "<d",
              V.BOOL: "<?"}


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string: u64 length (overridable), then the bytes."""
    raw = s.encode() if isinstance(s, str) else s
    return u64(len(raw) if length is None else length) + raw


@dataclass
class KV:
    key: str | bytes
    vtype: int
    value: Any = None
    etype: int | None = None  # element type of an array
    count: int | None = None  # declared array length (default: len(value))
    key_len: int | None = None  # declared key length
    raw: bytes | None = None  # the value's bytes as they are (after the type)

    def encode(self) -> bytes:
        out = gstr(self.key, self.key_len) + u32(self.vtype)
        if self.raw is not None:
            return out + self.raw
        return out + encode_value(self.vtype, self.value, self.etype, self.count)


def encode_value(vtype: int, value: Any, etype: int | None = None, count: int | None = None) -> bytes:
    if vtype == V.STRING:
        return gstr(value)
    if vtype == V.ARRAY:
        items = b"".join(encode_value(etype, v) for v in value)
        return u32(etype) + u64(len(value) if count is None else count) + items
    return struct.pack(SCALAR_FMT[V(vtype)], value)


@dataclass
class T:
    """A tensor info; `offset` None packs it after the tensor before it."""

    name: str | bytes
    dims: tuple[int, ...]
    ttype: int = Q.F32
    offset: int | None = None
    n_dims: int | None = None
    name_len: int | None = None

    def nbytes(self) -> int:
        known = self.ttype in set(GGML_QUANT_SIZES)  # an unknown type counts as 1 byte an element
        block, size = GGML_QUANT_SIZES[Q(self.ttype)] if known else (1, 1)
        return int(np.prod(self.dims, dtype=object)) // block * size

    def encode(self, offset: int) -> bytes:
        n_dims = len(self.dims) if self.n_dims is None else self.n_dims
        return (gstr(self.name, self.name_len) + u32(n_dims) + struct.pack(f"<{len(self.dims)}q", *self.dims)
                + u32(self.ttype) + u64(offset))


def pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def build(kvs: list[KV] = (), tensors: list[T] = (), *, magic: bytes = b"GGUF", version: int = 3,
          n_tensors: int | None = None, n_kv: int | None = None, alignment: int = 32,
          data: bytes | None = None) -> tuple[bytes, list[tuple[str, int]]]:
    """The file's bytes and its section boundaries [(label, offset)]. Data defaults to
    the packed tensors' bytes (a ramp); `alignment` lays out the file (declare a
    non-default one with a general.alignment KV yourself)."""
    marks = []
    out = bytearray(magic)
    marks.append(("after magic", len(out)))
    out += u32(version)
    marks.append(("after version", len(out)))
    out += u64(len(tensors) if n_tensors is None else n_tensors)
    marks.append(("after tensor count", len(out)))
    out += u64(len(kvs) if n_kv is None else n_kv)
    marks.append(("after kv count", len(out)))
    for i, kv in enumerate(kvs):
        out += kv.encode()
        marks.append((f"after kv {i}", len(out)))
    offset = 0
    for i, t in enumerate(tensors):
        at = offset if t.offset is None else t.offset
        out += t.encode(at)
        marks.append((f"after tensor info {i}", len(out)))
        offset = pad(at + t.nbytes(), alignment) if t.offset is None else offset + pad(t.nbytes(), alignment)
    out += bytes(pad(len(out), alignment) - len(out))
    marks.append(("before data", len(out)))
    if data is None:
        data = bytes(i % 251 for i in range(offset))
    out += data
    return bytes(out), marks


def valid(**overrides) -> tuple[bytes, list[tuple[str, int]]]:
    """A small valid file: a few KVs of every kind, three tensors of three types."""
    kvs = [
        KV("general.architecture", V.STRING, "llama"),
        KV("general.name", V.STRING, "tiny \u00e9"),
        KV("test.u8", V.UINT8, 7), KV("test.i64", V.INT64, -5), KV("test.bool", V.BOOL, True),
        KV("test.f64", V.FLOAT64, 0.5),
        KV("tokenizer.ggml.tokens", V.ARRAY, ["<unk>", "a", "", "\u00e9"], etype=V.STRING),
        KV("tokenizer.ggml.scores", V.ARRAY, [0.0, 1.0, 2.0, 3.0], etype=V.FLOAT32),
    ]
    tensors = [T("token_embd.weight", (32, 4), Q.Q8_0), T("output_norm.weight", (32,)),
               T("blk.0.attn_q.weight", (256, 2), Q.Q4_K)]
    args = {"kvs": kvs, "tensors": tensors, **overrides}
    return build(**args)


def int_fields(data: bytes) -> list[tuple[int, int, str]]:
    """(offset, size, label) of every integer field of a valid GGUF: counts, lengths,
    types, dims, offsets and integer values, array elements included."""
    fields, pos = [(4, 4, "version"), (8, 8, "tensor count"), (16, 8, "kv count")], 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def field(size: int, label: str) -> int:
        nonlocal pos
        fields.append((pos, size, label))
        pos += size
        return int.from_bytes(data[pos - size : pos], "little")

    def string(label: str) -> bytes:
        nonlocal pos
        n = field(8, label + " length")
        pos += n
        return data[pos - n : pos]

    for _ in range(n_kv):
        key = string("key").decode()
        vtype = field(4, f"{key} type")
        count, etype = 1, vtype
        if vtype == V.ARRAY:
            etype, count = field(4, f"{key} element type"), field(8, f"{key} count")
        for i in range(count):
            label = key if vtype != V.ARRAY else f"{key}[{i}]"
            if etype == V.STRING:
                string(label)
            elif etype in (V.FLOAT32, V.FLOAT64):
                pos += struct.calcsize(SCALAR_FMT[V(etype)])
            else:
                field(struct.calcsize(SCALAR_FMT[V(etype)]), label)
    for _ in range(n_tensors):
        name = string("tensor name").decode()
        n_dims = field(4, f"{name} n_dims")
        for j in range(n_dims):
            field(8, f"{name} dim {j}")
        field(4, f"{name} type")
        field(8, f"{name} offset")
    return fields


TOKENS = ["<unk>", "<s>", "</s>", "<0x0A>", "\u2581hi", "\u2581", "h", "i"]


def write_tiny_llama(path: Path, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
                     n_head_kv: int = 2, n_ff: int = 128, chat_template: str | None = None) -> Path:
    """A llama-architecture model llama.cpp loads and runs: 8 SPM tokens, F32 weights."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    add_tiny_tokenizer(w)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:  # numpy shape = ggml's ne reversed
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    n_kv_embd = n_embd // n_head * n_head_kv
    tensor("token_embd.weight", len(TOKENS), n_embd)
    tensor("output_norm.weight", n_embd)
    for i in range(n_layer):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", n_embd)
        tensor(b + "attn_q.weight", n_embd, n_embd)
        tensor(b + "attn_k.weight", n_kv_embd, n_embd)
        tensor(b + "attn_v.weight", n_kv_embd, n_embd)
        tensor(b + "attn_output.weight", n_embd, n_embd)
        tensor(b + "ffn_norm.weight", n_embd)
        tensor(b + "ffn_gate.weight", n_ff, n_embd)
        tensor(b + "ffn_down.weight", n_embd, n_ff)
        tensor(b + "ffn_up.weight", n_ff, n_embd)
    return write_out(w, path)


def write_chain_llama(path: Path, follows: dict[str, str], n_embd: int = 32) -> Path:
    """A tiny llama whose next token depends only on the last one, by a wide margin:
    `follows` maps a token of TOKENS to the one that comes after it (a token it does
    not name is followed by "</s>"). Its greedy text is the same on every CPU, unlike a
    real model's, whose near-ties the kernels decide.

    How: every layer's weights are zero, so attention and feed-forward add nothing and
    the last hidden state is the last token's embedding, a one-hot row; after the RMS
    norm it is sqrt(n_embd) there, and output.weight holds a 1 for each (token, next)
    pair: the next token's logit is sqrt(n_embd), every other one 0."""
    ids = {text: i for i, text in enumerate(TOKENS)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_embd)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_dimension_count(n_embd // 2)
    w.add_layer_norm_rms_eps(1e-5)
    add_tiny_tokenizer(w)

    def zeros(*shape: int) -> np.ndarray:  # numpy shape = ggml's ne reversed
        return np.zeros(shape, dtype=np.float32)

    output = zeros(len(TOKENS), n_embd)
    for token in TOKENS:
        output[ids[follows.get(token, "</s>")], ids[token]] = 1.0
    w.add_tensor("token_embd.weight", np.eye(len(TOKENS), n_embd, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", output)
    for name, shape in (("attn_norm", (n_embd,)), ("attn_q", (n_embd, n_embd)), ("attn_k", (n_embd // 2, n_embd)),
                        ("attn_v", (n_embd // 2, n_embd)), ("attn_output", (n_embd, n_embd)),
                        ("ffn_norm", (n_embd,)), ("ffn_gate", (n_embd, n_embd)), ("ffn_down", (n_embd, n_embd)),
                        ("ffn_up", (n_embd, n_embd))):
        w.add_tensor(f"blk.0.{name}.weight", zeros(*shape))
    return write_out(w, path)


def add_tiny_tokenizer(w: gguf.GGUFWriter) -> None:
    """An 8-token SPM vocabulary (<unk> <s> </s>, a byte token, 'hi' pieces)."""
    T_ = gguf.TokenType
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_token_types([T_.UNKNOWN, T_.CONTROL, T_.CONTROL, T_.BYTE] + [T_.NORMAL] * 4)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def write_lora(path: Path, shapes: dict[str, tuple[int, int]], *, rank: int = 8, std: float = 0.1,
               arch: str = "llama", seed: int = 0) -> Path:
    """A LoRA adapter as llama.cpp's convert_lora_to_gguf.py writes one, F32: for each weight
    of `shapes` ({name: ggml dimensions [inputs, outputs]}), A [inputs, rank] scaled to keep
    the size of what it multiplies and B [rank, outputs] of standard deviation `std`;
    alpha = rank, so that --lora adds B·A·x at scale 1."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("adapter")
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
    rng = np.random.default_rng(seed)
    for name, (n_in, n_out) in shapes.items():  # numpy shapes are ggml's reversed
        w.add_tensor(f"{name}.lora_a", (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32))
        w.add_tensor(f"{name}.lora_b", (rng.standard_normal((n_out, rank)) * std).astype(np.float32))
    return write_out(w, path)


def write_out(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_llama_bytes() -> bytes:
    """The bytes of write_tiny_llama's model (deterministic)."""
    with tempfile.TemporaryDirectory() as tmp:
        return write_tiny_llama(Path(tmp) / "tiny.gguf").read_bytes()
