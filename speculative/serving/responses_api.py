"""OpenAI's Responses API (POST /v1/responses) as the pinned llama-server serves it, without HTTP.

A request becomes a chat completions body (`to_chat`: llama-server's
server_chat_convert_responses_to_chatcmpl, tools/server/server-chat.cpp), which then goes through
openai_api.parse as any chat request does: its checks, chat template, tool grammar and reasoning
are the chat endpoint's. `input` is a string or a list of items: messages (`input_text` parts;
an assistant's `output_text` or `refusal` parts), `function_call` and `function_call_output`,
and `reasoning` items (their first `content` text), an assistant's items merged into one message;
`instructions` a system message first; function `tools` in Responses' flat shape (other tool
types skipped); `max_output_tokens` as `max_tokens`; `previous_response_id` refused. Everything
else is passed on as it is (`temperature`, `top_p`, `stream`, ...), and a named `tool_choice`
takes the chat shape, which llama-server would read as "auto".

The answer goes the other way (server-task.cpp's to_json_oaicompat_resp*): the chat answer
(openai_api.Reply's) becomes a Response (`response`: `resp_...`, its output items `rs_...`
reasoning, `msg_...` message, `fc_...` function calls, `usage` in input and output tokens), and
a stream of chat chunks becomes Responses' events (`Events`). As llama-server's, a response is
`completed` however it ended, its items close when it does, and `timings` are beside the
response in response.completed (on the last event of a step's with `timings_per_token`), not in
an unstreamed response. Beyond llama-server, every event has OpenAI's `sequence_number` and
`output_index` (text events `content_index` and `logprobs`), which the official SDK's stream
helper reads, and text that the chat reading held back to the end still comes as deltas before
the items close.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from speculative.serving.generation import ApiError, random_id

log = logging.getLogger("speculate.serve")

_CONVERTED = ("input", "instructions", "tools", "max_output_tokens", "reasoning")


# -- requests -----------------------------------------------------------------


def to_chat(body: object) -> dict:
    """A Responses request body as a chat completions body, or ApiError(400) with llama-server's message."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if "input" not in body:
        raise _bad("'input' is required")
    if body.get("previous_response_id") not in (None, ""):
        raise _bad("llama.cpp does not support 'previous_response_id'.")
    chat = {k: v for k, v in body.items() if k not in _CONVERTED}
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string")
        messages.append({"role": "system", "content": instructions})
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _add_item(messages, item)
    else:
        raise _bad("'input' must be a string or array of objects")
    chat["messages"] = messages
    if "tools" in body:
        tools = _tools(body["tools"])
        if tools:
            chat["tools"] = tools
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and "effort" in reasoning:
        chat["reasoning_effort"] = reasoning["effort"]
    choice = chat.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    return chat


def _bad(message: str) -> ApiError:
    return ApiError(400, message)


def _add_item(messages: list[dict], item: object) -> None:
    """One input item onto the chat messages (an assistant's items merge into the assistant message before)."""
    if not isinstance(item, dict):
        raise _bad("Cannot determine type of 'item'")
    merge = bool(messages) and messages[-1].get("role") == "assistant"
    item = dict(item)
    if isinstance(item.get("content"), str):  # an input message's text: as one input_text part
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    role, kind = item.get("role"), item.get("type")
    if isinstance(item.get("content"), list) and role in ("user", "system", "developer"):
        messages.append(_input_message(item))
    elif role == "assistant" and kind == "message":
        _output_message(messages, item, merge)
    elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("arguments", "call_id", "name")):
        call = {"function": {"arguments": item["arguments"], "name": item["name"]}, "id": item["call_id"],
                "type": "function"}
        if merge:
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output" and isinstance(item.get("call_id"), str) and \
            isinstance(item.get("output"), (str, list)):
        messages.append({"content": _call_output(item["output"]), "role": "tool", "tool_call_id": item["call_id"]})
    elif kind == "reasoning" and isinstance(item.get("summary"), list):
        _reasoning(messages, item, merge)
    else:
        raise _bad("Cannot determine type of 'item'")


def _input_message(item: dict) -> dict:
    """A user, system or developer message: its parts as chat content parts."""
    parts = []
    for part in item["content"]:
        kind = part.get("type") if isinstance(part, dict) else ""
        if kind == "input_text":
            if "text" not in part:
                raise _bad("'Input text' requires 'text'")
            parts.append({"text": part["text"], "type": "text"})
        elif kind == "input_image":
            if "image_url" not in part:
                raise _bad("'image_url' is required")
            parts.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
        elif kind == "input_file":
            raise _bad("'input_file' is not supported by llamacpp at this moment")
        else:
            raise _bad("'type' must be one of 'input_text', 'input_image', or 'input_file'")
    message = {k: v for k, v in item.items() if k not in ("type", "status")}
    message["content"] = parts
    return message


