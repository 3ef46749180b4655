"""What a template family's format is, for tool calls and reasoning: how the model's text is read
back into a message (`parse`, also on a prefix while streaming), and the grammar that holds a
call's arguments to its tool's JSON schema (`grammar`), lazy from the family's trigger where the
model may write text first, as the pinned llama.cpp's chat formats (common/chat.cpp,
common/parsers/) are.

A family is a subclass in formats/, found by `formats.detect(template_source)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from speculative.chat.message import ChatMessage

REASONING_FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")  # llama.cpp's --reasoning-format
TOOL_CHOICES = ("auto", "none", "required")                         # or {"type": "function", ...}


@dataclass(frozen=True)
class Syntax:
    """How one request's answer is read.

    reasoning_format: llama.cpp's --reasoning-format. `none` leaves thinking in the content;
      `deepseek` puts it in reasoning_content; `auto` and `deepseek-legacy` read as `deepseek`
      (the pinned parsers read them alike).
    thinking_open: the generation prompt ends inside the thinking block (the template opened
      `<think>`), so the text starts in reasoning.
    tools: the request has tools and a tool_choice other than `none`: calls are parsed (without,
      a call's text is content).
    parameters: each tool's parameters (JSON schema) by its name, for the formats whose
      arguments are not JSON and are typed by the schema (qwen3_coder's XML values: `5` is a
      number or the string "5" as the schema says); None: typed as they read.
    """
    reasoning_format: str = "auto"
    thinking_open: bool = False
    tools: bool = False
    parameters: dict[str, object] | None = field(default=None, hash=False)

    @property
    def extract_reasoning(self) -> bool:
        return self.reasoning_format != "none"


@dataclass(frozen=True)
class ToolGrammar:
    """The grammar for a request's tool calls (GBNF, root rule `root`).

    triggers: regular expressions, matched against the generated text, as llama.cpp's lazy
      grammars take them (llama_sampler_init_grammar_lazy_patterns): the grammar applies from
      the start of the first match's first group (the whole match when it has none). Empty:
      the grammar applies from the first token (tool_choice `required` or a named function).
    """
    gbnf: str
    triggers: tuple[str, ...] = ()

    @property
    def lazy(self) -> bool:
        return bool(self.triggers)


class Format:
    """A family's format. Subclasses set `name`, say which templates are theirs (`matches`),
    and implement `parse` and `grammar`."""
    name: ClassVar[str] = ""
    think: ClassVar[tuple[str, str] | None] = ("<think>", "</think>")  # None: no thinking block

    @classmethod
    def matches(cls, source: str) -> bool:
        """Whether a chat template (its Jinja source) writes this family's format."""
        raise NotImplementedError

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        """The message in the model's `text` (what it generated after the prompt). With
        `partial`, text is a prefix of the answer: what may still become a call's opening or a
        tag is held back (not content yet), a call's arguments are the JSON written so far, and
        each later parse extends this one (message.diffs)."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        """The grammar for `tools` (OpenAI's: {"type": "function", "function": {name, description,
        parameters}}), `choice` ("auto", "required", or {"type": "function", "function": {"name":
        ...}}) and `parallel` (several calls allowed); None with choice "none"."""
        raise NotImplementedError
