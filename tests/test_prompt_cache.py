"""--prompt-cache: the file format on its own, then real models restoring what another
Engine (another process, as far as the caches know) saved."""

from __future__ import annotations

import dataclasses
import json

import pytest

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.engine import prompt_cache
from speculative.engine.engine import Engine
from speculative.engine.prompt_cache import Part, Unusable
from speculative.engine.stream import complete
from speculative.errors import UsageError
from tests.conftest import SMOL, speculate, speculate_json
from tests.gguf_builder import write_lora, write_tiny_llama

IDENTITY = {"file": "/m.gguf", "size": 10, "mtime_ns": 1}
PARTS = [Part("target", IDENTITY, (1, 2, 3), b"target-state" * 100),
         Part("draft", {**IDENTITY, "file": "/d.gguf"}, (1, 2), b"draft-state")]
WANTED = {p.role: p.identity for p in PARTS}


def test_a_cache_round_trips_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "p.cache"
    prompt_cache.write(path, PARTS)
    assert prompt_cache.read(path, WANTED) == (PARTS, [])
    assert [p.name for p in tmp_path.iterdir()] == ["p.cache"]
    assert prompt_cache.read(path, {"target": IDENTITY}) == (PARTS[:1], [])  # no draft loaded


def test_a_part_for_other_models_or_settings_is_left_out_with_a_notice(tmp_path):
    path = tmp_path / "p.cache"
    prompt_cache.write(path, PARTS)
    parts, notices = prompt_cache.read(path, {**WANTED, "draft": {**WANTED["draft"], "mtime_ns": 2}})
    assert parts == PARTS[:1]
    assert notices == ["the draft part was saved for another model or settings (differs in mtime_ns); ignored"]


@pytest.mark.parametrize("damage", ["flip a state byte", "cut short", "damaged header", "version",
                                    "not a cache", "empty"])
def test_a_damaged_file_is_unusable(tmp_path, damage):
    path = tmp_path / "p.cache"
    prompt_cache.write(path, PARTS)
    data = bytearray(path.read_bytes())
    header_end = len(data) - sum(len(p.state) for p in PARTS)
    if damage == "flip a state byte":
        data[header_end + 5] ^= 1
    elif damage == "cut short":
        del data[-3:]
    elif damage == "damaged header":
        data[header_end - 3] = ord("{")
    elif damage == "version":
        data[len(prompt_cache.MAGIC)] += 1
    elif damage == "not a cache":
        data[0] ^= 1
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.raises(Unusable):
        prompt_cache.read(path, WANTED)


def rewrite_header(path, change) -> None:
    """Apply `change` to the parsed header's first part and write the file back (a header
    that still parses, unlike the damage above)."""
    data = path.read_bytes()
    start = len(prompt_cache.MAGIC) + prompt_cache._FIXED.size
    version, size = prompt_cache._FIXED.unpack(data[len(prompt_cache.MAGIC):start])
    header = json.loads(data[start:start + size])
    change(header["parts"][0])
    raw = json.dumps(header).encode()
    path.write_bytes(prompt_cache.MAGIC + prompt_cache._FIXED.pack(version, len(raw)) + raw + data[start + size:])


@pytest.mark.parametrize("change", [
    lambda part: part["tokens"].__setitem__(1, part["tokens"][1] + 1),  # claims a prefix the state lacks
    lambda part: part.__setitem__("bytes", 2**62),                      # must not be allocated
    lambda part: part.__setitem__("bytes", 2**64),
], ids=["a changed token", "a huge length", "a length past 64 bits"])
def test_a_header_that_parses_but_lies_is_unusable(tmp_path, change):
    path = tmp_path / "p.cache"
    prompt_cache.write(path, PARTS)
    rewrite_header(path, change)
    with pytest.raises(Unusable, match="target part is damaged"):
        prompt_cache.read(path, WANTED)


