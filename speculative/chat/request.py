"""What a chat request asks of its answer's format: the template's family (formats.detect), how
its text is read back (Syntax), and the grammar of its tool calls (lazy from the family's
trigger with tool_choice auto; from the first token with required or a named function), from
the request's tools, tool_choice, parallel_tool_calls and reasoning_format, as llama-server
--jinja reads them (common_chat_templates_apply)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from speculative.chat import formats
from speculative.chat.format import REASONING_FORMATS, Format, Syntax, ToolGrammar
from speculative.chat.message import ChatMessage, Delta, DiffError, diffs
from speculative.errors import UsageError

log = logging.getLogger("speculate")


@dataclass(frozen=True)
class Plan:
    format: Format
    syntax: Syntax
    grammar: ToolGrammar | None = None

    def after_prompt(self, prompt_tail: str) -> "Plan":
        """The plan once the prompt is rendered: whether it ends inside the thinking block (the
        template opened it, so the answer starts in reasoning)."""
        think = self.format.think
        opened = bool(think) and prompt_tail.rstrip().endswith(think[0])
        return dataclasses.replace(self, syntax=dataclasses.replace(self.syntax, thinking_open=opened))

    def read(self, text: str, final: bool = True) -> ChatMessage:
        """The message in `text`; a final text that does not parse (cut by max_tokens inside a
        call) is read as the prefix it is."""
        if final:
            try:
                return self.format.parse(text, False, self.syntax)
            except ValueError:
                pass
        return self.format.parse(text, True, self.syntax)


class Reading:
    """An answer read as it grows: each piece of text gives what it adds to the message (reasoning,
    content, a call's name or a piece of its arguments); what may still become a tag or a call's
    opening waits for the next piece, or for the end. Without a plan, the text is all content."""

    def __init__(self, plan: Plan | None):
        self.plan = plan
        self.text = ""
        self.message = ChatMessage()

    def push(self, text: str) -> list[Delta]:
        self.text += text
        return self._advance(self._read(final=False))

    def end(self) -> list[Delta]:
        return self._advance(self._read(final=True))

    def whole(self, text: str) -> ChatMessage:
        """The message in a whole answer, read at once (not streamed)."""
        return ChatMessage(content=text) if self.plan is None else self.plan.read(text)

    def _read(self, final: bool) -> ChatMessage:
        return self.whole(self.text) if final or self.plan is None else self.plan.read(self.text, final=False)

    def _advance(self, message: ChatMessage) -> list[Delta]:
        try:
            changes = diffs(self.message, message)
        except DiffError:  # a parser's bug: nothing that contradicts what was said
            log.warning("chat format %s: a parse does not extend the previous one; its change is dropped",
                        self.plan.format.name if self.plan else "none")
            return []
        self.message = message
        return changes


def plan(template: str, tools: list[dict] | None = None, choice: str | dict = "auto", parallel: bool = False,
         reasoning_format: str = "auto") -> Plan:
    """The plan for a request to a model whose Jinja chat template is `template`. UsageError
    for a choice the tools cannot meet (a named function that is not one of them, `required`
    without tools) or a reasoning format llama.cpp lacks; GrammarError for a tool's bad schema."""
    if reasoning_format not in REASONING_FORMATS:
        raise UsageError(f"reasoning_format: one of {', '.join(REASONING_FORMATS)}, not {reasoning_format!r}")
    family = formats.detect(template)
    if family.think is not None and family.think[0] not in template:
        reasoning_format = "none"  # a template that never thinks: a tag in the text is text
    tools = tools or []
    named = chosen_name(choice)
    if named is not None and named not in {t["function"]["name"] for t in tools}:
        raise UsageError(f"tool_choice: no tool named {named!r} among the request's tools")
    if choice == "required" and not tools:
        raise UsageError("tool_choice: required needs tools")
    calls = bool(tools) and choice != "none"
    grammar = family.grammar(tools, choice, parallel) if calls else None
    parameters = {t["function"]["name"]: t["function"].get("parameters") for t in tools} if calls else None
    return Plan(family, Syntax(reasoning_format=reasoning_format, tools=calls, parameters=parameters), grammar)


def chosen_name(choice: str | dict) -> str | None:
    """The function a tool_choice names ({"type": "function", "function": {"name": ...}}), or None."""
    if isinstance(choice, dict):
        return choice["function"]["name"]
    return None
