"""serving/generation.py: the one refusal of unsupported fields, read as each API reads its
fields, and the defaults both APIs take from the settings dataclasses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.serving import llama_api, openai_api
from speculative.serving.generation import ApiError, Defaults, refuse_unsupported

NEUTRAL = {"n": (1,), "echo": (False,), "tool_choice": ("none", "auto"), "json_schema": ()}


@pytest.mark.parametrize("strict_types", [True, False])
@pytest.mark.parametrize("body", [{}, {"n": 1}, {"n": None}, {"echo": False}, {"tool_choice": "auto"},
                                  {"json_schema": None}, {"other": 2}])
def test_a_neutral_or_absent_field_passes(body, strict_types):
    refuse_unsupported(body, NEUTRAL, strict_types)


@pytest.mark.parametrize("strict_types", [True, False])
@pytest.mark.parametrize("body, message", [
    ({"n": 2}, "n: not supported by this server (only 1)"),
    ({"n": True}, "n: not supported by this server (only 1)"),
    ({"echo": 0}, "echo: not supported by this server (only False)"),
    ({"tool_choice": "required"}, "tool_choice: not supported by this server (only 'none')"),
    ({"json_schema": {}}, "json_schema: not supported by this server"),
])
def test_any_other_value_is_a_400_naming_the_field(body, message, strict_types):
    with pytest.raises(ApiError) as e:
        refuse_unsupported(body, NEUTRAL, strict_types)
    assert (e.value.status, e.value.param, e.value.message) == (400, next(iter(body)), message)


def test_strict_types_tell_a_float_from_an_int_and_llama_servers_reading_does_not():
    with pytest.raises(ApiError):
        refuse_unsupported({"n": 1.0}, NEUTRAL, strict_types=True)
    refuse_unsupported({"n": 1.0}, NEUTRAL, strict_types=False)


def test_each_api_reads_its_fields_its_way():
    with pytest.raises(ApiError) as e:  # OpenAI's, strictly: 1.0 is not 1
        openai_api.parse({"prompt": "x", "n": 1.0}, chat=False)
    assert e.value.message == "n: Input should be a valid integer"
    assert llama_api.parse({"n_probs": 0.0, "n_cmpl": 1.0}, [1]) == llama_api.parse({}, [1])  # llama-server's: numbers


def test_omitted_fields_take_the_settings_defaults():
    spec = SpecSettings()
    generation, _ = llama_api.parse({}, [1])
    assert generation.sampling == SamplerSettings()
    assert generation.max_tokens is None and spec.n_predict == -1
    assert generation.ignore_eos == spec.ignore_eos
    assert openai_api.parse({"prompt": "x"}, chat=False).sampling == SamplerSettings()


def test_omitted_fields_are_llama_servers_own_defaults():
    """The settings' defaults are llama-server's (common/common.h), which editors and clients rely
    on: a change to the command line's defaults must not change the server's unnoticed."""
    sampling = llama_api.parse({}, [1])[0].sampling
    assert (sampling.temp, sampling.top_k, sampling.top_p, sampling.min_p,
            sampling.typical_p) == (0.8, 40, 0.95, 0.05, 1.0)
    assert (sampling.repeat_last_n, sampling.repeat_penalty, sampling.presence_penalty,
            sampling.frequency_penalty, sampling.seed) == (64, 1.0, 0.0, 0.0, -1)


def test_omitted_fields_take_the_servers_command_line():
    """serve's sampling flags, -n and --ignore-eos are what a request gets for what it leaves out
    (llama-server's --temp, --seed, -n, ...); what it gives wins."""
    server = SamplerSettings(temp=0.2, top_k=5, seed=42, sequence="kt", grammar='root ::= "a"')
    defaults = Defaults(server, n_predict=16, ignore_eos=True)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for generation in (openai_api.parse({"prompt": "x"}, False, defaults), openai_api.parse(chat, True, defaults),
                       llama_api.parse({}, [1], "", defaults)[0]):
        assert generation.sampling == server and generation.max_tokens == 16 and generation.ignore_eos
    given = openai_api.parse({"prompt": "x", "temperature": 0, "seed": 7, "max_tokens": 3, "ignore_eos": False,
                              "grammar": 'root ::= "b"'}, False, defaults)
    assert (given.sampling.temp, given.sampling.seed, given.sampling.top_k) == (0.0, 7, 5)
    assert given.max_tokens == 3 and not given.ignore_eos and given.sampling.grammar == 'root ::= "b"'
    generation, options = llama_api.parse({"temperature": 0, "n_predict": 3}, [1], "", defaults)
    assert (generation.sampling.temp, generation.sampling.top_k, generation.max_tokens) == (0.0, 5, 3)
    assert options.settings["samplers"] == ["top_k", "temperature"]
    assert openai_api.parse({"prompt": "x"}, False, Defaults(n_predict=-1)).max_tokens is None
    vocab = SimpleNamespace(n_ctx=64, eog_tokens=lambda: [2])
    props = llama_api.props(vocab, {"id": "x", "meta": {"spec_type": "none", "draft": None}}, "", "", False,
                            defaults=defaults)
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["seed"], params["n_predict"], params["ignore_eos"]) == (0.2, 42, 16, True)
    assert params["logit_bias"] == [{"bias": None, "token": 2}]  # --ignore-eos, as llama-server shows it


