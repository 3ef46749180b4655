"""llama.cpp's n-gram drafters (ngram-mod, ngram-map-k4v, ngram-cache) and its n-gram cache files.

Hand-checked cases follow the C++ of the pinned llama.cpp (common/ngram-mod.cpp,
common/ngram-map.cpp, common/ngram-cache.cpp, common/speculative.cpp). llama.cpp's own code,
built with g++ from the sdist scripts/test.sh keeps, is the reference beside them:
tests/ngram_drafter_harness.cpp replays token streams through its ngram-map-k4v
(common/ngram-map.cpp) and its ngram-mod (the wheel's libllama-common, through
common_speculative_*), and ours must draft the same at every step; its ngram-cache.cpp reads
the files we write and writes files we read. The CLI runs each type, alone and chained, on a
tiny real model, with greedy output identical to target-only output.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from speculative.decoding.cache import Cache
from speculative.decoding.drafter import Draft, Outcome
from speculative.decoding.events import Step, Token
from tests.fakes import generate
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import NgramModSettings, SamplerSettings, SpecSettings
from speculative.drafters import lookup_cache
from speculative.drafters import (Chain, LookupFiles, ModelDrafter, ModTable, NgramCache, NgramMapK4v, NgramMod,
                                  NgramSimple)
from speculative.drafters.ngram_cache import Counts, draft
from speculative.drafters.ngram_mod import MULTIPLIER, TABLE_SIZE
from speculative.errors import UsageError
from tests.conftest import speculate_here, vendored_tree
from tests.driver_harness import compile_cxx, wheel_libs
from tests.fakes import FakeBackend, ToyModel, plain_decode

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplerSettings(temp=0.0)
EMPTY = Counts()


def outcome(tokens: list[int], n_accepted: int, source: str) -> Outcome:
    return Outcome(Draft(tokens, source), n_accepted, 0, 0.0, 0.0)


# -- ngram-mod ------------------------------------------------------------------------------


def test_ngram_mod_hash_is_llama_cpps_in_64_bit_unsigned_arithmetic():
    table = ModTable(3)
    assert len(table.entries) == TABLE_SIZE == 4 * 1024 * 1024
    assert table.slot([1, 2, 3]) == ((1 * MULTIPLIER + 2) * MULTIPLIER + 3) % 2**64 % TABLE_SIZE
    big = [2**31 - 1] * 3  # the products wrap around 2^64, as size_t does
    assert table.slot(big) == (((big[0] * MULTIPLIER + big[1]) % 2**64 * MULTIPLIER + big[2]) % 2**64) % TABLE_SIZE
    table.add_all([*big, 7, 1, 2, 3, 9])  # numpy's uint64 wraps the same way
    assert table.entries[table.slot(big)] == 7 and table.entries[table.slot([1, 2, 3])] == 9


def test_ngram_mod_drafts_while_the_table_knows_what_follows():
    # prompt [1 2 3 4 5], n_match 2: the table holds (1 2)->3, (2 3)->4, (3 4)->5; (4 5) has no
    # follower in the prompt. After [.. 1 2] the chain runs 3, 4, 5 and stops at (4 5).
    def drafted(n_min: int, n_max: int) -> list[int]:
        mod = NgramMod(ModTable(2), n_min=n_min, n_max=n_max)
        mod.prefill([1, 2, 3, 4, 5])
        return mod.propose([1, 2, 3, 4, 5, 1, 2], 100).tokens

    assert drafted(n_min=2, n_max=4) == [3, 4, 5]
    assert drafted(n_min=2, n_max=2) == [3, 4]       # n_max reached
    assert drafted(n_min=4, n_max=8) == []           # the table ran out before n_min
    assert drafted(n_min=5, n_max=2) == [3, 4]       # llama.cpp checks n_min only where the table runs out


def test_ngram_mod_the_step_caps_the_draft_after_n_min_is_checked():
    mod = NgramMod(ModTable(2), n_min=3, n_max=8)
    mod.prefill([1, 2, 3, 4, 5])
    assert mod.propose([1, 2, 3, 4, 5, 1, 2], 2).tokens == [3, 4]
    assert mod.n_draft_last == 3


def test_ngram_mod_adds_generated_text_in_chunks_of_more_than_32_tokens():
    mod = NgramMod(ModTable(2), n_min=1, n_max=1)
    mod.prefill([1, 2, 3])                    # (1 2)->3
    assert mod.propose([1, 2, 3, 5, 6, 7, 5, 6], 8).tokens == []  # (5 6)->7 was generated: not in the table yet
    filler = list(range(100, 130))
    assert mod.propose([1, 2, 3, 5, 6, 7, *filler, 5, 6], 8).tokens == [7]  # 32 more tokens: added


def test_ngram_mod_a_prompt_that_fills_a_quarter_of_the_table_empties_it():
    table = ModTable(1, size=8)
    NgramMod(table).prefill([1, 2, 3])        # 2 of 8 slots: kept
    assert table.used == 2
    NgramMod(table).prefill([4, 5, 6, 7])     # 5 of 8: emptied
    assert table.used == 0 and (table.entries == -1).all()


def test_ngram_mod_five_low_acceptance_drafts_in_a_row_empty_the_table():
    table = ModTable(2)
    mod = NgramMod(table, n_min=1, n_max=4)
    prompt = list(range(1, 41))
    mod.prefill(prompt)                       # 38 pairs: (1 2)->3 ... (38 39)->40
    history = [*prompt, 1, 2]
    for streak in range(1, 5):
        mod.accept(outcome(mod.propose(history, 4).tokens, 0, "ngram-mod"))
        assert table.n_low == streak and table.used == 38
    mod.accept(outcome(mod.propose(history, 4).tokens, 0, "ngram-mod"))
    assert table.used == 0 and table.n_low == 0 and mod.i_last == 0
    assert mod.propose(history, 4).tokens == [3, 4, 5, 6]  # the whole history is added again
    assert table.used == 39
    mod.accept(outcome([3, 4, 5, 6], 1, "ngram-mod"))        # a quarter is not low
    assert table.n_low == 0
    mod.accept(outcome([9], 0, "draft"))                     # another drafter's draft: not ours
    assert table.n_low == 0


def test_ngram_mod_table_is_shared_by_requests():
    table = ModTable(2)
    NgramMod(table, n_min=1).prefill([7, 8, 9, 10])
    second = NgramMod(table, n_min=1, n_max=3)
    second.prefill([1, 2])
    assert second.propose([1, 2, 7, 8], 3).tokens == [9, 10]  # learned from the first request's prompt


# -- ngram-map-k4v --------------------------------------------------------------------------

K4V_PROMPT = [5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 7, 1]


def k4v(prompt: list[int], after: list[int], n: int = 2, m: int = 2, min_hits: int = 1) -> tuple[NgramMapK4v, list[int]]:
    drafter = NgramMapK4v(n, m, min_hits)
    drafter.prefill(prompt)
    return drafter, drafter.propose(prompt + after, 10).tokens


def test_ngram_map_k4v_drafts_the_continuation_seen_most():
    # key (1 2), found at 6 by the scan of the prompt (from 12-2-2-1 = 7 down); the values after
    # its occurrences at 1 and 6 are both [3 4]: seen twice, nothing else -> draft [3 4]
    drafter, drafted = k4v(K4V_PROMPT, [2])
    assert drafted == [3, 4]
    # accepted 1: the next draft of this value is 1 token long (the key is now found by its hash)
    drafter.accept(outcome(drafted, 1, "ngram-map-k4v"))
    assert drafter.propose([*K4V_PROMPT, 2, 3, 9, 1, 2], 10).tokens == [3]
    # rejected at once: the value never drafts again (llama.cpp keeps n_accepted = 0)
    drafter.accept(outcome([3], 0, "ngram-map-k4v"))
    assert drafter.propose([*K4V_PROMPT, 2, 3, 9, 1, 2, 3, 8, 1, 2], 10).tokens == []


def test_ngram_map_k4v_needs_one_value_twice_as_frequent_as_the_others():
    assert k4v([5, 1, 2, 3, 4, 6, 1, 2, 8, 9, 7, 1], [2])[1] == []  # [3 4] once, [8 9] once


def test_ngram_map_k4v_drafts_after_the_occurrence_found_even_when_the_counts_chose_another():
    # after (1 2): [3 4] twice, [8 9] once: [3 4] wins 2 >= 2 x 1, but llama.cpp copies the m
    # tokens after the occurrence it found (the latest, at 8), which is [8 9]
    assert k4v([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 8, 9, 7, 1], [2])[1] == [8, 9]


def test_ngram_map_k4v_counts_lookups_towards_min_hits():
    drafter, first = k4v(K4V_PROMPT, [2], min_hits=2)
    assert first == []
    assert drafter.propose([*K4V_PROMPT, 2, 9, 1, 2], 10).tokens == [3, 4]


def test_ngram_map_k4v_does_not_draft_at_the_prompts_last_token_nor_with_a_short_history():
    drafter = NgramMapK4v(2, 2, 1)
    drafter.prefill(K4V_PROMPT + [2])
    assert drafter.propose(K4V_PROMPT + [2], 10).tokens == []  # llama.cpp drafts from the first sampled token
    assert k4v([1, 2, 3, 1], [2])[1] == []                     # fewer than 2n + m tokens


# -- ngram-cache: statistics and drafts ------------------------------------------------------


def counts(tokens: list[int]) -> Counts:
    c = Counts()
    c.update(tokens, 0)
    return c


def test_ngram_cache_counts_each_token_after_its_1_to_4_grams():
    assert counts([1, 2, 1, 2, 1]).parts == {
        (1,): {2: 2}, (2,): {1: 2}, (1, 2): {1: 2}, (2, 1): {2: 1},
        (1, 2, 1): {2: 1}, (2, 1, 2): {1: 1}, (1, 2, 1, 2): {1: 1}}
    grown = counts([1, 2, 1])
    grown.update([1, 2, 1, 2, 1], 3)  # llama-lookup: nnew = 1 at a time, n-grams across the old end too
    assert grown.parts == counts([1, 2, 1, 2, 1]).parts


def test_ngram_cache_drafts_from_the_longest_n_gram_that_passes_and_goes_on_from_its_drafts():
    history = [1, 2, 1, 2, 1]
    # (1 2 1) -> {2: 1} passes the lax 3-gram rule (1 seen, 50%); then (1 2 1 2) -> 1, (2 1 2 1)? no,
    # (1 2 1) -> 2 again
    assert draft(history, 3, counts(history), EMPTY, EMPTY) == [2, 1, 2]
    assert draft(history, 1, counts(history), EMPTY, EMPTY) == [2]


def test_ngram_cache_lax_thresholds_and_ties():
    # after 5: {6: 1, 7: 1}: 2 seen, but 50% < the 66% a 1-gram needs
    assert draft([9, 5, 6, 8, 5, 7, 3, 5], 3, counts([9, 5, 6, 8, 5, 7, 3, 5]), EMPTY, EMPTY) == []
    # after 5: {6: 2} passes; after (5 6): {8: 1, 3: 1}, 50% passes for a 2-gram, a tie: the lower
    # id (llama.cpp: its hash table's order); after (5 6 3): {5: 1}
    history = [9, 5, 6, 8, 5, 6, 3, 5]
    assert draft(history, 3, counts(history), EMPTY, EMPTY) == [6, 3, 5]


def test_ngram_cache_static_counts_weigh_the_choice():
    history = [9, 5, 6, 8, 5, 6, 3, 5, 6]  # after (5 6): {8: 1, 3: 1}
    static = Counts()
    static.parts = {(5, 6): {8: 1}}        # 8 weighs 100, 3 weighs 1
    assert draft(history, 1, counts(history), EMPTY, static) == [8]
    assert draft(history, 1, counts(history), EMPTY, EMPTY) == [3]


def test_ngram_cache_dynamic_needs_the_strict_thresholds_and_static_is_the_last_resort():
    dynamic, static = Counts(), Counts()
    dynamic.parts = {(5,): {6: 3}}
    assert draft([1, 5], 1, EMPTY, dynamic, EMPTY) == []     # a 1-gram needs 4
    dynamic.parts = {(5,): {6: 4}}
    assert draft([1, 5], 1, EMPTY, dynamic, EMPTY) == [6]
    dynamic.parts = {(5,): {6: 3, 7: 1}}
    assert draft([1, 5], 1, EMPTY, dynamic, EMPTY) == [6]    # 75%: just enough
    dynamic.parts = {(5,): {6: 5, 7: 2}}
    assert draft([1, 5], 1, EMPTY, dynamic, EMPTY) == []     # 71% < 75%
    static.parts = {(1, 5): {6: 1, 7: 1}}                    # 2 seen, 50%: passes, a tie
    assert draft([1, 5], 1, EMPTY, EMPTY, static) == [6]
    static.parts = {(1, 5): {6: 1}}                          # seen once: too few
    assert draft([1, 5], 1, EMPTY, EMPTY, static) == []
    assert draft([5], 3, counts([5, 5, 5]), EMPTY, EMPTY) == []  # fewer than 2 tokens: nothing


def test_ngram_cache_drafter_follows_the_history_and_learns_at_the_end(tmp_path):
    files = LookupFiles(None, tmp_path / "dynamic.bin", 100, notify=lambda m: None)
    drafter = NgramCache(files)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    drafter.prefill(prompt)
    assert drafter.propose(prompt, 2).tokens == [3, 1]  # (2 3 1 2) -> 3, then (3 1 2 3) -> 1
    drafter.finish([*prompt, 3, 4])
    assert files.learned.parts == counts([*prompt, 3, 4]).parts  # llama-lookup: prompt and output
    files.save()
    assert lookup_cache.read(tmp_path / "dynamic.bin").part([2, 3]) == {1: 2, 4: 1}
    # the next request drafts from it: its own context knows nothing after (1 2), the dynamic
    # cache has (1 2) -> {3: 3}, which passes the strict 2-gram rule (3 seen, 66%)
    second = NgramCache(files)
    second.prefill([7, 1, 2])
    assert second.propose([7, 1, 2], 1).tokens == [3]


# -- the files -------------------------------------------------------------------------------


def table_of(parts: dict) -> lookup_cache.Table:
    return lookup_cache.Table.empty().merged(parts)


def test_a_cache_file_is_llama_cpps_records_little_endian():
    data = table_of({(7,): {3: 2}, (1, 2): {5: 1, 4: 9}}).to_bytes()
    assert data == (struct.pack("<5i", 1, 2, -1, -1, 2) + struct.pack("<4i", 4, 9, 5, 1)
                    + struct.pack("<5i", 7, -1, -1, -1, 1) + struct.pack("<2i", 3, 2))


def test_write_and_read_back(tmp_path):
    c = counts([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6])
    lookup_cache.write(tmp_path / "c.bin", table_of(c.parts))
    table = lookup_cache.read(tmp_path / "c.bin")
    assert len(table) == len(c.parts)
    assert all(table.part(gram) == part for gram, part in c.parts.items())
    assert table.part([4, 4]) is None
    assert lookup_cache.read(tmp_path / "c.bin", n_vocab=10).part([5]) == c.parts[(5,)]
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")  # llama.cpp writes an empty cache as an empty file
    assert len(lookup_cache.read(empty)) == 0


def test_merging_adds_counts_and_keeps_them_int32():
    table = table_of({(1,): {2: 3}})
    merged = table.merged({(1,): {2: 4, 5: 1}, (9, 9): {1: 1}})
    assert merged.part([1]) == {2: 7, 5: 1} and merged.part([9, 9]) == {1: 1}
    assert table.merged({(1,): {2: 2**31 - 2}}).part([1]) == {2: 2**31 - 1}


def good_file(tmp_path) -> Path:
    path = tmp_path / "good.bin"
    lookup_cache.write(path, table_of({(1, 2): {3: 2, 4: 1}, (5,): {6: 1}}))
    return path


def test_every_cut_of_a_file_is_a_clean_refusal(tmp_path):
    data = good_file(tmp_path).read_bytes()
    first = 4 * (5 + 2 * 2)  # the first record: (1 2) with two tokens
    for cut in range(1, len(data)):
        (tmp_path / "cut.bin").write_bytes(data[:cut])
        if cut == first:
            assert len(lookup_cache.read(tmp_path / "cut.bin")) == 1  # a whole record: a smaller cache
            continue
        kind = lookup_cache.NotACache if cut < first else lookup_cache.Unusable
        with pytest.raises(kind, match="cut short"):
            lookup_cache.read(tmp_path / "cut.bin")


@pytest.mark.parametrize("words, message", [
    ((1, -1, -1, -1, 1, 3, 0), "impossible token 3 with count 0"),
    ((1, -1, -1, -1, 1, -5, 1), "impossible token -5"),
    ((-1, 2, -1, -1, 1, 3, 1), r"impossible n-gram \[-1, 2, -1, -1\]"),
    ((1, -1, 2, -1, 1, 3, 1), r"impossible n-gram \[1, -1, 2, -1\]"),
    ((1, -1, -1, -1, 0), "impossible number of tokens 0"),
    ((1, -1, -1, -1, 2**30, 3, 1), "impossible number of tokens 1073741824"),   # huge: refused, not allocated
    ((1, -1, -1, -1, 2**20, 3, 1), "cut short"),                               # more than the file holds
    ((2**24, -1, -1, -1, 1, 3, 1), "impossible n-gram"),
])
def test_impossible_values_are_refused_at_their_byte(tmp_path, words, message):
    path = tmp_path / "bad.bin"
    path.write_bytes(struct.pack("<5i2i", 7, -1, -1, -1, 1, 8, 1) + struct.pack(f"<{len(words)}i", *words))
    with pytest.raises(lookup_cache.Unusable, match=message) as e:
        lookup_cache.read(path)
    assert not isinstance(e.value, lookup_cache.NotACache) and "at byte 28" in str(e.value)


def test_a_token_listed_twice_for_one_n_gram_counts_once_as_in_llama_cpp(tmp_path):
    path = tmp_path / "twice.bin"
    path.write_bytes(struct.pack("<5i4i", 7, -1, -1, -1, 2, 3, 1, 3, 5))
    assert lookup_cache.read(path).part([7]) == {3: 1}  # llama.cpp's loader keeps the first (emplace)


def test_a_repeated_n_gram_and_foreign_tokens_are_refused(tmp_path):
    path = tmp_path / "twice.bin"
    record = struct.pack("<5i2i", 7, -1, -1, -1, 1, 8, 1)
    path.write_bytes(record + struct.pack("<5i2i", 1, -1, -1, -1, 1, 8, 1) + record)
    with pytest.raises(lookup_cache.Unusable, match=r"n-gram \[7, -1, -1, -1\] appears twice at byte 56"):
        lookup_cache.read(path)
    with pytest.raises(lookup_cache.OtherVocabulary, match="token 6 is not in the target's vocabulary of 6"):
        lookup_cache.read(good_file(tmp_path), n_vocab=6)


@pytest.mark.parametrize("content", [b"hello, world: not a cache\n" * 20, b"GGUF\x03\x00\x00\x00" + bytes(64),
                                     bytes(range(256)) * 8, b"\x01"])
def test_files_that_are_not_caches_are_told_apart(tmp_path, content):
    path = tmp_path / "other"
    path.write_bytes(content)
    with pytest.raises(lookup_cache.NotACache, match="not an n-gram cache"):
        lookup_cache.read(path)
    with pytest.raises(UsageError, match="exists and is not an n-gram cache .*refusing to overwrite it"):
        lookup_cache.check_writable(path)


def test_a_file_larger_than_the_bound_is_not_read(tmp_path):
    path = tmp_path / "huge.bin"
    with open(path, "wb") as f:
        f.truncate(lookup_cache.MAX_BYTES + 4)  # sparse: nothing is written
    with pytest.raises(lookup_cache.Unusable, match="larger than the 64 MiB"):
        lookup_cache.read(path)


def test_check_writable_takes_caches_damaged_or_not_and_refuses_the_rest(tmp_path):
    lookup_cache.check_writable(tmp_path / "missing.bin")
    path = good_file(tmp_path)
    lookup_cache.check_writable(path)
    path.write_bytes(path.read_bytes()[:-3])  # damaged after its first record: still a cache
    lookup_cache.check_writable(path)
    (tmp_path / "empty.bin").write_bytes(b"")
    lookup_cache.check_writable(tmp_path / "empty.bin")
    with pytest.raises(UsageError, match="is a directory"):
        lookup_cache.check_writable(tmp_path)
    with pytest.raises(UsageError, match="-lcs/--lookup-cache-static .*missing.bin: cannot read it"):
        lookup_cache.check_static(tmp_path / "missing.bin")


def test_unusable_files_are_notices_and_only_a_damaged_dynamic_cache_is_replaced(tmp_path):
    notices: list[str] = []
    cut = good_file(tmp_path)
    cut.write_bytes(cut.read_bytes()[:-3])
    other = tmp_path / "other.txt"
    other.write_text("not a cache at all, but something of the user's\n")
    static = LookupFiles(other, None, 100, notices.append)
    assert len(static.static) == 0
    damaged = LookupFiles(None, cut, 100, notices.append)
    foreign = LookupFiles(None, other, 100, notices.append)
    for files in (damaged, foreign):
        files.learn(counts([1, 2, 3]))
        files.save()
    why = f"not an n-gram cache (impossible number of tokens {struct.unpack_from('<i', b'll, ')[0]} at byte 0)"
    assert notices == [f"-lcs {other}: {why}; ignored",
                       f"-lcd {cut}: damaged: cut short at byte 36; ignored; what this run generates will replace it",
                       f"-lcd {other}: {why}; ignored, and left as it is"]
    assert lookup_cache.read(cut).part([1, 2]) == {3: 1}
    assert other.read_text() == "not a cache at all, but something of the user's\n"


# -- llama.cpp's own code, compiled from the sdist -----------------------------------------------

STUBS = {  # what common/ngram-cache.cpp and common/ngram-map.cpp need of llama.h, ggml.h, common.h and log.h
    "llama.h": "#pragma once\n#include <cstdint>\n#include <cstdio>\n#include <cstdlib>\n"
               "typedef int32_t llama_token;\n#define LLAMA_TOKEN_NULL -1\n"
               "#define GGML_ASSERT(x) do { if (!(x)) { fprintf(stderr, \"GGML_ASSERT(%s)\\n\", #x); abort(); } } while (0)\n"
               "#define GGML_ABORT(...) do { fprintf(stderr, __VA_ARGS__); abort(); } while (0)\n"
               "inline int64_t ggml_time_ms() { return 0; }\n",
    "common.h": "#pragma once\n#include <algorithm>\n#include <string>\n#include <vector>\n#include \"llama.h\"\n"
                "using llama_tokens = std::vector<llama_token>;\n",
    "log.h": "#pragma once\n#define LOG_DBG(...) ((void) 0)\n#define LOG_INF(...) ((void) 0)\n",
}


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory) -> Path:
    """The pinned llama.cpp's files the harnesses build from, in one read of the sdist."""
    return vendored_tree(tmp_path_factory.mktemp("llama-cpp"), "include", "ggml/include", "common/common.h",
                         "common/speculative.h", "common/ngram-cache.h", "common/ngram-cache.cpp",
                         "common/ngram-map.h", "common/ngram-map.cpp")


