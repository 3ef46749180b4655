"""What every family's format needs, as the pinned llama.cpp's PEG chat parsers read and
constrain a model's text (common/chat-peg-parser.cpp, common/peg-parser.cpp,
common/chat-auto-parser-generator.cpp):

Reading (parse):
  parse_message(text, partial, syntax, think, markers, read_call)   the common reading: the
                    reasoning, then content up to each call's marker and the calls
  split_reasoning(text, partial, syntax, think) -> (reasoning, rest)
  split_calls(text, partial, markers, read_call) -> (content, calls)
  Reader            a cursor over the text: literals, whitespace, text up to a marker, JSON values
  Incomplete        raised where the text ends inside what is being read (a partial answer)
  NotJson           a ValueError where the text stops being JSON (with the value's text so far)
  read_json_call    a call written as a JSON object ({"name": ..., "arguments": {...}} and kin)
  call(name, args, complete)     a ToolCall whose arguments are reported as llama.cpp reports them
  held_back(text, markers)       how much of the end of a partial text may start a marker

  llama.cpp's parsers are lenient: where the text ends inside a marker, a JSON value or a tag,
  what is read so far is kept and the rest waits. A marker's prefix at the end of the content is
  held back (not content yet), a call appears once its name is complete (its arguments "{" until
  they start), and its arguments are the JSON text as the model wrote it so far (trailing
  whitespace and an unfinished escape held back), so each later parse extends the earlier one.
  A complete call's arguments are the JSON as written ({"arg1": 1} stays so, not compacted).
  A call, once shown, stays: where its text goes wrong later, it is kept as read.

Constraining (grammar):
  selected(tools, choice)        the tools a request's tool_choice allows (None: no grammar)
  Rules                          one grammar's rules: each tool's arguments from its JSON schema
                                 (tool-NAME-schema, or one argument's, tool-NAME-arg-KEY-schema,
                                 as llama.cpp names them) and the family's own
  json_call_rule, until_including, alternatives, repeated   pieces of a family's rules
  finish(rules, root, choice, triggers)   the ToolGrammar, checked, lazy from the family's
                                 trigger words (word_pattern) for tool_choice "auto"
  properties(tool), function_name(tool), tool_parameters(tool)   a tool's parts
Bad input: a tool whose parameters are no schema llama.cpp reads raises GrammarError, one line
naming the tool.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Iterable

from speculative.chat.format import Syntax, ToolGrammar
from speculative.chat.message import ChatMessage, ToolCall
from speculative.errors import GrammarError
from speculative.grammar import gbnf
from speculative.grammar.json_schema import Property, SharedRules, format_literal, object_properties

__all__ = ["Incomplete", "JsonCall", "NotJson", "Reader", "Rules", "alternatives", "call", "finish",
           "format_literal", "function_name", "held_back", "json_call_rule", "parse_message", "properties",
           "read_json_call", "repeated", "selected", "split_calls", "split_reasoning", "tool_parameters",
           "until_including", "word_pattern"]

SPACE = " \t\n\r"  # what llama.cpp's space() parser and the `space` rule's reading skip


# ---- reading ------------------------------------------------------------------------------

class Incomplete(Exception):
    """The text ends inside what was being read. `text`: what of it is reported so far (a JSON
    value's prefix), where that means something."""

    def __init__(self, text: str = ""):
        super().__init__(text)
        self.text = text


class NotJson(ValueError):
    """The text is not JSON from `pos` on (an index into the text read)."""

    def __init__(self, pos: int, detail: str):
        super().__init__(detail)
        self.pos = pos
        self.text = ""  # Reader.json_value: the value's text before the fault


def held_back(text: str, markers: tuple[str, ...] | list[str]) -> int:
    """How many characters at the end of `text` may be the start of one of `markers` (a proper
    prefix of it): what a partial answer holds back instead of streaming it as content."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def split_reasoning(text: str, partial: bool, syntax: Syntax, think: tuple[str, str] | None,
                    also_ends: tuple[str, ...] = ()) -> tuple[str, str]:
    """The reasoning at the start of `text` and the text after it, as llama.cpp's reasoning
    parser splits them: optional(<think> reasoning until </think>) at the start, or from the
    first character where the prompt opened the block (syntax.thinking_open). With
    reasoning_format `none` (or no thinking block) the reasoning stays in the text. An unclosed
    block is all reasoning (as llama.cpp reads it, complete or not); a partial closing tag at
    the end is held back. Whitespace around the reasoning and before the rest is dropped
    (whitespace-only reasoning is none, as llama.cpp's mapper drops it). `also_ends`: markers
    that end the reasoning too but belong to the rest (Qwen3.5's <tool_call>). With `none` and a
    block the prompt opened, the text keeps the opening tag the prompt wrote (and its newline)."""
    if think is None or not syntax.extract_reasoning:
        if think is not None and syntax.thinking_open:
            return "", think[0] + "\n" + text
        return "", text
    opening, closing = think
    start = 0
    if not syntax.thinking_open:
        lead = len(text) - len(text.lstrip(SPACE))
        if text.startswith(opening, lead):
            start = lead + len(opening)
        elif partial and opening.startswith(text[lead:]):
            return "", ""  # may still become the opening tag
        else:
            return "", text
    reader = Reader(text, start)
    reasoning, marker = reader.until((closing, *also_ends), partial)
    if marker is None:  # trailing whitespace waits: it may come before the closing tag
        return reasoning.strip(SPACE), ""
    after = reader.pos + (len(closing) if marker == closing else 0)
    return reasoning.strip(SPACE), text[after:].lstrip(SPACE)


def call(name: str, arguments: str, complete: bool, id: str = "") -> ToolCall:
    """A tool call as llama.cpp's mapper reports it: arguments "{" until their JSON starts, then
    the JSON written so far; complete, unclosed braces closed (a call closed by its marker)."""
    if not arguments:
        arguments = "{"
    if complete:
        arguments += "}" * _open_braces(arguments)
    return ToolCall(name, arguments, id)


def _open_braces(text: str) -> int:
    """The braces of a JSON text left open (outside strings), as json_brace_depth counts."""
    depth, in_string, escaped = 0, False, False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\" and in_string:
            escaped = True
        elif c == '"':
            in_string = not in_string
        elif not in_string:
            depth += {"{": 1, "}": -1}.get(c, 0)
    return max(depth, 0)


class Reader:
    """A cursor over a model's text, reading as llama.cpp's lenient PEG parser does: where the
    text ends inside what is read, Incomplete is raised (the caller keeps what it has)."""

    def __init__(self, text: str, pos: int = 0):
        self.text, self.pos = text, pos

    @property
    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    @property
    def rest(self) -> str:
        return self.text[self.pos:]

    def space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in SPACE:
            self.pos += 1

    def literal(self, word: str) -> bool:
        """Read `word` if it is next: True; False where something else is; Incomplete where the
        text ends inside it (or before it)."""
        rest = self.text[self.pos:self.pos + len(word)]
        if rest == word:
            self.pos += len(word)
            return True
        if word.startswith(rest) and self.pos + len(rest) == len(self.text):
            raise Incomplete()
        return False

    def until(self, markers: tuple[str, ...] | list[str], partial: bool) -> tuple[str, str | None]:
        """The text up to the first of `markers` (the cursor stays before it) and that marker;
        None where no marker follows: then all the rest, less a marker's prefix at the end when
        `partial` (held back)."""
        found = [(i, m) for m in markers if (i := self.text.find(m, self.pos)) >= 0]
        if found:
            end, marker = min(found, key=lambda f: (f[0], -len(f[1])))
        else:
            end, marker = len(self.text), None
            if partial:
                end -= held_back(self.text[self.pos:], markers)
        piece, self.pos = self.text[self.pos:end], end
        return piece, marker

    def json_value(self) -> str:
        """The JSON value next, as written; Incomplete(prefix written so far, less trailing
        whitespace and an unfinished escape) where the text ends inside it; NotJson (its
        `text`: the value's text before the fault) where the text is not JSON."""
        start = self.pos
        try:
            self.pos = _value_end(self.text, start)
        except Incomplete as e:
            raise Incomplete(self.text[start:e.args[0]].rstrip(SPACE)) from None
        except NotJson as e:
            e.text = self.text[start:e.pos].rstrip(SPACE)
            raise
        return self.text[start:self.pos]

    def json_string(self) -> str:
        """A JSON string next, decoded (Incomplete where it is unfinished; ValueError: none)."""
        if self.pos < len(self.text) and self.text[self.pos] != '"':
            raise ValueError("not a JSON string")
        return json.loads(self.json_value())


_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_ESCAPE = re.compile(r'\\(["\\/bfnrt]|u[0-9a-fA-F]{4})')
_UNFINISHED_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{0,3})?")  # at the end of the text


def _value_end(text: str, pos: int) -> int:
    """Where the JSON value at `pos` ends; Incomplete(where what is kept ends) at the text's end,
    NotJson where it is not JSON."""
    if pos >= len(text):
        raise Incomplete(pos)
    c = text[pos]
    if c == "{":
        return _container_end(text, pos, "}", True)
    if c == "[":
        return _container_end(text, pos, "]", False)
    if c == '"':
        return _string_end(text, pos)
    for word in ("true", "false", "null"):
        if text.startswith(word, pos):
            return pos + len(word)
        if len(text) - pos < len(word) and word.startswith(text[pos:]):
            raise Incomplete(len(text))
    m = _NUMBER.match(text, pos)
    if not m:
        if text[pos:] in ("-",):
            raise Incomplete(len(text))
        raise NotJson(pos, f"not JSON at {text[pos:pos + 20]!r}")
    if m.end() == len(text) or text[m.end() - 1] in ".eE+-":
        raise Incomplete(len(text))  # the number may go on
    return m.end()


def _string_end(text: str, pos: int) -> int:
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == '"':
            return i + 1
        if c == "\\":
            escape = _ESCAPE.match(text, i)
            if not escape:
                if _UNFINISHED_ESCAPE.fullmatch(text, i):
                    raise Incomplete(i)  # the escape is unfinished: held back
                raise NotJson(i, f"bad escape at {text[i:i + 6]!r}")
            i = escape.end()
        elif c < " ":
            raise NotJson(i, "control character in a JSON string")
        else:
            i += 1
    raise Incomplete(len(text))


def _container_end(text: str, pos: int, close: str, keyed: bool) -> int:
    i, first = _skip(text, pos + 1), True
    while True:
        if i >= len(text):
            raise Incomplete(len(text))
        if text[i] == close:
            return i + 1
        if not first:
            if text[i] != ",":
                raise NotJson(i, f"expected ',' or {close!r} at {text[i:i + 20]!r}")
            i = _skip(text, i + 1)
        if keyed:
            if i < len(text) and text[i] != '"':
                raise NotJson(i, f"expected a key at {text[i:i + 20]!r}")
            i = _skip(text, _string_end(text, i))
            if i >= len(text):
                raise Incomplete(len(text))
            if text[i] != ":":
                raise NotJson(i, f"expected ':' at {text[i:i + 20]!r}")
            i = _skip(text, i + 1)
        i = _skip(text, _value_end(text, i))
        first = False


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in SPACE:
        i += 1
    return i


ReadCall = Callable[[Reader], "tuple[ToolCall | list[ToolCall] | None, bool]"]


def split_calls(text: str, partial: bool, markers: tuple[str, ...],
                read_call: ReadCall) -> tuple[str, list[ToolCall]]:
    """The content and the calls in `text`: content up to a call's marker (one of `markers`),
    then calls, each read by `read_call` at its marker: (the call, or the calls one marker
    opens (a block: Granite's list, DeepSeek's section), or None while the first name is
    unfinished; whether it is complete), ValueError
    where the marker opens no call (the marker is content then). Text between and after calls
    is content (less the whitespace around calls); reading stops at a call left incomplete. A
    marker's or an unnamed call's start at the end of a partial text is held back."""
    reader, content, calls = Reader(text), "", []
    while True:
        piece, marker = reader.until(markers, partial)
        content += piece.lstrip(SPACE) if calls else piece
        if marker is None:
            return content, calls
        start = reader.pos
        try:
            found, complete = read_call(reader)
        except ValueError:
            reader.pos = start + len(marker)
            content += marker
            continue
        if not found and not complete:  # nothing named yet (a block that closed empty reads on)
            return content + ("" if partial else text[start:]), calls
        calls.extend(found if isinstance(found, list) else [found])
        if not complete:
            return content, calls
        reader.space()


def parse_message(text: str, partial: bool, syntax: Syntax, think: tuple[str, str] | None,
                  markers: tuple[str, ...], read_call: ReadCall, also_ends: tuple[str, ...] = ()) -> ChatMessage:
    """A family's message, read the common way: the reasoning (split_reasoning), then, where the
    request has tools, content and calls (split_calls); without tools, all the rest is content."""
    reasoning, rest = split_reasoning(text, partial, syntax, think, also_ends)
    if not syntax.tools:
        return ChatMessage(content=rest, reasoning_content=reasoning)
    content, calls = split_calls(rest, partial, markers, read_call)
    return ChatMessage(content=content, reasoning_content=reasoning, tool_calls=calls)


@dataclass
class JsonCall:
    """A call read from a JSON object ({"name": ..., "arguments": {...}} and its kin): its name
    once complete, its arguments' JSON so far, its id, whether the object closed."""
    name: str = ""
    arguments: str = ""
    id: str = ""
    complete: bool = False

    def tool_call(self) -> ToolCall:
        return call(self.name, self.arguments, self.complete, self.id)


def read_json_call(reader: Reader, name_key: str, args_key: str, id_key: str = "",
                   type_field: bool = False, names: Iterable[str] | None = None) -> JsonCall:
    """The call in the JSON object at the reader: `name_key` (a string; one of `names` where
    given), `args_key` (an object), `id_key` (a string or a number, optional) and, with
    `type_field`, "type": "function" (the OpenAI wrapper), in any order. Where the text ends
    inside the object, what is read so far (complete False); ValueError where the object is not
    such a call (a named call that goes wrong later stays, as read)."""
    found = JsonCall()
    try:
        if not reader.literal("{"):
            raise ValueError("not a JSON object")
        reader.space()
        first = True
        while not reader.literal("}"):
            if not first and not reader.literal(","):
                raise ValueError("expected ',' in the call object")
            reader.space()
            key = reader.json_string()
            reader.space()
            if not reader.literal(":"):
                raise ValueError("expected ':' in the call object")
            reader.space()
            _read_call_field(reader, found, key, (name_key, args_key, id_key, "type" if type_field else ""))
            if names is not None and key == name_key and found.name not in names:
                unknown, found.name = found.name, ""  # not a call: its text is content
                raise ValueError(f"{unknown!r} is not a tool of the request")
            reader.space()
            first = False
        found.complete = True
    except Incomplete:
        pass
    except ValueError:
        if not found.name:
            raise
        return found  # a named call stays (as read): a stream has shown it already
    if found.complete and not found.name:
        raise ValueError("a call without a name")
    return found


def _read_call_field(reader: Reader, found: JsonCall, key: str, keys: tuple[str, str, str, str]) -> None:
    name_key, args_key, id_key, type_key = keys
    if key == name_key:
        found.name = reader.json_string()
    elif key == args_key:
        if reader.rest[:1] not in ("{", ""):
            raise ValueError("the arguments are not a JSON object")
        try:
            found.arguments = reader.json_value()
        except (Incomplete, NotJson) as e:
            found.arguments = e.text
            raise
    elif key and key == id_key:
        value = json.loads(reader.json_value())
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ValueError("the call's id is not a string or a number")
        found.id = str(value)
    elif key and key == type_key:
        if reader.json_string() != "function":
            raise ValueError('"type" of a call is not "function"')
    else:
        raise ValueError(f"unexpected key {key!r} in the call object")


# ---- constraining -------------------------------------------------------------------------

def function_name(tool: dict) -> str:
    """The name of an OpenAI tool ({"type": "function", "function": {"name": ...}})."""
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise GrammarError(f"a tool without a function name: {json.dumps(tool)[:200]}")
    return name


def tool_parameters(tool: dict) -> object:
    """The JSON schema of a tool's arguments; none, null or {} is an object without properties
    (common_chat_tool_parameters)."""
    params = tool["function"].get("parameters")
    if params is None or params == {}:
        return {"type": "object", "properties": {}}
    return params


def properties(tool: dict) -> list[Property]:
    """The properties of `tool`'s parameters (GrammarError naming the tool for a schema that
    cannot constrain)."""
    try:
        return object_properties(tool_parameters(tool))
    except GrammarError as e:
        raise GrammarError(f"tool {function_name(tool)!r}: parameters: {e}") from None


def selected(tools: list[dict], choice: str | dict) -> list[dict] | None:
    """The tools `choice` allows: all ("auto", "required"), the named one, or None ("none", or
    no tools: no grammar). GrammarError for a choice that names no tool of the request."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        chosen = [t for t in tools if function_name(t) == wanted]
        if not chosen:
            raise GrammarError(f"tool_choice names function {wanted!r}, which is not among the tools")
        return chosen
    if choice not in ("auto", "required"):
        raise GrammarError(f"tool_choice {choice!r}: expected auto, none, required or a function")
    return list(tools)


class Rules:
    """One grammar's rules: the family's own and each tool's arguments, named as llama.cpp's
    build_grammar names them (tool-NAME-schema for a tool's parameters)."""

    def __init__(self):
        self._shared = SharedRules()

    def arguments(self, tool: dict) -> str:
        """The rule of `tool`'s arguments (its parameters' JSON schema); GrammarError naming the
        tool where the schema cannot constrain."""
        name = function_name(tool)
        try:
            return self._shared.add_schema(f"tool-{name}-schema", tool_parameters(tool))
        except GrammarError as e:
            raise GrammarError(f"tool {name!r}: parameters: {e}") from None

    def argument(self, tool: dict, key: str) -> str:
        """The rule of one argument of `tool` (its property `key`'s schema, its $refs resolved
        in the tool's parameters), named tool-NAME-arg-KEY-schema as llama.cpp names it."""
        name = function_name(tool)
        try:
            return self._shared.add_schema(f"tool-{name}-arg-{key}-schema", tool_parameters(tool), key)
        except GrammarError as e:
            raise GrammarError(f"tool {name!r}: parameters: {e}") from None

    def add(self, name: str, body: str) -> str:
        """Rule `name` ::= `body`; the name it got (a number added where taken)."""
        return self._shared.add_rule(name, body)

    def gbnf(self) -> str:
        return self._shared.grammar()


def alternatives(names: list[str]) -> str:
    """`a | b | c`: one of the rules `names`."""
    return " | ".join(names)


def repeated(item: str, parallel: bool, separator: str = "space") -> str:
    """One `item` (a rule name), or with `parallel` one or more, `separator` between them."""
    return f"{item} ({separator} {item})*" if parallel else item


def json_call_rule(rules: Rules, tool: dict, fields: list[tuple[str, str]], prefix: str = "",
                   suffix: str = "") -> str:
    """The rule `tool-NAME` of a JSON call object whose fields are `fields` ((key, rule) in
    order; the rule "NAME" stands for the tool's name as a JSON string, "ARGS" for its
    arguments), after `prefix` and before `suffix` (GBNF: optional fields around them), spaced
    as llama.cpp's standard_json_tools writes them."""
    name = function_name(tool)
    parts = []
    for key, rule in fields:
        value = {"NAME": format_literal(json.dumps(name, ensure_ascii=False)),
                 "ARGS": rules.arguments(tool)}.get(rule, rule)
        parts.append(f"{format_literal(json.dumps(key))} space \":\" space {value}")
    opening = '"{" space ' + (f"{prefix} " if prefix else "")
    closing = (f" {suffix}" if suffix else "") + ' space "}"'
    return rules.add(f"tool-{name}", opening + ' space "," space '.join(parts) + closing)


def until_including(rules: Rules, name: str, delimiter: str) -> str:
    """The rule `name`: any text up to and including the first `delimiter` (llama.cpp's
    gbnf_including_grammar: the delimiter's matching automaton, one rule per state)."""
    alphabet = sorted(set(delimiter))

    def next_state(state: int, c: str) -> int:
        seen = delimiter[:state] + c
        for n in range(len(seen), 0, -1):
            if delimiter.startswith(seen[-n:]):
                return n
        return 0

    def state_name(state: int) -> str:
        return name if state == 0 else f"{name}-{state:02d}"

    for state in range(len(delimiter)):
        completing, buckets, specific = [], {}, []
        for c in alphabet:
            to = next_state(state, c)
            if to == len(delimiter):
                completing.append(c)
            elif to:
                buckets.setdefault(to, []).append(c)
            else:
                continue
            specific.append(c)
        alts = [_char_class(completing)] if completing else []
        alts += [f"{_char_class(chars)} {state_name(to)}" for to, chars in sorted(buckets.items())]
        alts.append(f"{_char_class(specific, negated=True)} {state_name(0)}")
        rules.add(state_name(state), " | ".join(alts))
    return state_name(0)


def _char_class(chars: list[str], negated: bool = False) -> str:
    escaped = "".join({"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c, "\\" + c if c in "-]^[\\" else c)
                      for c in chars)
    return f"[{'^' if negated else ''}{escaped}]"


def finish(rules: Rules, root: str, choice: str | dict, triggers: tuple[str, ...],
           patterns: tuple[str, ...] = ()) -> ToolGrammar:
    """The ToolGrammar with root rule `root` (a body); lazy from `triggers` (words, the text
    that opens a call) and `patterns` (regular expressions, as ToolGrammar takes them) for
    choice "auto", from the first token otherwise. The grammar is checked
    (speculative.grammar.gbnf.check): a family's bug shows here, not in the sampler."""
    rules.add("root", root)
    text = rules.gbnf()
    gbnf.check(text)
    lazy = tuple(word_pattern(w) for w in triggers) + patterns if choice == "auto" else ()
    return ToolGrammar(text, lazy)


_REGEX_SPECIAL = set("\\^$.|?*+()[]{}/")


def word_pattern(word: str) -> str:
    """A regular expression matching `word` literally, the same in Python's re and C++
    std::regex ECMAScript (only the characters special to either escaped; newline, tab and
    carriage return as \\n, \\t, \\r)."""
    out = []
    for c in word:
        if c in _REGEX_SPECIAL:
            out.append("\\" + c)
        else:
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c, c))
    return "".join(out)
