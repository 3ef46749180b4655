"""The chat formats of hermes, qwen3_coder, llama3, mistral and generic against the pinned
llama.cpp's tests/test-chat.cpp: its cases for these templates, ported as data (input, tools,
reasoning format, whether the prompt opened the thinking block, the expected message), run as
its test_peg_parser runs them: every prefix of the input parsed as a partial answer, the stream
of deltas between parses accumulated and held to each parse, then the whole input parsed as a
complete answer and held to the expected message (content and reasoning compared stripped,
arguments as JSON, as its assert_msg_equals compares them).

Also: each family's templates (tests/data/templates, copied from llama.cpp's models/templates)
detect as that family; each grammar passes speculative.grammar.gbnf.check and accepts the call
text of the cases (over a real vocabulary: marked `real`, vocabulary only)."""

from __future__ import annotations

import ctypes
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import llama_cpp as ll
import numpy as np
import pytest

from speculative.chat.format import Syntax
from speculative.chat.formats import detect, family
from speculative.chat.message import ChatMessage, ToolCall, accumulate, diffs
from speculative.errors import GrammarError
from speculative.grammar.gbnf import check
from speculative.llamacpp.devices import init_once
from speculative.llamacpp.grammar import Grammar, vocab_index
from speculative.llamacpp.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "data" / "templates"


def tool(name: str, parameters: dict | None) -> dict:
    function = {"name": name, "description": ""}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or []}


INT, STR, NUM = {"type": "integer"}, {"type": "string"}, {"type": "number"}

# test-chat.cpp's tools (their descriptions left out: nothing reads them)
TOOLS = {t["function"]["name"]: t for t in [
    tool("special_function", obj({"arg1": INT}, ["arg1"])),
    tool("special_function_with_opt", obj({"arg1": INT, "arg2": INT}, ["arg1"])),
    tool("empty_args", {"type": "object", "properties": {}}),
    tool("empty_args_no_props", {"type": "object"}),
    tool("python", obj({"code": STR}, ["code"])),
    tool("html", obj({"markup": STR}, ["markup"])),
    tool("todo_list", obj({"todos": {"type": "array"}}, ["todos"])),
    tool("edit", obj({"filename": STR, "oldString": STR, "newString": STR}, ["filename", "oldString", "newString"])),
    tool("manage_todo_list", obj({"todos": {"type": "array"}}, ["todos"])),
    tool("run_in_terminal", obj({"command": STR}, ["command"])),
    tool("magic", obj({"name": STR, "ref": STR}, ["name", "ref"])),
    tool("magic_int", obj({"ref": INT, "name": STR}, ["ref"])),
    tool("amount", obj({"orig": NUM}, ["orig"])),
    tool("imaginary_number", obj({"number": obj({"real": NUM, "imaginary": NUM}, ["real", "imaginary"])},
                                 ["number"])),
    tool("set_nullable_str", obj({"name": {"type": ["string", "null"]}}, ["name"])),
    tool("set_nullable_str_nf", obj({"name": {"type": ["null", "string"]}}, ["name"])),
    tool("set_nullable_int", obj({"count": {"type": ["integer", "null"]}}, ["count"])),
    tool("set_union", obj({"value": {"type": ["string", "object"]}, "amount": {"type": ["string", "integer"]}},
                          ["value", "amount"])),
    tool("set_unit", obj({"unit": {"enum": ["celsius", "fahrenheit"]}}, ["unit"])),
    tool("string_param", obj({"text": STR}, [])),
    tool("quoted_unquoted", obj({"quoted": STR, "unquoted": STR}, ["quoted", "unquoted"])),
    tool("tool_2req_4opt", obj({"req1": STR, "req2": INT, "opt1": STR, "opt2": INT, "opt3": STR, "opt4": INT},
                               ["req1", "req2"])),
    tool("tool_2req_5opt", obj({"req1": STR, "req2": INT, "opt1": STR, "opt2": INT, "opt3": STR, "opt4": INT,
                                "opt5": STR}, ["req1", "req2"])),
]}

CALL = ("special_function", '{"arg1": 1}')  # test-chat.cpp's message_assist_call
HELLO = "Hello, world!\nWhat's up?"         # message_assist's content
THINKING = "I'm\nthinking"                  # message_assist_thoughts' reasoning


@dataclass
class Case:
    """One test-chat.cpp case: `input` as the model wrote it; `thinking_open`: the template's
    generation prompt (with test-chat.cpp's enable_thinking) ends inside <think>; the expected
    message: content, reasoning, calls as (name, arguments[, id])."""
    family: str
    input: str
    tools: tuple[str, ...] = ()
    reasoning_format: str = "none"  # test-chat.cpp's default
    thinking_open: bool = False
    parallel: bool = False
    choice: str = "auto"
    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, ...]] = field(default_factory=list)
    source: str = ""  # where in test-chat.cpp

    @property
    def syntax(self) -> Syntax:
        parameters = {n: TOOLS[n]["function"].get("parameters") for n in self.tools}
        return Syntax(self.reasoning_format, self.thinking_open, bool(self.tools) and self.choice != "none",
                      parameters or None)


def qwen3_coder_call(name: str, *args: tuple[str, str], opening: bool = True) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args)
    return ("<tool_call>\n" if opening else "") + f"<function={name}>\n{params}</function>\n</tool_call>"


HERMES = [
    # NousResearch-Hermes-2-Pro (test-chat.cpp: "NousResearch-Hermes-2-Pro and Hermes-3")
    Case("hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
         tools=("special_function",), calls=[CALL], source="Hermes-2-Pro"),
    Case("hermes", HELLO + '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
         tools=("special_function",), content=HELLO, calls=[("special_function", '{"arg1":1}')],
         source="Hermes-2-Pro"),
    # MiMo-VL / Hermes 3 / Qwen 2.5, Granite 4.0 and 4.1
    Case("hermes", HELLO, content=HELLO, source="Hermes-3 / Qwen2.5 / Granite 4.x"),
    Case("hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
         tools=("special_function",), calls=[CALL], source="Hermes-3 / Qwen2.5 / Granite 4.x"),
    # Qwen-QwQ-32B: the prompt always opens <think>
    Case("hermes", "Let me think about this...\n</think>\nThe answer is 42.", reasoning_format="auto",
         thinking_open=True, content="The answer is 42.", reasoning="Let me think about this...", source="QwQ"),
    Case("hermes", "</think>Hello, world!", reasoning_format="auto", thinking_open=True,
         content="Hello, world!", source="QwQ"),
]