def test_a_file_that_is_not_a_cache_is_never_overwritten(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("my notes")
    with pytest.raises(UsageError, match="not a speculate prompt cache"):
        prompt_cache.write(path, PARTS)
    assert path.read_text() == "my notes"
    with pytest.raises(UsageError, match="directory"):
        prompt_cache.check_writable(tmp_path)
    (tmp_path / "empty").touch()
    prompt_cache.check_writable(tmp_path / "empty")  # nothing in it to lose


# -- real models ---------------------------------------------------------------

GREEDY = SamplerSettings(temp=0.0)
SPEC = SpecSettings(types=("draft",), draft_max=4, n_predict=16)
DOCUMENT = ("Rome was founded, the legend says, by Romulus in 753 BC. It grew from a village on the "
            "Palatine hill into the capital of an empire around the Mediterranean. ") * 4


@pytest.fixture(scope="module")
def specs(model_path):
    path = model_path(SMOL)
    return ModelSpec(path, "target", n_ctx=1024), ModelSpec(path, "draft", n_ctx=1024)


def ask(engine: Engine, question: str) -> tuple[list[int], list[int], object]:
    prompt = engine.prompt_tokens(DOCUMENT + "Question: " + question + " Answer:")
    final = complete(engine, prompt, GREEDY, SPEC, seed=1)
    return prompt, final.tokens, final.stats


@pytest.mark.real
def test_a_later_process_keeps_the_shared_prefix_and_generates_the_same(specs, tmp_path, batch_invariant):
    path = tmp_path / "p.cache"
    with Engine(*specs, prompt_cache_file=path) as first:
        p1, _, stats = ask(first, "Who founded Rome?")
    assert stats.n_restored == 0 and stats.t_save > 0
    parts, _ = prompt_cache.read(path, {"target": first.target.cache_identity(),
                                        "draft": first.draft.cache_identity()})
    assert [(p.role, list(p.tokens)) for p in parts] == [("target", p1[:-1]), ("draft", p1[:-1])]

    with Engine(*specs) as plain:
        p2, expected, _ = ask(plain, "When was it founded?")
    shared = next(i for i, (a, b) in enumerate(zip(p1, p2)) if a != b)
    notices = []
    with Engine(*specs, notify=notices.append, prompt_cache_file=path) as second:
        positions = []  # where the draft model decodes: never inside the restored prefix
        decode = second.draft.decode
        second.draft.decode = lambda tokens, pos, outputs: positions.append(pos) or decode(tokens, pos, outputs)
        _, out, stats = ask(second, "When was it founded?")
    assert min(positions) == shared
    assert out == expected and notices == []
    assert stats.n_restored == stats.n_cached == shared and stats.to_dict()["n_restored"] == shared
    assert stats.t_restore > 0
    assert [list(p.tokens) for p in prompt_cache.read(path, {"target": parts[0].identity})[0]] == [p2[:-1]]


@pytest.mark.real
def test_a_stale_draft_part_is_ignored_and_the_target_part_still_used(specs, tmp_path):
    path = tmp_path / "p.cache"
    with Engine(*specs, prompt_cache_file=path) as first:
        p1, out1, _ = ask(first, "Who founded Rome?")
        wanted = {"target": first.target.cache_identity(), "draft": first.draft.cache_identity()}
    target, draft = prompt_cache.read(path, wanted)[0]
    prompt_cache.write(path, [target, dataclasses.replace(draft, identity={**draft.identity, "size": 1})])
    notices = []
    with Engine(*specs, notify=notices.append, prompt_cache_file=path, prompt_cache_ro=True) as second:
        _, out, stats = ask(second, "Who founded Rome?")
    assert out == out1 and stats.n_restored == len(p1) - 1
    assert notices == [f"prompt cache {path}: the draft part was saved for another model or settings "
                       "(differs in size); ignored"]
    assert prompt_cache.read(path, {"draft": {**draft.identity, "size": 1}})[0]  # -ro: not rewritten


@pytest.mark.real
def test_a_damaged_cache_is_ignored_with_a_notice_and_replaced(specs, tmp_path):
    path = tmp_path / "p.cache"
    with Engine(*specs, prompt_cache_file=path) as first:
        _, out1, _ = ask(first, "Who founded Rome?")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the draft's keys and values: only the checksum can tell
    path.write_bytes(bytes(data))
    notices = []
    with Engine(*specs, notify=notices.append, prompt_cache_file=path) as second:
        _, out, stats = ask(second, "Who founded Rome?")
        wanted = {"target": second.target.cache_identity(), "draft": second.draft.cache_identity()}
    assert out == out1 and stats.n_restored == 0
    assert notices == [f"prompt cache {path}: ignored: the draft part is damaged (changed)"]
    assert len(prompt_cache.read(path, wanted)[0]) == 2  # written whole again


@pytest.mark.real
def test_cli_prompt_cache_flags(model_path, tmp_path):
    smol = str(model_path(SMOL))
    common = ("-m", smol, "--spec-type", "none", "--temp", "0", "-n", "8", "-p", DOCUMENT + "Who founded Rome?")
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    refused = speculate(*common, "--prompt-cache", str(notes))
    assert refused.returncode == 2 and "not a speculate prompt cache" in refused.stderr
    assert notes.read_text() == "keep me" and len(refused.stderr.strip().splitlines()) == 1
    assert speculate(*common, "--prompt-cache-ro").returncode == 2

    path = tmp_path / "p.cache"
    ro = speculate(*common, "--prompt-cache", str(path), "--prompt-cache-ro")
    assert ro.returncode == 0 and "does not exist; nothing restored" in ro.stderr and not path.exists()
    first = speculate_json(*common, "--prompt-cache", str(path))
    second = speculate(*common, "--prompt-cache", str(path))
    assert first["n_restored"] == 0 and first["settings"]["prompt_cache"] == str(path) and path.exists()
    assert second.stdout.decode().strip() == first["text"].strip()
    assert f"({first['n_prompt'] - 1} from the prompt cache, restored in" in second.stderr


@pytest.mark.real
def test_a_cache_saved_without_an_adapter_is_not_used_with_one(tmp_path):
    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    lora = write_lora(tmp_path / "lora.gguf", {"blk.0.attn_q.weight": (64, 64)}, rank=4, std=1.0)
    path, prompt = tmp_path / "p.cache", [1, 4, 5, 6, 4, 5]
    none = SpecSettings(types=("none",), n_predict=3)

    def run(loras, notices: list | None = None):
        spec = ModelSpec(tiny, "tiny", n_ctx=64, loras=loras)
        notify = notices.append if notices is not None else None
        with Engine(spec, notify=notify, prompt_cache_file=path) as engine:
            return complete(engine, prompt, GREEDY, none, seed=1).stats

    assert run(()).n_restored == 0 and run(()).n_restored == len(prompt) - 1
    assert run(((lora, 0.0),)).n_restored == len(prompt) - 1  # scale 0: llama.cpp drops the adapter
    notices = []
    assert run(((lora, 0.5),), notices).n_restored == 0
    assert notices == [f"prompt cache {path}: the target part was saved for another model or settings "
                       "(differs in loras); ignored"]
    assert run(((lora, 0.5),)).n_restored == len(prompt) - 1  # that run saved its own
