"""llama.cpp's draft/target vocabulary rule, on GGUF files written by the `gguf` package."""

from __future__ import annotations

from pathlib import Path

import pytest

import gguf
from speculative.errors import ModelError
from speculative.models.gguf_meta import read_metadata
from speculative.models.vocab import check_compatible, read_vocab

BASE = [f"tok{i}" for i in range(300)]


def write_vocab(path: Path, tokens=BASE, model="gpt2", bos=1, eos=2, add_bos=None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_uint32("test.after_the_tokens", 7)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def check(tmp_path, **draft):
    check_compatible(read_vocab(write_vocab(tmp_path / "t.gguf")), read_vocab(write_vocab(tmp_path / "d.gguf", **draft)))


def test_identical_vocabularies_are_compatible(tmp_path):
    check(tmp_path)


def test_tokens_below_id_5_are_not_compared(tmp_path):
    check(tmp_path, tokens=["x0", "x1", "x2", "x3", "x4"] + BASE[5:])


def test_sizes_within_128_are_compatible(tmp_path):
    check(tmp_path, tokens=BASE + [f"extra{i}" for i in range(128)])


def test_first_differing_token_is_named(tmp_path):
    tokens = list(BASE)
    tokens[7], tokens[42] = "seven", "forty-two"
    with pytest.raises(ModelError, match="first differing token id 7: 'tok7' vs 'seven'"):
        check(tmp_path, tokens=tokens)


def test_sizes_more_than_128_apart_are_refused(tmp_path):
    with pytest.raises(ModelError, match="vocabulary sizes 300 vs 429 differ by 129"):
        check(tmp_path, tokens=BASE + [f"extra{i}" for i in range(129)])


@pytest.mark.parametrize("draft, message", [
    ({"model": "llama"}, "tokenizer types differ"),
    ({"bos": 3}, "BOS id differs"),
    ({"eos": 9}, "EOS id differs"),
    ({"add_bos": True}, "add-BOS differs"),
])
def test_special_token_rules(tmp_path, draft, message):
    with pytest.raises(ModelError, match=message):
        check(tmp_path, **draft)


def test_metadata_reader_reads_scalars_strings_and_arrays(tmp_path):
    path = write_vocab(tmp_path / "m.gguf", add_bos=False)
    meta = read_metadata(path, ["general.architecture", "tokenizer.ggml.tokens", "test.after_the_tokens",
                                "tokenizer.ggml.add_bos_token", "not.there"])
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.tokens"][299] == b"tok299"
    assert meta["test.after_the_tokens"] == 7 and meta["tokenizer.ggml.add_bos_token"] is False
    assert "not.there" not in meta


@pytest.mark.parametrize("cut", [0, 3, 10, 30, 200, -40])
def test_truncated_metadata_is_a_clean_model_error(tmp_path, cut):
    data = write_vocab(tmp_path / "m.gguf").read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut] if cut > 0 else data[: len(data) + cut] if cut else b"")
    with pytest.raises(ModelError, match="cut.gguf"):
        read_metadata(bad, ["tokenizer.ggml.tokens", "test.after_the_tokens"])