QWEN3_CODER = [
    # Qwen3-Coder
    Case("qwen3_coder", HELLO, content=HELLO, source="Qwen3-Coder"),
    Case("qwen3_coder", qwen3_coder_call("special_function", ("arg1", "1")), tools=("special_function",),
         calls=[CALL], source="Qwen3-Coder"),
    Case("qwen3_coder", qwen3_coder_call("special_function", ("arg1", "1"), opening=False),
         tools=("special_function",), calls=[CALL], source="Qwen3-Coder: no opening <tool_call>"),
    Case("qwen3_coder", "Let me call it.\n" + qwen3_coder_call("special_function", ("arg1", "1"), opening=False),
         tools=("special_function",), content="Let me call it.\n", calls=[("special_function", '{"arg1": 1}')],
         source="Qwen3-Coder: content, no opening <tool_call>"),
    Case("qwen3_coder", qwen3_coder_call("special_function", ("arg1", "1"), opening=False) + "\n"
         + qwen3_coder_call("special_function_with_opt", ("arg1", "1"), ("arg2", "2")),
         tools=("special_function", "special_function_with_opt"), parallel=True,
         calls=[("special_function", '{"arg1": 1}'), ("special_function_with_opt", '{"arg1": 1, "arg2": 2}')],
         source="Qwen3-Coder: only the first call may omit <tool_call>"),
    Case("qwen3_coder", qwen3_coder_call("special_function", ("arg1", "1")) + "\n"
         + qwen3_coder_call("special_function_with_opt", ("arg1", "1"), ("arg2", "2")),
         tools=("special_function", "special_function_with_opt"), parallel=True,
         calls=[("special_function", '{"arg1": 1}'), ("special_function_with_opt", '{"arg1": 1, "arg2": 2}')],
         source="Qwen3-Coder: parallel"),
    Case("qwen3_coder", qwen3_coder_call("python", ("code", 'def hello():\n    print("Hello, world!")\n\nhello()')),
         tools=("python",), calls=[("python", "{\"code\": \"def hello():\\n    print(\\\"Hello, world!\\\")\\n\\nhello()\"}")],
         source="Qwen3-Coder: multiline code"),
    Case("qwen3_coder", qwen3_coder_call("python", ("code", "格")), tools=("python",),
         calls=[("python", "{\"code\": \"格\"}")], source="Qwen3-Coder: asian unicode"),
    Case("qwen3_coder", qwen3_coder_call("html", ("markup", "<html>\n <head>\n  <title>Hello!</title>\n </head>\n</html>")),
         tools=("html",),
         calls=[("html", "{\"markup\": \"<html>\\n <head>\\n  <title>Hello!</title>\\n </head>\\n</html>\"}")],
         source="Qwen3-Coder: HTML content"),
    Case("qwen3_coder", qwen3_coder_call("todo_list", ("todos", '[{"item": "Check stuff", "selected": false}, '
                                                                 '{"item": "Prepare stuff", "selected": true}]')),
         tools=("todo_list",), calls=[("todo_list", '{"todos": [{"item": "Check stuff", "selected": false}, '
                                                    '{"item": "Prepare stuff", "selected": true}]}')],
         source="Qwen3-Coder: array of objects"),
    Case("qwen3_coder", qwen3_coder_call("edit", ("newString", "#include"), ("filename", "foo.c"),
                                         ("oldString", "#iclunde")),
         tools=("edit",), calls=[("edit", '{"newString": "#include", "filename": "foo.c", "oldString": "#iclunde"}')],
         source="Qwen3-Coder: required arguments in any order"),
    Case("qwen3_coder", qwen3_coder_call("tool_2req_4opt", ("req2", "42"), ("req1", "hello"), ("opt2", "200")),
         tools=("tool_2req_4opt",), calls=[("tool_2req_4opt", '{"req2": 42, "req1": "hello", "opt2": 200}')],
         source="Qwen3-Coder: 2 required + 4 optional"),
    Case("qwen3_coder", qwen3_coder_call("tool_2req_4opt", ("req1", "hello"), ("req2", "42"), ("opt4", "100"),
                                         ("opt2", "200")),
         tools=("tool_2req_4opt",),
         calls=[("tool_2req_4opt", '{"req1": "hello", "req2": 42, "opt4": 100, "opt2": 200}')],
         source="Qwen3-Coder: optional arguments reversed"),
    Case("qwen3_coder", qwen3_coder_call("tool_2req_5opt", ("req1", "world"), ("req2", "7"), ("opt5", "last"),
                                         ("opt3", "middle"), ("opt1", "first")),
         tools=("tool_2req_5opt",),
         calls=[("tool_2req_5opt", '{"req1": "world", "req2": 7, "opt5": "last", "opt3": "middle", "opt1": "first"}')],
         source="Qwen3-Coder: 2 required + 5 optional, reversed"),
    Case("qwen3_coder", qwen3_coder_call("tool_2req_5opt", ("req1", "test"), ("req2", "99"), ("opt3", "c"),
                                         ("opt1", "a"), ("opt5", "e"), ("opt4", "4"), ("opt2", "2")),
         tools=("tool_2req_5opt",),
         calls=[("tool_2req_5opt", '{"req1": "test", "req2": 99, "opt3": "c", "opt1": "a", "opt5": "e", '
                                   '"opt4": 4, "opt2": 2}')],
         source="Qwen3-Coder: all 5 optional shuffled"),
    Case("qwen3_coder", qwen3_coder_call("set_nullable_str", ("name", "hello world")), tools=("set_nullable_str",),
         calls=[("set_nullable_str", '{"name": "hello world"}')], source="Qwen3-Coder: nullable string"),
    Case("qwen3_coder", qwen3_coder_call("set_nullable_str_nf", ("name", "hello world")),
         tools=("set_nullable_str_nf",), calls=[("set_nullable_str_nf", '{"name": "hello world"}')],
         source="Qwen3-Coder: nullable string, null first"),
    Case("qwen3_coder", qwen3_coder_call("set_nullable_int", ("count", "42")), tools=("set_nullable_int",),
         calls=[("set_nullable_int", '{"count": 42}')], source="Qwen3-Coder: nullable integer"),
    Case("qwen3_coder", qwen3_coder_call("set_nullable_str", ("name", "null")), tools=("set_nullable_str",),
         calls=[("set_nullable_str", '{"name": null}')], source="Qwen3-Coder: nullable string given null"),
    Case("qwen3_coder", qwen3_coder_call("set_union", ("value", '{"a": 1}'), ("amount", "2 dollars")),
         tools=("set_union",), calls=[("set_union", '{"value": {"a": 1}, "amount": "2 dollars"}')],
         source="Qwen3-Coder: unions with string"),
    Case("qwen3_coder", qwen3_coder_call("set_union", ("value", "{not valid json"), ("amount", "42")),
         tools=("set_union",), calls=[("set_union", '{"value": "{not valid json", "amount": 42}')],
         source="Qwen3-Coder: unions with string, not JSON"),
    Case("qwen3_coder", qwen3_coder_call("set_unit", ("unit", "celsius")), tools=("set_unit",),
         calls=[("set_unit", '{"unit": "celsius"}')], source="Qwen3-Coder: enum without a type"),
    # Qwen3.5-4B: enable_thinking opens <think> in the prompt
    Case("qwen3_coder", "I'm\nthinking\n</think>\n\n" + HELLO, reasoning_format="auto", thinking_open=True,
         content=HELLO, reasoning=THINKING, source="Qwen3.5"),
    Case("qwen3_coder", "I'm\nthinking\n</think>\n\n" + HELLO, reasoning_format="none", thinking_open=True,
         content="<think>\nI'm\nthinking\n</think>\n\n" + HELLO, source="Qwen3.5: reasoning_format none"),
    Case("qwen3_coder", qwen3_coder_call("special_function", ("arg1", "1")), tools=("special_function",),
         reasoning_format="auto", calls=[CALL], source="Qwen3.5: thinking disabled"),
    Case("qwen3_coder", "I'm\nthinking\n</think>\n\n" + qwen3_coder_call("special_function", ("arg1", "1")),
         tools=("special_function",), reasoning_format="auto", thinking_open=True, reasoning=THINKING,
         calls=[("special_function", '{"arg1":1}')], source="Qwen3.5: thoughts then a call"),
    Case("qwen3_coder", qwen3_coder_call("special_function", ("arg1", "1")) + "\n"
         + qwen3_coder_call("special_function_with_opt", ("arg1", "1"), ("arg2", "2")),
         tools=("special_function", "special_function_with_opt"), reasoning_format="auto", parallel=True,
         calls=[("special_function", '{"arg1": 1}'), ("special_function_with_opt", '{"arg1": 1, "arg2": 2}')],
         source="Qwen3.5: parallel"),
    Case("qwen3_coder", qwen3_coder_call("edit", ("filename", "foo.c"), ("oldString", "#iclunde"),
                                         ("newString", "#include")),
         tools=("edit",), reasoning_format="auto",
         calls=[("edit", '{"filename": "foo.c", "oldString": "#iclunde", "newString": "#include"}')],
         source="Qwen3.5: edit"),
    Case("qwen3_coder", qwen3_coder_call("edit", ("filename", "foo.c"), ("oldString", "#iclunde"),
                                         ("newString", "#include\n")),
         tools=("edit",), reasoning_format="auto",
         calls=[("edit", '{"filename": "foo.c", "oldString": "#iclunde", "newString": "#include\\n"}')],
         source="Qwen3.5: a value ending in a newline"),
    Case("qwen3_coder", qwen3_coder_call("python", ("code", '    print("Hello, world!")')), tools=("python",),
         reasoning_format="auto", calls=[("python", "{\"code\": \"    print(\\\"Hello, world!\\\")\"}")],
         source="Qwen3.5: code that starts with an indent"),
    Case("qwen3_coder", qwen3_coder_call("run_in_terminal", ("command", "pwd")), tools=("run_in_terminal",),
         reasoning_format="auto", thinking_open=True, calls=[("run_in_terminal", '{"command": "pwd"}')],
         source="Qwen3.5: a call ends the opened thinking block"),
    Case("qwen3_coder", "Need to inspect the current directory.\n" + qwen3_coder_call("run_in_terminal", ("command", "pwd")),
         tools=("run_in_terminal",), reasoning_format="auto", thinking_open=True,
         reasoning="Need to inspect the current directory.", calls=[("run_in_terminal", '{"command": "pwd"}')],
         source="Qwen3.5: thoughts ended by a call"),
    Case("qwen3_coder", "<tool_call>\n<function=empty_args>\n</function>\n</tool_call>", tools=("empty_args",),
         reasoning_format="auto", calls=[("empty_args", "{}")], source="Qwen3.5: no arguments"),
    Case("qwen3_coder", "<tool_call>\n<function=empty_args_no_props>\n</function>\n</tool_call>",
         tools=("empty_args_no_props",), reasoning_format="auto", calls=[("empty_args_no_props", "{}")],
         source="Qwen3.5: no properties"),
    Case("qwen3_coder", "<think>\n\n</think>\n\n" + qwen3_coder_call("special_function", ("arg1", "1")),
         tools=("special_function",), reasoning_format="auto", thinking_open=True, reasoning="<think>\n\n",
         calls=[("special_function", '{"arg1": 1}')], source="Qwen3.5: reasoning traces not sent"),
    Case("qwen3_coder", "</think>\n\n" + qwen3_coder_call("special_function", ("arg1", "1")),
         tools=("special_function",), reasoning_format="auto", thinking_open=True,
         calls=[("special_function", '{"arg1": 1}')], source="Qwen3.5: empty thoughts"),
    Case("qwen3_coder", "</think>\n\n" + qwen3_coder_call("run_in_terminal", ("command", "pwd")),
         tools=("run_in_terminal",), reasoning_format="auto", thinking_open=True,
         calls=[("run_in_terminal", '{"command": "pwd"}')], source="Qwen3.5: empty thoughts, a call"),
    Case("qwen3_coder", "</think>\n\nLet me inspect the current directory.\n"
         + qwen3_coder_call("run_in_terminal", ("command", "pwd")),
         tools=("run_in_terminal",), reasoning_format="auto", thinking_open=True,
         content="Let me inspect the current directory.\n", calls=[("run_in_terminal", '{"command": "pwd"}')],
         source="Qwen3.5: content then a call"),
    Case("qwen3_coder", "</think>\n\nLet me inspect the current directory.\n"
         + qwen3_coder_call("run_in_terminal", ("command", "pwd")),
         tools=("run_in_terminal",), reasoning_format="auto", thinking_open=True, choice="required",
         content="Let me inspect the current directory.\n", calls=[("run_in_terminal", '{"command": "pwd"}')],
         source="Qwen3.5: content then a required call"),
    Case("qwen3_coder", "I should inspect the directory.\n</think>\n\nLet me inspect it now.\n"
         + qwen3_coder_call("run_in_terminal", ("command", "pwd")),
         tools=("run_in_terminal",), reasoning_format="auto", thinking_open=True,
         reasoning="I should inspect the directory.", content="Let me inspect it now.\n",
         calls=[("run_in_terminal", '{"command": "pwd"}')], source="Qwen3.5: thoughts, content, a call"),
    Case("qwen3_coder", "I need to run a terminal command.\n</think>\n\n"
         + qwen3_coder_call("run_in_terminal", ("command", "pwd")),
         tools=("manage_todo_list", "run_in_terminal"), reasoning_format="auto", thinking_open=True,
         reasoning="I need to run a terminal command.", calls=[("run_in_terminal", '{"command": "pwd"}')],
         source="Qwen3.5: after a tool result"),
    Case("qwen3_coder", "I need to run a terminal command.\n</think>\n\nLet me inspect the current directory.\n"
         + qwen3_coder_call("run_in_terminal", ("command", "pwd")),
         tools=("manage_todo_list", "run_in_terminal"), reasoning_format="auto", thinking_open=True,
         choice="required", reasoning="I need to run a terminal command.",
         content="Let me inspect the current directory.\n", calls=[("run_in_terminal", '{"command": "pwd"}')],
         source="Qwen3.5: after a tool result, required"),
    Case("qwen3_coder", "</think>\n\n" + qwen3_coder_call("run_in_terminal", ("command", "pwd")),
         tools=("manage_todo_list", "run_in_terminal"), reasoning_format="auto", thinking_open=True,
         calls=[("run_in_terminal", '{"command": "pwd"}')], source="Qwen3.5: after a tool result, no thoughts"),
    # NVIDIA-Nemotron-3-Nano
    Case("qwen3_coder", HELLO, reasoning_format="auto", content=HELLO, source="Nemotron 3 Nano"),
    Case("qwen3_coder", "I'm\nthinking\n</think>\n" + HELLO, thinking_open=True,
         content="<think>\nI'm\nthinking\n</think>\n" + HELLO, source="Nemotron 3 Nano: reasoning_format none"),
    Case("qwen3_coder", "I'm\nthinking\n</think>\n" + HELLO, reasoning_format="auto", thinking_open=True,
         content=HELLO, reasoning=THINKING, source="Nemotron 3 Nano"),
    Case("qwen3_coder", qwen3_coder_call("special_function", ("arg1", "1")) + "\n", tools=("special_function",),
         reasoning_format="auto", calls=[CALL], source="Nemotron 3 Nano: a call"),
    Case("qwen3_coder", "I'm\nthinking\n</think>\n" + qwen3_coder_call("special_function", ("arg1", "1")) + "\n",
         tools=("special_function",), reasoning_format="auto", thinking_open=True, reasoning=THINKING,
         calls=[("special_function", '{"arg1":1}')], source="Nemotron 3 Nano: thoughts, a call"),
    Case("qwen3_coder", qwen3_coder_call("special_function", ("arg1", "1")) + "\n"
         + qwen3_coder_call("special_function_with_opt", ("arg1", "1"), ("arg2", "2")) + "\n",
         tools=("special_function", "special_function_with_opt"), reasoning_format="auto", parallel=True,
         calls=[("special_function", '{"arg1": 1}'), ("special_function_with_opt", '{"arg1": 1, "arg2": 2}')],
         source="Nemotron 3 Nano: parallel"),
    Case("qwen3_coder", qwen3_coder_call("python", ("code", 'def hello():\n    print("Hello, world!")\n\nhello()'))
         + "\n", tools=("python",), reasoning_format="auto",
         calls=[("python", "{\"code\": \"def hello():\\n    print(\\\"Hello, world!\\\")\\n\\nhello()\"}")],
         source="Nemotron 3 Nano: code"),
    # StepFun3.5-Flash
    Case("qwen3_coder", "I was thinking\n</think>\nNow I'm not.", reasoning_format="deepseek", thinking_open=True,
         reasoning="I was thinking", content="Now I'm not.", source="StepFun 3.5"),
    Case("qwen3_coder", "Let me call the magic tool\n</think>\n"
         + qwen3_coder_call("magic", ("name", "fooBar"), ("ref", "5123123")),
         tools=("magic",), reasoning_format="deepseek", thinking_open=True, reasoning="Let me call the magic tool",
         calls=[("magic", '{"name": "fooBar", "ref": "5123123"}')], source="StepFun 3.5: numeric-looking strings"),
    Case("qwen3_coder", "Let me call the special function\n</think>\n"
         + qwen3_coder_call("special_function", ("arg1", "42555916")),
         tools=("special_function",), reasoning_format="deepseek", thinking_open=True,
         reasoning="Let me call the special function", calls=[("special_function", '{"arg1": 42555916}')],
         source="StepFun 3.5: numbers"),
    Case("qwen3_coder", "Let me call the special function with opt\n</think>\n"
         + qwen3_coder_call("special_function_with_opt", ("arg1", "42555916")),
         tools=("special_function_with_opt",), reasoning_format="deepseek", thinking_open=True,
         reasoning="Let me call the special function with opt",
         calls=[("special_function_with_opt", '{"arg1": 42555916}')], source="StepFun 3.5: optional left out"),
    Case("qwen3_coder", "Let me call the magic_int function\n</think>\n"
         + qwen3_coder_call("magic_int", ("ref", "42555916"), ("name", "baz")),
         tools=("magic_int",), reasoning_format="deepseek", thinking_open=True,
         reasoning="Let me call the magic_int function", calls=[("magic_int", '{"ref": 42555916, "name": "baz"}')],
         source="StepFun 3.5: integer and string"),
    Case("qwen3_coder", "Call string_param with empty text\n</think>\n" + qwen3_coder_call("string_param", ("text", "")),
         tools=("string_param",), reasoning_format="deepseek", thinking_open=True,
         reasoning="Call string_param with empty text", calls=[("string_param", '{"text": ""}')],
         source="StepFun 3.5: empty string"),
    Case("qwen3_coder", "Test simple quoted unquoted\n</think>\n"
         + qwen3_coder_call("quoted_unquoted", ("quoted", '"foo"'), ("unquoted", "foo")),
         tools=("quoted_unquoted",), reasoning_format="deepseek", thinking_open=True,
         reasoning="Test simple quoted unquoted", calls=[("quoted_unquoted", r'{"quoted": "\"foo\"", "unquoted": "foo"}')],
         source="StepFun 3.5: quoted and unquoted"),
    Case("qwen3_coder", "Test complex quoted unquoted\n</think>\n"
         + qwen3_coder_call("quoted_unquoted", ("quoted", '"printf(\\"foo\\");"'), ("unquoted", 'printf("foo");')),
         tools=("quoted_unquoted",), reasoning_format="deepseek", thinking_open=True,
         reasoning="Test complex quoted unquoted",
         calls=[("quoted_unquoted", r'{ "quoted" : "\"printf(\\\"foo\\\");\"", "unquoted": "printf(\"foo\");" }')],
         source="StepFun 3.5: complex quoted and unquoted"),
    Case("qwen3_coder", "Test negative number\n</think>\n" + qwen3_coder_call("magic_int", ("ref", "-14")),
         tools=("magic_int",), reasoning_format="deepseek", thinking_open=True, reasoning="Test negative number",
         calls=[("magic_int", '{ "ref" : -14 }')], source="StepFun 3.5: negative number"),
    Case("qwen3_coder", "Test decimal number\n</think>\n" + qwen3_coder_call("amount", ("orig", "3.14")),
         tools=("amount",), reasoning_format="deepseek", thinking_open=True, reasoning="Test decimal number",
         calls=[("amount", '{ "orig" : 3.14 }')], source="StepFun 3.5: decimal number"),
    Case("qwen3_coder", "Test imaginary number\n</think>\n"
         + qwen3_coder_call("imaginary_number", ("number", '{ "real": 3.14, "imaginary": 2.71 }')),
         tools=("imaginary_number",), reasoning_format="deepseek", thinking_open=True,
         reasoning="Test imaginary number",
         calls=[("imaginary_number", '{ "number" : {"real":3.14,"imaginary":2.71 } }')],
         source="StepFun 3.5: an object"),
]

