"""What both HTTP APIs of `speculate serve` read a request into, without HTTP: the neutral
request (Generation) the worker runs, whichever API it came from; the errors a request gets
(ApiError, Busy), which each API writes in its own format; and the refusal of the fields that
would change the answer in a way this server cannot honour, which each API lists itself
(openai_api.py, llama_api.py).
"""

from __future__ import annotations

import codecs
import math
import secrets
import string
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Protocol, Sequence

from speculative.chat.request import Plan
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.drafters import registry
from speculative.errors import GrammarError
from speculative.grammar import given


class ApiError(Exception):
    """An error the client gets as an OpenAI error object with this HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
             500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.extra = extra or {}  # fields of the error object besides these (llama-server's n_ctx, ...)

    @property
    def kind(self) -> str:
        """The error's `type`: llama-server's exceed_context_size_error for a prompt the context
        cannot hold (on every endpoint, /v1 included), else by status."""
        if self.code == "context_length_exceeded":
            return "exceed_context_size_error"
        return self.TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict:
        """As OpenAI's API gives it (`code` a string: context_length_exceeded, which OpenAI's
        clients read), with llama-server's `type`."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code,
                          **self.extra}}

    def llama_body(self) -> dict:
        """The error as llama-server's own endpoints give it (format_error_response): the HTTP
        status as `code`."""
        return {"error": {"code": self.status, "message": self.message, "type": self.kind, **self.extra}}


class Busy(ApiError):
    """No room for the request now: 503, worth retrying (Retry-After)."""

    def __init__(self, message: str):
        super().__init__(503, message)


@dataclass(frozen=True)
class Defaults:
    """What a request gets for a field it leaves out: the server's command line, as llama-server
    gives its own to every request (its sampling flags, --grammar and --json-schema, -n and
    --ignore-eos); without flags, llama-server's defaults (SamplerSettings', SpecSettings')."""
    sampling: SamplerSettings = SamplerSettings()
    n_predict: int = SpecSettings.n_predict  # -1: until end of generation or a full context
    ignore_eos: bool = SpecSettings.ignore_eos
    reasoning_format: str = "auto"        # --reasoning-format
    template_kwargs: Mapping = field(default_factory=dict)  # --chat-template-kwargs (and --reasoning)
    reasoning_budget: int = -1            # --reasoning-budget (-1: unrestricted)
    verbose: bool = False                 # -v (or -lv above 9): answers carry llama-server's __verbose

    @property
    def max_tokens(self) -> int | None:
        return None if self.n_predict < 0 else self.n_predict

    def chosen(self, **given) -> SamplerSettings:
        """The sampling settings of a request: the fields it gives (not None), the server's for
        the rest; its grammar when it gives one, else the server's."""
        grammar = given.pop("grammar", "") or self.sampling.grammar
        return replace(self.sampling, grammar=grammar, **{k: v for k, v in given.items() if v is not None})


@dataclass(frozen=True)
class Generation:
    """A request, checked and ready for the engine."""
    chat: bool
    prompt: str | None                      # /v1/completions
    messages: list[dict[str, str]] | None   # /v1/chat/completions, for the chat template
    sampling: SamplerSettings
    max_tokens: int | None                  # None: until end of generation or a full context
    stops: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    # llama-server's own endpoints (llama_api.py):
    tokens: tuple[int, ...] | None = None  # the prompt as tokens, used as they are
    n_indent: int = 0                      # text.LineLimits
    t_max_predict_ms: int = 0              # text.LineLimits (0 or less: none)
    cache_prompt: bool = True              # False: the caches start empty
    speculation: dict = field(default_factory=dict)  # the request's own SpecSettings (speculation())
    # chat: the template's `tools` and other variables (chat_template_kwargs), and how the answer
    # is read back into content, reasoning and tool calls (None: as plain text)
    tools: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)
    plan: Plan | None = None
    reasoning_budget: int = -1  # tokens the answer may think before its thinking is ended (-1: no limit)
    # what the OpenAI answers carry besides: a last chunk with the usage (stream_options.include_usage),
    # llama-server's `__verbose` object (its request field `verbose`, by default serve's -v)
    include_usage: bool = False
    verbose: bool = False
    n: int = 1                      # choices of this prompt, each its own sequence and random stream
    return_progress: bool = False   # the stream reports the prompt's progress (llama-server's prompt_progress)
    timings_per_token: bool = False  # llama-server's: the stream's steps and progress reports carry the timings so far
    logprobs: int | None = None     # OpenAI's logprobs: the alternatives listed per token (None: no logprobs)