def test_text_parts_are_joined_as_llama_cpp_joins_them():
    """A message's parts by newlines (concat_content_parts); a final assistant message, which the
    answer continues, by blank lines (common_chat_msg::render_content)."""
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    body = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": parts}]}
    user, prefill = openai_api.parse(body, chat=True).messages
    assert user["content"] == "Wh\nill" and prefill["content"] == "Wh\n\nill"
    answered = openai_api.parse({"messages": [*body["messages"], {"role": "user", "content": "more"}]}, chat=True)
    assert answered.messages[1]["content"] == "Wh\nill"  # a turn of the history, not continued


def test_timings_per_token_puts_the_timings_so_far_on_each_step_and_progress_report():
    """llama-server's timings_per_token: a streamed step's last chunk and each prompt_progress
    report carry the timings so far; before the first batch, nothing processed and no time."""
    from speculative.decoding.stats import Stats
    from speculative.engine.stream import Piece
    from speculative.serving.worker import Progress

    so_far = Stats(n_prompt=12, n_cached=2, n_predict=3, n_drafted=4, n_accept=2, t_encode=0.5, t_decode=0.25)
    piece = Piece((("a", False), ("b", True)), (97, 98), (None, None), stats=so_far)
    before, after = Progress(12, 2, 2, 0.7), Progress(12, 2, 12, 41.0)
    generation, options = llama_api.parse({"timings_per_token": True, "stream": True}, [1, 2])
    assert generation.timings_per_token and options.settings["timings_per_token"]
    reply = llama_api.Reply("m", options, [1, 2], lambda: "", 4096)
    (chunk,) = reply.chunks(piece)
    assert chunk["timings"] == openai_api.timings(so_far) and chunk["timings"]["draft_n"] == 4
    first, last = reply.progress(before)["timings"], reply.progress(after)["timings"]
    assert (first["prompt_n"], first["prompt_ms"], first["predicted_n"], first["cache_n"]) == (0, 0.0, 0, 2)
    assert (last["prompt_n"], last["prompt_ms"]) == (10, 41.0)
    assert "timings" not in llama_api.Reply("m", llama_api.parse({}, [1])[1], [1], lambda: "", 4096).chunks(piece)[0]
    for chat, body in ((True, {"messages": [{"role": "user", "content": "hi"}]}), (False, {"prompt": "hi"})):
        answer = openai_api.Reply("m", openai_api.parse({**body, "stream": True, "timings_per_token": True}, chat))
        assert answer.chunks(piece)[-1]["timings"] == openai_api.timings(so_far)
        assert answer.progress(before)["timings"]["prompt_n"] == 0 and answer.progress(after)["prompt_progress"] == {
            "total": 12, "cache": 2, "processed": 12, "time_ms": 41.0}
        assert "timings" not in openai_api.Reply("m", openai_api.parse({**body, "stream": True}, chat)).chunks(piece)[-1]