LLAMA3 = [
    # Llama 3.1, 3.2 (special_function) and 3.3 (python): content with tools
    Case("llama3", HELLO, tools=("special_function",), content=HELLO, source="Llama 3.1 / 3.2"),
    Case("llama3", HELLO, tools=("python",), content=HELLO, source="Llama 3.3"),
    # test-chat.cpp has no call for these templates; these are their calls as the templates
    # write them back (the JSON object, the OpenAI wrapper their instruction asks for)
    Case("llama3", '{"name": "special_function", "parameters": {"arg1": 1}}', tools=("special_function",),
         calls=[CALL], source="ours: the template's call"),
    Case("llama3", '{"type": "function", "name": "special_function", "parameters": {"arg1": 1}}',
         tools=("special_function",), calls=[CALL], source="ours: the OpenAI wrapper"),
    Case("llama3", '<|python_tag|>{"name": "python", "parameters": {"code": "print(1)"}}', tools=("python",),
         calls=[("python", '{"code": "print(1)"}')], source="ours: after <|python_tag|>"),
    Case("llama3", 'Use {"name": "Bob"} as the payload.', tools=("special_function",),
         content='Use {"name": "Bob"} as the payload.', source="ours: JSON that is no call"),
    Case("llama3", '{"name": "special_function", "parameters": {"arg1": 1}}, '
                   '{"name": "special_function_with_opt", "parameters": {"arg1": 1, "arg2": 2}}',
         tools=("special_function", "special_function_with_opt"), parallel=True,
         calls=[CALL, ("special_function_with_opt", '{"arg1": 1, "arg2": 2}')], source="ours: parallel"),
]

