"""tests/spec_driver_harness.cpp, llama.cpp's own speculative drivers run greedily (see
tests/driver_harness.py), on the tiny EAGLE-3 pair of tests/tiny_drafters.py: its output has
the promised shape, and its loop is right: the text it accepts is the target's own greedy text.
"""

from __future__ import annotations

import llama_cpp as ll
import numpy as np
import pytest

from tests.tiny_drafters import write_drafter
from tests.driver_harness import build_driver_harness, run_driver_harness

pytestmark = pytest.mark.real

BOS = 365  # the tiny models' tokenizer (tests/tiny_model.py): 365 <s>, 366 </s>
PROMPT = [BOS, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
N_MAX, N_STEPS = 4, 16


def target_alone_greedy(path, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation of `prompt`, n tokens, one decode a token, in a context
    of the harness's (speculate's) parameters."""
    model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
    assert model
    cparams = ll.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = 4096, 512, 512, 1
    cparams.kv_unified, cparams.swa_full, cparams.no_perf = True, True, True
    cparams.n_threads = cparams.n_threads_batch = 2
    cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = ll.llama_init_from_model(model, cparams)
    assert ctx
    try:
        n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        out: list[int] = []
        tokens = list(prompt)
        while len(out) < n:
            array = (ll.llama_token * len(tokens))(*tokens)
            assert ll.llama_decode(ctx, ll.llama_batch_get_one(array, len(tokens))) == 0
            logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            tokens = [int(np.argmax(logits))]
            out += tokens
        return out
    finally:
        ll.llama_free(ctx)
        ll.llama_model_free(model)


def test_llama_cpps_eagle3_driver_drafts_and_its_loop_keeps_the_targets_greedy_text(tmp_path, batch_invariant):
    draft, target = write_drafter("eagle3", tmp_path / "d.gguf")
    harness = build_driver_harness(tmp_path)
    steps = run_driver_harness(harness, "draft-eagle3", target, draft, N_MAX, N_STEPS, PROMPT)

    assert [s["step"] for s in steps] == list(range(N_STEPS))
    for s in steps:
        assert set(s) == {"step", "draft", "accepted", "next"}
        assert 0 <= len(s["draft"]) <= N_MAX and 0 <= s["accepted"] <= len(s["draft"])
    # each step emits its accepted draft tokens and the target's next token; before the first
    # step, the target's argmax after the prompt (not reported: it is what step 0 drafts after)
    emitted = [t for s in steps for t in [*s["draft"][:s["accepted"]], s["next"]]]
    greedy = target_alone_greedy(target, PROMPT, 1 + len(emitted))
    assert emitted == greedy[1:]
    # the tiny drafter follows the target some of the time: drafts accepted and rejected
    assert any(s["accepted"] > 0 for s in steps) and any(s["accepted"] < len(s["draft"]) for s in steps)