def with_stubs(llama_src: Path, tmp_path_factory, name: str, *files: str) -> Path:
    """A folder of the sdist's common/FILES and the stub headers they compile against."""
    src = tmp_path_factory.mktemp(name)
    for file in files:
        shutil.copy(llama_src / "common" / file, src / file)
    for file, text in STUBS.items():
        (src / file).write_text(text)
    return src


@pytest.fixture(scope="module")
def harness(llama_src, tmp_path_factory) -> Path:
    """tests/ngram_cache_harness.cpp built against the sdist's common/ngram-cache.cpp."""
    src = with_stubs(llama_src, tmp_path_factory, "ngram-cache-cpp", "ngram-cache.h", "ngram-cache.cpp")
    compile_cxx("-I", src, ROOT / "tests" / "ngram_cache_harness.cpp", src / "ngram-cache.cpp", "-o", src / "harness")
    return src / "harness"


@pytest.fixture(scope="module")
def map_harness(llama_src, tmp_path_factory) -> Path:
    """tests/ngram_drafter_harness.cpp with the sdist's common/ngram-map.cpp: its ngram-map-k4v."""
    src = with_stubs(llama_src, tmp_path_factory, "ngram-map-cpp", "ngram-map.h", "ngram-map.cpp")
    compile_cxx("-DNGRAM_MAP", "-I", src, ROOT / "tests" / "ngram_drafter_harness.cpp", src / "ngram-map.cpp",
                "-o", src / "harness")
    return src / "harness"