MISTRAL = [
    # mistralai-Mistral-Nemo-Instruct-2407
    Case("mistral", HELLO, content=HELLO, source="Mistral Nemo"),
    Case("mistral", '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]',
         tools=("special_function",), calls=[("special_function", '{"arg1":1}', "123456789")],
         source="Mistral Nemo"),
    # Mistral Small 3.2: [TOOL_CALLS]func_name[CALL_ID]id[ARGS]{...}
    Case("mistral", HELLO, content=HELLO, source="Mistral Small 3.2"),
    Case("mistral", '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}', tools=("special_function",),
         calls=[("special_function", '{"arg1":1}', "123456789")], source="Mistral Small 3.2"),
    Case("mistral", '[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{"arg1": 1}'
                    '[TOOL_CALLS]special_function_with_opt[CALL_ID]000000002[ARGS]{"arg1": 1, "arg2": 2}',
         tools=("special_function", "special_function_with_opt"), parallel=True,
         calls=[("special_function", '{"arg1": 1}', "000000001"),
                ("special_function_with_opt", '{"arg1": 1, "arg2": 2}', "000000002")],
         source="Mistral Small 3.2: parallel"),
    # Devstral
    Case("mistral", HELLO, content=HELLO, source="Devstral"),
    Case("mistral", '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', tools=("special_function",), calls=[CALL],
         source="Devstral"),
    Case("mistral", HELLO + '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', tools=("special_function",),
         content=HELLO, calls=[("special_function", '{"arg1":1}')], source="Devstral: content, a call"),
    # Ministral-3-14B-Reasoning-2512
    Case("mistral", HELLO, content=HELLO, source="Ministral 3"),
    Case("mistral", "[THINK]I'm\nthinking[/THINK]" + HELLO, content="[THINK]I'm\nthinking[/THINK]" + HELLO,
         source="Ministral 3: reasoning_format none"),
    Case("mistral", "[THINK]I'm\nthinking[/THINK]" + HELLO, reasoning_format="auto", content=HELLO,
         reasoning=THINKING, source="Ministral 3: thoughts"),
    Case("mistral", '[TOOL_CALLS]special_function[ARGS]{"arg1":1}', tools=("special_function",),
         reasoning_format="auto", calls=[CALL], source="Ministral 3: a call"),
    Case("mistral", "[THINK]I'm\nthinking[/THINK]" '[TOOL_CALLS]special_function[ARGS]{"arg1":1}',
         tools=("special_function",), reasoning_format="auto", reasoning=THINKING,
         calls=[("special_function", '{"arg1":1}')], source="Ministral 3: thoughts, a call"),
    Case("mistral", '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}'
                    '[TOOL_CALLS]special_function_with_opt[ARGS]{"arg1": 1, "arg2": 2}',
         tools=("special_function", "special_function_with_opt"), reasoning_format="auto", parallel=True,
         calls=[("special_function", '{"arg1": 1}'), ("special_function_with_opt", '{"arg1": 1, "arg2": 2}')],
         source="Ministral 3: parallel"),
    Case("mistral", '[THINK]Let me think about [TOOL_CALLS]special_function[ARGS]{"arg1":1} and more[/THINK]'
                    '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
         tools=("special_function",), reasoning_format="auto",
         reasoning='Let me think about [TOOL_CALLS]special_function[ARGS]{"arg1":1} and more',
         calls=[("special_function", '{"arg1": 1}')], source="Ministral 3: a call's marker in the reasoning"),
]