def random_id() -> str:
    """32 letters and digits, as llama-server's ids (random_string): a call id the model did not
    write, and the Responses API's ids after their prefix."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(32))


CHOICE_SEED_STEP = 0x9E3779B9  # choice i of a seeded request samples with seed + i times this (mod 2^32)


def choices(generation: Generation) -> list[Generation]:
    """A generation's n choices, each its own generation: the first is the request as it is, each
    other draws from a random stream of its own (a seeded request's seed moved on, else a random
    one), so that they differ."""
    seed = generation.sampling.seed
    return [replace(generation, n=1, sampling=replace(generation.sampling, seed=-1 if seed < 0 else
                                                      (seed + i * CHOICE_SEED_STEP) % 2**32))
            for i in range(generation.n)]


# A request's own speculation, in both APIs' bodies: llama-server's field -> (SpecSettings
# field, valid?, what it must be). Its value overrides the server's (and auto's choice of
# length) for this request's sequence only.
SPECULATION = {
    "speculative.n_max": ("draft_max", lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "speculative.n_min": ("draft_min", lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "speculative.p_min": ("draft_p_min", lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "speculative.type": ("types", lambda v: isinstance(v, str) and v != "" or
                         isinstance(v, list) and v and all(isinstance(t, str) for t in v),
                         "a speculative type, or a list of them"),
}


def speculation(data: dict) -> dict:
    """The SpecSettings fields a body's speculative.* fields set (ApiError 400 for a bad value)."""
    chosen = {}
    for name, (setting, valid, must) in SPECULATION.items():
        value = data.get(name)
        if value is None:
            continue
        if not valid(value):
            raise ApiError(400, f"{name}: must be {must}", param=name)
        if setting == "types":
            value = registry.canonical(value.split(",") if isinstance(value, str) else value)
        chosen[setting] = value
    if "draft_max" in chosen:
        chosen["draft_max_given"] = True  # it caps the n-gram types too, as --draft-max does
    return chosen


def is_int(v) -> bool:
    """A JSON integer (not a boolean)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite number that becomes a float as it is: an integer past 2**53 is refused, not
    rounded (and math.isfinite(10**400) would overflow)."""
    return (is_int(v) and abs(v) < 2**53) or (isinstance(v, float) and math.isfinite(v))


def refuse_unsupported(data: dict, neutral: Mapping[str, tuple], strict_types: bool) -> None:
    """ApiError(400) for the first field of `neutral` that `data` sets to anything but one of
    its neutral values (the values that change nothing; none: refused whatever it holds).
    `strict_types`: a value must also have its neutral value's type (OpenAI's API, read
    strictly: 1.0 is not 1); otherwise only a boolean must be one (llama-server, whose JSON
    library compares 1.0 and 1 as numbers, but not true and 1)."""
    for name, values in neutral.items():
        value = data.get(name)
        if value is not None and not any(_same(value, v, strict_types) for v in values):
            only = f" (only {values[0]!r})" if values else ""
            raise ApiError(400, f"{name}: not supported by this server{only}", param=name)


def _same(value: object, neutral: object, strict_types: bool) -> bool:
    if strict_types:
        return value == neutral and type(value) is type(neutral)
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def request_grammar(data: dict, chat: bool) -> str:
    """The GBNF a body asks for, as llama-server reads it (ApiError 400 for a bad one): `grammar`
    or `json_schema` (`grammar` wins when both are given, on /completion, /infill and
    /v1/completions); on chat, `response_format` too (json_object: any object, or its `schema`;
    json_schema: its json_schema.schema, enforced whatever `strict` says), and both fields at
    once are refused. An empty schema means any object."""
    grammar, schema = data.get("grammar"), data.get("json_schema")
    if chat:
        if schema is not None and grammar not in (None, ""):
            raise ApiError(400, "Cannot use both json_schema and grammar", param="grammar")
        schema = _response_format(data.get("response_format"), schema)
    if schema == {}:
        schema = {"type": "object"}
    try:
        return given.from_fields(grammar, schema)
    except GrammarError as e:
        raise ApiError(400, str(e), param="grammar" if grammar not in (None, "") else
                       "json_schema" if data.get("json_schema") is not None else "response_format") from None


