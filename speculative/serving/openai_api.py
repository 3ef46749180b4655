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

import time
import uuid
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from speculative.decoding.stats import Stats
from speculative.serving.generation import (ApiError, Defaults, Generation, refuse_unsupported, request_grammar,
                                            speculation)

MAX_STOPS = 16           # stop strings per request (OpenAI allows 4, llama-server any number)
MAX_STOP_CHARS = 256


# -- requests -----------------------------------------------------------------

Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


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

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value):
        return [value] if isinstance(value, str) else value


class CompletionRequest(_Request):
    prompt: Annotated[str, Field(min_length=1)]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):  # OpenAI takes a batch of prompts; this server one per request
            if len(value) != 1:
                raise PydanticCustomError("one_prompt", "one prompt per request: a string, or a list of one")
            return value[0]
        return value


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str = ""  # text, or OpenAI's list of text parts, joined

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value):
        if value is None:  # an assistant turn that only called tools
            return ""
        if isinstance(value, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in value):
                raise PydanticCustomError("text_parts", 'only text parts are served: {"type": "text", "text": ...}')
            return "".join(p["text"] for p in value)
        return value


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # newer clients' name for max_tokens


# Fields that exist in OpenAI's API but are not served: refused unless set to what they
# would be when omitted.
_NEUTRAL = {"n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "logprobs": (False,),
            "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],), "functions": ([],),
            "tool_choice": ("none", "auto"), "function_call": ("none", "auto")}


def parse(data: object, chat: bool, defaults: Defaults = Defaults()) -> Generation:
    """A request body (parsed JSON) as a Generation, or ApiError(400); what it leaves out, the
    server's `defaults`."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    refuse_unsupported(data, _NEUTRAL, strict_types=True)
    try:
        request = ChatRequest.model_validate(data) if chat else CompletionRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"],
                       param=str(first["loc"][0]) if first["loc"] else None) from None
    chosen = {"temp": request.temperature, "top_k": request.top_k, "top_p": request.top_p, "min_p": request.min_p,
              "repeat_penalty": request.repeat_penalty, "presence_penalty": request.presence_penalty,
              "frequency_penalty": request.frequency_penalty, "seed": request.seed}
    sampling = defaults.chosen(**chosen, grammar=request_grammar(data, chat))
    stops = tuple(request.stop or ())
    ignore_eos = defaults.ignore_eos if request.ignore_eos is None else request.ignore_eos
    newer = request.max_completion_tokens if chat else None  # newer clients' name wins
    max_tokens = next((n for n in (newer, request.max_tokens) if n is not None), defaults.max_tokens)
    if chat:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content}
                    for m in request.messages]
        return Generation(True, None, messages, sampling, max_tokens, stops, ignore_eos, request.stream,
                          speculation=speculation(data))
    return Generation(False, request.prompt, None, sampling, max_tokens, stops, ignore_eos, request.stream,
                      speculation=speculation(data))


# -- responses ----------------------------------------------------------------


def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.n_prompt, "completion_tokens": stats.n_predict,
            "total_tokens": stats.n_prompt + stats.n_predict,
            "prompt_tokens_details": {"cached_tokens": stats.n_cached}}


def timings(stats: Stats) -> dict:
    """llama-server's `timings` (its names), and the acceptance rate and tokens per target pass."""
    prompt_n = stats.n_prompt - stats.n_cached  # tokens processed; the rest the cache held from the last run
    prompt_ms, predicted_ms = 1000 * stats.t_encode, 1000 * stats.t_decode
    return {
        "cache_n": stats.n_cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": stats.encode_tps,  # 0 when the cache left nothing to process
        "predicted_n": stats.n_predict,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.n_predict if stats.n_predict else 0.0,
        "predicted_per_second": stats.decode_tps,
        "draft_n": stats.n_drafted,
        "draft_n_accepted": stats.n_accept,
        "draft_accept_rate": stats.accept_rate,
        "tokens_per_step": stats.tokens_per_step,
    }


class Reply:
    """The response objects of one request: the whole answer, or its stream of chunks."""

    def __init__(self, model: str, chat: bool):
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.chat = chat

    def full(self, text: str, finish: str, stats: Stats) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if self.chat else
                  {"index": 0, "text": text, "logprobs": None})
        return self._object(False, {**choice, "finish_reason": finish}, usage=usage(stats), timings=timings(stats))

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        if not self.chat:
            return None
        return self._object(True, {"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "finish_reason": None})

    def chunk(self, text: str) -> dict:
        return self._object(True, {"index": 0, **self._delta(text), "finish_reason": None})

    def last_chunk(self, finish: str, stats: Stats) -> dict:
        return self._object(True, {"index": 0, **self._delta(None), "finish_reason": finish},
                            usage=usage(stats), timings=timings(stats))

    def _delta(self, text: str | None) -> dict:
        if self.chat:
            return {"delta": {} if text is None else {"content": text}}
        return {"text": text or "", "logprobs": None}

    def _object(self, chunk: bool, choice: dict, **extra) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [choice], **extra}