GENERIC = [
    # google-gemma-2-2b-it: "simple content-only template"
    Case("generic", HELLO, content=HELLO, source="gemma 2"),
]

CASES = HERMES + QWEN3_CODER + LLAMA3 + MISTRAL + GENERIC


def renormalized(arguments: str) -> object:
    """test-chat.cpp's renormalize_json: the parsed JSON, or "" for a partial text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return ""


def assert_message(expected: Case, actual: ChatMessage) -> None:
    """test-chat.cpp's assert_msg_equals with ignore_whitespace_differences."""
    assert actual.content.strip() == expected.content.strip()
    assert actual.reasoning_content.strip() == expected.reasoning.strip()
    assert [(c.name, renormalized(c.arguments), c.id) for c in actual.tool_calls] == \
        [(c[0], renormalized(c[1]), c[2] if len(c) > 2 else "") for c in expected.calls]


def stream(fmt, text: str, syntax: Syntax) -> ChatMessage:
    """test_peg_parser's loop: each prefix parsed as a partial answer, its deltas from the
    previous parse accumulated as a client does, the accumulation equal to the parse each time;
    the complete answer's parse last (extending the last partial one). Returns the accumulation."""
    previous, assembled = ChatMessage(), ChatMessage()
    for end in range(1, len(text) + 1):
        current = fmt.parse(text[:end], True, syntax)
        for delta in diffs(previous, current):
            accumulate(assembled, delta)
        assert assembled == current, f"after {text[:end]!r}"
        previous = current
    final = fmt.parse(text, False, syntax)
    for delta in diffs(previous, final):
        accumulate(assembled, delta)
    assert assembled == final
    return final


