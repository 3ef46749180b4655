r"""JSON Schema turned into GBNF exactly as the pinned llama.cpp turns it (llama-server's
`json_schema`, `response_format`, and llama-cli's -j/-jf): byte for byte the grammar of
common/json-schema.cpp (the schema read into the supported subset) and
common/json-schema-to-grammar.cpp (that subset written as GBNF), so that speculate enforces what
llama-server would. tests/test_json_schema.py holds the two to each other over a corpus of
schemas, through tests/json_schema_harness.cpp built against the installed wheel.

    schema_to_gbnf(schema, warn=None) -> str    # the grammar; its root rule is `root`
    any_object_gbnf() -> str                    # response_format {"type": "json_object"}
    SharedRules(warn=None)                      # several schemas and hand-written rules in one
                                                # grammar (llama.cpp's build_grammar)
    format_literal(text) -> str                 # a GBNF string literal
    object_properties(schema) -> [Property]     # an object schema's properties, the JSON types
                                                # each may take (common_chat_schema::value_types)

`schema` is the parsed JSON (json.loads). An empty schema `{}` is any JSON value here, as in
json_schema_to_grammar; llama-server reads an absent or empty schema as ANY_OBJECT_SCHEMA before
converting it, and so must a caller that mirrors the server. `warn` gets each line llama.cpp
prints as a warning (a `pattern` its converter cannot express is accepted as any string).

Errors: GrammarError (exit 2), one line,

    json schema at <pointer>: <what is wrong>

<pointer> is where in the schema document the problem is, as a `$ref` names a place: `#` is the
whole schema, `#/properties/age/minimum` a keyword of a property's schema (JSON Pointer after the
`#`; `~` and `/` in a property name are written `~0` and `~1`). A problem found in a `$ref`'s
target names the target (`#/$defs/address/type`). Refused, where llama.cpp refuses them: a schema
that is not an object (booleans `true`/`false` included), a `type` that is not a JSON type, a
count (minItems, maxLength, ...) that is not a non-negative integer, a bound that is not a
number, a `$ref` that is not local (`#/...`: nothing is fetched) or does not resolve, an empty
`anyOf`/`oneOf`/`allOf`/`enum`/`type` list, a `pattern` that is not a regular expression.
Refused here where llama.cpp would write a grammar it cannot load, or crash: a
minimum count above the maximum (minItems > maxItems, minLength > maxLength, `{5,2}` in a
pattern) and most integer bounds of 16 digits or more with none on the other side (llama.cpp
writes such repetitions for them, on which its grammar parser loops), a pattern whose non-ASCII
character stands right before a quantifier (llama.cpp repeats the character's last UTF-8 byte
alone: a grammar that does not parse), and an allOf whose $ref leads back to itself (llama.cpp
recurses until it crashes).
Whatever llama.cpp ignores (unknown keywords and formats, `required` names with no property,
`strict`, `title`, `description`, ...) is ignored.

Derived from SchemaConverter in llama-cpp-python's llama_cpp/llama_grammar.py (MIT License,
Copyright (c) 2023 Andrei Betlen), a port of llama.cpp's examples/json_schema_to_grammar.py, and
brought in line with the pinned llama.cpp's common/json-schema.cpp and
common/json-schema-to-grammar.cpp (MIT License, Copyright (c) 2023-2026 The ggml authors).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable

from speculative.errors import GrammarError

ANY_OBJECT_SCHEMA = {"type": "object"}  # what llama-server converts for json_object and for {}
INT_MAX = 2**31 - 1  # C++ std::numeric_limits<int>::max(): no maximum
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # an integer's unbounded ends

SPACE_RULE = '| " " | "\\n"{1,2} [ \\t]{0,20}'
# name -> (rule, the rules it uses); llama.cpp's PRIMITIVE_RULES and STRING_FORMAT_RULES
PRIMITIVE_RULES = {
    "boolean": ('("true" | "false")', ()),
    "decimal-part": ("[0-9]{1,16}", ()),
    "integral-part": ("[0] | [1-9] [0-9]{0,15}", ()),
    "number": ('("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
               ("integral-part", "decimal-part")),
    "integer": ('("-"? integral-part)', ("integral-part",)),
    "value": ("object | array | string | number | boolean | null",
              ("object", "array", "string", "number", "boolean", "null")),
    "object": ('"{" space ( string ":" space value ("," space string ":" space value)* )? space "}"',
               ("string", "value")),
    "array": ('"[" space ( value ("," space value)* )? space "]"', ("value",)),
    "uuid": ('"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" '
             '[0-9a-fA-F]{12} "\\""', ()),
    "char": ('[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})', ()),
    "string": ('"\\"" char* "\\""', ("char",)),
    "null": ('"null"', ()),
}
STRING_FORMAT_RULES = {
    "date": ('[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )', ()),
    "time": ('([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? ( "Z" | ( "+" | "-" ) '
             '( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )', ()),
    "date-time": ('date "T" time', ("date", "time")),
    "date-string": ('"\\"" date "\\""', ("date",)),
    "time-string": ('"\\"" time "\\""', ("time",)),
    "date-time-string": ('"\\"" date-time "\\""', ("date-time",)),
}
RESERVED_NAMES = frozenset({"root", *PRIMITIVE_RULES, *STRING_FORMAT_RULES})
_INVALID_RULE_CHARS = re.compile(r"[^a-zA-Z0-9-]+")
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")


def schema_to_gbnf(schema: object, warn: Callable[[str], None] | None = None) -> str:
    """`schema` (parsed JSON) as llama.cpp's json_schema_to_grammar writes it (GrammarError, one
    line naming the place, for one it refuses); `warn` gets each warning llama.cpp prints."""
    builder = _Builder(schema)
    root = builder.build()
    converter = _Converter(builder.refs, warn)
    converter.visit(root, "")
    return converter.grammar()


def any_object_gbnf() -> str:
    """The grammar of OpenAI's response_format {"type": "json_object"}: any JSON object, as
    llama-server converts it (it reads json_object, and an empty schema, as {"type": "object"})."""
    return schema_to_gbnf(ANY_OBJECT_SCHEMA)


class SharedRules:
    """Several schemas and hand-written rules in one grammar, as llama.cpp's build_grammar shares
    one converter between them (a chat format's tool calls: each tool's parameters, and the
    call's own syntax around them). Rules of the same name and body are shared (`space`,
    `string`, ...); a name taken by another body gets a number, as llama.cpp's _add_rule does.
    Unlike llama.cpp, where the same `$ref` in two tools' schemas shares one rule (the first
    tool's target), each schema's `$ref` rules are named after the schema: no tool sees
    another's definitions."""

    def __init__(self, warn: Callable[[str], None] | None = None):
        self._converter = _Converter({}, warn)

    def add_schema(self, name: str, schema: object, property: str | None = None) -> str:
        """The rule matching `schema`, named `name` (its parts `name-...`); with `property`, the
        rule of that property of the object `schema` (its `$ref`s resolved in `schema`).
        GrammarError (one line, the place in `schema`) for a schema llama.cpp refuses."""
        builder = _Builder(schema)
        node = builder.build()
        if property is not None:
            node = next(n for p, n, _ in node.properties if p == property)
        conv = self._converter
        conv.refs, conv.ref_prefix = builder.refs, name + "-"
        try:
            return conv.visit(node, name)
        finally:
            conv.refs, conv.ref_prefix = {}, ""

    def add_rule(self, name: str, rule: str) -> str:
        """The name `rule` is given (`name`, or `name` with a number where taken)."""
        return self._converter.add_rule(name, rule)

    def grammar(self) -> str:
        """Every rule, sorted by name, as llama.cpp writes them."""
        return self._converter.grammar()


