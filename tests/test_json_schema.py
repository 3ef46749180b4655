"""speculative/grammar/json_schema.py held to the pinned llama.cpp's own converter.

Over a corpus of schemas users write (tests/data/schemas.json), our grammar is byte for byte
json_schema_to_grammar's (tests/json_schema_harness.cpp, built against the pinned sdist's headers
and linked to the installed wheel's libllama-common), with the same warnings, except the entries of
KNOWN_DIFFERENCES, each of which must still differ. Every bad schema is one line naming its place,
and llama.cpp refuses it too, or writes for it a grammar llama.cpp cannot load (the evidence is in
its output). The grammars we write load in llama.cpp (llama_sampler_init_grammar, no vocabulary
needed for a grammar without token references).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import llama_cpp as ll
import pytest

from speculative.errors import GrammarError
from speculative.grammar.json_schema import ANY_OBJECT_SCHEMA, any_object_gbnf, schema_to_gbnf
from speculative.llamacpp.devices import init_once
from tests.conftest import vendored_tree
from tests.driver_harness import compile_cxx, wheel_libs

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "json_schema_harness.cpp"
HEADERS = ("common/json-schema-to-grammar.h", "common/json-schema.h", "common/json.h")
CORPUS = json.loads((ROOT / "tests" / "data" / "schemas.json").read_text(encoding="utf-8"))
BY_NAME = {entry["name"]: entry["schema"] for entry in CORPUS}

# corpus name -> why our grammar is not llama.cpp's (each must still differ: the list cannot go stale)
KNOWN_DIFFERENCES: dict[str, str] = {}

# (what is wrong, schema, the place our error names, what llama.cpp does: None where it refuses the
# schema too, else a piece of the grammar it writes that llama.cpp's grammar parser cannot load)
INVALID = [
    ("not an object", "x", "#", None),
    ("a boolean schema", True, "#", None),
    ("a boolean item schema", {"type": "array", "items": True}, "#/items", None),
    ("an unknown type", {"type": "strin"}, "#/type", None),
    ("a type that is no string", {"type": 5}, "#/type", None),
    ("an unknown type in a list", {"type": ["string", "nul"]}, "#/type/1", None),
    ("an empty type list", {"type": []}, "#/type", None),
    ("a bound that is no number", {"properties": {"age": {"type": "integer", "minimum": "ten"}}},
     "#/properties/age/minimum", None),
    ("a negative count", {"type": "array", "minItems": -1}, "#/minItems", None),
    ("a fractional count", {"type": "string", "maxLength": 2.5}, "#/maxLength", None),
    ("a $ref that does not resolve", {"properties": {"a": {"$ref": "#/$defs/missing"}}}, "#/properties/a/$ref",
     None),
    ("a $ref out of an array's range", {"$defs": {"l": [{}]}, "$ref": "#/$defs/l/5"}, "#/$ref", None),
    ("a remote $ref", {"$ref": "https://example.com/person.schema.json"}, "#/$ref", None),
    ("a $ref to another file", {"$ref": "person.json#/$defs/a"}, "#/$ref", None),
    ("a $ref that is no string", {"$ref": 5}, "#/$ref", None),
    ("an error in a $ref's target", {"$defs": {"a": {"type": "bogus"}}, "$ref": "#/$defs/a"}, "#/$defs/a/type",
     None),
    ("an invalid pattern", {"properties": {"code": {"type": "string", "pattern": "^(ab$"}}},
     "#/properties/code/pattern", None),
    ("a pattern with nothing to repeat", {"type": "string", "pattern": "^*a$"}, "#/pattern", None),
    ("a pattern that is no string", {"type": "string", "pattern": 5}, "#/pattern", None),
    ("an empty anyOf", {"anyOf": []}, "#/anyOf", None),
    ("a oneOf that is no array", {"oneOf": {"type": "string"}}, "#/oneOf", None),
    ("an empty enum", {"enum": []}, "#/enum", None),
    ("additionalProperties of another kind", {"type": "object", "additionalProperties": "no"},
     "#/additionalProperties", None),
    ("properties that are no object", {"type": "object", "properties": [1]}, "#/properties", None),
    ("a format that is no string", {"type": "string", "format": 5}, "#/format", None),
    ("a property name to escape", {"properties": {"a/b~c": {"type": "nothing"}}}, "#/properties/a~1b~0c/type",
     None),
    ("minItems above maxItems", {"type": "array", "minItems": 5, "maxItems": 2}, "#/maxItems", "{4,1}"),
    ("minLength above maxLength", {"type": "string", "minLength": 5, "maxLength": 2}, "#/maxLength", "char{5,2}"),
    ("a pattern repeating {5,2}", {"type": "string", "pattern": "^a{5,2}$"}, "#/pattern", '"a"{5,2}'),
    ("an integer minimum of 17 digits", {"type": "integer", "minimum": 10**16}, "#/minimum", "[0-9]{16,15}"),
    ("a non-ASCII character before a quantifier", {"type": "string", "pattern": "^é+$"}, "#/pattern",
     '"\xc3" "\xa9"+'),
]


def test_the_corpus_covers_what_users_write():
    assert len(CORPUS) >= 40 and len(BY_NAME) == len(CORPUS)
    text = json.dumps(CORPUS)
    for keyword in ("$defs", "definitions", "anyOf", "oneOf", "allOf", "const", "enum", "pattern", "minItems",
                    "maxItems", "minLength", "maxLength", "exclusiveMinimum", "prefixItems", "additionalProperties",
                    '"format": "date-time"', '"format": "uuid"', '["string", "null"]'):
        assert keyword in text, keyword
    assert set(KNOWN_DIFFERENCES) <= set(BY_NAME)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_every_corpus_schema_converts(name):
    grammar = schema_to_gbnf(BY_NAME[name])
    assert grammar.endswith("\n") and re.search(r"^root ::= ", grammar, re.M), grammar
    names = [line.split(" ::= ")[0] for line in grammar.splitlines()]
    assert names == sorted(set(names))  # llama.cpp writes each rule once, sorted by name


@pytest.mark.parametrize("what, schema, place, _", INVALID, ids=[case[0] for case in INVALID])
def test_a_bad_schema_is_one_line_naming_its_place(what, schema, place, _):
    with pytest.raises(GrammarError) as info:
        schema_to_gbnf(schema)
    message = str(info.value)
    assert message.startswith(f"json schema at {place}: "), (what, message)
    assert "\n" not in message and len(message) > len(f"json schema at {place}: ") + 5
    assert info.value.exit_code == 2


def test_what_llama_cpp_would_crash_on_is_refused():
    cycle = {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"$ref": "#/$defs/a"}}}
    with pytest.raises(GrammarError, match=r"^json schema at #/\$defs/a/\$ref: \$ref #/\$defs/a refers to "):
        schema_to_gbnf(cycle)
    with pytest.raises(GrammarError, match="lone surrogate"):
        schema_to_gbnf({"const": "\ud800"})


def test_json_object_is_any_object_as_llama_server_converts_it():
    grammar = any_object_gbnf()
    assert grammar == schema_to_gbnf(ANY_OBJECT_SCHEMA) == schema_to_gbnf({"type": "object", "title": "x"})
    assert "root ::= object\n" in grammar and "value ::= object | array | string | number | boolean | null\n" in grammar
    assert "root ::= object" not in schema_to_gbnf({})  # {} is any JSON value; the server reads it as json_object


def test_a_pattern_llama_cpp_cannot_express_is_any_string_with_a_warning():
    warnings: list[str] = []
    grammar = schema_to_gbnf({"properties": {"zip": {"type": "string", "pattern": "^\\d{5}$"}}}, warnings.append)
    assert "zip ::= string\n" in grammar
    assert warnings == ["json schema at #/properties/zip/pattern: pattern ^\\d{5}$ is not supported "
                        "(unsupported escape: \\d), accepting any string"]
    assert "root ::= string\n" in schema_to_gbnf({"type": "string", "pattern": "^\\d{5}$"})


def test_unknown_keywords_and_formats_are_ignored():
    plain = schema_to_gbnf({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    assert schema_to_gbnf({"type": "object", "properties": {"a": {"type": "string", "format": "email",
                                                                  "description": "d", "examples": ["x"]}},
                           "required": ["a", "nope"], "strict": True, "$schema": "x", "title": "T"}) == plain


@pytest.mark.parametrize("name", list(BY_NAME))
def test_our_grammars_load_in_llama_cpp(name):
    init_once()
    sampler = ll.llama_sampler_init_grammar(None, schema_to_gbnf(BY_NAME[name]).encode(), b"root")
    assert sampler, f"llama.cpp refuses the grammar of {name}"
    ll.llama_sampler_free(sampler)


@pytest.fixture(scope="module")
def llama_cpp_converter(tmp_path_factory):
    """schema -> (stdout, stderr) of tests/json_schema_harness.cpp: llama.cpp's grammar (or
    "error: ..."), and its warnings."""
    folder = tmp_path_factory.mktemp("json-schema")
    src = vendored_tree(folder / "llama-cpp", *HEADERS)
    libs, harness = wheel_libs(), folder / "json_schema_harness"
    compile_cxx(f"-I{src / 'common'}", HARNESS, f"-L{libs}", "-lllama-common", "-lllama",
                f"-Wl,--disable-new-dtags,-rpath,{libs}", "-o", harness)

    def convert(schema: object) -> tuple[str, str]:
        proc = subprocess.run([str(harness)], input=json.dumps(schema, ensure_ascii=False).encode(),
                              capture_output=True, timeout=60)
        assert proc.returncode in (0, 1), proc.stderr.decode(errors="replace")
        return proc.stdout.decode("latin-1"), proc.stderr.decode(errors="replace")

    return convert


def ours(schema: object) -> tuple[str, int]:
    """Our grammar as the harness's bytes read one per character, and how many warnings."""
    warnings: list[str] = []
    return schema_to_gbnf(schema, warnings.append).encode().decode("latin-1"), len(warnings)