@pytest.mark.parametrize("case", CASES, ids=[f"{c.family}:{c.source}:{i}" for i, c in enumerate(CASES)])
def test_the_cases_of_test_chat_cpp(case: Case):
    fmt = family(case.family)()
    assert_message(case, stream(fmt, case.input, case.syntax))


# ---- what a partial answer holds back -----------------------------------------------------

WITH_TOOL = Syntax("auto", False, True, {"special_function": TOOLS["special_function"]["function"]["parameters"]})


def test_a_marker_s_start_is_held_back_until_it_is_known():
    hermes = family("hermes")()
    assert hermes.parse("Hello <tool_", True, WITH_TOOL).content == "Hello "
    assert hermes.parse("Hello <tool_", False, WITH_TOOL).content == "Hello <tool_"
    assert hermes.parse("Hello <tool_box>", True, WITH_TOOL).content == "Hello <tool_box>"
    opened = hermes.parse('Hello <tool_call>\n{"name": "special_fu', True, WITH_TOOL)
    assert (opened.content, opened.tool_calls) == ("Hello ", [])


def test_a_closing_thinking_tag_s_start_is_held_back():
    message = family("hermes")().parse("<think>I'm thinking</thi", True, Syntax())
    assert (message.reasoning_content, message.content) == ("I'm thinking", "")


@pytest.mark.parametrize("text,arguments", [
    ('<tool_call>\n{"name": "special_function"', "{"),
    ('<tool_call>\n{"name": "special_function", "arguments": ', "{"),
    ('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1', '{"arg1": 1'),
    ('<tool_call>\n{"name": "special_function", "arguments": {"ar', '{"ar'),
    ('<tool_call>\n{"name": "special_function", "arguments": {"a": "x\\', '{"a": "x'),
    ('<tool_call>\n{"name": "special_function", "arguments": {"a": "x\\u00', '{"a": "x'),
    ('<tool_call>\n{"name": "special_function", "arguments": {"a": 1, ', '{"a": 1,'),
])
def test_partial_arguments_are_the_json_written_so_far(text: str, arguments: str):
    """As llama.cpp reports them: "{" once the name is known, then the text as written, less
    trailing whitespace and an unfinished escape."""
    [call] = family("hermes")().parse(text, True, WITH_TOOL).tool_calls
    assert (call.name, call.arguments) == ("special_function", arguments)


def test_complete_arguments_are_kept_as_written():
    text = '<tool_call>\n{"name": "special_function", "arguments": {"arg1" :  1}}\n</tool_call>'
    assert family("hermes")().parse(text, False, WITH_TOOL).tool_calls == \
        [ToolCall("special_function", '{"arg1" :  1}')]


def test_qwen3_coder_values_are_typed_by_the_schema():
    """`5123123` is a string where the schema says string, a number where it says integer; with
    no schemas, as it reads."""
    text = qwen3_coder_call("magic_int", ("ref", "5123123"), ("name", "5"))
    typed = Syntax(tools=True, parameters={"magic_int": TOOLS["magic_int"]["function"]["parameters"]})
    fmt = family("qwen3_coder")()
    assert fmt.parse(text, False, typed).tool_calls[0].arguments == '{"ref":5123123,"name":"5"}'
    assert fmt.parse(text, False, Syntax(tools=True)).tool_calls[0].arguments == '{"ref":5123123,"name":5}'


