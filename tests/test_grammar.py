"""Grammars through real llama.cpp: every spec type keeps target-only output under a grammar, the
flags and fields reach the run, bad grammars are one line before any model loads.

The tiny models (tests/tiny_model.py, tests/tiny_drafters.py) share a byte-level tokenizer of
369 tokens, so a JSON grammar constrains them as it does a real vocabulary; their random weights
make the grammar, not the model, choose much of the text, and drafts are rejected often."""

from __future__ import annotations

import json
import numpy as np
import pytest

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.drafters.registry import TYPES
from speculative.engine.engine import Engine
from tests.conftest import speculate, speculate_here
from tests.test_mtp import steps_of, tokens_of
from tests.tiny_drafters import write_drafter
from tests.tiny_model import write_model

real = pytest.mark.real
PROMPT = "once upon a time there were a cat and a dog. once upon a time there were"
# A record with forced keys and punctuation, free strings and numbers: both kinds of forced text.
RECORD = r'''root ::= "{\"name\": " string ", \"age\": " number ", \"tags\": [" string ("," ws string)* "]}"
string ::= "\"" [a-z ]{1,10} "\""
number ::= [1-9] [0-9]?
ws ::= " "?'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Targets and drafters: a llama target with a second llama as its draft model, the
    EAGLE-3/DFlash/DSpark drafters with their targets, and a qwen35 target with its NextN layer."""
    folder = tmp_path_factory.mktemp("tiny-grammar")
    files = {"llama": write_model("llama", folder / "llama.gguf"),
             "draft": write_model("llama", folder / "draft.gguf", seed=3),
             "qwen35-mtp": write_model("qwen35", folder / "qwen35-mtp.gguf", mtp=True)}
    for arch in ("eagle3", "dflash", "dspark"):
        files[arch], files[f"{arch}-target"] = write_drafter(arch, folder / f"{arch}.gguf")
    return files


def setup(tiny, spec_type: str) -> tuple[ModelSpec, ModelSpec | None]:
    """The target (and draft model) spec_type runs with."""
    base = dict(n_ctx=512, n_threads=1)
    if spec_type in ("draft-eagle3", "draft-dflash", "draft-dspark"):
        arch = spec_type.removeprefix("draft-")
        return ModelSpec(tiny[f"{arch}-target"], "target", **base, feature_drafter=tiny[arch]), None
    if spec_type == "draft-mtp":
        return ModelSpec(tiny["qwen35-mtp"], "target", **base, mtp=True, n_rs_seq=4), None
    if spec_type == "draft":
        return ModelSpec(tiny["llama"], "target", **base), ModelSpec(tiny["draft"], "draft", **base)
    return ModelSpec(tiny["llama"], "target", **base), None


def run(engine: Engine, spec_type: str, sampling: SamplerSettings, draft_max: int = 4) -> list:
    spec = SpecSettings(types=(spec_type,), n_predict=120, draft_max=draft_max)
    return list(engine.run(engine.prompt_tokens(PROMPT), sampling, spec, 1))


@real
@pytest.mark.parametrize("spec_type", [*TYPES, "auto"])
def test_greedy_output_under_a_grammar_is_target_only_output(tiny, batch_invariant, spec_type):
    """For every spec type, with a grammar, the same tokens as the target alone under it, the
    answer complete ("stop") and inside the grammar; the models really drafted and were rejected
    somewhere, and forced text was drafted."""
    target, draft = setup(tiny, spec_type)
    greedy = SamplerSettings(temp=0.0, grammar=RECORD)
    with Engine(target, draft) as engine:
        reference = run(engine, "none", greedy)
        engine.forget()
        for draft_max in (1, 3, 8):
            events = run(engine, spec_type, greedy, draft_max)
            assert tokens_of(events) == tokens_of(reference), f"draft_max {draft_max}"
            engine.forget()
        text = b"".join(engine.target.token_bytes(t) for t in tokens_of(reference)).decode()
    assert events[-1].reason == "stop" and text.startswith('{"name": "') and text.endswith("]}")
    drafted = [s for s in steps_of(events) if s.n_drafted]
    if spec_type.startswith("draft"):  # (n-grams need more repeated text than this answer has)
        assert drafted and any(s.n_accepted < s.n_drafted for s in drafted), spec_type
    if spec_type in ("forced", "auto"):
        assert drafted


# Forced text the tiny tokenizer can spell in several ways (it has merges for the prompt's words).
TALE = r'root ::= "{\"tale\": \"once upon a time there were a cat and a dog\", \"n\": " [1-9] [0-9]? "}"'


@real
def test_forced_text_is_drafted_and_certain_tokens_taken_without_a_row(tiny, batch_invariant):
    """`forced` drafts the text the grammar forces: where one token alone spells it, certain
    (kind a); where several could, as the tokenizer spells it, verified (kind b) and sometimes
    rejected; the output is the target's alone under the grammar."""
    target, _ = setup(tiny, "forced")
    greedy = SamplerSettings(temp=0.0, grammar=TALE)
    with Engine(target) as engine:
        reference = tokens_of(run(engine, "none", greedy))
        engine.forget()
        events = run(engine, "forced", greedy, 16)
    steps = steps_of(events)
    assert tokens_of(events) == reference
    assert sum(s.n_certain for s in steps) > 0
    assert sum(s.n_drafted - s.n_certain for s in steps) > 0
    assert any(s.n_accepted < s.n_drafted for s in steps)


@real
def test_sampled_runs_stay_inside_the_grammar(tiny):
    target, draft = setup(tiny, "draft")
    with Engine(target, draft) as engine:
        for seed in range(4):
            sampling = SamplerSettings(temp=1.0, seed=seed, grammar=RECORD)
            for spec_type in ("draft", "forced", "auto"):
                events = list(engine.run(engine.prompt_tokens(PROMPT), sampling,
                                         SpecSettings(types=(spec_type,), n_predict=120), seed))
                text = b"".join(engine.target.token_bytes(t) for t in tokens_of(events)).decode()
                assert events[-1].reason == "stop" and text.startswith('{"name": "') and text.endswith("]}")


# -- the command line ---------------------------------------------------------------------


@real
def test_the_flags_constrain_the_one_shot_command(tiny, tmp_path):
    grammar_file = tmp_path / "record.gbnf"
    grammar_file.write_text(RECORD)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "w": {"enum": ["cat", "dog"]}},
              "required": ["n", "w"], "additionalProperties": False}
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    common = ["-m", str(tiny["llama"]), "-p", PROMPT, "-n", "80", "--temp", "0", "-t", "1"]
    for flags in (["--grammar", RECORD], ["--grammar-file", str(grammar_file)]):
        proc = speculate(*common, *flags)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.decode().startswith('{"name": "')
    for flags in (["-j", json.dumps(schema)], ["-jf", str(schema_file)]):
        proc = speculate(*common, *flags, "--json")
        assert proc.returncode == 0, proc.stderr
        answer = json.loads(json.loads(proc.stdout)["text"])
        assert set(answer) == {"n", "w"} and isinstance(answer["n"], int) and answer["w"] in ("cat", "dog")


@real
def test_a_run_cut_before_its_grammar_is_complete_says_so(tiny):
    proc = speculate("-m", str(tiny["llama"]), "-p", PROMPT, "-n", "5", "--temp", "0", "--grammar", RECORD,
                     "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["finish_reason"] == "length" and out["grammar_incomplete"] is True
    assert any("before the grammar was complete" in note for note in out["notes"])


BAD = [
    ('root ::= "a" (', "line 1, column"),
    ('root ::= "a"\nthing ::= [a-', "line 2, column"),
    ('root ::= item\n', "item"),
    ('root ::= root "a" | "b"', "left"),
    ('root ::= "a" root', "root"),
]


@pytest.mark.parametrize("grammar, said", BAD)
def test_a_bad_grammar_is_one_line_and_exit_2_before_any_model_loads(grammar, said, tmp_path):
    missing = str(tmp_path / "no-such-model.gguf")  # loading it would be exit 3
    proc = speculate_here("-m", missing, "-p", "x", "--grammar", grammar)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and said in proc.stderr and "--grammar" in proc.stderr


def test_a_bad_schema_names_its_path_and_exits_2(tmp_path):
    missing = str(tmp_path / "no-such-model.gguf")
    proc = speculate_here("-m", missing, "-p", "x", "-j", '{"type": "object", "properties": {"n": {"type": "nmber"}}}')
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "/properties/n" in proc.stderr
    proc = speculate_here("-m", missing, "-p", "x", "-j", '{"type": ')
    assert proc.returncode == 2 and "not JSON" in proc.stderr
    proc = speculate_here("-m", missing, "-p", "x", "--grammar", "root ::= \"a\"", "-j", "{}")
    assert proc.returncode == 2 and "one grammar" in proc.stderr
    proc = speculate_here("-m", missing, "-p", "x", "--grammar-file", str(tmp_path / "none.gbnf"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr


@real
def test_a_token_the_grammar_names_is_checked_against_the_vocabulary(tiny):
    proc = speculate("-m", str(tiny["llama"]), "-p", PROMPT, "-n", "4", "--grammar", "root ::= <[99999]>")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "99999" in proc.stderr


@real
def test_forced_without_a_grammar_is_refused(tiny):
    proc = speculate("-m", str(tiny["llama"]), "-p", PROMPT, "-n", "4", "--spec-type", "forced")
    assert proc.returncode == 2 and "--grammar" in proc.stderr



# -- the server's fields (read as llama-server reads them; no model) -----------------------


def test_completion_takes_grammar_or_json_schema_and_grammar_wins():
    from speculative.grammar import given
    from speculative.serving import llama_api, openai_api

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert llama_api.parse({"grammar": RECORD}, [1])[0].sampling.grammar == RECORD
    assert llama_api.parse({"json_schema": schema}, [1])[0].sampling.grammar == given.from_schema(schema)
    assert llama_api.parse({"grammar": RECORD, "json_schema": schema}, [1])[0].sampling.grammar == RECORD
    assert llama_api.parse({"json_schema": {}}, [1])[0].sampling.grammar == given.from_schema({"type": "object"})
    assert llama_api.parse({"grammar": ""}, [1])[0].sampling.grammar == ""
    assert openai_api.parse({"prompt": "x", "json_schema": schema}, chat=False).sampling.grammar == \
        given.from_schema(schema)


def test_chat_takes_response_format_and_refuses_both_fields():
    from speculative.grammar import given
    from speculative.serving import openai_api
    from speculative.serving.generation import ApiError

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    any_object = given.from_schema({"type": "object"})
    wrapped = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": schema}}
    assert openai_api.parse({**chat, "response_format": wrapped}, chat=True).sampling.grammar == given.from_schema(schema)
    assert openai_api.parse({**chat, "response_format": {"type": "json_object"}}, chat=True).sampling.grammar == any_object
    assert openai_api.parse({**chat, "response_format": {"type": "text"}}, chat=True).sampling.grammar == ""
    assert openai_api.parse({**chat, "grammar": RECORD}, chat=True).sampling.grammar == RECORD
    for body, said in [({"grammar": RECORD, "json_schema": schema}, "Cannot use both"),
                       ({"response_format": {"type": "xml"}}, "response_format type"),
                       ({"grammar": 'root ::= "a" ('}, "line 1, column"),
                       ({"json_schema": {"type": "nope"}}, "json schema")]:
        with pytest.raises(ApiError) as e:
            openai_api.parse({**chat, **body}, chat=True)
        assert e.value.status == 400 and said in e.value.message, e.value.message


# -- the server and batch, on a real model -----------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    from tests.test_serve import start_server, stop_server

    s = start_server(model_path, tmp_path_factory.mktemp("serve-grammar"), "-c", "2048", "-t", "1", "-np", "2")
    yield s
    stop_server(s)


@real
def test_the_server_constrains_each_request_by_its_own_fields(server):
    got, _, answer = server.request("POST", "/completion", {"prompt": "Alice is 31.", "n_predict": 64,
                                                            "temperature": 0, "json_schema": PERSON})
    assert got == 200, answer
    assert set(json.loads(answer["content"])) == {"name", "age"}
    got, _, answer = server.request("POST", "/completion", {"prompt": "Pick:", "n_predict": 8, "temperature": 0,
                                                            "grammar": 'root ::= " yes" | " no"', "json_schema": PERSON})
    assert got == 200 and answer["content"] in (" yes", " no"), answer
    reply = server.client().chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Describe Alice, 31, as JSON."}], temperature=0,
        max_tokens=64, response_format={"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                                "schema": PERSON}})
    assert set(json.loads(reply.choices[0].message.content)) == {"name", "age"}
    reply = server.client().completions.create(model="x", prompt="Pick:", max_tokens=8, temperature=0,
                                               extra_body={"grammar": 'root ::= " yes" | " no"'})
    assert reply.choices[0].text in (" yes", " no")


@real
def test_the_server_refuses_a_bad_grammar_with_a_400_naming_the_place(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for path, body, said in [
            ("/completion", {"prompt": "x", "grammar": 'root ::= "a"\nb ::= ('}, "grammar: line 2, column 7"),
            ("/v1/chat/completions", {**chat, "grammar": 'root ::= "a"', "json_schema": PERSON}, "Cannot use both"),
            ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
                "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}}}, "/properties/a"),
            ("/completion", {"prompt": "x", "grammar": "root ::= <[9999999]>"}, "outside this model's vocabulary")]:
        got, _, answer = server.request("POST", path, body)
        assert got == 400, (path, body, answer)
        assert said in json.dumps(answer), answer


@real
def test_batch_lines_carry_their_own_grammar(model_path, tmp_path):
    requests = tmp_path / "requests.jsonl"
    lines = [{"id": 1, "prompt": "Alice is 31.", "json_schema": PERSON, "temperature": 0},
             {"id": 2, "prompt": "Pick:", "grammar": 'root ::= " yes" | " no"', "temperature": 0},
             {"id": 3, "prompt": "x", "grammar": 'root ::= "a" ('},
             {"id": 4, "prompt": "Bob is 40.", "n_predict": 12, "temperature": 0}]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "results.jsonl"
    proc = speculate("batch", str(requests), "-o", str(out), "-m", str(model_path("smollm2-135m-instruct")),
                     "-n", "64", "-t", "1")
    assert proc.returncode == 1, proc.stderr  # line 3 is not a request
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(json.loads(results[1]["text"])) == {"name", "age"}
    assert results[2]["text"] in (" yes", " no")
    assert "line 1, column 14" in results[3]["error"]
    assert "text" in results[4]


@real
def test_what_llama_cpps_parser_prints_is_kept_from_the_terminal(tiny, monkeypatch, capfd):
    """Our checker refuses first whatever llama.cpp's parser refuses; were one to slip past it,
    llama.cpp's dump of the whole grammar on stderr is captured and cut to one line."""
    from speculative.errors import GrammarError
    from speculative.llamacpp import grammar as binding
    from speculative.llamacpp.model import LlamaModel

    monkeypatch.setattr(binding, "check", lambda text: type("Parsed", (), {"tokens": ()})())
    with LlamaModel(ModelSpec(tiny["llama"], "target", n_ctx=64, n_threads=1)) as model:
        capfd.readouterr()
        with pytest.raises(GrammarError) as e:
            model.grammar('root ::= "a" (\nb ::= "c"\n' + "# filler\n" * 50)
    assert "\n" not in str(e.value) and "llama.cpp refused the grammar" in str(e.value)
    assert capfd.readouterr().err == ""


@real
def test_every_admissible_token_of_a_real_vocabulary_is_found_without_asking_for_all(model_path):
    """At every position of a JSON answer, the tokens constraint.admissible finds through first
    and second bytes are exactly those llama.cpp admits out of the whole vocabulary."""
    from speculative.decoding.constraint import admissible
    from speculative.grammar import given
    from speculative.llamacpp.model import LlamaModel

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "string"}}, "n": {"type": "integer"}}, "required": ["name", "tags", "n"]}
    answer = '{\n  "name": "Ada é", "tags": ["x", "y"],\n "n": 12}'
    with LlamaModel(ModelSpec(model_path("smollm2-135m-instruct"), "target", n_ctx=64)) as model:
        state = model.grammar(given.from_schema(schema))
        everything = np.arange(model.n_vocab, dtype=np.int32)
        for token in [*model.tokenize(answer, add_special=False), None]:
            assert admissible(state).tolist() == np.flatnonzero(state.admitted(everything)).tolist()
            if token is not None:
                state.accept(token)
