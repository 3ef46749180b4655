"""The OpenAI-compatible requests and responses of `speculate serve`, without HTTP.

Requests are read strictly: a known field of the wrong type or out of range is an
error, never coerced ("5" is not a number), so a client is not silently misread.
Fields this server does not know are ignored, as llama-server does (clients send
`user`, `stream_options` and the like); fields that would change the answer in a way
it cannot honour (`n` > 1, `logprobs`, `tools`, ...) are refused.

Omitted fields take the server's command line (--temp, --top-k, -s, -n, ...: generation.Defaults),
as llama-server's do, and without flags SamplerSettings' defaults, which are llama.cpp's (and the
one-shot command's); OpenAI's own default would be temperature 1 and top_p 1. Omitted
`max_tokens` with no -n generates until an end-of-generation token or a full context.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
import uuid
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Callable, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from speculative.chat import request as chat_request
from speculative.chat.message import ChatMessage, Delta
from speculative.decoding.stats import Stats
from speculative.engine.chat import writes_parallel_calls
from speculative.engine.stream import Final, Piece
from speculative.errors import GrammarError, UsageError
from speculative.serving.generation import (MAX_TOP_LOGPROBS, ApiError, Defaults, Generation, Vocab, logit_bias,
                                            probs_json, random_id, refuse_unsupported, request_grammar, speculation)
from speculative.serving.worker import Progress

MAX_STOPS = 16           # stop strings per request (OpenAI allows 4, llama-server any number)
MAX_STOP_CHARS = 256


# -- requests -----------------------------------------------------------------

Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk, with no choices, carries the usage


class _Request(_Strict):
    model: Optional[str] = None   # one model is served; any name is accepted, as llama-server does
    stream: bool = False
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)                     # llama-server's extension
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)         # llama-server's extension
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repeat_penalty: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)  # llama-server's extension
    seed: Optional[int] = Field(None, ge=-1, lt=2**32)           # -1 or omitted: random
    stop: Optional[Annotated[list[Stop], Field(max_length=MAX_STOPS)]] = None  # a string is a list of one
    ignore_eos: Optional[bool] = None                            # llama-server's extension
    stream_options: Optional[StreamOptions] = None
    verbose: Optional[bool] = None                               # llama-server's: the answer's __verbose
    n: int = Field(1, ge=1)                                      # choices, each its own sequence (at most -np)
    return_progress: Optional[bool] = None                       # llama-server's: prompt_progress chunks
    timings_per_token: Optional[bool] = None                     # llama-server's: timings on every step's chunk

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value):
        return [value] if isinstance(value, str) else value


class CompletionRequest(_Request):
    prompt: Annotated[str, Field(min_length=1)]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token (0: the token's own)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):  # OpenAI takes a batch of prompts; this server one per request
            if len(value) != 1:
                raise PydanticCustomError("one_prompt", "one prompt per request: a string, or a list of one")
            return value[0]
        return value


def _text(value):
    """Message content: text, or OpenAI's list of text parts joined by newlines (llama.cpp's
    concat_content_parts, for templates that read text); None stays None."""
    if isinstance(value, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in value):
            raise PydanticCustomError("text_parts", 'only text parts are served: {"type": "text", "text": ...}')
        return "\n".join(p["text"] for p in value)
    return value


class FunctionCall(_Strict):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it

    @field_validator("arguments", mode="before")
    @classmethod
    def _as_text(cls, value):  # some clients send the object itself
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


class CallIn(_Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[str] = None
    tool_calls: Optional[list[CallIn]] = None    # an assistant's calls
    tool_call_id: Optional[str] = None           # a tool's result: the call it answers
    name: Optional[str] = None
    reasoning_content: Optional[str] = None      # an assistant's thinking, for templates that keep it

    _content = field_validator("content", mode="before")(_text)

    def rendered(self) -> dict:
        """As the chat template reads it: content always text, a call's arguments as an object
        (transformers' convention, which templates write with `tojson`)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id or "", "type": "function",
                                  "function": {"name": c.function.name, "arguments": _object(c.function.arguments)}}
                                 for c in self.tool_calls]
        for name in ("tool_call_id", "name", "reasoning_content"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def _object(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # as the client wrote it


class Function(_Strict):
    name: Annotated[str, Field(min_length=1)]
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(_Strict):
    name: str


class NamedChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # newer clients' name for max_tokens
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedChoice, None] = None  # None: auto
    parallel_tool_calls: Optional[bool] = None  # omitted: whether the template writes parallel calls
    reasoning_format: Optional[str] = None             # llama-server's
    chat_template_kwargs: Optional[dict] = None        # llama-server's: more template variables
    reasoning_budget_tokens: Optional[int] = Field(None, ge=-1)  # llama-server's (also thinking_budget_tokens)
    thinking_budget_tokens: Optional[int] = Field(None, ge=-1)
    add_generation_prompt: Optional[bool] = None       # False with continue_final_message (vLLM's)
    continue_final_message: Union[bool, str, None] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class AnyChatRequest(ChatRequest):
    """A chat request that may have no messages at all (the prompt is the template's generation
    prompt alone), as llama-server reads a request converted from Anthropic's Messages API
    (its test_anthropic_empty_messages); OpenAI's API, and /v1/chat/completions, refuse it."""
    messages: list[Message]


# Fields that exist in OpenAI's API but are not served: refused unless set to what they
# would be when omitted.
_NEUTRAL = {"best_of": (1,), "echo": (False,), "suffix": ("",), "functions": ([],), "function_call": ("none", "auto")}
LOGPROBS_DEFAULT = 20  # llama-server's alternatives per token when a chat asks for logprobs without top_logprobs


def parse_all(data: object, chat: bool, defaults: Defaults = Defaults(), template: str = "",
              vocab: Vocab | None = None) -> list[Generation]:
    """A request's generations: one, or on /v1/completions one per prompt of a list of prompts."""
    if not chat and isinstance(data, dict) and isinstance(data.get("prompt"), list) and len(data["prompt"]) > 1:
        return [parse({**data, "prompt": prompt}, chat, defaults, template, vocab) for prompt in data["prompt"]]
    return [parse(data, chat, defaults, template, vocab)]


def parse(data: object, chat: bool, defaults: Defaults = Defaults(), template: str = "",
          vocab: Vocab | None = None, no_messages: bool = False) -> Generation:
    """A request body (parsed JSON) as a Generation, or ApiError(400); what it leaves out, the
    server's `defaults`. `template`: the model's Jinja chat template (its tools and reasoning);
    `vocab`: the target, which reads logit_bias; `no_messages`: a chat of no messages is read too
    (AnyChatRequest)."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    refuse_unsupported(data, _NEUTRAL, strict_types=True)
    kind = (AnyChatRequest if no_messages else ChatRequest) if chat else CompletionRequest
    try:
        request = kind.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"],
                       param=str(first["loc"][0]) if first["loc"] else None) from None
    chosen = {"temp": request.temperature, "top_k": request.top_k, "top_p": request.top_p, "min_p": request.min_p,
              "repeat_penalty": request.repeat_penalty, "presence_penalty": request.presence_penalty,
              "frequency_penalty": request.frequency_penalty, "seed": request.seed}
    top = _logprobs(request, chat)
    sampling = replace(defaults.chosen(**chosen, grammar=request_grammar(data, chat)),
                       n_probs=0 if top is None else max(top, 1), logit_bias=logit_bias(data.get("logit_bias") or None, vocab))
    stops = tuple(request.stop or ())
    ignore_eos = defaults.ignore_eos if request.ignore_eos is None else request.ignore_eos
    newer = request.max_completion_tokens if chat else None  # newer clients' name wins
    max_tokens = next((n for n in (newer, request.max_tokens) if n is not None), defaults.max_tokens)
    answer = {"speculation": speculation(data), "verbose": defaults.verbose if request.verbose is None else request.verbose,
              "include_usage": request.stream_options is not None and request.stream_options.include_usage,
              "n": request.n, "return_progress": bool(request.return_progress), "logprobs": top,
              "timings_per_token": bool(request.timings_per_token)}
    if chat:
        return _chat(request, data, defaults, template, Generation(
            True, None, None, sampling, max_tokens, stops, ignore_eos, request.stream, **answer))
    return Generation(False, request.prompt, None, sampling, max_tokens, stops, ignore_eos, request.stream, **answer)


def _logprobs(request: _Request, chat: bool) -> int | None:
    """The alternatives the answer lists per token with its probability (None: no logprobs): a
    chat's top_logprobs, when it asks for logprobs (llama-server's 20 when not given); a
    completion's logprobs (0: the token's own probability only)."""
    if not chat:
        return request.logprobs
    if not request.logprobs:
        if request.top_logprobs is not None:
            raise ApiError(400, "top_logprobs requires logprobs to be set to true", param="top_logprobs")
        return None
    if request.stream and request.tools:
        raise ApiError(400, "logprobs is not supported with tools + stream", param="logprobs")
    return LOGPROBS_DEFAULT if request.top_logprobs is None else request.top_logprobs


def _chat(request: ChatRequest, data: dict, defaults: Defaults, template: str, generation: Generation) -> Generation:
    """A chat request's messages, tools and reasoning, checked as llama-server checks them."""
    _check_messages(request.messages, data["messages"])
    _check_continuation(request)
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
    kwargs = {**defaults.template_kwargs, **(request.chat_template_kwargs or {})}
    if request.add_generation_prompt is False:  # the template's own variable (a prompt that ends with the history)
        kwargs["add_generation_prompt"] = False
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise ApiError(400, 'invalid type for "enable_thinking" (expected boolean, got string)',
                       param="chat_template_kwargs")
    choice = request.tool_choice or "auto"
    choice = choice if isinstance(choice, str) else choice.model_dump()
    if tools and choice != "none" and "grammar" in data:
        raise ApiError(400, "Cannot use custom grammar constraints with tools.", param="grammar")
    if tools and not template:
        raise ApiError(400, "tools need the model's Jinja chat template", param="tools")
    parallel = request.parallel_tool_calls
    if parallel is None:  # llama-server's default: what the template can write back
        parallel = bool(tools) and writes_parallel_calls(template)
    try:
        plan = chat_request.plan(template, tools, choice, parallel, request.reasoning_format or defaults.reasoning_format)
    except UsageError as e:
        raise ApiError(400, str(e), param="tool_choice" if str(e).startswith("tool_choice") else "reasoning_format") from None
    except GrammarError as e:
        raise ApiError(400, str(e), param="tools") from None
    sampling = generation.sampling
    if plan.grammar is not None:
        sampling = replace(sampling, grammar=plan.grammar.gbnf, grammar_triggers=plan.grammar.triggers)
    budget = next((b for b in (request.reasoning_budget_tokens, request.thinking_budget_tokens) if b is not None),
                  defaults.reasoning_budget)
    messages = [m.rendered() for m in request.messages]
    last = data["messages"][-1].get("content") if messages else None
    if isinstance(last, list) and messages[-1]["role"] == "assistant":  # the message continued: its parts
        messages[-1]["content"] = "\n\n".join(p["text"] for p in last)  # as render_content joins them
    return replace(generation, messages=messages, sampling=sampling,
                   tools=tools or None, template_kwargs=kwargs, plan=plan, reasoning_budget=budget)