@pytest.fixture(scope="module")
def mod_harness(llama_src, tmp_path_factory) -> Path:
    """tests/ngram_drafter_harness.cpp built with the sdist's headers and linked against the wheel's
    libllama-common: llama.cpp's own ngram-mod, through common_speculative_*."""
    libs, out = wheel_libs(), tmp_path_factory.mktemp("ngram-mod-cpp") / "harness"
    compile_cxx("-DNGRAM_MOD", *(f"-I{llama_src / d}" for d in ("common", "include", "ggml/include")),
                ROOT / "tests" / "ngram_drafter_harness.cpp", f"-L{libs}", "-lllama-common", "-lllama",
                f"-Wl,--disable-new-dtags,-rpath,{libs}", "-o", out)  # an RPATH: libllama-common finds libllama too
    return out


def dump(harness: Path, path: Path) -> list[tuple[int, ...]]:
    """Every (n-gram, token, count) of a file, as llama.cpp's common_ngram_cache_load reads it."""
    out = subprocess.run([str(harness), "dump", str(path)], check=True, capture_output=True, text=True).stdout
    return [tuple(map(int, line.split())) for line in out.splitlines()]


def rows(table: lookup_cache.Table) -> list[tuple[int, ...]]:
    grams, tokens, counts_ = table.pairs()
    return sorted((*g, t, c) for g, t, c in zip(grams.tolist(), tokens.tolist(), counts_.tolist()))


