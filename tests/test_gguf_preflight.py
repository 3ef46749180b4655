"""The GGUF pre-flight check: hostile or corrupt headers never reach llama.cpp.

Every case is a file built byte by byte (tests/gguf_builder.py), at least the
hostile cases of llama.cpp's tests/test-gguf.cpp; each must be refused with a
one-line ModelError naming the file and the field, with little work: the check is
Python over a memory map, so its work is the Python lines it runs, counted by a trace
hook (lines_at_most) and bounded by the header's size, whatever counts and lengths the
header claims (a runaway loop is stopped where it runs, not timed). The mutation test
loads every mutant the check accepts in a child process, which llama.cpp must not kill.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from speculative.errors import ModelError
from speculative.models.gguf_meta import preflight, read_metadata
from tests.conftest import QWEN, QWEN_DRAFT, SMOL, speculate
from tests.gguf_builder import KV, Q, T, V, build, gstr, int_fields, tiny_llama_bytes, u32, u64, valid, write_tiny_llama

ARCH = KV("general.architecture", V.STRING, "llama")


# Measured: a hostile header of a few hundred bytes takes 100-600 lines, the tiny model's
# header 1.6 lines a byte, the registry models' 0.6 (their 150k-token vocabularies included).
WORK_FIXED = 1000      # Python lines any check may take
WORK_PER_BYTE = 2      # ... and per byte of the header


class TooMuchWork(Exception):
    pass


@contextlib.contextmanager
def lines_at_most(limit: int):
    """Within the block, the Python lines past `limit` raise TooMuchWork in the code running them."""
    count = 0

    def line(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count > limit:
                raise TooMuchWork(f"more than {limit} Python lines")
        return line

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: line)
    try:
        yield
    finally:
        sys.settrace(previous)


def work_limit(header_bytes: int) -> int:
    return WORK_FIXED + WORK_PER_BYTE * header_bytes


def size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def header_size(path: Path) -> int:
    """Where a valid GGUF's tensor infos end (its data follows, after a little padding)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return max(at + n for at, n, _ in int_fields(data))