def _check_messages(messages: list[Message], raw: list[dict]) -> None:
    """llama-server's rules: every message but an assistant's has content, an assistant's has
    content or tool calls, and no two assistant messages end the list."""
    for i, (m, given) in enumerate(zip(messages, raw)):
        if m.role != "assistant" and "content" not in given:
            raise ApiError(400, "All non-assistant messages must contain 'content'", param=f"messages.{i}")
        if m.role == "assistant" and "content" not in given and "tool_calls" not in given:
            raise ApiError(400, "Assistant message must contain either 'content' or 'tool_calls'!",
                           param=f"messages.{i}")
    if len(messages) >= 2 and messages[-1].role == messages[-2].role == "assistant":
        raise ApiError(400, "Cannot have 2 or more assistant messages at the end of the list.", param="messages")


def _check_continuation(request: ChatRequest) -> None:
    """A final assistant message is continued (llama-server's assistant prefill); vLLM's explicit
    continue_final_message says the same, and cannot go with a generation prompt."""
    if request.continue_final_message not in (None, False) and request.add_generation_prompt:
        raise ApiError(400, "Cannot set both add_generation_prompt and continue_final_message to true.",
                       param="continue_final_message")
    last = request.messages[-1] if request.messages else None
    if last is not None and last.role == "assistant" and last.tool_calls:
        raise ApiError(400, "Cannot continue an assistant message that contains tool calls.", param="messages")