@dataclass(frozen=True)
class Property:
    """One property of an object schema: its name, whether it is required, and the JSON types
    ("null", "boolean", "integer", "number", "string", "array", "object") its value may take."""
    name: str
    required: bool
    types: frozenset[str]


def object_properties(schema: object) -> list[Property]:
    """The properties of an object schema, in the schema's order, as llama.cpp's
    foreach_parameter sees them ([] for a schema that is not an object); GrammarError where
    llama.cpp refuses the schema."""
    builder = _Builder(schema)
    root = builder.build()
    if root.kind != "object":
        return []
    return [Property(name, required, frozenset(_value_types(node, builder.refs, set())))
            for name, node, required in root.properties]


_ALL_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array"}.get(type(value), "object")


def _value_types(node: _Node, refs: dict[str, _Node | None], seen: set[str]) -> frozenset[str]:
    """The JSON types a value of `node` may take (json-schema.cpp's value_types_impl)."""
    kind = node.kind
    if kind == "any":
        return _ALL_TYPES
    if kind == "number":
        return frozenset({"number", "integer"})
    if kind in ("tuple", "array"):
        return frozenset({"array"})
    if kind == "const":
        return frozenset({_json_type(node.value)})
    if kind == "enum":
        return frozenset(_json_type(v) for v in node.values)
    if kind == "ref":
        target = refs.get(node.ref)
        if target is None or node.ref in seen:
            return frozenset()  # a cycle contributes no type
        return _value_types(target, refs, seen | {node.ref})
    if kind == "anyOf":
        return frozenset().union(*(_value_types(c, refs, seen) for c in node.children))
    if kind == "allOf":
        return _ALL_TYPES.intersection(*(_value_types(c, refs, seen) for c in node.children))
    return frozenset({kind})  # null boolean integer string object


def format_literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    return _format_literal(text)


def _fail(path: str, detail: str) -> GrammarError:
    """The one-line error at `path`."""
    return GrammarError(_one_line(f"json schema at {path}: {detail}"))


def _one_line(text: str) -> str:
    """`text` with the control characters of what it quotes escaped as JSON escapes them."""
    return re.sub(r"[\x00-\x1f]", lambda m: json.dumps(m.group())[1:-1], text)


# JSON values as nlohmann::ordered_json (llama.cpp's common_json) sees them


def _is_integer(v: object) -> bool:
    """An integer nlohmann keeps as one (int64 or uint64); a larger one it reads as a double."""
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**64


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _wrap(v: int, bits: int) -> int:
    """A C++ cast of `v` to a signed integer of `bits` bits."""
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def _describe(v: object) -> str:
    kind = ("null" if v is None else "a boolean" if isinstance(v, bool) else "a number" if _is_number(v)
            else "a string" if isinstance(v, str) else "an array" if isinstance(v, list) else "an object")
    return kind if kind in ("null", "an object") else f"{kind} ({_dump(v)[:40]})"


def _dump(v: object) -> str:
    """`v` as nlohmann's dump() writes it: compact, keys in order, UTF-8 unescaped, a double in
    its shortest form with nlohmann's switch to exponents (1e+15, 1e-05)."""
    if isinstance(v, dict):
        return "{" + ",".join(f"{_dump(str(k))}:{_dump(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(map(_dump, v)) + "]"
    if isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and not _is_integer(v)):
        return _dump_double(float(v))
    return json.dumps(v, ensure_ascii=False)