def tokens_for_cross_check(seed: int, n: int = 3000) -> list[int]:
    """Text-like tokens: a skewed vocabulary with repeated phrases, so n-grams recur."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 5000, size=rng.integers(2, 9)).tolist() for _ in range(40)]
    out: list[int] = []
    while len(out) < n:
        out += phrases[rng.integers(len(phrases))] if rng.random() < 0.5 else [int(rng.zipf(1.3) % 60000)]
    return out[:n]


@pytest.mark.parametrize("sizes", [(1, 4), (2, 2)])  # llama-lookup's context cache, llama-lookup-create's
def test_a_file_llama_cpp_writes_reads_as_the_same_statistics(harness, tmp_path, sizes):
    tokens = tokens_for_cross_check(seed=sizes[0])
    path = tmp_path / "from-llama.bin"
    subprocess.run([str(harness), "write", str(path), *map(str, sizes)], input=" ".join(map(str, tokens)),
                   check=True, capture_output=True, text=True)
    table = lookup_cache.read(path)
    ours = Counts()
    ours.update(tokens, 0)
    expected = {gram: part for gram, part in ours.parts.items() if sizes[0] <= len(gram) <= sizes[1]}
    assert len(table) == len(expected) > 500
    assert all(table.part(gram) == part for gram, part in expected.items())
    assert rows(table) == dump(harness, path)


def test_a_file_we_write_reads_in_llama_cpp_as_ours_and_merges_alike(harness, tmp_path):
    first, second = Counts(), Counts()
    first.update(tokens_for_cross_check(seed=3), 0)
    second.update(tokens_for_cross_check(seed=4), 0)
    a, b = table_of(first.parts), table_of(second.parts)
    lookup_cache.write(tmp_path / "a.bin", a)
    lookup_cache.write(tmp_path / "b.bin", b)
    assert dump(harness, tmp_path / "a.bin") == rows(a)
    subprocess.run([str(harness), "merge", str(tmp_path / "a.bin"), str(tmp_path / "b.bin"),
                    str(tmp_path / "merged.bin")], check=True, capture_output=True)
    assert rows(lookup_cache.read(tmp_path / "merged.bin")) == rows(a.merged(second.parts))


# -- llama.cpp's own ngram-map-k4v and ngram-mod, on the same token streams as ours -------------


@dataclass
class Request:
    """A request of a stream: its prompt, the text the greedy target generates after it, how
    many tokens it generates before it ends, and the most a step drafts (the type's limit or
    --draft-max). A step also leaves room in the output for the target's own token, as
    speculate's loop (and llama-server's n_draft_max) does before -n."""
    prompt: list[int]
    output: list[int]
    n_stop: int
    draft_max: int


def agreeing(draft: list[int], output: list[int]) -> int:
    """What a greedy target accepts of a draft: the prefix that agrees with its own text."""
    n = 0
    while n < len(draft) and draft[n] == output[n]:
        n += 1
    return n


def replay(new_drafter, requests: list[Request]) -> list[str]:
    """Our drafter on the stream, called as speculate's loop calls it (prefill, then each step
    propose with the step's k and accept with what the target kept), one line per step as the
    harness prints it: "k: drafted tokens"."""
    lines = []
    for request in requests:
        drafter = new_drafter()
        drafter.prefill(request.prompt)
        lines.append("begin")
        history, output, generated = list(request.prompt), request.output, 0
        while generated < request.n_stop:
            k = min(request.draft_max, len(output) - generated - 1)
            draft = drafter.propose(history, k).head(k) if k > 0 else Draft([], "none")
            accepted = agreeing(draft.tokens, output[generated:])
            drafter.accept(outcome(draft.tokens, accepted, draft.source))
            lines.append(" ".join([f"{k}:", *map(str, draft.tokens)]))
            history += output[generated : generated + accepted + 1]
            generated += accepted + 1
    return lines


def llama_cpp(harness: Path, params: tuple[int, int, int], requests: list[Request]) -> list[str]:
    """The harness on the stream: llama.cpp's drafter, one line per step."""
    words = [*params]
    for r in requests:
        words += [len(r.prompt), *r.prompt, len(r.output), *r.output, r.n_stop, r.draft_max]
    proc = subprocess.run([str(harness)], input=" ".join(map(str, words)), capture_output=True, text=True,
                          timeout=600)  # a guard against a hang only
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


