"""The assistant's message as the API returns it: content, reasoning and tool calls, parsed from
the model's text (format.py); and, while the text grows, the deltas between two parses, as the
pinned llama.cpp computes them (common_chat_msg_diff::compute_diffs) for a stream."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str = ""  # JSON text of an object; while streaming, a prefix of it
    id: str = ""         # the model's own id where its format has one; the server gives the rest


@dataclass
class ChatMessage:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Delta:
    """One change between two parses: text added to the content or the reasoning, or to the
    tool call at `index` (its name and id when they are new, a piece of its arguments)."""
    content: str = ""
    reasoning_content: str = ""
    index: int | None = None
    call: ToolCall | None = None


class DiffError(ValueError):
    """A later parse is not an extension of an earlier one (a parser's bug)."""


def _added(before: str, after: str) -> str:
    if not after.startswith(before):
        raise DiffError(f"{after!r} does not extend {before!r}")
    return after[len(before):]


def diffs(before: ChatMessage, after: ChatMessage) -> list[Delta]:
    """What `after` adds to `before`: reasoning, then content, then the last call of `before`
    grown, then each new call."""
    out = []
    if after.reasoning_content != before.reasoning_content:
        out.append(Delta(reasoning_content=_added(before.reasoning_content, after.reasoning_content)))
    if after.content != before.content:
        out.append(Delta(content=_added(before.content, after.content)))
    if len(after.tool_calls) < len(before.tool_calls):
        raise DiffError(f"{len(after.tool_calls)} tool calls after {len(before.tool_calls)}")
    if before.tool_calls:
        i = len(before.tool_calls) - 1
        old, new = before.tool_calls[i], after.tool_calls[i]
        if old.name and new.name and not new.name.startswith(old.name):
            raise DiffError(f"tool call {i} renamed from {old.name!r} to {new.name!r}")
        args = _added(old.arguments, new.arguments)
        renamed = (old.id, old.name) != (new.id, new.name)
        if args or renamed:
            out.append(Delta(index=i, call=ToolCall(new.name if renamed else "", args, new.id if renamed else "")))
    for i in range(len(before.tool_calls), len(after.tool_calls)):
        new = after.tool_calls[i]
        out.append(Delta(index=i, call=ToolCall(new.name, new.arguments, new.id)))
    return out


def accumulate(message: ChatMessage, delta: Delta) -> None:
    """Apply one delta, as a client assembling a stream does (the tests' check of `diffs`)."""
    message.reasoning_content += delta.reasoning_content
    message.content += delta.content
    if delta.index is not None:
        while len(message.tool_calls) <= delta.index:
            message.tool_calls.append(ToolCall(""))
        call = message.tool_calls[delta.index]
        call.name = delta.call.name or call.name
        call.id = delta.call.id or call.id
        call.arguments += delta.call.arguments