def refused(path: Path, match: str, bad_file: Path | None = None) -> str:
    """preflight(path) raises a one-line ModelError naming the (bad) file and `match`, with
    work bounded by the file's size (these files are all header)."""
    with lines_at_most(work_limit(size(path))), pytest.raises(ModelError) as err:
        preflight(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{bad_file or path}: "), message
    assert match in message, message
    return message


def write(tmp_path: Path, data: bytes, name: str = "bad.gguf") -> Path:
    return rewrite(tmp_path / name, data)


def rewrite(path: Path, data: bytes) -> Path:
    """Write a new file: truncating an existing one costs milliseconds on ext4."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)
    return path


def two_tensors(second: T, **kw) -> bytes:
    """'a' (64 F32 = 256 bytes at 0) and `second`, with enough data for both."""
    return build([ARCH], [T("a", (64,)), second], data=bytes(1024), **kw)[0]


# (id, file bytes, distinctive part of the message)
CASES = [
    # header (test-gguf.cpp HEADER_*)
    ("bad magic", build(magic=b"FUGG")[0], "not a GGUF file (magic b'FUGG'"),
    ("version 0", build(version=0)[0], "header: version 0"),
    ("version 1", build(version=1)[0], "GGUF v1 is no longer supported"),
    ("version 99", build(version=99)[0], "version 99 (only versions 2 and 3"),
    ("big-endian version", build(version=3 << 24)[0], "big-endian"),
    ("tensor count 2^63", build(n_tensors=1 << 63)[0], "tensor count 9223372036854775808 is larger than 65536"),
    ("tensor count -1", build(n_tensors=(1 << 64) - 1)[0], "tensor count 18446744073709551615"),
    ("kv count 2^40", build(n_kv=1 << 40)[0], "key/value count 1099511627776 is larger than 65536"),
    ("kv count -1", build(n_kv=(1 << 64) - 1)[0], "key/value count 18446744073709551615"),
    ("counts too large for the file", build([ARCH], n_kv=1000, n_tensors=1000)[0],
     "1000 key/value pairs and 1000 tensor infos need at least"),
    # key/value pairs (KV_*)
    ("empty key", build([KV("", V.UINT8, 1)])[0], "key/value pair 0: empty key"),
    ("key length 2^62", build([KV("a", V.UINT8, 1, key_len=1 << 62)])[0],
     "key/value pair 0: key length 4611686018427387904 is larger than 65536"),
    ("key length -1", build([KV("a", V.UINT8, 1, key_len=(1 << 64) - 1)])[0], "key length 18446744073709551615"),
    ("key longer than the file", build([ARCH, KV("a", V.UINT8, 1, key_len=60000)])[0],
     "key/value pair 1: key runs past the end of the file"),
    ("key not UTF-8", build([KV(b"gen\xff", V.UINT8, 1)])[0], "key/value pair 0: key is not valid UTF-8"),
    ("key with NUL", build([KV(b"general.architecture\0x", V.UINT8, 1)])[0], "key contains a NUL byte"),
    ("unknown value type", build([KV("my.key", 13, raw=b"\0" * 8)])[0], "key 'my.key': unknown value type 13"),
    ("value type -1", build([KV("my.key", (1 << 32) - 1, raw=b"\0" * 8)])[0], "unknown value type 4294967295"),
    ("array of arrays", build([KV("my.key", V.ARRAY, raw=u32(V.ARRAY) + u64(1) + u32(V.UINT8) + u64(1) + b"\1")])[0],
     "key 'my.key': arrays of arrays are not supported"),
    ("unknown array element type", build([KV("my.key", V.ARRAY, raw=u32(99) + u64(1) + b"\0" * 8)])[0],
     "key 'my.key': unknown array element type 99"),
    ("duplicate key", build([ARCH, KV("my.key", V.UINT8, 1), KV("my.key", V.UINT32, 2)])[0],
     "key 'my.key': duplicate key"),
    ("array length 2^62", build([KV("my.key", V.ARRAY, [1], etype=V.UINT8, count=1 << 62)])[0],
     "key 'my.key': array of 4611686018427387904 elements is longer than 1073741824"),
    ("array longer than the file", build([KV("my.key", V.ARRAY, [1, 2], etype=V.UINT32, count=1 << 29)])[0],
     "key 'my.key': array of 536870912 elements runs past the end of the file"),
    ("string array length 2^62", build([KV("my.key", V.ARRAY, ["a"], etype=V.STRING, count=1 << 62)])[0],
     "array of 4611686018427387904 elements is longer"),
    ("string array longer than the file", build([KV("my.key", V.ARRAY, ["a"], etype=V.STRING, count=10**6)])[0],
     "key 'my.key': array of 1000000 strings runs past the end of the file"),
    ("string in an array longer than the file",
     build([KV("my.key", V.ARRAY, raw=u32(V.STRING) + u64(2) + gstr("a") + gstr("b", 10**6))])[0],
     "key 'my.key': a string runs past the end of the file"),
    ("string longer than the file", build([KV("my.key", V.STRING, raw=gstr("abc", 10**6))])[0],
     "key 'my.key' runs past the end of the file"),
    ("string length 2^62", build([KV("my.key", V.STRING, raw=gstr("abc", 1 << 62))])[0],
     "key 'my.key': string length 4611686018427387904 is larger than 1073741824"),
    ("alignment 0", build([KV("general.alignment", V.UINT32, 0)])[0], "alignment 0 is not a power of two"),
    ("alignment 3", build([KV("general.alignment", V.UINT32, 3)])[0], "alignment 3 is not a power of two"),
    ("alignment 13 with tensors", build([KV("general.alignment", V.UINT32, 13)], [T("a", (8,))], alignment=13)[0],
     "alignment 13 is not a power of two"),
    ("alignment uint64", build([KV("general.alignment", V.UINT64, 32)])[0],
     "key 'general.alignment': must be of type uint32, not uint64"),
    ("alignment int32", build([KV("general.alignment", V.INT32, 32)])[0], "must be of type uint32, not int32"),
    ("alignment string", build([KV("general.alignment", V.STRING, "32")])[0], "must be of type uint32, not string"),
    ("alignment array", build([KV("general.alignment", V.ARRAY, [32], etype=V.UINT32)])[0],
     "must be of type uint32, not array"),
    # tensor infos (TENSORS_*)
    ("empty tensor name", build([ARCH], [T("", (32,))])[0], "tensor info 0: empty tensor name"),
    ("tensor name too long", build([ARCH], [T("x" * 64, (32,))])[0], "tensor name length 64 is larger than 63"),
    ("tensor name length 2^62", build([ARCH], [T("x", (32,), name_len=1 << 62)])[0],
     "tensor info 0: tensor name length 4611686018427387904"),
    ("tensor name not UTF-8", build([ARCH], [T(b"\xc3(", (32,))])[0], "tensor info 0: tensor name is not valid UTF-8"),
    ("tensor with 0 dims", build([ARCH], [T("t", (), n_dims=0)])[0], "tensor 't': 0 dimensions (must be 1 to 4)"),
    ("tensor with 5 dims", build([ARCH], [T("t", (1, 1, 1, 1, 1))])[0], "tensor 't': 5 dimensions"),
    ("tensor with 2^32-1 dims", build([ARCH], [T("t", (1,), n_dims=(1 << 32) - 1)])[0], "4294967295 dimensions"),
    ("zero dimension", build([ARCH], [T("t", (32, 0))])[0], "tensor 't': dimension 1 is 0 (must be at least 1)"),
    ("negative dimension", build([ARCH], [T("t", (-1,))])[0], "tensor 't': dimension 0 is -1"),
    ("element count overflow", build([ARCH], [T("t", (4 * (2**31 - 1),) * 2, Q.I8)], data=b"")[0],
     "tensor 't': shape [8589934588, 8589934588] has more than 2^63-1 elements"),
    ("byte size overflow", build([ARCH], [T("t", (4, 2**30 - 1, 2**30 + 1, 1))], data=b"")[0],
     "tensor 't': 18446744073709551600 bytes of F32 data do not fit in the file"),
    ("data size overflow (DATA_MEM_SIZE_OVERFLOW)",
     build([ARCH], [T("a", (0x7FFFFFFFFFFFFFC0,), Q.I8), T("b", (0x7FFFFFFFFFFFFFC0,), Q.I8)], data=bytes(32))[0],
     "tensor 'a': 9223372036854775744 bytes of I8 data do not fit in the file"),
    ("tensor larger than the file", build([ARCH], [T("t", (2**40,), Q.I8)], data=b"")[0],
     "1099511627776 bytes of I8 data do not fit in the file"),
    ("unknown tensor type 4 (Q4_2)", build([ARCH], [T("t", (32,), 4)])[0], "tensor 't': unknown ggml type 4"),
    ("unknown tensor type 5 (Q4_3)", build([ARCH], [T("t", (32,), 5)])[0], "unknown ggml type 5"),
    ("unknown tensor type 31", build([ARCH], [T("t", (32,), 31)])[0], "unknown ggml type 31"),
    ("unknown tensor type 43", build([ARCH], [T("t", (32,), 43)])[0], "unknown ggml type 43"),
    ("tensor type -1", build([ARCH], [T("t", (32,), (1 << 32) - 1)])[0], "unknown ggml type 4294967295"),
    ("row not a multiple of the block size", build([ARCH], [T("t", (33, 2), Q.Q8_0)], data=bytes(128))[0],
     "tensor 't': 33 elements per row is not a multiple of the Q8_0 block size 32"),
    ("offset not aligned", two_tensors(T("b", (64,), offset=257)),
     "tensor 'b': offset 257 is not a multiple of the alignment 32"),
    ("offset -1", two_tensors(T("b", (8,), offset=(1 << 64) - 1)), "offset 18446744073709551615 is not a multiple"),
    ("offset outside the file", two_tensors(T("b", (64,), offset=1 << 40)),
     "tensor 'b': offset 1099511627776 is outside the file"),
    ("data past the end", two_tensors(T("b", (64,), offset=896)), "tensor 'b': data ["),
    ("overlapping tensors", two_tensors(T("b", (64,), offset=128)),
     "tensor 'b': offset 128 overlaps the data of (offset 0, 256 bytes) tensor 'a'"),
    ("duplicated tensor data", two_tensors(T("b", (64,), offset=0)),
     "tensor 'b': offset 0 has the same offset as tensor 'a'"),
    ("gap between tensors", two_tensors(T("b", (64,), offset=512)),
     "tensor 'b': offset 512 leaves a gap after the tensor before it (expected 256"),
    ("duplicate tensor names", build([ARCH], [T("a", (32,)), T("a", (32,))])[0], "tensor 'a': duplicate tensor name"),
    ("alignment inconsistent with offsets",
     build([ARCH, KV("general.alignment", V.UINT32, 64)], [T("a", (8,)), T("b", (8,))])[0],
     "tensor 'b': offset 32 is not a multiple of the alignment 64"),
    ("not enough data (DATA_NOT_ENOUGH_DATA)", valid()[0][:-1], "tensor 'blk.0.attn_q.weight': data ["),
    ("data section past the end", build([ARCH], [T("ab", (8,))])[0][:dict(build([ARCH], [T("ab", (8,))])[1])[
        "after tensor info 0"]], "data section: starts at byte 128 (end of the header padded to 32)"),
    # hyperparameters llama.cpp aborts on (found by the mutation test below)
    ("block count 0", build([ARCH, KV("llama.block_count", V.UINT32, 0)])[0],
     "key 'llama.block_count': 0 layers (llama.cpp supports 1 to 512)"),
    ("block count 513", build([ARCH, KV("llama.block_count", V.UINT32, 513)])[0], "513 layers"),
    ("more KV heads than heads", build([ARCH, KV("llama.attention.head_count", V.UINT32, 4),
                                        KV("llama.attention.head_count_kv", V.UINT32, 2**28 + 2)])[0],
     "key 'llama.attention.head_count_kv': 268435458 KV heads is more than the 4 heads"),
    ("per-layer KV heads", build([ARCH, KV("llama.attention.head_count", V.ARRAY, [4, 4], etype=V.UINT32),
                                  KV("llama.attention.head_count_kv", V.ARRAY, [2, 8], etype=V.UINT32)])[0],
     "8 KV heads is more than the 4 heads"),
    ("key length x heads overflows", build([ARCH, KV("llama.attention.head_count", V.UINT32, 64),
                                            KV("llama.attention.key_length", V.UINT32, 2**27)])[0],
     "key 'llama.attention.key_length': 134217728 x 64 heads overflows 32 bits"),
    ("negative epsilon", build([ARCH, KV("llama.attention.layer_norm_rms_epsilon", V.FLOAT32, -1e-5)])[0],
     "key 'llama.attention.layer_norm_rms_epsilon': epsilon"),
    ("NaN epsilon", build([ARCH, KV("llama.attention.layer_norm_epsilon", V.FLOAT32, float("nan"))])[0],
     "epsilon nan is not a finite number"),
    ("unknown rope scaling", build([ARCH, KV("llama.rope.scaling.type", V.STRING, "linea\u0155")])[0],
     "key 'llama.rope.scaling.type': unknown RoPE scaling type"),
    ("too many experts", build([ARCH, KV("llama.expert_count", V.UINT32, 1025),
                                KV("llama.expert_used_count", V.UINT32, 2)])[0], "key 'llama.expert_count'"),
    ("more experts used than exist", build([ARCH, KV("llama.expert_count", V.UINT32, 8),
                                            KV("llama.expert_used_count", V.UINT32, 9)])[0], "9 experts used of 8"),
    ("experts, none used", build([ARCH, KV("llama.expert_count", V.UINT32, 8)])[0], "8 experts, none used"),
    ("expert groups", build([ARCH, KV("llama.expert_count", V.UINT32, 8), KV("llama.expert_used_count", V.UINT32, 2),
                             KV("llama.expert_group_count", V.UINT32, 3)])[0], "3 groups (0 used) of 8 experts"),
    ("duplicate tokens", build([ARCH, KV("tokenizer.ggml.tokens", V.ARRAY, ["a", "b", "a"], etype=V.STRING)])[0],
     "key 'tokenizer.ggml.tokens': tokens 0 and 2 are both 'a'"),
    ("empty token named like another", build([ARCH, KV("tokenizer.ggml.tokens", V.ARRAY, ["[EMPTY_1]", ""],
                                                       etype=V.STRING)])[0], "tokens 0 and 1 are both '[EMPTY_1]'"),
]


@pytest.mark.parametrize("data, match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_file_is_refused(tmp_path, data, match):
    refused(write(tmp_path, data), match)


def test_messages_name_the_byte_offset(tmp_path):
    data = two_tensors(T("b", (64,), offset=1 << 40))
    message = refused(write(tmp_path, data, "model.gguf"), "outside the file")
    # the offset field of 'b' is the last 8 bytes of the tensor infos
    header_end = dict(build([ARCH], [T("a", (64,)), T("b", (64,))])[1])["after tensor info 1"]
    assert message.endswith(f"outside the file ({len(data)} bytes) (at byte {header_end - 8})"), message


def test_hostile_headers_allocate_little(tmp_path):
    for name in ("array length 2^62", "string length 2^62", "key length 2^62", "kv count 2^40",
                 "string array length 2^62", "tensor larger than the file"):
        data = dict((c[0], c[1]) for c in CASES)[name]
        path = write(tmp_path, data)
        tracemalloc.start()
        with pytest.raises(ModelError):
            preflight(path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1 << 20, (name, peak)


# -- truncation --------------------------------------------------------------

@pytest.mark.parametrize("label, cut", valid()[1], ids=[m[0] for m in valid()[1]])
def test_truncated_at_a_section_boundary(tmp_path, label, cut):
    data = valid()[0]
    assert cut < len(data)
    refused(write(tmp_path, data[:cut]), "invalid GGUF")


def test_truncated_at_every_byte(tmp_path):
    data = valid()[0]
    path = tmp_path / "cut.gguf"
    for cut in range(1, len(data)):
        rewrite(path, data[:cut])
        with pytest.raises(ModelError, match="cut.gguf: invalid GGUF: .* \\(at byte \\d+\\)$"):
            preflight(path)


def test_truncated_model_at_random_bytes(tmp_path):
    data = write_tiny_llama(tmp_path / "tiny.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    header = header_size(tmp_path / "tiny.gguf")
    for cut in random.Random(1234).sample(range(1, len(data)), 150):
        rewrite(path, data[:cut])
        with lines_at_most(work_limit(min(cut, header))), pytest.raises(ModelError, match="cut.gguf: invalid GGUF: "):
            preflight(path)


# -- not GGUF at all ---------------------------------------------------------

def test_empty_file(tmp_path):
    refused(write(tmp_path, b""), "invalid GGUF: the file is empty")


def test_directory(tmp_path):
    refused(tmp_path, "is a directory, not a GGUF file")


def test_missing_file(tmp_path):
    refused(tmp_path / "nope.gguf", "cannot read: No such file or directory")


def test_fifo_is_not_opened(tmp_path):
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    refused(fifo, "not a regular file")


def test_text_file(tmp_path):
    refused(write(tmp_path, b"hello, I am a text file\n", "notes.txt"), "not a GGUF file (magic b'hell'")


def test_three_bytes(tmp_path):
    refused(write(tmp_path, b"GGU"), "header: magic runs past the end of the file")


def test_path_through_a_file(tmp_path):
    refused(write(tmp_path, b"GGUF") / "model.gguf", "cannot read: Not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    path = write(tmp_path, valid()[0])
    path.chmod(0)
    refused(path, "cannot read: Permission denied")


def test_split_model_checks_the_other_splits(tmp_path):
    split = KV("split.count", V.UINT16, 2)
    write(tmp_path, build([ARCH, split, KV("split.no", V.UINT16, 0)], [T("a", (8,))])[0], "m-00001-of-00002.gguf")
    second = write(tmp_path, build(magic=b"GGUG")[0], "m-00002-of-00002.gguf")
    refused(tmp_path / "m-00001-of-00002.gguf", "not a GGUF file", bad_file=second)
    second.write_bytes(build([split, KV("split.no", V.UINT16, 1)], [T("b", (8,))])[0])
    preflight(tmp_path / "m-00001-of-00002.gguf")


# -- valid files -------------------------------------------------------------

@pytest.mark.parametrize("variant", [{}, {"version": 2}])
def test_valid_file_passes(tmp_path, variant):
    path = write(tmp_path, valid(**variant)[0], "ok.gguf")
    preflight(path)
    assert read_metadata(path, ["test.u8", "tokenizer.ggml.tokens"]) == {
        "test.u8": 7, "tokenizer.ggml.tokens": [b"<unk>", b"a", b"", "\u00e9".encode()]}


def test_custom_alignment_passes(tmp_path):
    kvs = [ARCH, KV("general.alignment", V.UINT32, 64)]
    preflight(write(tmp_path, build(kvs, [T("a", (8,)), T("b", (32,), Q.Q8_0)], alignment=64)[0]))
    preflight(write(tmp_path, build(kvs + [KV("general.alignment2", V.UINT32, 1)])[0]))


def test_files_without_tensors_or_keys_pass(tmp_path):
    preflight(write(tmp_path, build()[0]))  # llama.cpp refuses it cleanly later (no architecture)


def test_gguf_writer_model_passes(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    with lines_at_most(work_limit(header_size(path))):
        preflight(path)


@pytest.mark.real
@pytest.mark.parametrize("name", [SMOL, QWEN, QWEN_DRAFT])
def test_registry_models_pass(model_path, name):
    """Hundreds of MB: the work is the header's (the vocabulary, the tensor infos), never the data's."""
    path = model_path(name)
    header = header_size(path)
    assert header < size(path) / 10
    with lines_at_most(work_limit(header)):
        preflight(path)


# -- through the CLI ---------------------------------------------------------

@pytest.mark.parametrize("name, data, match", [
    ("bad-magic.gguf", build(magic=b"FUGG")[0], "not a GGUF file"),
    ("v1.gguf", build(version=1)[0], "GGUF v1"),
    ("huge-array.gguf", dict((c[0], c[1]) for c in CASES)["array length 2^62"], "array of 4611686018427387904"),
    ("outside.gguf", two_tensors(T("b", (64,), offset=1 << 40)), "outside the file"),
    ("notes.txt", b"not a model\n", "not a GGUF file"),
])
def test_cli_refuses_hostile_file(tmp_path, name, data, match):
    path = write(tmp_path, data, name)
    proc = speculate("-m", str(path), "-p", "hi", "-n", "1", timeout=60)
    assert proc.returncode == 3, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    # (the registry's own magic check may speak first for a file that is not GGUF at all)
    assert lines[0].startswith("speculate: error: ") and str(path) in lines[0], proc.stderr
    assert match in lines[0], proc.stderr
    assert proc.stdout == b""


# -- mutations: preflight accepts or refuses; llama.cpp never dies ------------

WORKER = r"""
import sys
from speculative.errors import SpeculateError
from speculative.decoding.settings import ModelSpec
from speculative.llamacpp.model import LlamaModel
print("@@ ready", flush=True)
for line in sys.stdin:
    try:
        LlamaModel(ModelSpec(line.rstrip("\n"), name="mutant", n_ctx=64, n_batch=8, n_threads=1)).close()
        print("@@ loaded", flush=True)
    except SpeculateError:
        print("@@ refused", flush=True)
"""


class Loader:
    """A persistent child process that loads (model + context + one decode) the paths
    it is sent, answering `loaded` or `refused`; restarted when llama.cpp kills it.

    A load that does not answer within `timeout` is a hang: the fixture sets it to a
    multiple of the unmutated model's load, measured by this loader on this machine under
    its load (and no less than MIN_TIMEOUT); a child's start-up is not timed."""

    MIN_TIMEOUT = 30.0
    HANG = 50  # times the unmutated model's load

    def __init__(self, log: Path):
        self.log, self.proc = log, None
        self.timeout = self.MIN_TIMEOUT

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "GGML_NO_BACKTRACE": "1", "SPECULATE_LLAMA_LOG": ""}
        proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=self.log.open("ab"), env=env, text=True)
        if proc.stdout.readline() != "@@ ready\n":
            pytest.fail(f"the loader did not start: {self.log.read_bytes()[-600:].decode(errors='replace')}")
        return proc

    def calibrate(self, path: Path) -> None:
        """The hang timeout, from a load of `path` (a model that loads)."""
        start = time.monotonic()
        assert self.load(path, timeout=600) == "loaded"
        self.timeout = max(self.MIN_TIMEOUT, self.HANG * (time.monotonic() - start))

    def load(self, path: Path, timeout: float | None = None) -> str:
        timeout = timeout or self.timeout
        if self.proc is None:
            self.proc = self._start()
        proc, line = self.proc, ""
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            proc.stdin.write(f"{path}\n")
            proc.stdin.flush()
            while not line.startswith("@@"):
                line = proc.stdout.readline()
                if not line:
                    break
        except BrokenPipeError:
            pass
        finally:
            timer.cancel()
        if line.startswith("@@"):
            return line.split()[1]
        self.proc = None
        rc = proc.wait()
        tail = self.log.read_bytes()[-600:].decode(errors="replace")
        return f"killed by signal {-rc}" + (f" (no answer in {timeout:.0f} s)" if rc == -9 else "") + f": {tail}"

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def mutation_env(tmp_path_factory):
    work = tmp_path_factory.mktemp("mutants")
    (work / "tiny-llama.gguf").write_bytes(TINY_LLAMA)
    loader = Loader(work / "llama.log")
    loader.calibrate(work / "tiny-llama.gguf")
    yield work, TINY_LLAMA, loader
    loader.close()