def test_without_tools_a_call_is_content():
    text = '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>'
    message = family("hermes")().parse(text, False, Syntax())
    assert (message.content, message.tool_calls) == (text, [])


# answers that go wrong part way: a stream of them must never take back what it showed
GARBLED = [
    ("hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1x}}</tool_call>tail'),
    ("hermes", 'a <tool_cal b <tool_call>oops'),
    ("hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>\nthen text\n'
               '<tool_call>\n{"name": "special_function", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {"arg1": 1}, "name": "special_function"}</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "special_function", "arguments": "text"}</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": [1, 2,, 3]}}</tool_call>'),
    ("qwen3_coder", qwen3_coder_call("special_function", ("arg1", "12abc"))),
    ("qwen3_coder", qwen3_coder_call("special_function", ("arg1", "[1, x]"))),
    ("qwen3_coder", "<function=nope>\n<parameter=a>\nb\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", "#include <functional>\n" + qwen3_coder_call("python", ("code", "x\n"))),
    ("qwen3_coder", qwen3_coder_call("set_union", ("value", "null and more"), ("amount", "42 "))),
    ("llama3", '{"name": "special_function", "parameters": {"arg1": 1}} trailing'),
    ("llama3", '{"x": 1} {"name": "special_function", "parameters": {"arg1": "a"}}'),
    ("llama3", '<|python_tag|>brave_search.call(query="x")'),
    ("llama3", '{"name": "special_function", "parameters": {"arg1": 1}, "extra": 2}'),
    ("mistral", '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}[TOOL_CALLS]nope[ARGS]{}'),
    ("mistral", '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}}, {"bad": 1}]'),
    ("mistral", '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}}, '
                '{"name": "special_function_with_opt", "arguments": {"arg1": 2}, "id": 7}]'),
    ("mistral", "[THINK]hmm[/THI"),
    ("mistral", '[TOOL_CALLS]special function[ARGS]{}'),
]
SCHEMAS = {n: TOOLS[n]["function"]["parameters"]
           for n in ("special_function", "special_function_with_opt", "python", "set_union")}


@pytest.mark.parametrize("name,text", GARBLED)
@pytest.mark.parametrize("parameters", [None, SCHEMAS], ids=["untyped", "typed"])
@pytest.mark.parametrize("reasoning_format", ["auto", "none"])
def test_a_garbled_answer_never_takes_back_what_a_stream_showed(name: str, text: str, parameters, reasoning_format):
    stream(family(name)(), text, Syntax(reasoning_format, False, True, parameters))


# ---- detection ---------------------------------------------------------------------------

DETECTED = {
    "hermes": ["NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
               "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Qwen-QwQ-32B", "ibm-granite-granite-4.0",
               "ibm-granite-granite-4.1"],
    "qwen3_coder": ["Qwen3-Coder", "Qwen3.5-4B", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "StepFun3.5-Flash"],
    "llama3": ["meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
               "meta-llama-Llama-3.3-70B-Instruct"],
    "mistral": ["mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506",
                "unsloth-mistral-Devstral-Small-2507", "mistralai-Ministral-3-14B-Reasoning-2512"],
    "generic": ["google-gemma-2-2b-it"],
}


@pytest.mark.parametrize("name,template", [(n, t) for n, ts in DETECTED.items() for t in ts])
def test_each_template_detects_as_its_family(name: str, template: str):
    assert detect((TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")).name == name


@pytest.mark.real
def test_qwen2_5_coder_s_own_template_detects_as_hermes(model_path):
    """The template in the pulled GGUF's metadata, as the server will read it."""
    reader = gguf.GGUFReader(str(model_path("qwen2.5-coder-0.5b-instruct")))
    field_ = reader.fields["tokenizer.chat_template"]
    source = bytes(field_.parts[field_.data[0]]).decode("utf-8")
    assert detect(source).name == "hermes"


# ---- grammars ----------------------------------------------------------------------------

CHOICES = ["auto", "required", {"type": "function", "function": {"name": "special_function"}}]
FAMILY_NAMES = ["hermes", "qwen3_coder", "llama3", "mistral"]


@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
def test_a_grammar_for_every_choice(name: str, choice, parallel: bool):
    """A checked grammar; lazy from triggers (valid regular expressions) only for "auto"; a named
    function's grammar names no other tool."""
    tools = [TOOLS["special_function"], TOOLS["special_function_with_opt"], TOOLS["python"]]
    grammar = family(name)().grammar(tools, choice, parallel)
    check(grammar.gbnf)
    assert grammar.lazy == (choice == "auto")
    for pattern in grammar.triggers:
        re.compile(pattern)
    tools_named = {m.group(1) for m in re.finditer(r"^tool-(special-function-with-opt|python)\b", grammar.gbnf, re.M)}
    assert bool(tools_named) == (choice != CHOICES[2])


@pytest.mark.parametrize("name", FAMILY_NAMES + ["generic"])
def test_no_grammar_for_tool_choice_none(name: str):
    assert family(name)().grammar([TOOLS["special_function"]], "none", True) is None


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_tool_whose_parameters_are_no_schema_is_refused_by_name(name: str):
    bad = tool("broken", {"type": "object", "properties": {"n": {"type": "integr"}}})
    with pytest.raises(GrammarError, match=r"^tool 'broken': parameters: json schema at #/properties/n/type: ") as info:
        family(name)().grammar([TOOLS["special_function"], bad], "auto", False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_named_function_that_is_no_tool_is_refused(name: str):
    choice = {"type": "function", "function": {"name": "nowhere"}}
    with pytest.raises(GrammarError, match="'nowhere', which is not among the tools"):
        family(name)().grammar([TOOLS["special_function"]], choice, False)


def test_generic_has_no_grammar_for_auto_and_refuses_a_required_call():
    generic = family("generic")()
    assert generic.grammar([TOOLS["special_function"]], "auto", False) is None
    for choice in CHOICES[1:]:
        with pytest.raises(GrammarError, match="this model's chat template has no tool support"):
            generic.grammar([TOOLS["special_function"]], choice, False)


def test_several_tools_with_the_same_ref_keep_their_own_definitions():
    """Two tools whose schemas both say {"$ref": "#/$defs/x"} for different x: each call's
    argument rule reaches its own tool's definition (llama.cpp would share the first's)."""
    def with_def(name: str, kind: str) -> dict:
        return tool(name, {"type": "object", "properties": {"v": {"$ref": "#/$defs/x"}}, "required": ["v"],
                           "$defs": {"x": obj({"k": {"type": kind}}, ["k"])}})
    gbnf = family("hermes")().grammar([with_def("a", "integer"), with_def("b", "boolean")], "auto", False).gbnf
    rules = dict(line.split(" ::= ", 1) for line in gbnf.splitlines())
    assert rules["tool-a-schema-v"] == "tool-a-schema-ref-defs-x"
    assert rules["tool-b-schema-v"] == "tool-b-schema-ref-defs-x"
    assert rules["tool-a-schema-ref-defs-x-k-kv"].endswith(" integer")
    assert rules["tool-b-schema-ref-defs-x-k-kv"].endswith(" boolean")


# ---- the grammars accept the cases' calls (llama.cpp's own sampler) ----------------------

@pytest.fixture(scope="module")
def vocabulary(model_path):
    """Qwen2.5-Coder's vocabulary (loaded alone: no weights), whose <tool_call> is one token."""
    init_once()
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(str(model_path("qwen2.5-coder-0.5b-instruct")).encode(), params)
    assert model
    yield Tokenizer(ll.llama_model_get_vocab(model))
    ll.llama_model_free(model)


def sampler(tokenizer: Tokenizer, grammar) -> Grammar:
    """llama.cpp's grammar sampler for `grammar`: lazy from its triggers where it has them
    (llama_sampler_init_grammar_lazy_patterns, as llama-server makes it)."""
    if grammar.lazy:
        patterns = (ctypes.c_char_p * len(grammar.triggers))(*[p.encode() for p in grammar.triggers])
        made = ll.llama_sampler_init_grammar_lazy_patterns(
            tokenizer._vocab, grammar.gbnf.encode(), b"root", patterns, len(grammar.triggers), None, 0)
    else:
        made = ll.llama_sampler_init_grammar(tokenizer._vocab, grammar.gbnf.encode(), b"root")
    assert made, grammar.gbnf
    return Grammar(made, vocab_index(tokenizer), tokenizer)


def generated(case: Case) -> str:
    """What the grammar sees of the case's input: the text after the reasoning (llama-server
    keeps triggers inside thinking from firing), and for a grammar applied from the first token
    (required, named) the calls alone, from where the first one starts."""
    fmt = family(case.family)()
    reasoning_end = 0
    if fmt.think is not None and case.reasoning_format != "none":
        closing = case.input.find(fmt.think[1])
        reasoning_end = closing + len(fmt.think[1]) if closing >= 0 else 0
    text = case.input[reasoning_end:]
    if case.choice == "auto":
        return text
    starts = [text.find(m) for m in ("<tool_call>", "<function=", "[TOOL_CALLS]", "{") if m in text]
    return text[min(starts):]


def refusal(tokenizer: Tokenizer, state: Grammar, text: str) -> str | None:
    """`text` token by token through `state`: where it refuses a token (what came before and
    the token), or None where it takes them all."""
    tokens = tokenizer.tokenize(text, add_special=False, parse_special=True)
    for i, token in enumerate(tokens):
        if not state.admitted(np.array([token]))[0]:
            before = b"".join(tokenizer.token_bytes(t) for t in tokens[:i])
            return f"refused {tokenizer.token_bytes(token)!r} after {before!r}"
        state.accept(token)
    return None


def assert_accepts(tokenizer: Tokenizer, grammar, text: str) -> None:
    """Each token admitted, the answer may end there, and the grammar did apply (it refuses
    prose at the end: a trigger fired)."""
    state = sampler(tokenizer, grammar)
    assert refusal(tokenizer, state, text) is None
    assert state.admitted(np.array([tokenizer.end_token()]))[0], "the grammar wants more"
    prose = tokenizer.tokenize(" Thanks", add_special=False)[0]
    assert not state.admitted(np.array([prose]))[0], "the grammar never applied (no trigger fired)"


ACCEPTED = [c for c in CASES if c.calls and c.family != "generic"]


@pytest.mark.real
@pytest.mark.parametrize("case", ACCEPTED, ids=[f"{c.family}:{c.source}:{i}" for i, c in enumerate(ACCEPTED)])
def test_the_grammar_accepts_the_calls(case: Case, vocabulary: Tokenizer):
    """The case's text through llama.cpp's sampler for the format's grammar of the case's tools,
    choice and parallel."""
    grammar = family(case.family)().grammar([TOOLS[n] for n in case.tools], case.choice, case.parallel)
    assert_accepts(vocabulary, grammar, generated(case))


ONE_CALL = [c for c in ACCEPTED if len(c.calls) == 1 and c.choice == "auto"]


@pytest.mark.real
@pytest.mark.parametrize("case", ONE_CALL, ids=[f"{c.family}:{c.source}:{i}" for i, c in enumerate(ONE_CALL)])
def test_the_grammar_of_a_named_function_accepts_its_call(case: Case, vocabulary: Tokenizer):
    """The same call with tool_choice naming its function: the grammar applies from the first
    token, to the call alone."""
    named = {"type": "function", "function": {"name": case.calls[0][0]}}
    grammar = family(case.family)().grammar([TOOLS[n] for n in case.tools], named, False)
    assert_accepts(vocabulary, grammar, generated(Case(**{**case.__dict__, "choice": "required"})))


WRONG = {
    "hermes": '<tool_call>\n{"name": "special_function", "arguments": {"arg1": "one"}}\n</tool_call>',
    "qwen3_coder": qwen3_coder_call("special_function", ("arg1", "one")),
    "llama3": '{"name": "special_function", "parameters": {"arg1": "one"}}',
    "mistral": '[TOOL_CALLS]special_function[ARGS]{"arg1": "one"}',
}


@pytest.mark.real
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_the_grammar_refuses_arguments_against_the_schema(name: str, vocabulary: Tokenizer):
    grammar = family(name)().grammar([TOOLS["special_function"]], "required", False)
    assert refusal(vocabulary, sampler(vocabulary, grammar), WRONG[name]) is not None
