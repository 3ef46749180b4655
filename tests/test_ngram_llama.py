"""llama.cpp's n-gram drafters ngram-mod and ngram-map-k4v.

Hand-checked cases follow the C++ of the pinned llama.cpp (common/ngram-mod.cpp,
common/ngram-map.cpp, common/speculative.cpp); random sequences check the drafters' vectorised
code against line-by-line ports (tests/llama_ngram_ref.py).
"""

from __future__ import annotations

import random

import numpy as np

from speculative.drafters import Draft, ModTable, NgramMapK4v, NgramMod, Outcome
from speculative.drafters.ngram_mod import MULTIPLIER, TABLE_SIZE
from tests.llama_ngram_ref import RefMap, RefMod, RefModImpl


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


def test_ngram_mod_matches_the_line_by_line_port_of_llama_cpp():
    rng = random.Random(1)
    for trial in range(60):
        n, size = rng.choice([1, 2, 3, 5]), rng.choice([7, 64, 1024])
        n_min, n_max, vocab = rng.choice([0, 1, 2, 4]), rng.choice([0, 1, 3, 8]), rng.choice([3, 5, 50])
        ref, table = RefModImpl(RefMod(n, size), n_min, n_max), ModTable(n, size)
        mine = NgramMod(table, n_min, n_max)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        ref.begin(prompt)
        mine.prefill(prompt)
        history = [*prompt, rng.randrange(vocab)]  # llama.cpp drafts after the prompt and a sampled token
        for step in range(80):
            expected = ref.draft(history[:-1], history[-1])
            assert mine.propose(history, 1000).tokens == expected, (trial, step)
            assert table.entries.tolist() == ref.mod.entries and table.used == ref.mod.used
            if expected:
                accepted = rng.randrange(len(expected) + 1)
                ref.accept(accepted, len(expected))
                mine.accept(outcome(expected, accepted, "ngram-mod"))
                assert table.n_low == ref.n_low
                history += expected[:accepted]
            history += [rng.randrange(vocab)] * rng.choice([1, 1, 2])


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


def test_ngram_map_k4v_matches_the_line_by_line_port_of_llama_cpp():
    rng = random.Random(2)
    drafts = 0
    for trial in range(150):
        n, m, hits, vocab = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 5]), rng.choice([1, 1, 2, 3]), rng.choice([2, 3, 4, 8])
        ref, mine = RefMap(n, m, hits), NgramMapK4v(n, m, hits)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        ref.begin(prompt)
        mine.prefill(prompt)
        history = [*prompt, rng.randrange(vocab)]
        for step in range(60):
            expected = ref.draft(history[:-1], history[-1])
            assert mine.propose(history, 1000).tokens == expected, (trial, step)
            drafts += bool(expected)
            if expected and rng.random() < 0.8:
                accepted = rng.randrange(len(expected) + 1)
                ref.accept(accepted)
                mine.accept(outcome(expected, accepted, "ngram-map-k4v"))
                history += expected[:accepted]
            history.append(rng.randrange(vocab))
        assert {i: v for i, v in enumerate(ref.key_map) if v} == {int(i): int(mine.key_map[i]) for i in np.flatnonzero(mine.key_map)}
    assert drafts > 1000