def _dump_double(x: float) -> str:
    if not math.isfinite(x):
        return "null"  # what nlohmann writes for a NaN or an infinity
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    mantissa, _, exponent = repr(abs(x)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    scale = int(exponent or 0) - len(fraction) + len(digits) - len(digits.rstrip("0"))
    digits = digits.rstrip("0")
    k, n = len(digits), len(digits) + scale  # nlohmann's format_buffer, min_exp -4, max_exp 15
    sign = "-" if x < 0 else ""
    if k <= n <= 15:
        return f"{sign}{digits}{'0' * (n - k)}.0"
    if 0 < n <= 15:
        return f"{sign}{digits[:n]}.{digits[n:]}"
    if -4 < n <= 0:
        return f"{sign}0.{'0' * -n}{digits}"
    e = n - 1
    head = digits if k == 1 else f"{digits[0]}.{digits[1:]}"
    return f"{sign}{head}e{'-' if e < 0 else '+'}{abs(e):02d}"


def _format_literal(text: str) -> str:
    return '"' + "".join(_LITERAL_ESCAPES.get(c, c) for c in text) + '"'


def _pointer(path: str, *tokens: str | int) -> str:
    """`path` with JSON Pointer tokens added (a property's name escaped as RFC 6901 asks)."""
    return path + "".join("/" + str(t).replace("~", "~0").replace("/", "~1") for t in tokens)


# The schema read into llama.cpp's subset (common/json-schema.cpp's common_chat_schema nodes)


@dataclass
class _Node:
    kind: str  # any ref anyOf allOf const enum null boolean number integer string array tuple object
    path: str  # where in the document: errors found while converting name it
    children: list[_Node] = field(default_factory=list)  # anyOf, allOf, tuple
    value: object = None  # const
    values: list = field(default_factory=list)  # enum
    ref: str = ""
    pattern: str = ""
    format: str = ""  # "", "uuid", "date", "time", "date-time"
    min_count: int = 0  # minLength, minItems
    max_count: int = -1  # maxLength, maxItems; -1: none
    minimum: int = INT64_MIN
    maximum: int = INT64_MAX
    items: _Node | None = None  # array
    properties: list[tuple[str, _Node, bool]] = field(default_factory=list)  # (name, schema, required)
    additional: _Node | None = None  # object: None when no other key is allowed


def _format(schema: dict, path: str) -> str:
    if "format" not in schema:
        return ""
    value = schema["format"]
    if not isinstance(value, str):
        raise _fail(_pointer(path, "format"), f"must be a string, not {_describe(value)}")
    if value in ("date", "time", "date-time"):
        return value
    return "uuid" if value == "uuid" or re.fullmatch(r"uuid[1-5]", value) else ""


def _count(schema: dict, key: str, path: str, default: int) -> int:
    if key not in schema:
        return default
    value = schema[key]
    if not _is_integer(value) or _wrap(value, 32) < 0:
        raise _fail(_pointer(path, key), f"must be a non-negative integer, not {_describe(value)}")
    return _wrap(value, 32)


def _bound(schema: dict, key: str, path: str, round_up: bool) -> int:
    """A bound of an integer: a fractional one rounded inwards, to the integers it still admits."""
    value = schema[key]
    if _is_integer(value):
        return _wrap(value, 64)
    if not _is_number(value) or not math.isfinite(value):
        raise _fail(_pointer(path, key), f"must be a number, not {_describe(value)}")
    return _wrap(int(math.ceil(value) if round_up else math.floor(value)), 64)


def _array_index(token: str) -> int | None:
    """std::stoull's reading of a $ref token that selects in an array (None: not a number)."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?)(\d+)", token)
    if not m or int(m.group(2)) >= 2**64:
        return None
    return (-int(m.group(2)) if m.group(1) == "-" else int(m.group(2))) % 2**64


class _Builder:
    """The schema document read into _Node trees as common_chat_schema_builder reads it (the
    first problem raised as GrammarError); `refs`: each `$ref` string's target, built once."""

    def __init__(self, root: object):
        self.root = root
        self.refs: dict[str, _Node | None] = {}

    def build(self) -> _Node:
        return self.node(self.root, "#")

    def node(self, schema: object, path: str, type_path: str | None = None) -> _Node:
        """`type_path`: where the `type` is, for a schema that is one entry of a `type` list."""
        if not isinstance(schema, dict):
            raise _fail(path, f"a schema must be a JSON object, not {_describe(schema)}")
        if "$ref" in schema:
            return self.ref(schema["$ref"], path)
        for key in ("oneOf", "anyOf"):
            if key in schema:
                return self.alternatives("anyOf", schema[key], _pointer(path, key))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.type_list(schema, kind, path)
        if "const" in schema:
            return _Node("const", path, value=schema["const"])
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise _fail(_pointer(path, "enum"), f"must be a non-empty array, not {_describe(schema['enum'])}")
            return _Node("enum", path, values=list(schema["enum"]))
        if kind is not None and not isinstance(kind, str):
            raise _fail(type_path or _pointer(path, "type"),
                        f"must be a string or an array of strings, not {_describe(kind)}")
        return self.typed(schema, kind or "", path, type_path or _pointer(path, "type"))

    def typed(self, schema: dict, kind: str, path: str, type_path: str) -> _Node:
        has_properties = "properties" in schema or (
            "additionalProperties" in schema and schema["additionalProperties"] is not True)
        if kind == "":  # without a type the structural keywords decide
            if has_properties:
                return self.object(schema, path)
            if "allOf" in schema:
                return self.alternatives("allOf", schema["allOf"], _pointer(path, "allOf"))
            if "items" in schema or "prefixItems" in schema:
                return self.array(schema, path)
            if any(k in schema for k in ("pattern", "minLength", "maxLength")) or _format(schema, path):
                return self.string(schema, path)
            return _Node("any", path)
        if kind in ("object", "string") and "allOf" in schema and not (kind == "object" and has_properties):
            return self.alternatives("allOf", schema["allOf"], _pointer(path, "allOf"))
        if kind == "object":
            return self.object(schema, path)
        if kind == "string":
            return self.string(schema, path)
        if kind == "array":
            return self.array(schema, path)
        if kind == "integer":
            return self.integer(schema, path)
        if kind in ("number", "boolean", "null"):
            return _Node(kind, path)
        raise _fail(type_path, f"unrecognized type {json.dumps(kind, ensure_ascii=False)} "
                               f"(one of {', '.join(_TYPES)})")

    def ref(self, ref: object, path: str) -> _Node:
        if not isinstance(ref, str):
            raise _fail(_pointer(path, "$ref"), f"must be a string, not {_describe(ref)}")
        if not ref.startswith("#/"):
            raise _fail(_pointer(path, "$ref"), f"unsupported $ref {ref}: only references into the same "
                                                "document (#/...) are supported, nothing is fetched")
        if ref not in self.refs:
            self.refs[ref] = None  # reserved first: a cycle back to this $ref stops here
            self.refs[ref] = self.node(self.resolve(ref, path), ref)
        return _Node("ref", path, ref=ref)

    def resolve(self, ref: str, path: str) -> object:
        """What `ref` points at, its tokens taken as written (no ~0 ~1 or %-decoding, as llama.cpp)."""
        target = self.root
        for token in ref[1:].split("/")[1:]:
            if isinstance(target, dict) and token in target:
                target = target[token]
            elif isinstance(target, list):
                index = _array_index(token)
                if index is None or index >= len(target):
                    raise _fail(_pointer(path, "$ref"), f"cannot resolve $ref {ref}: {token} is out of range")
                target = target[index]
            else:
                raise _fail(_pointer(path, "$ref"), f"cannot resolve $ref {ref}: {token} not found")
        return target

    def alternatives(self, kind: str, alts: object, path: str) -> _Node:
        if not isinstance(alts, list):
            raise _fail(path, f"must be an array of schemas, not {_describe(alts)}")
        if not alts:
            raise _fail(path, "must not be empty")
        return _Node(kind, path, children=[self.node(alt, _pointer(path, i)) for i, alt in enumerate(alts)])

    def type_list(self, schema: dict, kinds: list, path: str) -> _Node:
        """{"type": ["a", "b"], ...}: {"anyOf": [{"type": "a", ...}, {"type": "b", ...}]}."""
        if not kinds:
            raise _fail(_pointer(path, "type"), "must not be empty")
        return _Node("anyOf", path, children=[self.node({**schema, "type": kind}, path, _pointer(path, "type", i))
                                              for i, kind in enumerate(kinds)])

    def object(self, schema: dict, path: str) -> _Node:
        required = schema.get("required")
        required = {n for n in required if isinstance(n, str)} if isinstance(required, list) else set()
        node = _Node("object", path)
        if "properties" in schema:
            properties = schema["properties"]
            if not isinstance(properties, dict):
                raise _fail(_pointer(path, "properties"), f"must be an object, not {_describe(properties)}")
            node.properties = [(name, self.node(prop, _pointer(path, "properties", name)), name in required)
                               for name, prop in properties.items()]
        if "additionalProperties" in schema:
            additional = schema["additionalProperties"]
            if isinstance(additional, bool):
                node.additional = _Node("any", _pointer(path, "additionalProperties")) if additional else None
            elif isinstance(additional, dict):
                node.additional = self.node(additional, _pointer(path, "additionalProperties"))
            else:
                raise _fail(_pointer(path, "additionalProperties"),
                            f"must be a boolean or a schema, not {_describe(additional)}")
        elif "properties" not in schema:
            node.additional = _Node("any", path)  # {"type": "object"} alone: any object
        return node

    def array(self, schema: dict, path: str) -> _Node:
        if "items" in schema or "prefixItems" in schema:  # items wins when both are there
            key = "items" if "items" in schema else "prefixItems"
            items = schema[key]
            if isinstance(items, list):
                return _Node("tuple", path, children=[self.node(item, _pointer(path, key, i))
                                                      for i, item in enumerate(items)])
            item = self.node(items, _pointer(path, key))
        else:
            item = _Node("any", path)
        return _Node("array", path, items=item, min_count=_count(schema, "minItems", path, 0),
                     max_count=_count(schema, "maxItems", path, -1))

    def string(self, schema: dict, path: str) -> _Node:
        pattern = schema.get("pattern", "")
        if not isinstance(pattern, str):
            raise _fail(_pointer(path, "pattern"), f"must be a string, not {_describe(pattern)}")
        return _Node("string", path, pattern=pattern, format=_format(schema, path),
                     min_count=_count(schema, "minLength", path, 0), max_count=_count(schema, "maxLength", path, -1))

    def integer(self, schema: dict, path: str) -> _Node:
        node = _Node("integer", path)
        if "minimum" in schema:
            node.minimum = _bound(schema, "minimum", path, True)
        elif "exclusiveMinimum" in schema:
            node.minimum = _wrap(_bound(schema, "exclusiveMinimum", path, False) + 1, 64)
        if "maximum" in schema:
            node.maximum = _bound(schema, "maximum", path, False)
        elif "exclusiveMaximum" in schema:
            node.maximum = _wrap(_bound(schema, "exclusiveMaximum", path, True) - 1, 64)
        return node


# GBNF pieces (json-schema-to-grammar.cpp's free functions)


class _Unloadable(Exception):
    """What llama.cpp's converter would write here llama.cpp's grammar parser cannot load."""


def _repetition(item: str, low: int, high: int, separator: str = "") -> str:
    """build_repetition: `item` `low` to `high` times (INT_MAX: no end), `separator` between."""
    has_max = high != INT_MAX
    if high == 0:
        return ""
    if low == 0 and high == 1:
        return item + "?"
    if not separator:
        if low == 1 and not has_max:
            return item + "+"
        if low == 0 and not has_max:
            return item + "*"
        if low < 0 or (has_max and high < low):
            raise _Unloadable(f"{{{low},{high}}}")
        return f"{item}{{{low},{high if has_max else ''}}}"
    rest = _repetition(f"({separator} {item})", 0 if low == 0 else low - 1, high - 1 if has_max else high)
    result = item + " " + rest
    return f"({result})?" if low == 0 else result


def _not_strings(strings: list[str], char_rule: str) -> str:
    """A JSON string that is none of `strings` (a trie of their characters, as _not_strings)."""
    nodes: list[tuple[dict[str, int], list[bool]]] = [({}, [False])]
    for word in strings:
        current = 0
        for c in word:
            if c not in nodes[current][0]:
                nodes[current][0][c] = len(nodes)
                nodes.append(({}, [False]))
            current = nodes[current][0][c]
        nodes[current][1][0] = True
    out = ['["] ( ']

    def visit(index: int) -> None:
        children = nodes[index][0]
        for n, c in enumerate(sorted(children)):
            out.append(("" if n == 0 else " | ") + f"[{c}]")
            if nodes[children[c]][0]:
                out.append(" (")
                visit(children[c])
                out.append(")")
            else:
                out.append(f" {char_rule}+")
        if children:
            out.append(f' | [^"{"".join(sorted(children))}] {char_rule}*')

    visit(0)
    out.append(" )" + ("" if nodes[0][1][0] else "?") + ' ["]')
    return "".join(out)


class _IntRange:
    """build_min_max_int: the decimal integers from `low` to `high` (INT64_MIN / INT64_MAX: no end)."""

    def __init__(self) -> None:
        self.out: list[str] = []

    def digit_range(self, first: str, last: str) -> None:
        self.out.append(f"[{first}]" if first == last else f"[{first}-{last}]")

    def more_digits(self, low: int, high: int) -> None:
        self.out.append("[0-9]")
        if low == high == 1:
            return
        if high != low and high != INT_MAX and high < low:
            raise _Unloadable(f"{{{low},{high}}}")
        self.out.append(f"{{{low}" + ("" if high == low else "," + ("" if high == INT_MAX else str(high))) + "}")

    def uniform(self, low: str, high: str) -> None:
        """Numbers of one length from `low` to `high`, written as digit strings."""
        i = 0
        while i < len(low) and i < len(high) and low[i] == high[i]:
            i += 1
        if i > 0:
            self.out.append(f'"{low[:i]}"')
        if i >= len(low) or i >= len(high):
            return
        if i > 0:
            self.out.append(" ")
        rest = len(low) - i - 1
        if rest == 0:
            self.out.append(f"[{low[i]}-{high[i]}]")
            return
        low_rest, high_rest, zeros, nines = low[i + 1:], high[i + 1:], "0" * rest, "9" * rest
        reached = False
        self.out.append("(")
        if low_rest == zeros:
            self.digit_range(low[i], chr(ord(high[i]) - 1))
            self.out.append(" ")
            self.more_digits(rest, rest)
        else:
            self.out.append(f"[{low[i]}] (")
            self.uniform(low_rest, nines)
            self.out.append(")")
            if ord(low[i]) < ord(high[i]) - 1:
                self.out.append(" | ")
                reached = high_rest == nines
                self.digit_range(chr(ord(low[i]) + 1), high[i] if reached else chr(ord(high[i]) - 1))
                self.out.append(" ")
                self.more_digits(rest, rest)
        if not reached:
            self.out.append(" | ")
            self.digit_range(high[i], high[i])
            self.out.append(" ")
            self.uniform(zeros, high_rest)
        self.out.append(")")

    def build(self, low: int, high: int, decimals: int = 16, top: bool = True) -> None:
        has_min, has_max = low != INT64_MIN, high != INT64_MAX
        if has_min and has_max:
            self.both(low, high, decimals)
        elif has_min:
            self.at_least(low, decimals, top)
        elif has_max:
            if high >= 0:
                if top:
                    self.out.append('"-" [1-9] ')
                    self.more_digits(0, max(decimals - 1, 1))
                    self.out.append(" | ")
                self.build(0, high, decimals, True)
            else:
                self.out.append('"-" (')
                self.build(-high, INT64_MAX, decimals, False)
                self.out.append(")")

    def both(self, low: int, high: int, decimals: int) -> None:
        if low < 0 and high < 0:
            self.out.append('"-" (')
            self.build(-high, -low, decimals, True)
            self.out.append(")")
            return
        if low < 0:
            self.out.append('"-" (')
            self.build(0, -low, decimals, True)
            self.out.append(") | ")
            low = 0
        low_s, high_s = str(low), str(high)
        for digits in range(len(low_s), len(high_s)):
            self.uniform(low_s, "9" * digits)
            low_s = "1" + "0" * digits
            self.out.append(" | ")
        self.uniform(low_s, high_s)

    def at_least(self, low: int, decimals: int, top: bool) -> None:
        fewer = max(decimals - 1, 1)
        if low < 0:
            self.out.append('"-" (')
            self.build(INT64_MIN, -low, decimals, False)
            self.out.append(") | [0] | [1-9] ")
            self.more_digits(0, decimals - 1)
        elif low == 0:
            if top:
                self.out.append("[0] | [1-9] ")
                self.more_digits(0, fewer)
            else:
                self.more_digits(1, decimals)
        elif low <= 9:
            c, start = str(low), "1" if top else "0"
            if c > start:
                self.digit_range(start, chr(ord(c) - 1))
                self.out.append(" ")
                self.more_digits(1, fewer)
                self.out.append(" | ")
            self.digit_range(c, "9")
            self.out.append(" ")
            self.more_digits(0, fewer)
        else:
            s = str(low)
            if s[0] > "1":
                self.digit_range("1" if top else "0", chr(ord(s[0]) - 1))
                self.out.append(" ")
                self.more_digits(len(s), fewer)
                self.out.append(" | ")
            self.digit_range(s[0], s[0])
            self.out.append(" (")
            self.build(int(s[1:]), INT64_MAX, fewer, False)
            self.out.append(")")
            if s[0] < "9":
                self.out.append(" | ")
                self.digit_range(chr(ord(s[0]) + 1), "9")
                self.out.append(" ")
                self.more_digits(len(s) - 1, fewer)


def _int_range(low: int, high: int) -> str:
    ranges = _IntRange()
    ranges.build(low, high)
    return "(" + "".join(ranges.out) + ")"


# Regular expressions (`pattern`) as GBNF: _pattern_to_rule


class _UnsupportedPattern(Exception):
    """A regular expression GBNF cannot express here: llama.cpp accepts any string instead."""


class _InvalidPattern(Exception):
    """Not a regular expression: llama.cpp refuses the schema."""


_NON_LITERAL = frozenset("|.()[]{}*+?^$")
_ESCAPED_IN_REGEXPS_BUT_NOT_IN_LITERALS = frozenset("^$.[]()|{}*+?")
_HEX = frozenset("0123456789abcdefABCDEF")


def _gbnf_escape_length(pattern: str, pos: int) -> int:
    """How long the escape at `pos` is when GBNF reads it as the regex does (0: it does not)."""
    if pos + 1 >= len(pattern) or pattern[pos] != "\\":
        return 0
    after = pattern[pos + 1]
    if after in 'trn\\"[]-':
        return 2
    n_hex = {"x": 2, "u": 4, "U": 8}.get(after, 0)
    if not n_hex or pos + 2 + n_hex > len(pattern) or not set(pattern[pos + 2:pos + 2 + n_hex]) <= _HEX:
        return 0
    return 2 + n_hex


def _stoi(text: str) -> int:
    """std::stoi: leading space, a sign, then digits up to the first other character."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?\d+)", text)
    if not m or not -(2**31) <= int(m.group(1)) < 2**31:
        raise _UnsupportedPattern("invalid number in curly brackets")
    return int(m.group(1))


def _curly_counts(inside: str) -> tuple[int, int]:
    nums = inside.split(",")
    if len(nums) not in (1, 2):
        raise _UnsupportedPattern("wrong number of values in curly brackets")
    if len(nums) == 1:
        return _stoi(nums[0]), _stoi(nums[0])
    return (_stoi(nums[0]) if nums[0] else 0), (_stoi(nums[1]) if nums[1] else INT_MAX)


class _Pattern:
    """One `pattern` as GBNF rules, read as llama.cpp reads it: byte by byte (`text` holds the
    pattern's UTF-8 bytes, one character each), so that what it makes of a non-ASCII character
    is llama.cpp's. add_rule(name, rule) adds a rule (given as bytes the same way)."""

    def __init__(self, text: str, name: str, add_rule: Callable[[str, str], str], dot: Callable[[], str]):
        self.text, self.name, self.add_rule, self.dot = text[1:-1], name, add_rule, dot
        self.i, self.depth = 0, 0
        self.sub_rules: dict[str, str] = {}
        if len(text) < 2 or text[0] != "^" or text[-1] != "$":
            raise _UnsupportedPattern("not anchored with '^' and '$'")

    def rule(self) -> str:
        rule = self.transform()
        if self.depth != 0:
            raise _InvalidPattern("unbalanced parentheses")
        return self.add_rule(self.name, '"\\"" (' + rule + ') "\\""')

    def transform(self) -> str:
        """The sequence from here to the `)` that closes the group (or the end), as one rule."""
        seq: list[tuple[str, bool]] = []  # (text, is a literal)
        s = self.text
        while self.i < len(s):
            c = s[self.i]
            if c == ".":
                seq.append((self.dot(), False))
                self.i += 1
            elif c == "(":
                self.group(seq)
            elif c == ")":
                self.i += 1
                if self.depth == 0:
                    raise _InvalidPattern("unbalanced parentheses")
                self.depth -= 1
                return _join(seq)
            elif c in "^$":
                raise _UnsupportedPattern("anchor inside the pattern")
            elif c == "[":
                seq.append((self.char_class(), False))
            elif c == "|":
                seq.append(("|", False))
                self.i += 1
            elif c in "*+?":
                if not seq:
                    raise _InvalidPattern("nothing to repeat")
                seq[-1] = (_rule(seq[-1]) + c, False)
                self.i += 1
            elif c == "{":
                self.counted(seq)
            else:
                seq.append((self.literal(c), True))
        return _join(seq)

    def group(self, seq: list[tuple[str, bool]]) -> None:
        self.i += 1
        if self.i < len(self.text) and self.text[self.i] == "?":
            if self.i + 1 < len(self.text) and self.text[self.i + 1] == ":":
                self.i += 2  # (?:...) is a plain group
            else:
                raise _UnsupportedPattern("unsupported group syntax")
        self.depth += 1
        if self.depth > 100:
            raise _UnsupportedPattern("pattern nesting too deep")
        seq.append(("(" + self.transform() + ")", False))

    def char_class(self) -> str:
        s, out = self.text, "["
        self.i += 1
        while self.i < len(s) and s[self.i] != "]":
            if s[self.i] == "\\":
                n = _gbnf_escape_length(s, self.i)
                if n == 0:
                    raise _UnsupportedPattern("unsupported escape in character class: " + s[self.i:self.i + 2])
                out += s[self.i:self.i + n]
                self.i += n
            else:
                out += s[self.i]
                self.i += 1
        if self.i >= len(s):
            raise _InvalidPattern("unterminated character class")
        self.i += 1
        return out + "]"

    def counted(self, seq: list[tuple[str, bool]]) -> None:
        """`{m}`, `{m,}`, `{,n}`, `{m,n}` after the last item of `seq`."""
        end = self.text.find("}", self.i + 1)
        if end < 0:
            raise _UnsupportedPattern("unterminated curly brackets")
        low, high = _curly_counts(self.text[self.i + 1:end])
        self.i = end + 1
        if not seq:
            raise _InvalidPattern("nothing to repeat")
        sub, is_literal = seq[-1]
        if not is_literal:
            if sub not in self.sub_rules:
                self.sub_rules[sub] = ""
                self.sub_rules[sub] = self.add_rule(f"{self.name}-{len(self.sub_rules)}", sub)
            sub = self.sub_rules[sub]
        seq[-1] = (_repetition(f'"{sub}"' if is_literal else sub, low, high), False)

    def literal(self, c: str) -> str:
        """The characters from here that stand for themselves (the last one alone when a quantifier follows)."""
        s, out = self.text, ""
        while self.i < len(s):
            i = self.i
            if s[i] == "\\":
                if i == len(s) - 1:
                    raise _InvalidPattern("trailing backslash")
                n = 2 if s[i + 1] in _ESCAPED_IN_REGEXPS_BUT_NOT_IN_LITERALS else _gbnf_escape_length(s, i)
                if n == 0:
                    raise _UnsupportedPattern("unsupported escape: " + s[i:i + 2])
                out += s[i + 1] if s[i + 1] in _ESCAPED_IN_REGEXPS_BUT_NOT_IN_LITERALS else s[i:i + n]
                self.i += n
            elif s[i] == '"':
                out += '\\"'
                self.i += 1
            elif s[i] not in _NON_LITERAL and (i == len(s) - 1 or not out or s[i + 1] == "."
                                              or s[i + 1] not in _NON_LITERAL):
                out += s[i]
                self.i += 1
            else:
                break
        if not out:  # nothing taken: a stray ']' or '}'
            raise _UnsupportedPattern("unsupported character: " + c)
        return out


def _rule(item: tuple[str, bool]) -> str:
    return f'"{item[0]}"' if item[1] else item[0]


def _join(seq: list[tuple[str, bool]]) -> str:
    """The items of a sequence, consecutive literals merged into one."""
    out: list[str] = []
    literal = ""
    for text, is_literal in seq:
        if is_literal:
            literal += text
            continue
        if literal:
            out.append(f'"{literal}"')
            literal = ""
        out.append(text)
    if literal:
        out.append(f'"{literal}"')
    return " ".join(out)


def _as_bytes(text: str) -> str:
    """`text`'s UTF-8 bytes, one character each (how llama.cpp's converter reads a pattern)."""
    return text.encode("utf-8").decode("latin-1")


def _from_bytes(text: str) -> str:
    return text.encode("latin-1").decode("utf-8")


# The nodes as GBNF rules (json-schema-to-grammar.cpp's common_chat_schema_converter)


class _Converter:
    """Rules named and shared as llama.cpp's converter names them; grammar() writes them sorted."""

    def __init__(self, refs: dict[str, _Node | None], warn: Callable[[str], None] | None):
        self.refs, self.warn = refs, warn
        self.ref_prefix = ""  # SharedRules: the schema's own `$ref` rules
        self.rules = {"space": SPACE_RULE}
        self.resolving: set[str] = set()

    def grammar(self) -> str:
        text = "".join(f"{name} ::= {self.rules[name]}\n" for name in sorted(self.rules))
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _fail("#", f"a string holds {text[e.start]!r}, a lone surrogate: not Unicode") from None
        return text

    def add_rule(self, name: str, rule: str) -> str:
        name = _INVALID_RULE_CHARS.sub("-", name)
        key, i = name, 0
        while key in self.rules and self.rules[key] != rule:
            key, i = f"{name}{i}", i + 1
        self.rules[key] = rule
        return key

    def primitive(self, name: str, builtin: tuple[str, tuple[str, ...]]) -> str:
        added = self.add_rule(name, builtin[0])
        for dep in builtin[1]:
            if dep not in self.rules:
                self.primitive(dep, PRIMITIVE_RULES.get(dep) or STRING_FORMAT_RULES[dep])
        return added

    def visit(self, node: _Node, name: str) -> str:
        """The rule that matches `node`, named after `name` ("": the root)."""
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        sub = name + "-" if name else ""
        kind = node.kind
        if kind == "ref":
            return self.add_rule(rule_name, self.resolve_ref(node))
        if kind == "anyOf":
            alternatives = [self.visit(c, f"{name or 'alternative'}-{i}") for i, c in enumerate(node.children)]
            return self.add_rule(rule_name, " | ".join(alternatives))
        if kind == "allOf":
            return _all_of(self, node, name, rule_name)
        if kind == "const":
            return self.add_rule(rule_name, _format_literal(_dump(node.value)))
        if kind == "enum":
            return self.add_rule(rule_name, "(" + " | ".join(_format_literal(_dump(v)) for v in node.values) + ")")
        if kind == "object":
            if not node.properties and node.additional is not None and node.additional.kind == "any":
                return self.add_rule(rule_name, self.primitive("object", PRIMITIVE_RULES["object"]))
            required = {n for n, _, is_required in node.properties if is_required}
            properties = [(n, schema) for n, schema, _ in node.properties]
            return self.add_rule(rule_name, _object_rule(self, properties, required, name, node.additional))
        if kind == "tuple":
            items = [self.visit(item, f"{sub}tuple-{i}") for i, item in enumerate(node.children)]
            return self.add_rule(rule_name, '"[" space ' + ' "," space '.join(items) + ' space "]"')
        if kind == "array":
            return self.array(node, sub, rule_name)
        if kind == "string":
            return self.string(node, rule_name)
        if kind == "integer":
            return self.integer(node, rule_name)
        if kind == "any":
            return self.add_rule(rule_name, self.primitive("value", PRIMITIVE_RULES["value"]))
        return self.visit_primitive(rule_name, kind)  # number, boolean, null

    def visit_primitive(self, rule_name: str, kind: str) -> str:
        return self.primitive("root" if rule_name == "root" else kind, PRIMITIVE_RULES[kind])

    def resolve_ref(self, node: _Node) -> str:
        ref = node.ref
        name = self.ref_prefix + "ref" + _INVALID_RULE_CHARS.sub("-", ref[ref.find("#") + 1:])
        key = self.ref_prefix + ref
        if name not in self.rules and key not in self.resolving:
            self.resolving.add(key)
            name = self.visit(self.refs[ref], name)
            self.resolving.discard(key)
        return name

    def array(self, node: _Node, sub: str, rule_name: str) -> str:
        if node.items.kind == "any" and node.min_count == 0 and node.max_count < 0:
            return self.visit_primitive(rule_name, "array")
        item = self.visit(node.items, sub + "item")
        high = INT_MAX if node.max_count < 0 else node.max_count
        try:
            items = _repetition(item, node.min_count, high, '"," space')
        except _Unloadable:
            raise _max_below_min(node, "Items") from None
        return self.add_rule(rule_name, '"[" space ' + items + ' space "]"')

    def string(self, node: _Node, rule_name: str) -> str:
        if node.pattern:
            return self.pattern(node, rule_name)
        if node.format == "uuid":
            return self.visit_primitive(rule_name, "uuid")
        if node.format:
            builtin = f"{node.format}-string"
            return self.add_rule(rule_name, self.primitive(builtin, STRING_FORMAT_RULES[builtin]))
        if node.min_count > 0 or node.max_count >= 0:
            char = self.primitive("char", PRIMITIVE_RULES["char"])
            high = INT_MAX if node.max_count < 0 else node.max_count
            try:
                chars = _repetition(char, node.min_count, high)
            except _Unloadable:
                raise _max_below_min(node, "Length") from None
            return self.add_rule(rule_name, '"\\"" ' + chars + ' "\\""')
        return self.visit_primitive(rule_name, "string")

    def integer(self, node: _Node, rule_name: str) -> str:
        if node.minimum == INT64_MIN and node.maximum == INT64_MAX:
            return self.visit_primitive(rule_name, "integer")
        try:
            return self.add_rule(rule_name, _int_range(node.minimum, node.maximum))
        except _Unloadable as e:
            bound = "minimum" if node.minimum != INT64_MIN else "maximum"
            raise _fail(_pointer(node.path, bound), f"llama.cpp writes the repetition {e} for this bound, "
                                                    "which its grammar parser cannot load") from None

    def pattern(self, node: _Node, rule_name: str) -> str:
        where, snapshot = _pointer(node.path, "pattern"), dict(self.rules)
        try:
            text = _as_bytes(node.pattern)
        except UnicodeError:
            raise _fail(where, f"pattern {node.pattern!r} holds a lone surrogate: not Unicode") from None
        try:
            return _Pattern(text, rule_name, lambda n, r: self.add_rule(n, _from_bytes(r)),
                            lambda: self.add_rule("dot", "[^\\x0A\\x0D]")).rule()
        except _UnsupportedPattern as e:
            self.rules = snapshot
            if self.warn:
                self.warn(_one_line(f"json schema at {where}: pattern {node.pattern} is not supported "
                                    f"({_from_bytes(str(e))}), accepting any string"))
            return self.add_rule(rule_name, self.primitive("string", PRIMITIVE_RULES["string"]))
        except _InvalidPattern as e:
            raise _fail(where, f"invalid pattern {node.pattern}: {_from_bytes(str(e))}") from None
        except _Unloadable as e:
            raise _fail(where, f"pattern {node.pattern}: llama.cpp writes the repetition {e} for it, which its "
                               "grammar parser cannot load") from None
        except UnicodeError:
            raise _fail(where, f"pattern {node.pattern}: a non-ASCII character right before a quantifier, which "
                               "llama.cpp's converter splits into bytes, repeating the last alone (a grammar it cannot "
                               "load); put the character in a group, as in (é)+") from None


def _max_below_min(node: _Node, what: str) -> GrammarError:
    """maxItems below minItems, maxLength below minLength: llama.cpp writes `x{5,2}`, which its
    grammar parser cannot load (it loops)."""
    return _fail(_pointer(node.path, f"max{what}"), f"max{what} {node.max_count} is below min{what} {node.min_count} "
                                                    "(llama.cpp cannot load the grammar it writes for it)")


def _object_rule(conv: _Converter, properties: list[tuple[str, _Node]], required: set[str], name: str,
                 additional: _Node | None) -> str:
    """_build_object_rule: the required properties in schema order, then any of the optional
    ones in schema order, then (`additional` not None) other keys, each with its own rule."""
    prefix = name + "-" if name else ""
    required_props, optional_props, names = [], [], []
    kv: dict[str, str] = {}
    for prop, schema in properties:
        value = conv.visit(schema, prefix + prop)
        kv[prop] = conv.add_rule(f"{prefix}{prop}-kv", _format_literal(_dump(prop)) + ' space ":" space ' + value)
        (required_props if prop in required else optional_props).append(prop)
        names.append(prop)
    if additional is not None:
        value = (conv.visit(additional, f"{prefix}additional-value") if additional.kind != "any"
                 else conv.primitive("value", PRIMITIVE_RULES["value"]))
        if names:
            char = conv.primitive("char", PRIMITIVE_RULES["char"])
            key = conv.add_rule(f"{prefix}additional-k", _not_strings(names, char))
        else:
            key = conv.primitive("string", PRIMITIVE_RULES["string"])
        kv["*"] = conv.add_rule(f"{prefix}additional-kv", key + ' ":" space ' + value)
        optional_props.append("*")
    if not required_props and not optional_props:
        return '"{" space "}"'
    rule = '"{" space ' + ' "," space '.join(kv[k] for k in required_props)
    if optional_props:
        rule += " (" + (' "," space ( ' if required_props else "")

        def rest(keys: list[str], first_is_optional: bool) -> str:
            k = keys[0]
            comma = f'( "," space {kv[k]} )'
            if first_is_optional:
                out = comma + ("*" if k == "*" else "?")
            else:
                out = kv[k] + (" " + comma + "*" if k == "*" else "")
            if len(keys) > 1:
                out += " " + conv.add_rule(f"{prefix}{k}-rest", rest(keys[1:], True))
            return out

        rule += " | ".join(rest(optional_props[i:], False) for i in range(len(optional_props)))
        rule += (" )" if required_props else "") + " )?"
    return rule + ' space "}"'


def _all_of(conv: _Converter, node: _Node, name: str, rule_name: str) -> str:
    """allOf: the enum values every part admits, else one object of all the parts' properties
    (those of anyOf parts optional, the rest required; other parts add nothing)."""
    required: set[str] = set()
    properties: list[tuple[str, _Node]] = []
    enum_values: dict[str, int] = {}

    def add(part: _Node, is_required: bool, seen: frozenset = frozenset()) -> None:
        if part.kind == "ref":
            if part.ref in seen:  # llama.cpp recurses without end
                raise _fail(_pointer(part.path, "$ref"),
                            f"$ref {part.ref} refers to itself with no schema in between")
            if conv.refs.get(part.ref) is not None:
                add(conv.refs[part.ref], is_required, seen | {part.ref})
        elif part.kind == "object":
            for prop, schema, _ in part.properties:
                properties.append((prop, schema))
                if is_required:
                    required.add(prop)
        elif part.kind == "enum":
            for value in part.values:
                literal = _format_literal(_dump(value))
                enum_values[literal] = enum_values.get(literal, 0) + 1

    for child in node.children:
        for part in child.children if child.kind == "anyOf" else [child]:
            add(part, child.kind != "anyOf")
    common = [v for v in sorted(enum_values) if enum_values[v] == len(node.children)]
    if common:
        return conv.add_rule(rule_name, "(" + " | ".join(common) + ")")
    return conv.add_rule(rule_name, _object_rule(conv, properties, required, name, None))
