"""A template none of the families writes: plain content (and reasoning in <think>, where the
model writes it).

The pinned llama.cpp has no generic JSON tool-call form any more (COMMON_CHAT_FORMAT_GENERIC is
gone): a template its differential autoparser finds no tool calls in is read as content, and
no grammar is made for its tools (common/chat-auto-parser-generator.cpp). So here: tools are
not read from the text, tool_choice "auto" has no grammar, and "required" or a named function,
which nothing could meet, is refused.
"""

from __future__ import annotations

from speculative.chat.format import Format, Syntax, ToolGrammar
from speculative.chat.formats._common import selected, split_reasoning
from speculative.chat.message import ChatMessage
from speculative.errors import GrammarError


class Generic(Format):
    name = "generic"

    @classmethod
    def matches(cls, source: str) -> bool:
        return True  # the fallback: detect() asks it last, if at all

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        reasoning, rest = split_reasoning(text, partial, syntax, self.think)
        return ChatMessage(content=rest, reasoning_content=reasoning)

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        if selected(tools, choice) is None or choice == "auto":
            return None
        wanted = "a named function" if isinstance(choice, dict) else f'"{choice}"'
        raise GrammarError(f"tool_choice {wanted}: this model's chat template has no tool support")


FORMAT = Generic