@pytest.mark.real
def test_the_corpus_converts_byte_for_byte_as_llama_cpp_does(llama_cpp_converter):
    differ, warned = [], []
    for name, schema in BY_NAME.items():
        grammar, n_warnings = ours(schema)
        theirs, stderr = llama_cpp_converter(schema)
        if (grammar != theirs) != (name in KNOWN_DIFFERENCES):
            differ.append(f"{name}: {'no longer differs' if grammar == theirs else 'differs'}\n--- llama.cpp\n"
                          f"{theirs}--- ours\n{grammar}")
        if n_warnings != stderr.count("is not supported ("):
            warned.append(f"{name}: {n_warnings} warnings, llama.cpp: {stderr.strip()}")
        if name == "pattern-unsupported-class":
            assert n_warnings == 1 and "WARNING: JSON schema conversion was incomplete" in stderr
    assert not differ, "\n".join(differ)
    assert not warned, "\n".join(warned)


@pytest.mark.real
@pytest.mark.parametrize("what, schema, place, evidence", INVALID, ids=[case[0] for case in INVALID])
def test_llama_cpp_refuses_a_bad_schema_or_writes_what_it_cannot_load(llama_cpp_converter, what, schema, place,
                                                                       evidence):
    theirs, _ = llama_cpp_converter(schema)
    if evidence is None:
        assert theirs.startswith("error: JSON schema conversion failed:"), theirs
    else:
        assert not theirs.startswith("error:") and evidence in theirs, theirs


@pytest.mark.real
def test_a_split_character_is_a_grammar_llama_cpp_cannot_load(llama_cpp_converter):
    """The one refusal that does not hang llama.cpp's grammar parser ({5,2} would): checked there."""
    init_once()
    theirs, _ = llama_cpp_converter({"type": "string", "pattern": "^é+$"})
    assert not ll.llama_sampler_init_grammar(None, theirs.encode("latin-1"), b"root")
    grouped = {"type": "string", "pattern": "^(é)+$"}
    assert ours(grouped)[0] == llama_cpp_converter(grouped)[0]
