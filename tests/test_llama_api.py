"""llama-server's own endpoints without a model: request fields, the FIM prompt's assembly
and budget, response_fields, the line limits (n_indent, t_max_predict_ms) and the infill
sampler, against a vocabulary made by hand."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from speculative.decoding.sampling import Sampler, infill
from speculative.decoding.settings import SamplerSettings
from speculative.engine.text import LineLimits
from speculative.serving import llama_api
from speculative.serving.generation import ApiError

PRE, SUF, MID, REP, SEP, BOS, EOT = 900, 901, 902, 903, 904, 905, 906


class Chars:
    """A vocabulary of one token per character (its code point), with FIM tokens."""

    def __init__(self, n_batch=64, n_ctx=256, fim=True, rep_sep=True, add_bos=False):
        self.n_batch, self.n_ctx, self.n_vocab, self.add_bos = n_batch, n_ctx, 1000, add_bos
        self.fim = {"pre": PRE, "suf": SUF, "mid": MID, "rep": REP if rep_sep else None,
                    "sep": SEP if rep_sep else None}
        if not fim:
            self.fim = {k: None for k in self.fim}
        self.calls = []

    def tokenize(self, text, add_special, parse_special=True):
        self.calls.append((text, add_special, parse_special))
        return ([BOS] if add_special and self.add_bos else []) + [ord(c) for c in text]

    def token_bytes(self, token, special=True):
        return b"" if token >= 900 else chr(token).encode()

    def fim_tokens(self):
        return self.fim

    def bos_token(self):
        return BOS

    def is_eog(self, token):
        return token == EOT

    def end_token(self):
        return EOT


def codes(text):
    return [ord(c) for c in text]


def test_infill_prompt_is_llama_servers_repo_level_format():
    vocab = Chars()
    tokens = llama_api.infill_prompt(vocab, {
        "input_prefix": "ab", "input_suffix": "cd", "prompt": "x",
        "input_extra": [{"filename": "f.py", "text": "E1", "time": 3}, {"text": "E2"}]})
    assert tokens == [REP, *codes("myproject\n"), SEP, *codes("f.py\n"), *codes("E1"), SEP, *codes("tmp\n"),
                      *codes("E2"), SEP, *codes("filename\n"), PRE, *codes("abx"), SUF, *codes("cd"), MID]
    # prefix and suffix as plain text (special tokens not parsed), the prompt with them parsed
    assert ("ab", False, False) in vocab.calls and ("x", False, True) in vocab.calls


def test_infill_budget_takes_the_prefix_end_the_suffix_start_and_the_newest_extra():
    vocab = Chars(n_batch=16, n_ctx=40, rep_sep=False, add_bos=True)
    prefix, suffix = "p" * 10 + "0123456789AB", "S" * 30
    tokens = llama_api.infill_prompt(vocab, {"input_prefix": prefix, "input_suffix": suffix, "prompt": "",
                                             "input_extra": [{"text": "old" * 20}, {"text": "new"}]})
    # n_prefix_take = 3*(16/4) = 12, n_suffix_take = 16/4 - 2 = 2, n_extra_take = 40 - 16 + 2 = 26
    extra = codes(llama_api.CHUNK_SEPARATOR + "old" * 20 + llama_api.CHUNK_SEPARATOR + "new")[-26:]
    assert tokens == [*extra, BOS, PRE, *codes("0123456789AB"), SUF, *codes("SS"), MID]


def test_infill_without_fim_tokens_is_501_before_the_body_is_read():
    with pytest.raises(ApiError) as e:
        llama_api.infill_prompt(Chars(fim=False), "not even an object")
    assert e.value.status == 501 and e.value.llama_body()["error"]["type"] == "not_supported_error"
    assert "Infill is not supported by this model" in e.value.message


@pytest.mark.parametrize("body, message", [
    ({"input_suffix": ""}, '"input_prefix" is required'),
    ({"input_prefix": ""}, '"input_suffix" is required'),
    ({"input_prefix": "", "input_suffix": "", "prompt": 5}, '"prompt" must be a string'),
    ({"input_prefix": "", "input_suffix": "", "input_extra": {}}, '"input_extra" must be an array'),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": 1}]}, 'must contain a "text" field'),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "", "filename": 2}]}, '"filename"'),
])
def test_bad_infill_bodies(body, message):
    with pytest.raises(ApiError) as e:
        llama_api.infill_prompt(Chars(), body)
    assert e.value.status == 400 and message in e.value.message


def test_completion_prompts_text_tokens_and_mixed():
    vocab = Chars(add_bos=True)
    assert llama_api.completion_prompts(vocab, {"prompt": "ab"}) == [[BOS, 97, 98]]
    assert llama_api.completion_prompts(vocab, {"prompt": [5, 6]}) == [[5, 6]]
    assert llama_api.completion_prompts(vocab, {"prompt": ["a", 7, "b"]}) == [[BOS, 97, 7, 98]]
    assert llama_api.completion_prompts(vocab, {"prompt": [7, "b"]}) == [[7, 98]]  # BOS only before a leading string
    assert llama_api.completion_prompts(vocab, {"prompt": [{"prompt_string": "a"}]}) == [[BOS, 97]]
    for body in ({"prompt": []}, {}, {"prompt": 3}, [], {"prompt": ["a", 3.5]}):
        with pytest.raises(ApiError):
            llama_api.completion_prompts(vocab, body)


def test_several_prompts_are_several_answers_as_llama_server_reads_them():
    vocab = Chars(add_bos=True)
    assert llama_api.completion_prompts(vocab, {"prompt": ["a", "b"]}) == [[BOS, 97], [BOS, 98]]
    assert llama_api.completion_prompts(vocab, {"prompt": [[5, 6], "b", {"prompt_string": "c"}]}) == [
        [5, 6], [BOS, 98], [BOS, 99]]


def test_probabilities_bias_choices_and_progress_are_read_and_reported():
    vocab = Chars()
    g, o = llama_api.parse({"n_probs": 4, "post_sampling_probs": True, "n_cmpl": 2, "return_progress": True,
                            "logit_bias": [[97, -2.5], ["b", False], [3, 1]]}, [1], vocab=vocab)
    assert g.sampling.n_probs == 4 and g.sampling.post_sampling_probs and g.n == 2 and g.return_progress
    assert g.sampling.logit_bias == ((97, -2.5), (98, float("-inf")), (3, 1.0))
    assert o.n_probs == 4 and o.post_sampling and o.settings["n_probs"] == 4 and o.settings["post_sampling_probs"]
    assert o.settings["logit_bias"] == [{"bias": -2.5, "token": 97}, {"bias": None, "token": 98},
                                       {"bias": 1.0, "token": 3}]
    assert llama_api.parse({"logprobs": 3}, [1])[0].sampling.n_probs == 3  # llama-server's alias
    assert llama_api.parse({"logit_bias": {"97": 2, "ab": -1}}, [1], vocab=vocab)[0].sampling.logit_bias == (
        (97, 2.0), (97, -1.0), (98, -1.0))


@pytest.mark.parametrize("body", [{"n_probs": -1}, {"n_probs": "3"}, {"n_cmpl": 0}, {"post_sampling_probs": 1},
                                  {"logit_bias": [[1]]}, {"logit_bias": [[1, "x"]]}, {"logit_bias": 3},
                                  {"logit_bias": {"99999": 1}}, {"return_progress": "yes"}])
def test_bad_probabilities_bias_and_choices_are_400s(body):
    with pytest.raises(ApiError) as e:
        llama_api.parse(body, [1], vocab=Chars())
    assert e.value.status == 400


def test_fields_read_as_llama_server_reads_them():
    g, o = llama_api.parse({"n_predict": 5, "top_p": 1.5, "temperature": None, "top_k": 7.9, "stop": "x",
                            "samplers": ["top_k", "Top-P", "infill", "nonsense"], "n_indent": 2,
                            "t_max_predict_ms": 300, "cache_prompt": False, "response_fields": ["content"],
                            "t_max_prompt_ms": 500, "id_slot": 0, "n_cmpl": 3, "input_extra": []}, [1, 2])
    assert g.max_tokens == 5 and g.sampling.top_p == 1.0 and g.sampling.top_k == 7 and g.stops == ("x",)
    assert g.sampling.sequence == "kpi" and g.n_indent == 2 and g.t_max_predict_ms == 300
    assert not g.cache_prompt and g.tokens == (1, 2) and o.response_fields == ("content",)
    assert g.sampling.temp == 0.8  # null: the default
    assert o.settings["samplers"] == ["top_k", "top_p", "infill"] and o.settings["n_predict"] == 5
    # no temperature sampler: llama-server draws from the chain whatever the temperature is
    assert not llama_api.parse({"temperature": 0, "samplers": ["top_k"]}, [1])[0].sampling.greedy
    assert llama_api.parse({"temperature": 0, "samplers": ["temperature"]}, [1])[0].sampling.greedy
    assert llama_api.parse({"samplers": "kt"}, [1])[0].sampling.sequence == "kt"
    assert llama_api.parse({"n_predict": 0}, [1])[0].max_tokens == 1  # llama-server generates one token
    assert llama_api.parse({"max_tokens": 9}, [1])[0].max_tokens == 9


def test_ignore_eos_shows_as_llama_servers_bias_on_each_end_of_generation_token():
    """llama-server applies ignore_eos as a logit bias of -infinity (null in JSON) on every EOG token."""
    for ignore_eos, bias in ((True, [{"bias": None, "token": EOT}, {"bias": None, "token": 907}]), (False, [])):
        _, options = llama_api.parse({"ignore_eos": ignore_eos}, [1], eog=np.array([EOT, 907]))
        assert options.settings["logit_bias"] == bias and options.settings["ignore_eos"] == ignore_eos


@pytest.mark.parametrize("body, message", [
    ({"n_predict": "5"}, "Field 'n_predict': type must be number"),
    ({"n_predict": -2}, "Field 'n_predict': Value must be between"),
    ({"n_indent": -1}, "Field 'n_indent'"),
    ({"stream": 1}, "Field 'stream': type must be boolean"),
    ({"stop": [1]}, "Field 'stop'"),
    ({"samplers": 5}, "Field 'samplers'"),
    ({"response_fields": "content"}, "Field 'response_fields'"),
])
def test_bad_fields(body, message):
    with pytest.raises(ApiError) as e:
        llama_api.parse(body, [1])
    assert e.value.status == 400 and message in e.value.message


# Every field docs/serving.md's "Refused (400) unless at the value that changes nothing" names: values
# it refuses, and the values that change nothing. The adaptive_p sampler is refused in `samplers`.
REFUSED = {
    "min_keep": ([1], [0]),
    "dynatemp_range": ([0.5], [0, 0.0]),
    "top_n_sigma": ([1.0, 0], [-1]),
    "xtc_probability": ([0.5], [0]),
    "dry_multiplier": ([0.8], [0]),
    "mirostat": ([2, 1], [0]),
    "adaptive_target": ([0.5], [-1]),
    "lora": ([[{"id": 0, "scale": 0.5}]], [[]]),
    "echo": ([True], [False]),
}
REFUSED_CASES = [(name, value) for name, (refused, _) in REFUSED.items() for value in refused]
NEUTRAL_CASES = [(name, value) for name, (_, neutral) in REFUSED.items() for value in neutral]


def test_the_refused_fields_are_the_docs_and_the_codes():
    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    listed = text.split("Refused (`400`) unless at the value that changes nothing:")[1].split(".")[0]
    assert set(re.findall(r"`([a-z_]+)`", listed)) == {*REFUSED, "adaptive_p"}
    assert set(llama_api._NEUTRAL) == set(REFUSED)


@pytest.mark.parametrize("name, value", REFUSED_CASES)
@pytest.mark.parametrize("prompt_of", [lambda v, d: llama_api.completion_prompts(v, d)[0], llama_api.infill_prompt],
                         ids=["completion", "infill"])
def test_a_refused_field_is_llama_servers_400(name, value, prompt_of):
    body = {"prompt": "x", "input_prefix": "a", "input_suffix": "b", name: value}
    with pytest.raises(ApiError) as e:
        llama_api.parse(body, prompt_of(Chars(), body))
    assert e.value.status == 400 and e.value.param == name
    assert e.value.llama_body() == {"error": {"code": 400, "type": "invalid_request_error",
                                              "message": e.value.message}}
    assert e.value.message.startswith(f"{name}: not supported by this server")


@pytest.mark.parametrize("name, value", [*NEUTRAL_CASES, *((name, None) for name in REFUSED)])
def test_a_refused_field_at_the_value_that_changes_nothing_is_accepted(name, value):
    """...and so is null, which is absent, as for every field."""
    assert llama_api.parse({"n_predict": 4, name: value}, [1]) == llama_api.parse({"n_predict": 4}, [1])


@pytest.mark.parametrize("samplers", [["top_k", "adaptive_p"], ["adaptive-p"], "kat"])
def test_the_adaptive_p_sampler_is_refused(samplers):
    with pytest.raises(ApiError) as e:
        llama_api.parse({"samplers": samplers}, [1])
    assert e.value.status == 400 and "adaptive_p is not supported" in e.value.message


def test_response_fields_select_by_path():
    answer = {"content": "x", "timings": {"prompt_n": 3}, "truncated": False}
    assert llama_api.select(answer, ["content", "timings/prompt_n", "missing", "timings/none"]) == {
        "content": "x", "timings/prompt_n": 3}
    assert llama_api.select(answer, [""]) == {}
    assert llama_api.select(answer, []) == answer


def test_n_indent_ends_the_first_line_less_indented_than_asked():
    limits = LineLimits(n_indent=4)
    out = [limits.push(t) for t in ("x = 1", "\n    y", " = 2\n", "  ", "\t", "z = 3\n")]
    assert "".join(out) == "x = 1\n    y = 2\n  \t" and limits.stopped
    assert limits.push("more") == ""
    # the first line is exempt; a blank line (a newline at indentation 0) ends it too
    limits = LineLimits(n_indent=2)
    assert limits.push("a\n\n") == "a\n" and limits.stopped
    # blanks at the end, which no character followed, come back with flush
    limits = LineLimits(n_indent=2)
    assert limits.push("a\n ") == "a\n" and not limits.stopped and limits.flush() == " "


@pytest.mark.parametrize("n_indent, pieces, shown, stopped", [
    (4, ["x = 1", "\n    y = 2"], ["x = 1", "\n    y = 2"], False),  # exactly n_indent blanks: on it goes
    (4, ["  x", "\n  y"], ["  x", "\n  "], True),  # the first line continues the cursor's: never checked
    (2, ["a\n\tb"], ["a\n\t"], True),  # a tab is one blank
    (2, ["a\n\t b"], ["a\n\t b"], False),  # tabs and spaces alike
    (3, ["a\n", " ", " ", "  b"], ["a\n", "", "", "    b"], False),  # blanks wait for what follows them
    (3, ["a\n", " ", " ", "b"], ["a\n", "", "", "  "], True),
    (2, ["a\n  b\n  c\nd = 1"], ["a\n  b\n  c\n"], True),  # every line, within one piece too
    (3, ["a\n  \n"], ["a\n  "], True),  # a newline is the first other character of its line
    (2, ["a\n  \n  b"], ["a\n  \n  b"], False),
    (0, ["a\nb"], ["a\nb"], False),  # 0: no limit
])
def test_n_indent_on_hand_made_pieces(n_indent, pieces, shown, stopped):
    limits = LineLimits(n_indent=n_indent)
    assert [limits.push(piece) for piece in pieces] == shown and limits.stopped == stopped
    assert limits.push("z") == ("" if stopped else "z")  # nothing once it has stopped


def test_t_max_predict_counts_from_the_first_token_and_strictly_past_the_time():
    now = [5.0]
    limits = LineLimits(t_max=1.0, clock=lambda: now[0])
    now[0] = 10.0  # the clock starts with the first token, not with the limits
    assert limits.push("a\n") == "a\n" and not limits.stopped
    now[0] = 11.0  # exactly t_max later: not past it (llama-server's t_gen_ms() > t_max_predict_ms)
    assert limits.push("b\n") == "b\n" and not limits.stopped
    now[0] = 11.5
    assert limits.push("c\nd") == "c\nd" and limits.stopped
    assert limits.push("e\n") == ""


def test_the_two_limits_together():
    now = [0.0]
    limits = LineLimits(n_indent=2, t_max=1.0, clock=lambda: now[0])
    assert limits.push("x") == "x"
    now[0] = 2.0  # late: this newline would end the text, but its next line is indented less first
    assert limits.push("y\nz") == "y\n" and limits.stopped
    limits = LineLimits(n_indent=2, t_max=1.0, clock=lambda: now[0])
    assert limits.push("x") == "x"
    now[0] = 4.0
    assert limits.push("\n  z\n ") == "\n  z\n " and limits.stopped  # late: the whole token, its blank too
    assert LineLimits(t_max=0.0, clock=lambda: now[0]).push("a\n") == "a\n"  # 0: no time limit


def test_t_max_predict_ends_at_the_first_newline_after_the_time():
    now = [0.0]
    limits = LineLimits(t_max=1.0, clock=lambda: now[0])
    assert limits.push("a\n") == "a\n" and not limits.stopped  # in time
    now[0] = 0.5
    assert limits.push("b") == "b"
    now[0] = 2.0
    assert limits.push("c") == "c" and not limits.stopped  # late, but no newline yet
    assert limits.push("d\ne") == "d\ne" and limits.stopped  # the whole token, as llama-server sends it


def test_the_infill_sampler_merges_prefixes_and_drops_the_unlikely():
    vocab = Chars()
    ids = np.array(codes("abz"))
    # "a" (p .5), "b" (.3), "z" (.2): no prefix pairs; .2 stays (>= 0.2), then 1/(3+1) drops it
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    kept, z = infill(ids, logits, vocab)
    assert sorted(kept.tolist()) == codes("ab") and np.allclose(sorted(z), sorted(logits[:2]))

    class Words(Chars):
        def token_bytes(self, token, special=True):
            return {1: b"for", 2: b"fo", 3: b"x"}.get(token, b"")

    # "fo" is a prefix of "for": the likelier takes both (0.35 + 0.3), "x" (0.35) stays
    kept, _ = infill(np.array([1, 2, 3]), np.log(np.array([0.3, 0.35, 0.35])), Words())
    assert sorted(kept.tolist()) == [2, 3]
    # end of generation likely enough: only it remains
    kept, _ = infill(np.array([97, EOT]), np.log(np.array([0.8, 0.2])), vocab)
    assert kept.tolist() == [EOT]
    # nothing likely enough: end of turn alone
    flat = np.zeros(10)
    kept, _ = infill(np.arange(97, 107), flat, vocab)
    assert kept.tolist() == [EOT]


def test_greedy_with_the_infill_sampler_takes_the_argmax_of_what_it_leaves():
    vocab = Chars()
    logits = np.full(1000, -np.inf, dtype=np.float32)
    logits[[97, EOT]] = np.log([0.8, 0.2])  # EOT weighs enough: infill keeps it alone
    greedy = Sampler(SamplerSettings(temp=0.0, sequence="kit"), 0, vocab=vocab)
    assert greedy.sample(logits.copy()) == EOT
    assert Sampler(SamplerSettings(temp=0.0), 0).sample(logits.copy()) == 97  # without infill: the argmax