def drafted(lines: list[str]) -> list[list[int]]:
    return [list(map(int, line.split()[1:])) for line in lines]


def assert_same_drafts(harness: Path, params: tuple[int, int, int], requests: list[Request], new_drafter) -> list[str]:
    """Ours drafts what llama.cpp drafts at every step of the stream; llama.cpp's lines."""
    theirs, ours = llama_cpp(harness, params, requests), replay(new_drafter, requests)
    if ours != theirs:
        i = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(ours), len(theirs)))
        begun = [j for j, line in enumerate(theirs[:i]) if line == "begin"]
        pytest.fail(f"{params}: request {len(begun) - 1}, step {i - begun[-1] - 1}: llama.cpp drafted "
                    f"[{theirs[i] if i < len(theirs) else 'nothing'}], ours [{ours[i] if i < len(ours) else 'nothing'}]; "
                    f"the steps before: {theirs[max(begun[-1] + 1, i - 3):i]}")
    return theirs


def noise(rng: random.Random, alphabet: list[int], n_requests: int, draft_max: int, spare: int = 0) -> list[Request]:
    """Requests of random text over a few tokens: every key recurs, with several continuations.
    Half the prompts are short, some shorter than ngram-map-k4v needs to draft: its first
    lookups then find keys in what was generated since."""
    requests = []
    for _ in range(n_requests):
        prompt = rng.choices(alphabet, k=rng.randrange(1, rng.choice([12, 50])))
        requests.append(Request(prompt, rng.choices(alphabet, k=60 + spare), 60, draft_max))
    return requests


class Code:
    """Tokens shaped like source code: lines of a dozen shapes, which share their openings in
    fours and differ after them, over a few dozen names (the commoner ones more often), and
    blocks of earlier lines copied again with a token edited now and then, as the answer to an
    edit request copies its prompt."""

    NEWLINE = 1

    def __init__(self, rng: random.Random):
        self.rng = rng
        openings = [[rng.randrange(2, 40) for _ in range(rng.randrange(2, 6))] for _ in range(3)]
        self.shapes = [openings[i % 3] + [rng.choice([None, rng.randrange(2, 40)]) for _ in range(rng.randrange(2, 9))]
                       for i in range(12)]
        self.names = list(range(1000, 1040))

    def name(self) -> int:
        return self.names[min(int(self.rng.expovariate(0.2)), len(self.names) - 1)]

    def text(self, n_tokens: int) -> list[int]:
        lines: list[list[int]] = []
        while sum(map(len, lines)) < n_tokens:
            if lines and self.rng.random() < 0.5:
                start = self.rng.randrange(len(lines))
                for line in lines[start : start + self.rng.randrange(1, 9)]:
                    lines.append([self.name() if self.rng.random() < 0.03 else t for t in line])
            else:
                lines.append([self.name() if t is None else t for t in self.rng.choice(self.shapes)] + [self.NEWLINE])
        return [t for line in lines for t in line][:n_tokens]

    def requests(self, n_requests: int, n_prompt: int, n_output: int, draft_max: int, spare: int = 0) -> list[Request]:
        requests = []
        for _ in range(n_requests):
            text = self.text(n_prompt + n_output + spare)
            requests.append(Request(text[:n_prompt], text[n_prompt:], n_output, draft_max))
        return requests


def count_drafts(lines: list[str]) -> int:
    return sum(bool(d) for d in drafted(lines))


# ngram-map-k4v: a new map for each request, in llama.cpp's as in ours


def k4v_drafter(n: int, m: int, min_hits: int):
    return lambda: NgramMapK4v(n, m, min_hits)


def test_ngram_map_k4v_drafts_what_llama_cpps_own_code_drafts_on_random_text(map_harness):
    rng, total = random.Random(2), 0
    for n, m, min_hits in itertools.product([1, 2, 3], [1, 2, 3, 5], [1, 2, 3]):
        alphabet = list(range(rng.choice([2, 3, 4, 8])))
        requests = noise(rng, alphabet, 12, draft_max=rng.choice([2, m, 64]))
        total += count_drafts(assert_same_drafts(map_harness, (n, m, min_hits), requests, k4v_drafter(n, m, min_hits)))
    assert total > 2000


@pytest.mark.parametrize("params", [(12, 48, 1), (4, 8, 1), (3, 6, 2), (6, 16, 3), (2, 4, 1)])
def test_ngram_map_k4v_drafts_what_llama_cpps_own_code_drafts_on_code(map_harness, params):
    """Long prompts: the prompt's keys are found through the hash table once hashed, the new
    ones by the scan; the defaults (12, 48, 1) included."""
    requests = Code(random.Random(params[0])).requests(3, n_prompt=2500, n_output=600, draft_max=params[1])
    lines = assert_same_drafts(map_harness, params, requests, k4v_drafter(*params))
    assert count_drafts(lines) > 10


@pytest.mark.parametrize("n", [1, 2])
def test_ngram_map_k4v_hash_collisions_lose_keys_as_in_llama_cpp(map_harness, n):
    """Keys whose hashes share a slot of the table: the first position stored stays, and a key
    whose slot holds another key is found only by the scan of what is not hashed yet."""
    from speculative.drafters.ngram_map import HASH_SLOTS, LCG_FACTOR, _hash
    if n == 1:  # a token and the same plus 2^18 share a slot; the largest tokens wrap the hash
        alphabet = [5, 5 + HASH_SLOTS, 9, 9 + HASH_SLOTS, 2**31 - 1, 2**31 - 1 - HASH_SLOTS]
    else:       # (a, b) and (a + 1, b - LCG_FACTOR mod 2^18)
        alphabet = [7, 11, 8, (11 - LCG_FACTOR) % HASH_SLOTS, 2**31 - 5, 3]
        assert _hash([7, 11]) % HASH_SLOTS == _hash(alphabet[2:4]) % HASH_SLOTS
    requests = noise(random.Random(n), alphabet, 40, draft_max=4)
    assert count_drafts(assert_same_drafts(map_harness, (n, 2, 1), requests, k4v_drafter(n, 2, 1))) > 50


