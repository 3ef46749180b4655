"""Llama 3.1, 3.2 and 3.3's tool calls: the answer is a JSON object, optionally after
<|python_tag|>, with the OpenAI wrapper's "type" first where the model writes it:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    {"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}

The pinned llama.cpp reads these templates with its differential autoparser (JSON_NATIVE calls
with no marker, keys "name" then "parameters", and the template's 'Respond in the format
{"name": function name, ...}' instruction adds the wrapper's "type"). It has no grammar for
tool_choice "auto" (no marker to trigger on); here the grammar is lazy from a call's opening at
the start of the answer (a pattern), or from <|python_tag|>. The older built-in tools'
`<|python_tag|>name.call(...)` form is not read (nor does the pinned llama.cpp read it): that
text stays content.
"""

from __future__ import annotations

from speculative.chat.format import Format, Syntax, ToolGrammar
from speculative.chat.formats._common import (Incomplete, Reader, Rules, alternatives, finish,
                                              json_call_rule, parse_message, read_json_call, repeated,
                                              selected)
from speculative.chat.message import ChatMessage, ToolCall

PYTHON_TAG = "<|python_tag|>"
# the grammar applies from a call's opening at the start of the answer (or from the tag)
CALL_PATTERN = r'^\s*(<\|python_tag\|>|\{\s*"(?:type|name)")[\s\S]*$'


class Llama3(Format):
    name = "llama3"
    think = None

    @classmethod
    def matches(cls, source: str) -> bool:
        # the header tokens, and the call's JSON as the template writes it back
        return "<|start_header_id|>" in source and '"parameters": ' in source

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        names = set(syntax.parameters) if syntax.parameters is not None else None
        return parse_message(text, partial, syntax, None, (PYTHON_TAG, "{"), lambda r: _read_call(r, names))

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        chosen = selected(tools, choice)
        if chosen is None:
            return None
        rules = Rules()
        wrapper = '("\\"type\\"" space ":" space "\\"function\\"" space "," space)?'
        bodies = [json_call_rule(rules, t, [("name", "NAME"), ("parameters", 'ARGS')], wrapper) for t in chosen]
        call = rules.add("tool-call", alternatives(bodies))
        calls = repeated(call, parallel, separator='space "," space')
        root = f'"{PYTHON_TAG}"? space {calls}'
        return finish(rules, root, choice, (), (CALL_PATTERN,))


def _read_call(reader: Reader, names: set[str] | None) -> tuple[ToolCall | None, bool]:
    """[<|python_tag|>] {"type": "function", "name": ..., "parameters": {...}} [,]."""
    try:
        if reader.literal(PYTHON_TAG):
            reader.space()
    except Incomplete:
        return None, False
    found = read_json_call(reader, "name", "parameters", type_field=True, names=names)
    if not found.name:
        return None, False
    if found.complete:
        reader.space()
        if reader.rest[:1] in (",", ";"):  # several calls
            reader.pos += 1
    return found.tool_call(), found.complete


FORMAT = Llama3
