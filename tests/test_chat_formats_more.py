"""The chat formats of deepseek, gemma4, gpt_oss, functionary, granite and command_r7b against the
pinned llama.cpp's tests/test-chat.cpp: its cases for their templates, ported as data and run as
its test_peg_parser runs them (tests/test_chat_formats.py's Case and stream: every prefix parsed
as a partial answer, the deltas accumulated and held to each parse, the whole input parsed as a
complete answer and held to the expected message). A case test-chat.cpp runs as a partial answer
(is_partial) is run so too, and also parsed as complete: a truncated answer reads the same.

The grammars are held to llama.cpp itself, with no model (tests/chat_grammar_harness.cpp): as
test-chat.cpp checks them, the lazy triggers must fire on a case's calls (found as
llama_grammar_trigger_pattern::find finds them, the same in Python's re), and llama.cpp's grammar
engine must accept the text from there (for a required call, from where the calls start) and be
complete after it. Each family's grammar takes one call, or with parallel_tool_calls several,
and a named function's grammar no other tool's; what a grammar takes, the parser reads back.
The templates (tests/data/templates, copied from llama.cpp's models/templates) detect as their
family."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from speculative.chat.format import Syntax
from speculative.chat.formats import detect, family
from tests.conftest import vendored_tree
from tests.driver_harness import compile_cxx, wheel_libs
from tests.test_chat_formats import (CALL, HELLO, STR, TEMPLATES, THINKING, TOOLS, Case, assert_message,
                                     obj, stream, tool)
from tests.test_chat_formats import test_a_grammar_for_every_choice as every_choice
from tests.test_chat_formats import test_a_named_function_that_is_no_tool_is_refused as named_no_tool
from tests.test_chat_formats import test_a_tool_whose_parameters_are_no_schema_is_refused_by_name as bad_schema
from tests.test_chat_formats import test_no_grammar_for_tool_choice_none as no_grammar

HARNESS = Path(__file__).parent / "chat_grammar_harness.cpp"
FAMILIES = ["deepseek", "gemma4", "gpt_oss", "functionary", "granite", "command_r7b"]

# test-chat.cpp's tools that tests/test_chat_formats.py's TOOLS lacks, and gpt-oss' own edit tool
MORE_TOOLS = {t["function"]["name"]: t for t in [
    tool("get_time", obj({"city": STR}, ["city"])),
    tool("get_weather", obj({"city": STR}, ["city"])),
    tool("toggle", obj({"enabled": {"type": "boolean"}}, ["enabled"])),
    tool("set_nullable", obj({"value": {"type": "null"}}, ["value"])),
    tool("set_config", obj({"config": {"type": "object"}}, ["config"])),
]}
MORE_TOOLS["gpt-oss edit"] = tool("edit", obj({"oldString": STR, "newString": STR, "replaceAll": {"type": "boolean"}},
                                              ["oldString", "newString"]))


def tool_def(name: str) -> dict:
    return MORE_TOOLS.get(name) or TOOLS[name]


@dataclass
class More(Case):
    """A Case whose tools may be MORE_TOOLS'; `partial`: test-chat.cpp runs it as a partial
    answer (its grammar is not held to it)."""
    partial: bool = False

    @property
    def syntax(self) -> Syntax:
        parameters = {tool_def(n)["function"]["name"]: tool_def(n)["function"].get("parameters") for n in self.tools}
        return Syntax(self.reasoning_format, self.thinking_open, bool(self.tools) and self.choice != "none",
                      parameters or None)


THOUGHTS = dict(content=HELLO, reasoning=THINKING)                                  # message_assist_thoughts
THOUGHTS_CALL_IDX = dict(reasoning=THINKING, calls=[("special_function", '{"arg1": 1}', "0")])
UNPARSED_R7B = "<|START_THINKING|>I'm\nthinking<|END_THINKING|>" + HELLO
R7B_ACTION = ('<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "special_function", '
              '"parameters": {"arg1": 1}}\n]<|END_ACTION|>')
R7B_PARTIAL = '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "special_function", '

R7B = partial(More, "command_r7b", source="Command R7B")
COHERE2 = partial(More, "command_r7b", thinking_open=True, source="Cohere2 MoE")  # its prompt opens the thinking
COMMAND_R7B = [
    R7B("<|START_RESPONSE|>" + HELLO + "<|END_RESPONSE|>", content=HELLO),
    R7B("<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>" + HELLO + "<|END_RESPONSE|>",
        reasoning_format="deepseek", **THOUGHTS),
    R7B("<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>" + HELLO + "<|END_RESPONSE|>",
        content=UNPARSED_R7B),
    R7B("<|START_THINKING|>I'm\nthinking<|END_THINKING|>" + R7B_ACTION, reasoning_format="deepseek",
        tools=("special_function",), **THOUGHTS_CALL_IDX),
    R7B("<|START_THINKING|>I'm\nthinking<|END_THINKING|>" + R7B_PARTIAL, reasoning_format="deepseek",
        tools=("special_function",), reasoning=THINKING, calls=[("special_function", "", "0")], partial=True,
        source="Command R7B: partial"),
    R7B("<|START_THINKING|><|END_THINKING|>" + R7B_ACTION, reasoning_format="deepseek", tools=("special_function",),
        calls=[("special_function", '{"arg1":1}', "0")]),
    COHERE2("I'm\nthinking<|END_THINKING|><|START_TEXT|>" + HELLO + "<|END_TEXT|>", reasoning_format="deepseek",
            **THOUGHTS),
    COHERE2("I'm\nthinking<|END_THINKING|><|START_TEXT|>" + HELLO + "<|END_TEXT|>", content=UNPARSED_R7B,
            source="Cohere2 MoE: reasoning_format none"),
    COHERE2("<|END_THINKING|><|START_TEXT|>" + HELLO + "<|END_TEXT|>", reasoning_format="deepseek", content=HELLO),
    COHERE2("I'm\nthinking<|END_THINKING|>" + R7B_ACTION, reasoning_format="deepseek", tools=("special_function",),
            **THOUGHTS_CALL_IDX),
    COHERE2("<|END_THINKING|>" + R7B_ACTION, reasoning_format="deepseek", tools=("special_function",),
            calls=[("special_function", '{"arg1":1}', "0")]),
    COHERE2('<|END_THINKING|><|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "todo_list", '
            '"parameters": {"todos": ["buy milk", "walk dog"]}}\n]<|END_ACTION|>', reasoning_format="deepseek",
            tools=("todo_list",), calls=[("todo_list", '{"todos": ["buy milk", "walk dog"]}', "0")]),
    COHERE2('I\'m\nthinking<|END_THINKING|><|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": '
            '"special_function", "parameters": {"arg1": 1}},\n    {"tool_call_id": "1", "tool_name": "python", '
            '"parameters": {"code": "print(\'hey\')"}}\n]<|END_ACTION|>', reasoning_format="deepseek",
            parallel=True, tools=("special_function", "python"), reasoning=THINKING,
            calls=[("special_function", '{"arg1": 1}', "0"), ("python", "{\"code\": \"print('hey')\"}", "1")],
            source="Cohere2 MoE: parallel"),
    COHERE2("I'm\nthinking<|END_THINKING|><|START_TEXT|>" + HELLO + "<|END_TEXT|>", reasoning_format="deepseek",
            tools=("special_function",), source="Cohere2 MoE: tools, no call", **THOUGHTS),
    COHERE2(R7B_ACTION, reasoning_format="deepseek", tools=("special_function",), choice="required",
            calls=[("special_function", '{"arg1": 1}', "0")], source="ours: Cohere2 MoE, a required call"),
    COHERE2("I'm\nthinking<|END_THINKING|>" + R7B_PARTIAL, reasoning_format="deepseek", tools=("special_function",),
            reasoning=THINKING, calls=[("special_function", "", "0")], partial=True, source="Cohere2 MoE: partial"),
]

GRANITE = [
    More("granite", HELLO, content=HELLO, source="Granite 3.3"),
    More("granite", "<think>I'm\nthinking</think>" + HELLO, reasoning_format="deepseek", source="Granite 3.3",
         **THOUGHTS),
    # test-chat.cpp's TODO ("pending support for WRAPPED_WITH_REASONING"), as llama.cpp's earlier Granite read it
    More("granite", "<think>I'm\nthinking</think><response>" + HELLO + "</response>", reasoning_format="deepseek",
         source="Granite 3.3: the TODO case", **THOUGHTS),
    # ours: the calls the template's system prompt asks for
    More("granite", '<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]',
         tools=("special_function",), calls=[CALL], source="ours: a call"),
    More("granite", "<think>I'm\nthinking</think>" + HELLO + '<|tool_call|>[{"name": "special_function", '
         '"arguments": {"arg1": 1}}, {"name": "python", "arguments": {"code": "print(1)"}}]',
         tools=("special_function", "python"), parallel=True, reasoning_format="deepseek", reasoning=THINKING,
         content=HELLO, calls=[CALL, ("python", '{"code": "print(1)"}')], source="ours: thoughts, content, calls"),
]

FUNCTIONARY = [
    More("functionary", "all\n" + HELLO, content=HELLO, source="Functionary v3.2"),
    More("functionary", 'special_function\n{"arg1": 1}', tools=("special_function",), calls=[CALL],
         source="Functionary v3.2"),
    # ours: content before the calls, and several calls, as the template writes them back
    More("functionary", 'all\nLet me look.>>>special_function\n{"arg1": 1}>>>python\n{"code": "print(1)"}',
         tools=("special_function", "python"), parallel=True, content="Let me look.",
         calls=[CALL, ("python", '{"code": "print(1)"}')], source="ours: content, calls"),
    More("functionary", "all\n" + HELLO, tools=("special_function",), content=HELLO, source="ours: tools, no call"),
    More("functionary", 'python\n{"code": "print(1)"}', tools=("special_function", "python"),
         choice={"type": "function", "function": {"name": "python"}}, calls=[("python", '{"code": "print(1)"}')],
         source="ours: a named function"),
]

ANALYSIS = "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
GPT_OSS = partial(More, "gpt_oss", reasoning_format="auto", source="GPT-OSS")
GPT = [
    More("gpt_oss", "<|channel|>final<|message|>" + HELLO, content=HELLO, source="GPT-OSS: final"),
    More("gpt_oss", "<|channel|>commentary<|message|>" + HELLO, content=HELLO, source="GPT-OSS: commentary"),
    GPT_OSS(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>" + HELLO, **THOUGHTS),
    More("gpt_oss", ANALYSIS + "<|start|>assistant<|channel|>final<|message|>" + HELLO, content=ANALYSIS + HELLO,
         source="GPT-OSS: reasoning_format none"),
    GPT_OSS("<|channel|>analysis<|message|>I'm\nthinking", reasoning=THINKING, partial=True,
            source="GPT-OSS: partial analysis"),
    GPT_OSS(' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', tools=("special_function",),
            calls=[CALL], source="GPT-OSS: recipient in the role"),
    GPT_OSS('<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', tools=("special_function",),
            calls=[CALL], source="GPT-OSS: recipient in the channel"),
    GPT_OSS(' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}',
            tools=("special_function",), calls=[CALL], source="GPT-OSS: constraint"),
    GPT_OSS('<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', tools=("special_function",),
            calls=[CALL], source="GPT-OSS: commentary channel"),
    GPT_OSS(ANALYSIS + '<|start|>assistant to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}',
            tools=("special_function",), reasoning=THINKING, calls=[("special_function", '{"arg1":1}')],
            source="GPT-OSS: thoughts, a call"),
    GPT_OSS("<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.edit <|constrain|>json<|message|>{"oldString": "if (part < railCount - 1) {", '
            '"newString": "if (part < 4) {", "replaceAll": false}', tools=("gpt-oss edit",),
            reasoning="Thinking about edit...",
            calls=[("edit", '{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", '
                            '"replaceAll": false}')], source="GPT-OSS: complex tool calling"),
    GPT_OSS("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant "
            "to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'",
            reasoning="I will execute python to say hello", source="GPT-OSS: unsolicited, recipient in the role"),
    GPT_OSS("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant<|channel|>"
            'commentary to=python <|constrain|>code<|message|>print("hello")',
            reasoning="I will execute python to say hello", source="GPT-OSS: unsolicited, recipient in the channel"),
    GPT_OSS("<|channel|>commentary to=assistant" + ANALYSIS + "<|start|>assistant<|channel|>final<|message|>" + HELLO,
            source="GPT-OSS: stray commentary before the reasoning", **THOUGHTS),
    GPT_OSS(ANALYSIS + "<|start|>assistant<|channel|>commentary to=assistant<|channel|>final<|message|>" + HELLO,
            source="GPT-OSS: stray commentary before the final message", **THOUGHTS),
]

GEMMA = partial(More, "gemma4", source="Gemma 4")
GEMMA_CALLS = [  # (input's call, tool, expected arguments)
    ('get_time{city:<|"|>London<|"|>}', "get_time", '{"city": "London"}'),
    ('get_time{city:<|"|>San Francisco<|"|>}', "get_time", '{"city": "San Francisco"}'),
    ("empty_args{}", "empty_args", "{}"),
    ("special_function{arg1:42}", "special_function", '{"arg1": 42}'),
    ("special_function{arg1:-7}", "special_function", '{"arg1": -7}'),
    ("amount{orig:3.14}", "amount", '{"orig": 3.14}'),
    ("toggle{enabled:true}", "toggle", '{"enabled": true}'),
    ("toggle{enabled:false}", "toggle", '{"enabled": false}'),
    ("set_nullable{value:null}", "set_nullable", '{"value": null}'),
    ('todo_list{todos:[<|"|>buy milk<|"|>,<|"|>walk dog<|"|>]}', "todo_list", '{"todos":["buy milk","walk dog"]}'),
    ('set_config{config:{theme:<|"|>dark<|"|>,count:3}}', "set_config", '{"config":{"theme":"dark","count":3}}'),
    ("todo_list{todos:[]}", "todo_list", '{"todos":[]}'),
    ("set_config{config:{}}", "set_config", '{"config":{}}'),
    ("amount{orig:1.5e10}", "amount", '{"orig": 1.5e10}'),
]
GEMMA4 = [
    GEMMA("Hello, world!", content="Hello, world!"),
    GEMMA("<|channel>thought\nI'm\nthinking<channel|>" + HELLO, reasoning_format="auto", **THOUGHTS),
    GEMMA("<|channel>thought<channel|>" + HELLO, reasoning_format="auto", content=HELLO,
          source="Gemma 4: empty reasoning"),
    GEMMA("<|channel>thought\nI'm\nthinking<channel|>" + HELLO, content="<|channel>thought\nI'm\nthinking<channel|>"
          + HELLO, source="Gemma 4: reasoning_format none"),
    *[GEMMA(f"<|tool_call>call:{text}<tool_call|>", tools=(name,), calls=[(name, args)], source=f"Gemma 4: {name}")
      for text, name, args in GEMMA_CALLS],
    GEMMA(HELLO + '<|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>', tools=("get_time",), content=HELLO,
          calls=[("get_time", '{"city": "Paris"}')], source="Gemma 4: content, a call"),
    GEMMA('<|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>', tools=("get_time",), choice="required",
          calls=[("get_time", '{"city": "Paris"}')], source="Gemma 4: required"),
    GEMMA("<|channel>thought\nI'm\nthinking<channel|><|tool_call>call:get_time{city:<|\"|>Paris<|\"|>}<tool_call|>",
          reasoning_format="auto", tools=("get_time",), choice="required", reasoning=THINKING,
          calls=[("get_time", '{"city": "Paris"}')], source="Gemma 4: required after reasoning"),
    GEMMA('<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|>'
          '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>', tools=("get_time", "get_weather"),
          parallel=True, calls=[("get_time", '{"city": "London"}'), ("get_weather", '{"city": "Paris"}')],
          source="Gemma 4: parallel"),
    GEMMA("<|channel>thought\n<channel|>" + HELLO + "<channel|>", reasoning_format="auto", content=HELLO,
          source="Gemma 4: a stray <channel|>"),
    GEMMA("<|channel>thought\n<channel|>" + HELLO + "<|channel>thought\n<channel|>", reasoning_format="auto",
          content=HELLO, source="Gemma 4: an empty thought at the end"),
    GEMMA("<|channel>thought\n<channel|>" + HELLO + "<|channel>thought\n<channel|><channel|>", reasoning_format="auto",
          content=HELLO, source="Gemma 4: an empty thought and a stray <channel|>"),
    GEMMA("<|channel><|channel>thought\n<channel|>" + HELLO, reasoning_format="auto", content=HELLO,
          source="Gemma 4: a repeated channel opening"),
]



def dsml(*invokes: tuple[str, list[tuple[str, str, bool]]], block: str = "function_calls") -> str:
    """A DSML block of invokes (name, [(parameter, value, string?)])."""
    body = "".join(f'<｜DSML｜invoke name="{name}">\n'
                   + "".join(f'<｜DSML｜parameter name="{k}" string="{str(s).lower()}">{v}</｜DSML｜parameter>\n'
                             for k, v, s in params)
                   + "</｜DSML｜invoke>\n" for name, params in invokes)
    return f"<｜DSML｜{block}>\n{body}</｜DSML｜{block}>"


V31 = partial(More, "deepseek", reasoning_format="deepseek", source="DeepSeek V3.1")
V32 = partial(More, "deepseek", reasoning_format="deepseek", source="DeepSeek V3.2")
V4 = partial(More, "deepseek", reasoning_format="deepseek", source="DeepSeek V4")
R1 = partial(More, "deepseek", reasoning_format="deepseek", thinking_open=True, source="DeepSeek R1")
CALL_V31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{}<｜tool▁sep｜>{{\"city\": \"{}\"}}<｜tool▁call▁end｜>"
CALL_R1 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
           "```json\n{\"arg1\": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
TOKYO = dsml(("get_time", [("city", "Tokyo", True)]))
ARG1 = dsml(("special_function", [("arg1", "1", False)]))
BOTH_PARIS = dsml(("get_time", [("city", "Paris", True)]), ("get_weather", [("city", "Paris", True)]))
MAGIC_INT = dsml(("magic_int", [("ref", "42", False), ("name", "foo bar", True)]))


def v4(text: str) -> str:
    return text.replace("｜DSML｜function_calls>", "｜DSML｜tool_calls>")


DEEPSEEK = [
    # V3.1: the prompt opens <think> with thinking enabled, closes it without
    V31(CALL_V31.format("get_time", "XYZCITY") + "<｜tool▁calls▁end｜>", tools=("get_time",),
        calls=[("get_time", '{"city":"XYZCITY"}')]),
    V31("REASONING</think>" + CALL_V31.format("get_time", "Tokyo") + "<｜tool▁calls▁end｜>", thinking_open=True,
        tools=("get_time",), reasoning="REASONING", calls=[("get_time", '{"city":"Tokyo"}')]),
    V31("REASONING</think>CONTENT" + CALL_V31.format("get_time", "Paris")
        + CALL_V31.format("get_weather", "Paris")[len("<｜tool▁calls▁begin｜>"):] + "<｜tool▁calls▁end｜>",
        thinking_open=True, tools=("get_time", "get_weather"), parallel=True, reasoning="REASONING",
        content="CONTENT", calls=[("get_time", '{"city":"Paris"}'), ("get_weather", '{"city":"Paris"}')],
        source="DeepSeek V3.1: parallel"),
    V31("REASONING</think>\nCONTENT", thinking_open=True, content="CONTENT", reasoning="REASONING\n"),
    V31("CONTENT", content="CONTENT"),
    # V3.2 (DSML): the prompt ends in <think> (thinking) or <think></think>
    V32(HELLO, content=HELLO),
    V32("I'm\nthinking</think>" + HELLO, thinking_open=True, **THOUGHTS),
    V32("Let me check the time</think>\n\n" + TOKYO, thinking_open=True, tools=("get_time",),
        reasoning="Let me check the time", calls=[("get_time", '{"city": "Tokyo"}')]),
    V32(ARG1, tools=("special_function",), calls=[CALL], source="DeepSeek V3.2: integer, no thinking"),
    V32("Calling both</think>\n\n" + BOTH_PARIS, thinking_open=True, parallel=True, tools=("get_time", "get_weather"),
        reasoning="Calling both", calls=[("get_time", '{"city": "Paris"}'), ("get_weather", '{"city": "Paris"}')],
        source="DeepSeek V3.2: parallel"),
    V32("Thinking about it</think>Let me call the function.\n\n" + ARG1, thinking_open=True,
        tools=("special_function",), reasoning="Thinking about it", content="Let me call the function.",
        calls=[CALL], source="DeepSeek V3.2: content before the calls"),
    *[V32(f"Test {what}</think>\n\n" + dsml((name, [(key, value, False)])), thinking_open=True, tools=(name,),
          reasoning=f"Test {what}", calls=[(name, args)], source=f"DeepSeek V3.2: {what}")
      for what, name, key, value, args in [
          ("negative", "magic_int", "ref", "-14", '{"ref": -14}'),
          ("decimal", "amount", "orig", "3.14", '{"orig": 3.14}'),
          ("boolean", "toggle", "enabled", "true", '{"enabled": true}'),
          ("array", "todo_list", "todos", '["buy milk","walk dog"]', '{"todos": ["buy milk", "walk dog"]}'),
          ("object", "set_config", "config", '{"theme":"dark","level":2}',
           '{"config": {"theme": "dark", "level": 2}}')]],
    V32("</think>\n\n" + dsml(("get_time", [("city", "XYZCITY", True)])), thinking_open=True, tools=("get_time",),
        calls=[("get_time", '{"city": "XYZCITY"}')], source="DeepSeek V3.2: empty reasoning"),
    V32("Multi-arg call</think>\n\n" + MAGIC_INT, thinking_open=True, tools=("magic_int",), reasoning="Multi-arg call",
        calls=[("magic_int", '{"ref": 42, "name": "foo bar"}')], source="DeepSeek V3.2: several parameters"),
    # V4: DSML's block is tool_calls; the prompt ends in <think> (thinking) or </think>
    V4(HELLO, content=HELLO),
    V4("I'm\nthinking</think>" + HELLO, thinking_open=True, **THOUGHTS),
    V4("Let me check the time</think>\n\n" + v4(TOKYO), thinking_open=True, tools=("get_time",),
       reasoning="Let me check the time", calls=[("get_time", '{"city": "Tokyo"}')]),
    V4(v4(ARG1), tools=("special_function",), calls=[CALL], source="DeepSeek V4: integer, no thinking"),
    V4("Calling both</think>\n\n" + v4(BOTH_PARIS), thinking_open=True, parallel=True, tools=("get_time", "get_weather"),
       reasoning="Calling both", calls=[("get_time", '{"city": "Paris"}'), ("get_weather", '{"city": "Paris"}')],
       source="DeepSeek V4: parallel"),
    V4("Thinking about it</think>Let me call the function.\n\n" + v4(ARG1), thinking_open=True,
       tools=("special_function",), reasoning="Thinking about it", content="Let me call the function.",
       calls=[CALL], source="DeepSeek V4: content before the calls"),
    V4("Multi-arg call</think>\n\n" + v4(MAGIC_INT), thinking_open=True, tools=("magic_int",),
       reasoning="Multi-arg call", calls=[("magic_int", '{"ref": 42, "name": "foo bar"}')],
       source="DeepSeek V4: several parameters"),
    V4("Let me check the time\n\n" + v4(TOKYO), thinking_open=True, tools=("get_time",),
       reasoning="Let me check the time", calls=[("get_time", '{"city": "Tokyo"}')],
       source="DeepSeek V4: a call ends the reasoning"),
    V4("\n\n" + v4(ARG1), tools=("special_function",), calls=[CALL], source="DeepSeek V4 Flash"),
    # R1 and its distills: the prompt opens <think> (R1-Distill-Qwen's closes it without thinking)
    R1("</think>" + HELLO, content=HELLO, source="DeepSeek R1 Distill Llama"),
    R1("I'm\nthinking</think>" + HELLO, source="DeepSeek R1 Distill Llama", **THOUGHTS),
    R1("</think>" + HELLO, content=HELLO, source="llama.cpp's DeepSeek R1"),
    R1("I'm\nthinking</think>" + HELLO, source="llama.cpp's DeepSeek R1", **THOUGHTS),
    R1("</think>" + CALL_R1, tools=("special_function",), parallel=True, calls=[CALL], source="llama.cpp's DeepSeek R1"),
    R1("</think>" + HELLO, content=HELLO, source="DeepSeek R1 Distill Qwen"),
    R1("I'm\nthinking</think>" + HELLO, source="DeepSeek R1 Distill Qwen", **THOUGHTS),
    R1(CALL_R1, thinking_open=False, tools=("special_function",), calls=[CALL],
       source="DeepSeek R1 Distill Qwen: thinking disabled"),
    # ours: a required call forced right after the prompt's <think>
    R1(CALL_R1, tools=("special_function",), choice="required", calls=[CALL], source="ours: R1, a required call"),
    V31(CALL_V31.format("get_time", "Paris") + "<｜tool▁calls▁end｜>", thinking_open=True, tools=("get_time",),
        choice="required", calls=[("get_time", '{"city": "Paris"}')], source="ours: V3.1, a required call"),
]

CASES = COMMAND_R7B + GRANITE + FUNCTIONARY + GPT + GEMMA4 + DEEPSEEK


@pytest.mark.parametrize("case", CASES, ids=[f"{c.family}:{c.source}:{i}" for i, c in enumerate(CASES)])
def test_the_cases_of_test_chat_cpp(case: More):
    fmt = family(case.family)()
    assert_message(case, stream(fmt, case.input, case.syntax))
    if case.partial:
        assert_message(case, fmt.parse(case.input, True, case.syntax))


# ---- detection ---------------------------------------------------------------------------

DETECTED = {
    "command_r7b": ["CohereForAI-c4ai-command-r7b-12-2024-tool_use", "Cohere2MoE"],
    "granite": ["ibm-granite-granite-3.3-2B-Instruct"],
    "functionary": ["meetkai-functionary-medium-v3.2"],
    "gpt_oss": ["openai-gpt-oss-120b"],
    "gemma4": ["google-gemma-4-31B-it", "google-gemma-4-31B-it-interleaved"],
    "deepseek": ["deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-V3.2", "deepseek-ai-DeepSeek-V4",
                 "deepseek-ai-DeepSeek-V4-Flash-0731", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
                 "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "llama-cpp-deepseek-r1"],
}


@pytest.mark.parametrize("name,template", [(n, t) for n, ts in DETECTED.items() for t in ts])
def test_each_template_detects_as_its_family(name: str, template: str):
    assert detect((TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")).name == name


def test_granite_4_is_not_granite_3():
    """Granite 4.x writes <tool_call> JSON: hermes' (its template mentions no <|tool_call|>)."""
    for template in ("ibm-granite-granite-4.0", "ibm-granite-granite-4.1"):
        source = (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
        assert not family("granite").matches(source)
        assert not family("granite").matches(source + "<|tool_call|>")


# ---- grammars, held to llama.cpp ---------------------------------------------------------

@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory):
    """jobs -> llama.cpp's verdicts, through tests/chat_grammar_harness.cpp: for each job
    (grammar, text, search, triggers), whether the grammar accepts `text` whole (1; 2: only a
    prefix of what it wants; 0: no) and where each trigger starts the grammar in `search` (a
    character index, None where it does not fire)."""
    folder = tmp_path_factory.mktemp("chat-grammar")
    src = vendored_tree(folder / "llama-cpp", "include", "ggml/include", "src/llama-grammar.h")
    libs, harness = wheel_libs(), folder / "chat_grammar_harness"
    compile_cxx(f"-I{src / 'src'}", f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", HARNESS,
                f"-L{libs}", "-lllama", f"-Wl,--disable-new-dtags,-rpath,{libs}", "-o", harness)

    def field(text: str) -> bytes:
        data = text.encode()
        return f"{len(data)}\n".encode() + data

    def run(jobs: list[tuple[str, str, str, tuple[str, ...]]]) -> list[tuple[int, list[int | None]]]:
        feed = b"".join(field(g) + field(t) + field(s) + f"{len(ps)}\n".encode() + b"".join(map(field, ps))
                        for g, t, s, ps in jobs)
        proc = subprocess.run([str(harness)], input=feed, capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
        results = []
        for (_, _, search, _), line in zip(jobs, proc.stdout.decode().splitlines(), strict=True):
            verdict, *starts = map(int, line.split())
            assert -2 not in starts, "std::regex refuses a trigger"
            results.append((verdict, [None if s < 0 else len(search.encode()[:s].decode()) for s in starts]))
        return results

    return run


def trigger_start(pattern: str, text: str) -> int | None:
    """llama_grammar_trigger_pattern::find in Python's re: a pattern in ^...$ against the whole
    text first, then anywhere; the grammar starts at the first non-empty group (else the match)."""
    found = re.fullmatch(pattern, text) if pattern.startswith("^") and pattern.endswith("$") else None
    found = found or re.search(pattern, text)
    if found is None:
        return None
    return next((found.start(i) for i in range(1, found.re.groups + 1) if found.group(i)), found.start())


def first_trigger(patterns: tuple[str, ...], text: str) -> tuple[int, int] | None:
    """As a lazy grammar meets the text growing (here a character at a time): the length at which
    a trigger first fires, and where the grammar starts (the first firing trigger's, in order)."""
    for end in range(1, len(text) + 1):
        for pattern in patterns:
            start = trigger_start(pattern, text[:end])
            if start is not None:
                return end, start
    return None


GRAMMAR_CASES = [c for c in CASES if c.calls and not c.partial]


@pytest.mark.parametrize("case", GRAMMAR_CASES, ids=[f"{c.family}:{c.source}:{i}" for i, c in enumerate(GRAMMAR_CASES)])
def test_the_grammar_takes_the_calls_as_llama_cpp_reads_it(case: More, llama_cpp):
    """test_peg_parser's grammar check: the triggers (of the grammar for tool_choice auto) fire on
    the case's text, the same in Python's re and in llama.cpp; llama.cpp's grammar engine accepts
    the text from there, whole, for the case's choice (a required call's grammar applies from
    the first token of the calls)."""
    fmt, tools = family(case.family)(), [tool_def(n) for n in case.tools]
    grammar = fmt.grammar(tools, case.choice, case.parallel)
    assert grammar.lazy == (case.choice == "auto")
    triggers = fmt.grammar(tools, "auto", case.parallel).triggers
    fired = first_trigger(triggers, case.input)
    assert fired is not None, f"no trigger fires: {triggers}"
    end, start = fired
    python_starts = [[trigger_start(p, s) for p in triggers] for s in (case.input[:end], case.input)]
    results = llama_cpp([("root ::= \"\"", "", case.input[:end], triggers), ("root ::= \"\"", "", case.input, triggers),
                         (grammar.gbnf, case.input[start:], "", ())])
    assert [r[1] for r in results[:2]] == python_starts
    assert results[2][0] == 1, f"llama.cpp's grammar refuses {case.input[start:]!r} ({results[2][0]})"


def _r7b_two() -> str:
    second = '{"tool_call_id": "1", "tool_name": "python", "parameters": {"code": "print(1)"}}'
    return R7B_ACTION.replace("}}\n]", "}},\n    " + second + "\n]")


def _deepseek_samples() -> list[tuple[str, str]]:
    python_r1 = "\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>python\n```json\n{\"code\": \"print(1)\"}\n```<｜tool▁call▁end｜>"
    python_v31 = '<｜tool▁call▁begin｜>python<｜tool▁sep｜>{"code": "print(1)"}<｜tool▁call▁end｜>'
    v31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>special_function<｜tool▁sep｜>{"arg1": 1}<｜tool▁call▁end｜>'
    dsml_two = dsml(("special_function", [("arg1", "1", False)]), ("python", [("code", "print(1)", True)]))
    end = "<｜tool▁calls▁end｜>"
    return [(CALL_R1, CALL_R1.replace(end, python_r1 + end)), (v31 + end, v31 + python_v31 + end),
            (ARG1, dsml_two), (v4(ARG1), v4(dsml_two))]


# family -> [(a call of special_function, that call and one of python after it)], as each form writes them
SAMPLES = {
    "command_r7b": [(R7B_ACTION, _r7b_two())],
    "granite": [('<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]',
                 '<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}, '
                 '{"name": "python", "arguments": {"code": "print(1)"}}]')],
    "functionary": [('special_function\n{"arg1": 1}', 'special_function\n{"arg1": 1}>>>python\n{"code": "print(1)"}')],
    "gemma4": [("<|tool_call>call:special_function{arg1:1}<tool_call|>",
                '<|tool_call>call:special_function{arg1:1}<tool_call|><|tool_call>call:python{code:<|"|>print(1)<|"|>}'
                "<tool_call|>")],
    "gpt_oss": [(' to=functions.special_function<|channel|>commentary <|constrain|>json<|message|>{"arg1": 1}', None),
                ('<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', None)],
    "deepseek": _deepseek_samples(),
}
SAMPLE_CASES = [(name, one, two) for name, pairs in SAMPLES.items() for one, two in pairs]
NAMED_PYTHON = {"type": "function", "function": {"name": "python"}}


@pytest.mark.parametrize("name,one,two", SAMPLE_CASES, ids=[f"{n}:{i}" for i, (n, _, _) in enumerate(SAMPLE_CASES)])
@pytest.mark.parametrize("choice", ["auto", "required", NAMED_PYTHON], ids=["auto", "required", "named"])
@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
def test_one_call_or_several_and_only_the_named_tool(name: str, one: str, two: str | None, choice, parallel: bool,
                                                     llama_cpp):
    """Without parallel_tool_calls the grammar takes exactly one call, with it one or more; a
    named function's grammar refuses another tool's call; and the parser reads back the calls
    the grammar takes."""
    fmt, tools = family(name)(), [TOOLS["special_function"], TOOLS["python"]]
    grammar = fmt.grammar(tools, choice, parallel)
    texts = [one] if two is None else [one, two]
    verdicts = [v for v, _ in llama_cpp([(grammar.gbnf, text, "", ()) for text in texts])]
    if choice == NAMED_PYTHON:
        assert verdicts[0] == 0
    else:
        assert verdicts == ([1] if two is None else [1, 1 if parallel else 0])
    syntax = Syntax("auto", tools=True)
    assert [c.name for c in fmt.parse(one, False, syntax).tool_calls] == ["special_function"]
    if two is not None:
        assert [c.name for c in fmt.parse(two, False, syntax).tool_calls] == ["special_function", "python"]


# tests/test_chat_formats.py's checks of every family's grammar, for these families

@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "special_function"}}],
                         ids=["auto", "required", "named"])
@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
def test_a_grammar_for_every_choice(name: str, choice, parallel: bool):
    every_choice(name, choice, parallel)


@pytest.mark.parametrize("name", FAMILIES)
def test_no_grammar_for_tool_choice_none(name: str):
    no_grammar(name)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tool_whose_parameters_are_no_schema_is_refused_by_name(name: str):
    bad_schema(name)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_named_function_that_is_no_tool_is_refused(name: str):
    named_no_tool(name)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_damaged_answer_still_streams(name: str):
    """Each case's input with a character cut out (at a quarter, half and three quarters of it):
    whatever the parser makes of it, each parse extends the one before (tests/test_chat_formats.py's
    stream), with tools and without."""
    for case in (c for c in CASES if c.family == name):
        for cut in (len(case.input) // 4, len(case.input) // 2, 3 * len(case.input) // 4):
            damaged = case.input[:cut] + case.input[cut + 1:]
            for syntax in (case.syntax, Syntax(case.reasoning_format, case.thinking_open)):
                stream(family(name)(), damaged, syntax)