# ngram-mod: one table for every request of the stream, in llama.cpp's (one sequence) as in ours


def mod_drafters(n_match: int, n_min: int, n_max: int):
    table = ModTable(n_match)
    return lambda: NgramMod(table, n_min, n_max)


def test_ngram_mod_drafts_what_llama_cpps_own_code_drafts_on_random_text(mod_harness):
    """Eight requests on one table for each setting. The step's cap stays above n_max (the
    output goes on after the request stops), where ours and llama.cpp judge acceptance alike:
    see the next test for where they do not."""
    rng, total = random.Random(1), 0
    for n_match, (n_min, n_max) in itertools.product([1, 2, 3, 5], [(0, 1), (1, 3), (2, 8), (4, 8), (5, 3)]):
        alphabet = list(range(rng.choice([3, 5, 50])))
        requests = noise(rng, alphabet, 8, draft_max=n_max, spare=n_max)
        lines = assert_same_drafts(mod_harness, (n_match, n_min, n_max), requests, mod_drafters(n_match, n_min, n_max))
        total += count_drafts(lines)
    assert total > 2000


@pytest.mark.parametrize("params", [(24, 48, 64), (8, 4, 16), (4, 2, 32), (3, 1, 8)])
def test_ngram_mod_drafts_what_llama_cpps_own_code_drafts_on_code_across_requests(mod_harness, params):
    """Four requests of code on one table (later ones draft from earlier prompts and outputs),
    generated text added in chunks; llama.cpp's defaults (24, 48, 64) included."""
    requests = Code(random.Random(params[0])).requests(4, n_prompt=2500, n_output=600, draft_max=params[2],
                                                      spare=params[2])
    lines = assert_same_drafts(mod_harness, params, requests, mod_drafters(*params))
    assert count_drafts(lines) > 40


@pytest.mark.parametrize("n_match", [1, 2, 3])
def test_ngram_mod_hash_collisions_overwrite_as_in_llama_cpp(mod_harness, n_match):
    """n-grams whose hashes share a slot (found with our hash, so a hash of ours that is not
    llama.cpp's would not collide there): the later overwrites the earlier, and a lookup
    takes whatever the slot holds. The largest tokens wrap the 64-bit arithmetic."""
    size = TABLE_SIZE
    alphabet = {1: [5, 5 + size, 9, 9 + size, 2**31 - 1, 2**31 - 1 - size],
                2: [7, 11, 8, (11 - MULTIPLIER) % size, 2**31 - 5, 3],                  # (7 11) and (8 x)
                3: [7, 11, 13, 8, (13 - MULTIPLIER**2) % size, 2**31 - 5]}[n_match]     # (7 11 13) and (8 11 x)
    pairs = {1: ([5], [5 + size]), 2: ([7, 11], alphabet[2:4]), 3: ([7, 11, 13], [8, 11, alphabet[4]])}[n_match]
    assert ModTable(n_match).slot(pairs[0]) == ModTable(n_match).slot(pairs[1])
    requests = noise(random.Random(n_match), alphabet, 40, draft_max=4, spare=4)
    lines = assert_same_drafts(mod_harness, (n_match, 1, 4), requests, mod_drafters(n_match, 1, 4))
    assert count_drafts(lines) > 300


def by_request(lines: list[str]) -> list[list[str]]:
    requests: list[list[str]] = []
    for line in lines:
        if line == "begin":
            requests.append([])
        else:
            requests[-1].append(line)
    return requests


def test_ngram_mod_a_table_more_than_a_quarter_full_at_a_prompt_is_emptied_as_in_llama_cpp(mod_harness):
    """With n_match 1 a token's slot is the token itself: the first prompt fills exactly a
    quarter of the 4M slots (kept: it drafts from them), the second only overwrites slots in
    use (kept), the third fills one slot more (emptied, its own n-grams with it: nothing to
    draft)."""
    quarter = TABLE_SIZE // 4
    prompts = [[*range(quarter), 5], [3, 4, 5], [quarter + 5, 5]]
    requests = [Request(prompt, list(range(6, 40)), 16, 8) for prompt in prompts]
    lines = by_request(assert_same_drafts(mod_harness, (1, 1, 8), requests, mod_drafters(1, 1, 8)))
    assert [request[0] for request in lines] == ["8: 6 7 8 9 10 11 12 13"] * 2 + ["8:"]


def low_acceptance_stream(draft_max: int) -> list[Request]:
    """A request teaches (100 101) -> 102 ...; in the next one (1 2) drafts 3 4 5 ... and the
    target takes only the 3, five times, then says 100 101 102 ..."""
    taught = Request(list(range(100, 107)), [7, 8, 9, 10], 3, draft_max)
    output = [t for i in range(5) for t in (2, 3, 50 + i, 1)][:-1] + list(range(100, 120))
    return [taught, Request([*range(1, 17), 1], output, len(output) - 8, draft_max)]


def test_ngram_mod_five_low_drafts_empty_the_table_as_in_llama_cpp_where_the_cap_is_the_draft(mod_harness):
    """8 drafted, 1 accepted, five times: the table is emptied (the first request's n-grams
    with it), and the next draft puts this request's history back."""
    lines = by_request(assert_same_drafts(mod_harness, (2, 1, 8), low_acceptance_stream(8), mod_drafters(2, 1, 8)))
    assert lines[1].count("8: 3 4 5 6 7 8 9 10") == 5
    assert not any(line.startswith("8: 102") for line in lines[1])


def test_ngram_mod_judges_the_tokens_verified_where_llama_cpp_judges_those_drafted_before_the_cap(mod_harness):
    """README's deliberate difference, shown on llama.cpp's own code: the step's cap (2) cuts
    the draft of 8 to 3 4, of which the target takes 3. Of the tokens verified that is a half,
    not low for us; of those drafted an eighth, low for llama.cpp, whose table is emptied after
    five. Until then every step drafts alike; after it, ours still drafts the first request's
    102 103 after 100 101, and llama.cpp nothing."""
    requests = low_acceptance_stream(2)
    theirs, ours = llama_cpp(mod_harness, (2, 1, 8), requests), replay(mod_drafters(2, 1, 8), requests)
    i = ours.index("2: 102 103")
    assert theirs[:i] == ours[:i] and ours[:i].count("2: 3 4") == 5
    assert theirs[i] == "2:"


# -- settings and flags ------------------------------------------------------------------------


def test_defaults_are_llama_cpps():
    spec = SpecSettings(types=("ngram-mod",))
    assert spec.ngram_mod == NgramModSettings(n_match=24, n_min=48, n_max=64)
    assert (spec.ngram_map_k4v.size(False), spec.ngram_map_k4v.m, spec.ngram_map_k4v.min_hits) == (12, 48, 1)
    limits = {t: spec.draft_limit(t) for t in ("ngram-mod", "ngram-map-k4v", "ngram-cache", "draft", "ngram-simple")}
    assert limits == {"ngram-mod": 64, "ngram-map-k4v": 48, "ngram-cache": 8, "draft": 3, "ngram-simple": 3}
    given = SpecSettings(types=("ngram-mod",), draft_max=16, draft_max_given=True)
    assert [given.draft_limit(t) for t in ("ngram-mod", "ngram-map-k4v", "ngram-cache", "draft")] == [16, 16, 16, 16]
    wide = SpecSettings(types=("ngram-mod", "ngram-cache"), draft_max=100, draft_max_given=True)
    assert (wide.draft_limit("ngram-mod"), wide.draft_limit("ngram-cache"), wide.step_max) == (64, 100, 100)
    assert SpecSettings(types=("ngram-mod", "draft")).step_max == 64