# -- responses ----------------------------------------------------------------


def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.n_prompt, "completion_tokens": stats.n_predict,
            "total_tokens": stats.n_prompt + stats.n_predict,
            "prompt_tokens_details": {"cached_tokens": stats.n_cached}}


def timed(chunks: list[dict], stats: Stats | None, per_token: bool) -> list[dict]:
    """A step's chunks, the last with the timings so far where timings_per_token asks for them
    (llama-server's, on /v1 and /completion alike)."""
    if chunks and per_token and stats is not None:
        chunks[-1]["timings"] = timings(stats)
    return chunks


def timings(stats: Stats) -> dict:
    """llama-server's `timings` (its names), and the acceptance rate and tokens per target pass."""
    prompt_n = stats.n_prompt - stats.n_cached  # tokens processed; the rest the cache held from the last run
    prompt_ms, predicted_ms = 1000 * stats.t_encode, 1000 * stats.t_decode
    # llama-server's rates are over the decode steps: the first token comes from the prompt's logits
    steps = max(stats.n_predict - 1, 0)
    return {
        "cache_n": stats.n_cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": stats.encode_tps,  # 0 when the cache left nothing to process
        "predicted_n": stats.n_predict,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
        "predicted_per_second": 1000 * steps / predicted_ms if steps and predicted_ms else 0.0,
        "draft_n": stats.n_drafted,
        "draft_n_accepted": stats.n_accept,
        "draft_accept_rate": stats.accept_rate,
        "tokens_per_step": stats.tokens_per_step,
    }