TINY_LLAMA = tiny_llama_bytes()
INTERESTING = [0, 1, 2, 3, 7, 8, 31, 32, 33, 63, 64, 255, 256, 511, 512, 513, 1024, 1025, 2**16, 2**28 + 2,
               2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
FIELDS = int_fields(TINY_LLAMA)  # (offset, size, label) of every integer field
HEADER_END = max(at + size for at, size, _ in FIELDS)
TINY_HEADER = HEADER_END + 32  # and the padding to the data's alignment
VALUES = [f for f in FIELDS if " " not in f[2]]  # integer values: hyperparameters, token ids and types
FLIP = st.tuples(st.just("flip"), st.integers(0, HEADER_END + 64), st.integers(0, 7))
SET_VALUE = st.tuples(st.just("set"), st.sampled_from(VALUES), st.sampled_from(INTERESTING))
# one or two of: a bit flip (in or just past the header), a value or any integer field
# (count, length, type, dim, offset) overwritten, inserted bytes, a truncation; weighted
# towards the mutations preflight may accept, which llama.cpp then has to survive
MUTATIONS = st.lists(st.one_of(
    FLIP, FLIP, FLIP, SET_VALUE, SET_VALUE,
    st.tuples(st.just("set"), st.sampled_from(FIELDS), st.one_of(st.sampled_from(INTERESTING),
                                                                 st.integers(0, 2**64 - 1))),
    st.tuples(st.just("insert"), st.integers(0, HEADER_END), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("truncate"), st.integers(0, len(TINY_LLAMA) - 1)),
), min_size=1, max_size=2)


def mutate(data: bytes, mutations) -> bytes:
    out = bytearray(data)
    for kind, *args in mutations:
        if kind == "flip":
            pos, bit = args
            if pos < len(out):
                out[pos] ^= 1 << bit
        elif kind == "truncate":
            del out[args[0]:]
        elif kind == "insert":
            out[args[0]:args[0]] = args[1]
        else:
            (at, size, _label), value = args
            if at + size <= len(out):
                out[at : at + size] = (value & ((1 << 8 * size) - 1)).to_bytes(size, "little")
    return bytes(out)


@pytest.mark.real
def test_tiny_llama_loads_unmutated(mutation_env):
    work, base, loader = mutation_env
    assert loader.load(work / "tiny-llama.gguf") == "loaded"


@pytest.mark.real
@settings(derandomize=True, max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutations=MUTATIONS)
def test_mutants_never_crash(mutation_env, mutations):
    work, base, loader = mutation_env
    path = work / "mutant.gguf"
    rewrite(path, mutate(base, mutations))
    try:
        with lines_at_most(work_limit(min(size(path), TINY_HEADER + 64))):  # 64: two insertions
            preflight(path)
        accepted = True
    except ModelError as e:
        assert "\n" not in str(e)
        accepted = False
    event("refused by preflight" if not accepted else "accepted")
    if accepted:
        outcome = loader.load(path)
        event(f"llama.cpp: {outcome}")
        assert outcome in ("loaded", "refused"), f"mutant {mutations}: preflight accepted it, llama.cpp was {outcome}"