def test_spec_default_joins_the_list_where_llama_cpps_order_puts_ngram_mod():
    from speculative.cli.options import with_spec_default
    assert with_spec_default(None, True) == ("ngram-mod",)
    assert with_spec_default(None, False) == ("auto",)
    assert with_spec_default(("draft",), True) == ("ngram-mod", "draft")
    assert with_spec_default(("ngram-simple", "ngram-cache", "draft"), True) == (
        "ngram-simple", "ngram-mod", "ngram-cache", "draft")
    assert with_spec_default(("ngram-map-k4v",), True) == ("ngram-map-k4v", "ngram-mod")
    assert with_spec_default(("draft", "ngram-mod"), True) == ("draft", "ngram-mod")  # named: left where it is


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command line of this tree (not an installed `speculate`): stdout as bytes."""
    proc = subprocess.run([sys.executable, "-c", "from speculative.cli.main import main; main()", *args], capture_output=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), "GGML_CPU_TILED_MM": "0"})
    proc.stderr = proc.stderr.decode("utf-8", errors="replace")
    return proc


@pytest.mark.parametrize("args, message", [
    (("--spec-type", "ngram-mod", "--spec-ngram-mod-n-min", "-1"), "--spec-ngram-mod-n-min must be between 0 and 1024"),
    (("--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "1025"), "--spec-ngram-mod-n-max must be between 0 and 1024"),
    (("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "0"), "--spec-ngram-mod-n-match must be between 1 and 1024"),
    (("--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", "0"), "--spec-ngram-map-k4v-*: n-gram sizes must be in [1, 1024]"),
    (("--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-m", "2000"), "n-gram sizes must be in [1, 1024]"),
    (("--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-min-hits", "0"), "min-hits must be >= 1"),
    (("--spec-type", "auto,ngram-mod"), "--spec-type auto chooses among ngram-simple, ngram-pool, draft, draft-mtp, "
                                        "draft-eagle3, draft-dflash, draft-dspark, not ngram-mod"),
    (("--spec-type", "none", "--spec-default"), "--spec-default adds ngram-mod, which --spec-type none cannot take"),
    (("--spec-type", "ngram-cache,ngram-cache"), "names a type twice"),
    (("-lcs", "x.bin"), "-lcs/--lookup-cache-static is for --spec-type ngram-cache"),
    (("--spec-type", "ngram-simple", "-lcd", "x.bin"), "-lcd/--lookup-cache-dynamic is for --spec-type ngram-cache"),
    (("--spec-type", "ngram-cache", "-lcs", "/nonexistent/static.bin"), "cannot read it: No such file or directory"),
    (("--spec-type", "ngram-cache", "-lcd", "/"), "-lcd/--lookup-cache-dynamic /: is a directory"),
    (("--spec-type", "ngram-cache", "-lcd", str(ROOT / "README.md")),
     "README.md: exists and is not an n-gram cache (impossible number of tokens"),
    (("--spec-type", "ngram-mod", "--draft-min", "65"), "--draft-min (65) is larger than --draft-max (64)"),
])
def test_bad_flags_exit_2_with_one_line_before_any_model(args, message):
    proc = speculate_here("-m", "/nonexistent/model.gguf", "-p", "x", *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculate: error: ") and message in lines[0], proc.stderr


# -- chains, and the loop with greedy and sampled verification (fake backend) -------------------

ALL_TYPES = ("ngram-mod", "ngram-map-k4v", "ngram-cache")
PROMPT = [3, 5, 7, 11, 3, 5, 7, 11, 3, 5, 7, 11, 2, 3, 5, 7]


def small(name: str, files: LookupFiles | None = None):
    """Each new drafter with settings a short toy text can use."""
    if name == "ngram-mod":
        return NgramMod(ModTable(2, size=4096), n_min=1, n_max=6)
    if name == "ngram-map-k4v":
        return NgramMapK4v(2, 2, 1)
    return NgramCache(files or LookupFiles(None, None, 24, lambda m: None))


def test_each_new_type_chains_with_the_others_each_within_its_limit():
    model = ToyModel(seed=1)
    for first in ALL_TYPES:
        for second in ("ngram-simple", "draft", *(t for t in ALL_TYPES if t != first)):
            other = (NgramSimple(n=3, m=4) if second == "ngram-simple" else
                     ModelDrafter(Cache(FakeBackend(model)), p_min=0.0) if second == "draft" else small(second))
            chain = Chain([small(first), other], [6, 2])
            chain.prefill(PROMPT)
            assert chain.name == f"{first},{second}"
            d = chain.propose(PROMPT, 6)
            assert d.tokens and d.source in (first, second) and len(d.tokens) <= (6 if d.source == first else 2)
            chain.accept(Outcome(d, 1, 0, 0.0, 0.0))
            chain.finish([*PROMPT, 1])
    fallback = Chain([small("ngram-mod"), ModelDrafter(Cache(FakeBackend(model)), p_min=0.0)], [6, 2])
    fallback.prefill([1, 2, 4, 8])
    assert fallback.propose([1, 2, 4, 8], 6).source == "draft"  # ngram-mod finds nothing: the model drafts 2
    assert len(fallback.propose([1, 2, 4, 8], 6).tokens) == 2


def toy() -> ToyModel:
    """Its greedy text falls into a cycle of 7 tokens, which every n-gram drafter finds."""
    return ToyModel(vocab=24, seed=4, eog_bias=-40.0)


def run_loop(names: tuple[str, ...], sampling: SamplerSettings, seed: int, n: int = 40,
             accept: str = "rejection") -> list:
    spec = SpecSettings(types=names, n_predict=n, accept=accept)
    chain = Chain([small(name) for name in names], [spec.draft_limit(name) for name in names])
    return list(generate(Cache(FakeBackend(toy())), PROMPT, Sampler(sampling, seed), spec, chain))


@pytest.mark.parametrize("names", [("ngram-mod",), ("ngram-map-k4v",), ("ngram-cache",), ALL_TYPES,
                                   ("ngram-cache", "ngram-map-k4v", "ngram-mod")])
def test_greedy_and_sample_and_match_output_is_target_only_output(names):
    sampled = SamplerSettings(temp=0.5, top_k=3, top_p=1.0, min_p=0.0)  # narrow enough to repeat itself
    for sampling, seed, accept in ((GREEDY, 1, "rejection"), (sampled, 1, "match")):
        events = run_loop(names, sampling, seed, accept=accept)
        assert [e.id for e in events if isinstance(e, Token)] == plain_decode(toy(), PROMPT, 40, Sampler(sampling, seed))
        assert sum(e.n_accepted for e in events if isinstance(e, Step)) > 0


def test_speculative_sampling_with_ngram_drafts_follows_the_target_distribution(monkeypatch):
    """n-gram drafts are one-hot proposals (q = None); the first three tokens of 3,000 seeded runs
    match target-only probabilities (the L1 bound of tests/test_loop.py, false alarms 1e-6)."""
    from tests import test_loop
    monkeypatch.setattr(test_loop, "PROMPT", PROMPT)  # target_only_marginals starts from its PROMPT
    sampling = SamplerSettings(temp=1.0, top_k=4, top_p=1.0, min_p=0.0)
    runs, n_tokens, drafted = 3000, 3, 0
    hist = np.zeros((n_tokens, toy().vocab))
    for seed in range(runs):
        events = run_loop(ALL_TYPES, sampling, seed, n=n_tokens)
        drafted += sum(e.n_drafted for e in events if isinstance(e, Step))
        for i, t in enumerate(e.id for e in events if isinstance(e, Token)):
            hist[i, t] += 1
    assert drafted > runs
    lam = np.sqrt(2 * (toy().vocab * np.log(2) + np.log(1e6)) / runs)
    for i, expected in enumerate(test_loop.target_only_marginals(toy(), sampling, n_tokens)):
        assert np.abs(hist[i] / runs - expected).sum() < lam, f"token {i}"


# -- the command line on a tiny real model ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny llama model, and a prompt whose greedy continuation copies a passage of it (so the
    n-gram drafters draft, and the target accepts some)."""
    from tests.tiny_model import write_model
    root = tmp_path_factory.mktemp("tiny-ngram")
    model = write_model("llama", root / "tiny.gguf", seed=0)
    start = "def add(a, b): return a + b"
    (root / "start.txt").write_text(start)
    first = cli("-m", str(model), "-f", str(root / "start.txt"), *TINY_RUN, "--spec-type", "none")
    assert first.returncode == 0, first.stderr
    prompt = root / "prompt.txt"
    prompt.write_text(start + json.loads(first.stdout)["text"] + "\n" + start)
    return {"model": model, "prompt": prompt, "root": root}