def total_stats(finals: Sequence[Final], n: int) -> Stats:
    """The statistics of a request's choices together (n per prompt): each prompt's once (the
    first of its choices), every choice's generated tokens and drafts."""
    total = Stats()
    for i, final in enumerate(finals):
        total.merge(final.stats)
        if i % n:
            total.n_prompt -= final.stats.n_prompt
            total.n_cached -= final.stats.n_cached
    return total


def combined(answers: list[dict], finals: Sequence[Final], n: int) -> dict:
    """A request's choices as one answer (llama-server's): the first's, with every choice in
    `choices`; the usage of all (total_stats), the timings the first's, as llama-server's."""
    if len(answers) == 1:
        return answers[0]
    return {**answers[0], "choices": [a["choices"][0] for a in answers], "usage": usage(total_stats(finals, n))}


class Reply:
    """The response objects of one request: the whole answer, or its stream of chunks. A chat
    answer is read back through the request's plan (chat/request.py): reasoning into
    reasoning_content, tool calls into tool_calls; while streaming, each piece's text is parsed
    with what came before and only what it adds is sent (message.diffs)."""

    def __init__(self, model: str, generation: Generation, index: int = 0, first: "Reply | None" = None,
                 piece: Callable[[int], bytes] = lambda token: b""):
        """`index`: the choice's, among a request's; `first`: the request's first choice, whose id
        and time every choice's objects share; `piece`: a token's bytes, for logprobs."""
        self.id = first.id if first else f"{'chatcmpl' if generation.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = first.created if first else int(time.time())
        self.model = model
        self.index = index
        self.chat = generation.chat
        self.include_usage = generation.include_usage
        self.reading = chat_request.Reading(generation.plan)
        self.call_ids: list[str] = []  # each call's id, given when it first appears
        self.logprobs = generation.logprobs
        self.per_token = generation.timings_per_token
        self.piece = piece
        self._pending: tuple[list[int], list] = ([], [])  # streamed tokens whose text no chunk carried yet

    def started(self, prompt_tail: str) -> None:
        """The prompt's end is known: whether the answer starts inside a thinking block."""
        if self.reading.plan is not None:
            self.reading.plan = self.reading.plan.after_prompt(prompt_tail)

    def full(self, final: Final, verbose: dict | None = None) -> dict:
        """The whole answer; `verbose`: llama-server's __verbose object, when the request asks for it."""
        finish = final.reason
        if not self.chat:
            choice = {"index": self.index, "text": final.text, "logprobs": self._logprobs(final.tokens, final.probs)}
        else:
            message = self.reading.whole(final.text)
            choice = {"index": self.index, "message": {"role": "assistant", **self._fields(message)}}
            if self.logprobs is not None:
                choice["logprobs"] = self._logprobs(final.tokens, final.probs)
            finish = _finish(finish, message)
        return self._object(False, {**choice, "finish_reason": finish}, usage=usage(final.stats),
                            **_verbose(verbose), timings=timings(final.stats))

    def first_chunk(self, **extra) -> dict | None:
        """Chat streams open with the assistant's role, as llama-server's do (content null); `extra`:
        the chunk's other fields (llama-server's prompt_progress, which comes in such chunks)."""
        if not self.chat:
            return self._object(True, {"index": self.index, "text": "", "logprobs": None, "finish_reason": None},
                                **extra) if extra else None
        return self._object(True, {"index": self.index, "delta": {"role": "assistant", "content": None},
                                   "finish_reason": None}, **extra)

    def progress(self, progress: Progress) -> dict:
        """A prompt_progress chunk (return_progress), with timings_per_token the timings so far."""
        return self.first_chunk(prompt_progress=progress.json(),
                                **({"timings": timings(progress.stats())} if self.per_token else {}))

    def chunks(self, piece: Piece) -> list[dict]:
        """The chunks for a piece of text: none while it may still be a tag or a call's opening. With
        logprobs, the tokens of the text a chunk carries are in it (those of held back text wait);
        with timings_per_token, the last has the timings so far."""
        self._pending[0].extend(piece.ids)
        self._pending[1].extend(piece.probs)
        if not self.chat:
            chunks = [self._with_logprobs(self._object(True, {"index": self.index, "text": piece.text,
                                                              "logprobs": None, "finish_reason": None}))]
        else:
            chunks = self._carrying([self._chunk(self._delta(change)) for change in self.reading.push(piece.text)])
        return timed(chunks, piece.stats, self.per_token)

    def last_chunks(self, final: Final, verbose: dict | None = None, include_usage: bool = True) -> list[dict]:
        """The stream's end, as llama-server's: a completion's last chunk with its usage; a chat's
        deltas that the end of the text settles (a tag held back), the finish, and with
        include_usage a chunk of no choices with the usage (unless the caller sends it, for several
        choices). The last carries the timings, the first `verbose` (llama-server's __verbose
        object) when the request asks for it."""
        stats = final.stats
        if not self.chat:
            return [self._object(True, {"index": self.index, "text": "", "logprobs": None, "finish_reason": final.reason},
                                 usage=usage(stats), **_verbose(verbose), timings=timings(stats))]
        out = self._carrying([self._chunk(self._delta(change)) for change in self.reading.end()])
        out.append(self._chunk({}, _finish(final.reason, self.reading.message)))
        if self.include_usage and include_usage:  # OpenAI's: the usage in a chunk of its own, with no choices
            out.append(self.usage_chunk(stats))
        out[0].update(_verbose(verbose))
        out[-1]["timings"] = timings(stats)
        return out

    def usage_chunk(self, stats: Stats) -> dict:
        return {**self._object(True, {}), "choices": [], "usage": usage(stats)}

    def _carrying(self, chunks: list[dict]) -> list[dict]:
        """Chat chunks, the pending tokens' logprobs in the first (the others' lists empty)."""
        for chunk in chunks:
            self._with_logprobs(chunk)
        return chunks

    def _with_logprobs(self, chunk: dict) -> dict:
        if self.logprobs is not None:
            chunk["choices"][0]["logprobs"] = self._logprobs(*self._pending)
            self._pending = ([], [])
        return chunk

    def _logprobs(self, tokens: Sequence[int], probs: Sequence) -> dict | None:
        """OpenAI's logprobs of these tokens, as llama-server gives them (`content`: each token with
        its logprob and top_logprobs); a completion's also in OpenAI's older fields."""
        if self.logprobs is None:
            return None
        content = [{**entry, "top_logprobs": entry["top_logprobs"][:self.logprobs]}
                   for entry in probs_json(self.piece, tokens, probs, False)]
        if self.chat:
            return {"content": content}
        offsets = itertools.accumulate((len(e["token"]) for e in content[:-1]), initial=0)
        return {"content": content, "tokens": [e["token"] for e in content],
                "token_logprobs": [e["logprob"] for e in content],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in content],
                "text_offset": list(offsets) if content else []}

    def _chunk(self, delta: dict, finish: str | None = None, **extra) -> dict:
        return self._object(True, {"index": self.index, "delta": delta, "finish_reason": finish}, **extra)

    def _delta(self, change: Delta) -> dict:
        if change.index is None:
            return {"content": change.content} if change.content else {"reasoning_content": change.reasoning_content}
        call = {"index": change.index}
        if change.call.name:  # a new call (or its name settled): its id and name
            call.update(id=self._call_id(change.index, change.call.id), type="function")
            call["function"] = {"name": change.call.name, "arguments": change.call.arguments}
        else:
            call["function"] = {"arguments": change.call.arguments}
        return {"tool_calls": [call]}

    def _call_id(self, index: int, own: str) -> str:
        while len(self.call_ids) <= index:
            self.call_ids.append("")
        if not self.call_ids[index]:
            self.call_ids[index] = own or random_id()
        return self.call_ids[index]

    def _fields(self, message: ChatMessage) -> dict:
        """A whole message's fields: content (null when only calls), reasoning_content, tool_calls."""
        fields = {"content": message.content if message.content or not message.tool_calls else None}
        if message.reasoning_content:
            fields["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            fields["tool_calls"] = [{"id": self._call_id(i, c.id), "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}}
                                    for i, c in enumerate(message.tool_calls)]
        return fields

    def _object(self, chunk: bool, choice: dict, **extra) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": _fingerprint(), "choices": [choice], **extra}


@functools.lru_cache(maxsize=1)
def _fingerprint() -> str:
    """llama-server's system_fingerprint is its build ("b" and its number); speculate's is "b" and its version."""
    try:
        return f"b{version('speculate')}-speculate"
    except PackageNotFoundError:
        return "b0-speculate"


def _verbose(verbose: dict | None) -> dict:
    return {} if verbose is None else {"__verbose": verbose}


def _finish(finish: str, message: ChatMessage) -> str:
    """OpenAI's finish_reason: tool_calls when the answer ended (not cut) with calls."""
    return "tool_calls" if message.tool_calls and finish == "stop" else finish