def _output_message(messages: list[dict], item: dict, merge: bool) -> None:
    """An assistant's message: its output_text (or input_text) and refusal parts."""
    parts = []
    for part in item["content"] if isinstance(item.get("content"), list) else []:
        kind = part.get("type") if isinstance(part, dict) else ""
        if kind in ("output_text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise _bad("'Output text' requires 'text'")
            parts.append({"text": part["text"], "type": "text"})
        elif kind == "refusal":
            if not isinstance(part.get("refusal"), str):
                raise _bad("'Refusal' requires 'refusal'")
            parts.append({"refusal": part["refusal"], "type": "refusal"})
        else:
            raise _bad("'type' must be one of 'output_text' or 'refusal'")
    if merge:
        before = messages[-1]
        before["content"] = (before["content"] if isinstance(before.get("content"), list) else []) + parts
    else:
        messages.append({**{k: v for k, v in item.items() if k not in ("type", "status")}, "content": parts})


def _call_output(output: str | list) -> str | list:
    """A function call's output: text, or input_text and input_image parts as chat parts."""
    if isinstance(output, str):
        return output
    parts = []
    for part in output:
        if not isinstance(part, dict) or "type" not in part:
            raise _bad("Output of tool call missing 'type' field")
        if part["type"] == "input_text":
            parts.append({**part, "type": "text"})
        elif part["type"] == "input_image":
            if "image_url" not in part:
                raise _bad("'image_url' is required")
            parts.append({**part, "type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise _bad("Output of tool call should be 'Input text' or 'Input image'")
    return parts


def _reasoning(messages: list[dict], item: dict, merge: bool) -> None:
    """A reasoning item: its first content text as the assistant's reasoning_content."""
    content = item.get("content")
    if not isinstance(content, list):
        raise _bad("item['content'] is not an array")
    if not content:
        raise _bad("item['content'] is empty")
    if not isinstance(content[0], dict) or not isinstance(content[0].get("text"), str):
        raise _bad("item['content']['text'] is not a string")
    if merge:
        messages[-1]["reasoning_content"] = content[0]["text"]
    else:
        messages.append({"role": "assistant", "content": [], "reasoning_content": content[0]["text"]})


def _tools(tools: object) -> list[dict]:
    """Function tools in the chat shape (`strict` true unless given); other tool types are skipped."""
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array of objects")
    out = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else ""
        if kind != "function":
            log.warning("unsupported Responses tool type %r skipped", kind)
            continue
        function = {k: v for k, v in tool.items() if k != "type"}
        function.setdefault("strict", True)
        out.append({"type": "function", "function": function})
    return out


# -- answers ------------------------------------------------------------------


def response(answer: dict) -> dict:
    """The Response of a whole chat answer (openai_api.Reply.full's): its reasoning, message and
    calls as output items, its usage in Responses' names."""
    message = answer["choices"][0]["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
    if message.get("content"):
        output.append(_message_item(new_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed"))
    return {"completed_at": int(time.time()), "created_at": answer["created"], "id": new_id("resp"),
            "model": answer["model"], "object": "response", "output": output, "status": "completed",
            "usage": usage(answer["usage"])}


def usage(chat: dict) -> dict:
    """A chat answer's usage in Responses' names."""
    return {"input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
            "total_tokens": chat["total_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]}}


def new_id(prefix: str) -> str:
    """`prefix_` and 32 letters and digits, as llama-server's ids."""
    return f"{prefix}_{random_id()}"


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    content = [{"text": text, "type": "reasoning_text"}] if text else []
    return {"id": item_id, "summary": [], "type": "reasoning", "content": content, "encrypted_content": "",
            "status": status}


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"content": content, "id": item_id, "role": "assistant", "status": status, "type": "message"}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    """A function call: llama-server's `fc_` item id and `call_` call id around the chat answer's call id."""
    return {"id": f"fc_{call_id}", "type": "function_call", "status": status, "arguments": arguments,
            "call_id": f"call_{call_id}", "name": name}


@dataclass
class _Item:
    """An output item of a stream, open until the stream ends."""
    index: int    # output_index
    kind: str     # reasoning, message or function_call
    id: str
    text: str = ""               # reasoning or message text, a call's arguments, so far
    name: str = ""               # a call's
    call_id: str = ""            # a call's, as the chat answer gives it
    held: list[str] = field(default_factory=list)  # a call's arguments before its name


class Events:
    """The events of one streamed response, from the chat chunks of its answer (Reply's): the
    opening, each chunk's, and the end, each event a dict with its `type` (the SSE event name)."""

    def __init__(self, model: str):
        self.id = new_id("resp")
        self.model = model
        self.created = int(time.time())
        self.sequence = 0
        self.items: list[_Item] = []
        self.calls: dict[int, _Item] = {}  # by the chat answer's call index

    def opening(self, progress: dict | None = None) -> list[dict]:
        """response.created and response.in_progress (with llama-server's prompt_progress, when given)."""
        events = [self._event("response.created", response=self._state("in_progress"))]
        return events + self.progress(progress)

    def progress(self, progress: dict | None) -> list[dict]:
        """A response.in_progress event (with llama-server's prompt_progress, when given)."""
        event = self._event("response.in_progress", response=self._state("in_progress"))
        if progress is not None:
            event["prompt_progress"] = progress
        return [event]

    def chunks(self, chunks: list[dict], timings: dict | None = None) -> list[dict]:
        """The events of a step's chunks; `timings` on the last, as llama-server's timings_per_token."""
        events = [event for chunk in chunks for choice in chunk.get("choices", ())
                  for event in self._delta(choice.get("delta") or {})]
        if events and timings is not None:
            events[-1]["timings"] = timings
        return events

    def end(self, chunks: list[dict]) -> list[dict]:
        """The stream's last chunks (Reply.last_chunks, with include_usage): the text they settle,
        every item's done events, then response.completed with the usage and the timings beside it."""
        events = self.chunks(chunks)
        totals = next(chunk["usage"] for chunk in chunks if chunk.get("usage"))
        output = []
        for item in self.items:
            events += self._done(item)
            output.append(events[-1]["item"])
        completed = self._event("response.completed", response={
            **self._state("completed"), "created_at": self.created, "model": self.model, "output": output,
            "usage": usage(totals)})
        if "timings" in chunks[-1]:
            completed["timings"] = chunks[-1]["timings"]
        return events + [completed]

    def _delta(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("reasoning_content"):
            item, events = self._open("reasoning", "rs")
            item.text += delta["reasoning_content"]
            events.append(self._event("response.reasoning_text.delta", delta=delta["reasoning_content"],
                                      item_id=item.id, output_index=item.index, content_index=0))
        if delta.get("content"):
            item, opened = self._open("message", "msg")
            item.text += delta["content"]
            events += opened + [self._event("response.output_text.delta", item_id=item.id, output_index=item.index,
                                            content_index=0, delta=delta["content"], logprobs=[])]
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def _open(self, kind: str, prefix: str) -> tuple[_Item, list[dict]]:
        """The stream's reasoning or message item, and the events that open it if it is new."""
        item = next((i for i in self.items if i.kind == kind), None)
        if item is not None:
            return item, []
        item = _Item(len(self.items), kind, new_id(prefix))
        self.items.append(item)
        if kind == "reasoning":
            return item, [self._added(item, _reasoning_item(item.id, "", "in_progress"))]
        return item, [self._added(item, _message_item(item.id, None, "in_progress")),
                      self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                  content_index=0, part={"type": "output_text", "text": ""})]

    def _call(self, call: dict) -> list[dict]:
        """A call's delta: its item opened once its name is known, then its arguments."""
        function = call.get("function") or {}
        item = self.calls.get(call["index"])
        if item is None:
            item = self.calls[call["index"]] = _Item(-1, "function_call", "")
        item.name = function.get("name") or item.name
        item.call_id = call.get("id") or item.call_id
        item.held.append(function.get("arguments") or "")
        if not item.name:
            return []
        events = []
        if item.index < 0:
            item.index, item.id = len(self.items), f"fc_{item.call_id}"
            self.items.append(item)
            events.append(self._added(item, _call_item(item.call_id, item.name, "", "in_progress")))
        arguments = "".join(item.held)
        item.held.clear()
        if arguments:
            item.text += arguments
            events.append(self._event("response.function_call_arguments.delta", delta=arguments, item_id=item.id,
                                      output_index=item.index))
        return events

    def _done(self, item: _Item) -> list[dict]:
        """An item's closing events, the last response.output_item.done with the whole item."""
        if item.kind == "reasoning":
            return [self._event("response.output_item.done", output_index=item.index,
                                item=_reasoning_item(item.id, item.text, "completed"))]
        if item.kind == "function_call":
            return [self._event("response.output_item.done", output_index=item.index,
                                item=_call_item(item.call_id, item.name, item.text, "completed"))]
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        return [self._event("response.output_text.done", **where, text=item.text, logprobs=[]),
                self._event("response.content_part.done", **where, part=_text_part(item.text)),
                self._event("response.output_item.done", output_index=item.index,
                            item=_message_item(item.id, item.text, "completed"))]

    def _added(self, item: _Item, shown: dict) -> dict:
        return self._event("response.output_item.added", output_index=item.index, item=shown)

    def _state(self, status: str) -> dict:
        return {"id": self.id, "object": "response", "status": status}

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event