def _response_format(value: object, schema: object) -> object:
    """OpenAI's response_format over a chat body's json_schema (llama-server's reading)."""
    if value is None:
        return schema
    if not isinstance(value, dict):
        raise ApiError(400, "response_format must be an object", param="response_format")
    kind = value.get("type", "")
    if kind == "json_object":
        return value.get("schema", {}) if "schema" in value or schema is None else schema
    if kind == "json_schema":
        wrapper = value.get("json_schema", {})
        if not isinstance(wrapper, dict):
            raise ApiError(400, "response_format.json_schema must be an object", param="response_format")
        return wrapper.get("schema", {})
    if kind not in ("", "text"):
        raise ApiError(400, 'response_format type must be one of "text", "json_object" or "json_schema", '
                       f"but got: {kind}", param="response_format")
    return schema


# -- token probabilities and biases, as both APIs give and read them ---------------------

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on the alternatives per token (top_logprobs, logprobs)
LOWEST = -3.4028234663852886e38  # the log of a probability of 0: llama-server's (the lowest float, valid JSON)


class Vocab(Protocol):
    """What reading biases and writing probabilities need of the target (llamacpp.model.LlamaModel)."""
    n_vocab: int

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]: ...
    def token_bytes(self, token: int, special: bool = True) -> bytes: ...


def logit_bias(value: object, vocab: Vocab, param: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """A body's logit_bias, read as llama-server reads it (server-schema.cpp): an object of token
    -> bias, or an array of [token, bias] pairs, a token being an id or a text (each of its tokens
    biased), a bias a number or false (banned). An id outside the vocabulary, a bias of another
    type or an entry of another shape: ApiError 400 (llama-server skips them silently)."""
    if value is None:
        return ()
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise ApiError(400, f"{param}: an object of token -> bias, or an array of [token, bias] pairs", param=param)
    out: list[tuple[int, float]] = []
    for token, bias in pairs:
        if bias is False:
            bias = -math.inf
        elif not is_number(bias):
            raise ApiError(400, f"{param}: the bias of {token!r} must be a number, or false to ban it", param=param)
        for t in _bias_tokens(token, vocab, param):
            out.append((t, float(bias)))
    return tuple(out)


def _bias_tokens(token: object, vocab: Vocab, param: str) -> list[int]:
    """A logit_bias key: a token id (an integer, or its digits as an object's key), else a text."""
    if isinstance(token, str) and token.lstrip("-").isdigit():
        token = int(token)
    if is_int(token):
        if not 0 <= token < vocab.n_vocab:
            raise ApiError(400, f"{param}: token {token} is outside this model's vocabulary "
                                f"(0 to {vocab.n_vocab - 1})", param=param)
        return [token]
    if isinstance(token, str):
        return vocab.tokenize(token, False, False)
    raise ApiError(400, f"{param}: a token is an id or a text, not {token!r}", param=param)


def probs_json(piece: Callable[[int], bytes], ids: Sequence[int], probs: Sequence, post_sampling: bool) -> list[dict]:
    """Generated tokens with their probabilities (TokenProbs), as llama-server writes them
    (probs_vector_to_json, for /completion's completion_probabilities and OpenAI's
    logprobs.content): id, token (its text, an incomplete last character cut), bytes, and
    logprob and top_logprobs, or with post_sampling_probs prob and top_probs."""
    value, tops = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def entry(token: int, p: float) -> dict:
        raw = piece(token)
        return {"id": token, "token": _valid_utf8(raw), "bytes": list(raw),
                value: p if post_sampling else (math.log(p) if p > 0 else LOWEST)}

    return [{**entry(t, p.prob), tops: [entry(i, q) for i, q in p.top]} for t, p in zip(ids, probs) if p is not None]


def _valid_utf8(raw: bytes) -> str:
    """The text of a token's bytes, an incomplete character at its end cut (llama-server's
    validate_utf8), as an incremental decoder holds it back; invalid bytes elsewhere replaced."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw)