TINY_RUN = ("-n", "40", "--temp", "0", "-t", "1", "--json")
SMALL_FLAGS = ("--spec-ngram-mod-n-match", "4", "--spec-ngram-mod-n-min", "2", "--spec-ngram-map-k4v-size-n", "3",
               "--spec-ngram-map-k4v-size-m", "4")


def tiny_run(tiny: dict, *args: str) -> dict:
    proc = cli("-m", str(tiny["model"]), "-f", str(tiny["prompt"]), *TINY_RUN, *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.real
def test_every_new_type_alone_and_chained_gives_target_only_greedy_output(tiny, batch_invariant):
    alone = tiny_run(tiny, "--spec-type", "none")
    for types in ("ngram-mod", "ngram-map-k4v", "ngram-cache", "ngram-cache,ngram-simple",
                  "ngram-mod,ngram-map-k4v,ngram-cache,ngram-map-k,ngram-simple", "ngram-simple,ngram-mod"):
        out = tiny_run(tiny, "--spec-type", types, *SMALL_FLAGS)
        assert out["tokens"] == alone["tokens"], types
        assert out["n_accept"] > 0, types
    with_draft = tiny_run(tiny, "-md", str(tiny["model"]), "--spec-type", "ngram-map-k4v,draft", *SMALL_FLAGS)
    assert with_draft["tokens"] == alone["tokens"] and with_draft["n_accept"] > 0
    default = tiny_run(tiny, "--spec-default")  # ngram-mod at llama.cpp's 24/48/64: nothing that long repeats here
    assert default["tokens"] == alone["tokens"] and default["settings"]["spec_type"] == "ngram-mod"
    assert default["settings"]["ngram_mod"] == {"n_match": 24, "n_min": 48, "n_max": 64}
    assert default["settings"]["draft_max"] == 64


@pytest.mark.real
def test_sample_and_match_with_the_new_types_is_target_only_sampling(tiny, batch_invariant):
    sampled = ("--temp", "0.8", "-s", "7", "--spec-accept", "match")
    alone = tiny_run(tiny, "--spec-type", "none", *sampled)
    out = tiny_run(tiny, "--spec-type", "ngram-cache,ngram-mod,ngram-map-k4v", *SMALL_FLAGS, *sampled)
    assert out["tokens"] == alone["tokens"] and out["n_drafted"] > 0
    assert tiny_run(tiny, "--spec-type", "ngram-mod", *SMALL_FLAGS, "--temp", "0.8", "-s", "7")["n_predict"] == 40


@pytest.mark.real
def test_lookup_cache_files_round_trip_through_runs_and_llama_cpp(tiny, batch_invariant, harness, tmp_path):
    alone = tiny_run(tiny, "--spec-type", "none")
    dynamic = tmp_path / "dynamic.bin"
    first = tiny_run(tiny, "--spec-type", "ngram-cache", "-lcd", str(dynamic))
    assert first["tokens"] == alone["tokens"] and first["settings"]["lookup_cache_dynamic"] == str(dynamic)
    written = lookup_cache.read(dynamic)
    assert rows(written) == dump(harness, dynamic)  # llama.cpp reads what the run wrote
    assert written.part(first["tokens"][-3:-1]) is not None  # the output's n-grams are in it
    second = tiny_run(tiny, "--spec-type", "ngram-cache", "-lcd", str(dynamic), "-lcs", str(dynamic))
    assert second["tokens"] == alone["tokens"]
    # the same prompt and output again: every count doubled
    assert rows(lookup_cache.read(dynamic)) == [(*row[:5], 2 * row[5]) for row in rows(written)]
    # a static cache llama.cpp wrote (llama-lookup-create's 2-grams of the prompt and output) drafts
    static = tmp_path / "static.bin"
    subprocess.run([str(harness), "write", str(static), "2", "2"], input=" ".join(map(str, alone["tokens"])),
                   check=True, capture_output=True, text=True)
    out = tiny_run(tiny, "--spec-type", "ngram-cache", "-lcs", str(static))
    assert out["tokens"] == alone["tokens"] and out["n_accept"] > 0


@pytest.mark.real
def test_damaged_and_foreign_cache_files_are_one_line_notices(tiny, batch_invariant, tmp_path):
    alone = tiny_run(tiny, "--spec-type", "none")
    cut = tmp_path / "cut.bin"
    lookup_cache.write(cut, table_of({(1, 2): {3: 2}, (5,): {6: 1}}))
    cut.write_bytes(cut.read_bytes()[:-2])
    foreign = tmp_path / "foreign.bin"
    lookup_cache.write(foreign, table_of({(1, 2): {100000: 2}}))  # the tiny vocabulary has 369 tokens
    proc = cli("-m", str(tiny["model"]), "-f", str(tiny["prompt"]), *TINY_RUN, "--spec-type", "ngram-cache",
               "-lcd", str(cut), "-lcs", str(foreign))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == alone["tokens"]
    notices = [line for line in proc.stderr.splitlines() if line.startswith(("-lcs", "-lcd"))]
    assert notices == [
        f"-lcs {foreign}: token 100000 is not in the target's vocabulary of 369 tokens (a cache written for another "
        "tokenizer?); ignored",
        f"-lcd {cut}: damaged: cut short at byte 28; ignored; what this run generates will replace it"]
    assert "Traceback" not in proc.stderr
    assert len(lookup_cache.read(cut)) > 10  # replaced by this run's n-grams
