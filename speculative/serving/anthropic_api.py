"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens) as the pinned
llama-server serves it, translated to and from the OpenAI chat API, without HTTP.

A request becomes an OpenAI chat body, as llama-server's server_chat_convert_anthropic_to_oai
makes it (`to_openai`), which openai_api.parse then reads as /v1/chat/completions' own: every
check, the chat template, the tool grammars and the reasoning rules are that endpoint's. The
system prompt becomes a system message; text blocks stay text parts; tool_use blocks become the
assistant's tool_calls and thinking blocks its reasoning_content; each tool_result becomes a
tool message after the message that held it; stop_sequences become `stop`, thinking's
budget_tokens the reasoning budget, and max_tokens defaults to 4096 (Anthropic's API requires it).

The answer is Reply's (openai_api.py), read back into Anthropic's shapes: the whole
chat.completion as a message (`message`, llama-server's to_json_anthropic), and the stream's
chunks as Anthropic's events (`Events`). Neither carries llama-server's `timings`.

Where this is stricter than llama-server, which skips what it cannot read: a message, block or
tool that is not an object, a block type it does not know, a field of the wrong type are a 400
here, never silently dropped. An image anywhere is refused with llama-server's own 500 for a
model without a vision projector.
"""

from __future__ import annotations

import json

from speculative.serving.generation import ApiError

DEFAULT_MAX_TOKENS = 4096         # llama-server's, for a body without max_tokens
DEFAULT_THINKING_BUDGET = 10000   # llama-server's, for thinking enabled without budget_tokens
PASSED_ON = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")  # the same in both APIs
IMAGES_REFUSED = "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
BILLING_HEADER = "x-anthropic-billing-header:"
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use"}  # OpenAI's finish_reason; any other: max_tokens
CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # tool_choice's type; "tool" names one


# -- requests -------------------------------------------------------------------


def to_openai(body: object) -> dict:
    """An Anthropic Messages body as an OpenAI chat body (ApiError 400 where it cannot be read;
    500, llama-server's, for an image). With "stream": true the body asks for the usage chunk,
    which Events reports in message_delta."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = _system(body.get("system"))
    if "messages" not in body:
        raise ApiError(400, "'messages' is required", param="messages")
    if not isinstance(body["messages"], list):
        raise ApiError(400, "Expected 'messages' to be an array", param="messages")
    for i, message in enumerate(body["messages"]):
        messages += _message(message, f"messages.{i}")
    out: dict = {"messages": messages}
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    out.update(_tool_choice(body.get("tool_choice")))
    if "stop_sequences" in body:
        out["stop"] = body["stop_sequences"]
    out["max_tokens"] = body["max_tokens"] if "max_tokens" in body else DEFAULT_MAX_TOKENS
    out.update({name: body[name] for name in PASSED_ON if name in body})
    budget = _thinking_budget(body.get("thinking"))
    if budget is not None:
        out["thinking_budget_tokens"] = budget
    if body.get("stream") is True:
        out["stream_options"] = {"include_usage": True}
    return out


def _system(system: object) -> list[dict]:
    """`system`, a string or text blocks (joined as they are), as a system message."""
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": _billing(system)}]
    if not isinstance(system, list):
        raise ApiError(400, "system: must be a string or a list of text blocks", param="system")
    texts = []
    for i, block in enumerate(system):
        if _kind(block, f"system.{i}") != "text":
            raise ApiError(400, f"system.{i}: only text blocks are read in the system prompt", param="system")
        texts.append(_billing(_field(block, "text", str, "", f"system.{i}")))
    return [{"role": "system", "content": "".join(texts)}]


def _billing(text: str) -> str:
    """Claude Code's billing line opens its system prompt with a stamp that changes on every
    request (cch=xxxxx;), which would end the prompt cache's reuse there: fixed to fffff, as
    llama-server does (its normalize_anthropic_billing_header)."""
    if not text.startswith(BILLING_HEADER):
        return text
    at = text.find("cch=", len(BILLING_HEADER))
    start = at + len("cch=")
    if at < 0 or start + 5 >= len(text) or text[start + 5] != ";":
        return text
    return text[:start] + "fffff" + text[start + 5:]


def _message(message: object, where: str) -> list[dict]:
    """One Anthropic message as OpenAI messages: the message (its text parts, tool calls and
    reasoning), then a tool message for each tool_result it holds."""
    if not isinstance(message, dict):
        raise ApiError(400, f"{where}: a message must be an object", param=where)
    role = message.get("role", "")
    if "content" not in message:  # an assistant's is dropped; the chat endpoint refuses the others
        return [] if role == "assistant" else [message]
    content = message["content"]
    if not isinstance(content, list):  # a string as it is; the chat endpoint refuses anything else
        return [message]
    parts: list[dict] = []
    calls: list[dict] = []
    results: list[dict] = []
    reasoning = ""
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = _kind(block, at)
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise ApiError(400, f"{at}.text: must be a string", param=at)
            parts.append(block)  # as it is (cache_control and all): the chat endpoint reads its text
        elif kind == "thinking":
            reasoning += _field(block, "thinking", str, "", at)
        elif kind == "tool_use":
            calls.append(_call(block, at))
        elif kind == "tool_result":
            results.append(_result(block, at))
        elif kind != "redacted_thinking":  # Anthropic's encrypted thinking: nothing a local model reads
            _refuse(kind, at)
    if not (parts or calls or reasoning):
        return results
    out: dict = {"role": role, "content": parts or ""}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = reasoning
    return [out, *results]


def _call(block: dict, where: str) -> dict:
    arguments = _field(block, "input", dict, {}, where)
    return {"id": _field(block, "id", str, "", where), "type": "function",
            "function": {"name": _field(block, "name", str, "", where),
                         "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))}}


def _result(block: dict, where: str) -> dict:
    """A tool_result as a tool message: its content a string, or its text blocks joined (is_error
    is not passed on, as llama-server does not)."""
    content = block.get("content")
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = _kind(part, f"{where}.content.{k}")
            if kind != "text":
                _refuse(kind, f"{where}.content.{k}")
            texts.append(_field(part, "text", str, "", f"{where}.content.{k}"))
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ApiError(400, f"{where}.content: must be a string or a list of blocks", param=where)
    return {"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, "", where), "content": content or ""}


def _kind(block: object, where: str) -> object:
    if not isinstance(block, dict):
        raise ApiError(400, f"{where}: a content block must be an object", param=where)
    return block.get("type")


def _refuse(kind: object, where: str):
    if kind == "image":
        raise ApiError(500, IMAGES_REFUSED)
    raise ApiError(400, f"{where}.type: content blocks of type {json.dumps(kind)} are not supported "
                   "(text, image, tool_use, tool_result, thinking, redacted_thinking)", param=where)


def _field(block: dict, name: str, kind: type, default, where: str):
    """A block's field: `default` when absent or null, ApiError 400 when of another type."""
    value = block.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise ApiError(400, f"{where}.{name}: must be {'a string' if kind is str else 'an object'}", param=where)
    return value


def _tools(tools: object) -> list[dict]:
    """Anthropic's tools (name, description, input_schema) as OpenAI's function tools."""
    if not isinstance(tools, list):
        raise ApiError(400, "tools: must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ApiError(400, f"tools.{i}: a tool must be an object", param="tools")
        description = tool.get("description")
        out.append({"type": "function", "function": {
            "name": tool.get("name") or "", "description": "" if description is None else description,
            "parameters": tool["input_schema"] if "input_schema" in tool else {}}})
    return out


def _tool_choice(choice: object) -> dict:
    """tool_choice, and its disable_parallel_tool_use, as OpenAI's fields."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "tool_choice.name: the tool to use must be named", param="tool_choice")
        out: dict = {"tool_choice": {"type": "function", "function": {"name": name}}}
    elif kind in CHOICES:
        out = {"tool_choice": CHOICES[kind]}
    else:
        raise ApiError(400, 'tool_choice: must be an object whose type is "auto", "any", "tool" or "none"',
                       param="tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise ApiError(400, "tool_choice.disable_parallel_tool_use: must be a boolean", param="tool_choice")
    if disable:
        out["parallel_tool_calls"] = False
    return out


def _thinking_budget(thinking: object):
    """thinking: {"type": "enabled", "budget_tokens": N}'s N (None: thinking is not limited)."""
    if thinking is None:
        return None
    if not isinstance(thinking, dict):
        raise ApiError(400, "thinking: must be an object", param="thinking")
    if thinking.get("type") != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    return DEFAULT_THINKING_BUDGET if budget is None else budget


# -- answers --------------------------------------------------------------------


def message(answer: dict, stop_word: str = "") -> dict:
    """Reply's whole chat.completion as Anthropic's message; `stop_word`: the stop sequence that
    ended it, if one did."""
    choice = answer["choices"][0]
    reply = choice["message"]
    content = []
    if reply.get("reasoning_content"):  # no signature: nothing here can sign a local model's thinking
        content.append({"type": "thinking", "thinking": reply["reasoning_content"], "signature": ""})
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
    return {"id": answer["id"], "type": "message", "role": "assistant", "content": content,
            "model": answer["model"], "stop_reason": STOP_REASONS.get(choice["finish_reason"], "max_tokens"),
            "stop_sequence": stop_word or None, "usage": usage(answer["usage"])}


def usage(openai: dict) -> dict:
    """OpenAI's usage as Anthropic's: the prompt's tokens that the cache held apart from the rest."""
    cached = openai["prompt_tokens_details"]["cached_tokens"]
    return {"cache_read_input_tokens": cached, "input_tokens": openai["prompt_tokens"] - cached,
            "output_tokens": openai["completion_tokens"]}


def _input(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


class Events:
    """Anthropic's stream of one answer, from Reply's chunks: message_start with the first, then
    each block opened by its first delta (content_block_start), its deltas (thinking_delta,
    text_delta, input_json_delta: a tool call's arguments as they come), and at the end every block
    closed in order (a thinking block after an empty signature_delta), message_delta with the stop
    reason and the usage, and message_stop. Each event is {"event": name, "data": object}, as
    llama-server builds them.

    Blocks are numbered in the order they open, and stay open until the end, as llama-server's:
    thinking (0), then the text, then each tool call."""

    def __init__(self, n_prompt: int):
        self.n_prompt = n_prompt  # until the end says how much the cache held, all of it is input
        self.blocks: dict[object, int] = {}  # "thinking", "text" or a tool call's index -> the block's
        self.waiting: dict[int, str] = {}    # arguments of a call whose name has not come yet
        self.stop_reason = "max_tokens"
        self.started = False

    def chunk(self, chunk: dict) -> list[dict]:
        """The events of one chunk (the first opens the message)."""
        events = [] if self.started else [self._message_start(chunk)]
        self.started = True
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                events += self._delta("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                events += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice["finish_reason"] is not None:
                self.stop_reason = STOP_REASONS.get(choice["finish_reason"], "max_tokens")
        return events

    def end(self, chunks: list[dict], stop_word: str = "") -> list[dict]:
        """The last chunks' events (their usage chunk: OpenAI's include_usage), then the end:
        the blocks closed, message_delta and message_stop."""
        events = [event for chunk in chunks for event in self.chunk(chunk)]
        counts = next(chunk["usage"] for chunk in chunks if chunk.get("usage") and not chunk["choices"])
        for key, index in self.blocks.items():  # in the order they opened
            if key == "thinking":
                events.append(_event("content_block_delta", index=index,
                                     delta={"type": "signature_delta", "signature": ""}))
            events.append(_event("content_block_stop", index=index))
        # the usage in full, as Anthropic's own message_delta has it: message_start could not yet
        # say how much of the prompt the cache held
        events.append(_event("message_delta", delta={"stop_reason": self.stop_reason,
                                                     "stop_sequence": stop_word or None}, usage=usage(counts)))
        events.append(_event("message_stop"))
        return events

    def _message_start(self, chunk: dict) -> dict:
        return _event("message_start", message={
            "id": chunk["id"], "type": "message", "role": "assistant", "content": [], "model": chunk["model"],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"cache_read_input_tokens": 0, "input_tokens": self.n_prompt, "output_tokens": 0}})

    def _delta(self, key: object, delta: dict, block: dict | None = None) -> list[dict]:
        """A delta for the block of `key`, opened first (as `block`) if it is new."""
        events = []
        if key not in self.blocks:
            self.blocks[key] = len(self.blocks)
            start = block or ({"type": "thinking", "thinking": ""} if key == "thinking" else {"type": "text", "text": ""})
            events.append(_event("content_block_start", index=self.blocks[key], content_block=start))
        if delta:
            events.append(_event("content_block_delta", index=self.blocks[key], delta=delta))
        return events

    def _call(self, call: dict) -> list[dict]:
        """A tool call's delta: its block opens once its name is known, with the arguments so far."""
        index, function = call["index"], call["function"]
        arguments = self.waiting.pop(index, "") + function.get("arguments", "")
        if index not in self.blocks and not function.get("name"):
            self.waiting[index] = arguments
            return []
        delta = {"type": "input_json_delta", "partial_json": arguments} if arguments else {}
        block = {"type": "tool_use", "id": call.get("id", ""), "name": function.get("name", ""), "input": {}}
        return self._delta(index, delta, block)


def _event(name: str, **data) -> dict:
    return {"event": name, "data": {"type": name, **data}}
