"""llama-server's own endpoints of `speculate serve`, without HTTP: /completion, /infill,
/tokenize, /detokenize, /props and /metrics, as the pinned llama.cpp's tools/server serves
them (server-context.cpp, server-common.cpp, server-schema.cpp, server-task.cpp), for the
editor plugins that speak them (llama.vim, llama.vscode).

Requests are read as llama-server reads them: a null field is an absent one, a field of the
wrong type is `400 Field 'name': ...`, numbers outside a soft range are clamped (top_p 1.5 is
1) and outside a hard one refused. Fields that would change the answer in a way this server
cannot honour (a grammar, logit biases, mirostat, DRY, XTC, ...) are refused unless they hold
their neutral value; fields that change nothing here are accepted and ignored (IGNORED).
Errors are llama-server's error objects: {"error": {"code", "message", "type"}}.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from speculative.decoding.settings import SamplerSettings
from speculative.engine.stream import Final, Piece
from speculative.serving.generation import Vocab as BiasVocab
from speculative.serving.generation import (ApiError, Defaults, Generation, logit_bias, probs_json, refuse_unsupported,
                                            request_grammar, speculation)
from speculative.serving.openai_api import timed, timings
from speculative.serving.worker import Metrics, Progress

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
MAX_STOPS = 16
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # format_prompt_infill's, for models without FIM_SEP

# llama-server's sampler names (common_sampler_types_from_names) and letters (..._from_chars),
# as letters of --sampling-seq. d, s and x are accepted at their neutral settings only (see
# _NEUTRAL), where they change nothing; adaptive_p draws differently and is refused.
SAMPLER_LETTERS = {"dry": "d", "top_k": "k", "top_p": "p", "top_n_sigma": "s", "typ_p": "y", "min_p": "m",
                   "temperature": "t", "xtc": "x", "infill": "i", "penalties": "e", "adaptive_p": "a"}
_ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p",
            **{alias: name for name in SAMPLER_LETTERS if "_" in name
               for alias in (name.replace("_", "-"), name.replace("_", ""))}}
SAMPLER_NAMES = {letter: name for name, letter in SAMPLER_LETTERS.items()}

# Fields llama-server reads that this server accepts and does not use, and why (docs/serving.md's list).
IGNORED = {
    "t_max_prompt_ms": "llama-server does not implement it either",
    "id_slot": "the slot whose cache holds the longest part of the prompt is taken (-sps)",
    "model": "one model",
    "n_cache_reuse": "the cache keeps the longest shared prefix; no KV shifting",
    "sse_ping_interval": "no pings: every step sends its text",
    "stream_options": "the final answer carries the timings",
    "verbose": "llama-server's own answers have no __verbose object (its /v1 answers do, as speculate's)",
    "backend_sampling": "sampling runs in speculate",
}

# Fields that change the answer in a way this server cannot honour: accepted at the value that
# changes nothing (llama-server's default), refused otherwise.
_NEUTRAL = {"min_keep": (0,), "dynatemp_range": (0,),
            "top_n_sigma": (-1,), "xtc_probability": (0,), "dry_multiplier": (0,), "mirostat": (0,),
            "lora": ([],), "adaptive_target": (-1,), "echo": (False,)}


class Vocab(BiasVocab, Protocol):
    """What these endpoints read of the target model (llamacpp.model.LlamaModel)."""
    n_ctx: int
    n_batch: int
    add_bos: bool

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]: ...
    def token_bytes(self, token: int, special: bool = True) -> bytes: ...
    def fim_tokens(self) -> dict[str, int | None]: ...
    def bos_token(self) -> int | None: ...
    def eog_tokens(self) -> Sequence[int]: ...


# -- reading fields as llama-server does -------------------------------------------------


def _present(data: dict, name: str) -> bool:
    return data.get(name) is not None  # a null field is an absent one


def _field_error(name: str, message: str) -> ApiError:
    return ApiError(400, f"Field '{name}': {message}", param=name)


def _number(data: dict, names: Sequence[str], default: float, lo: float, hi: float, hard: bool = False,
            integer: bool = False) -> float:
    """A number field (the first of `names` present): clamped into [lo, hi], or refused outside
    it when `hard`; an integer field truncates a fraction, as nlohmann's get<int> does."""
    for name in names:
        if _present(data, name):
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise _field_error(name, f"type must be number, but is {type(value).__name__}")
            if integer:
                value = int(value)
            if hard and not lo <= value <= hi:
                raise _field_error(name, f"Value must be between {lo} <= value <= {hi}, but got {value}")
            return min(max(value, lo), hi)
    return default


def _bool(data: dict, name: str, default: bool) -> bool:
    if not _present(data, name):
        return default
    if not isinstance(data[name], bool):
        raise _field_error(name, f"type must be boolean, but is {type(data[name]).__name__}")
    return data[name]


def _stops(data: dict) -> tuple[str, ...]:
    if not _present(data, "stop"):
        return ()
    stop = data["stop"]
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise _field_error("stop", "a string or an array of strings")
    if len(words) > MAX_STOPS:
        raise _field_error("stop", f"at most {MAX_STOPS} stop strings")
    return tuple(w for w in words if w)


def _sequence(data: dict, default: str) -> str:
    """`samplers` as letters of --sampling-seq: names (unknown ones skipped, as llama-server
    does) or a string of letters."""
    if not _present(data, "samplers"):
        return default
    samplers = data["samplers"]
    if isinstance(samplers, str):
        letters = "".join(c for c in samplers if c in SAMPLER_NAMES)
    elif isinstance(samplers, list) and all(isinstance(s, str) for s in samplers):
        names = [_ALIASES.get(s.lower(), s.lower()) for s in samplers]
        letters = "".join(SAMPLER_LETTERS[n] for n in names if n in SAMPLER_LETTERS)
    else:
        raise _field_error("samplers", "an array of sampler names or a string of sampler letters")
    if "a" in letters:
        raise ApiError(400, "samplers: adaptive_p is not supported by this server", param="samplers")
    return letters


@dataclass(frozen=True)
class Options:
    """What a /completion or /infill request asks beyond the Generation, for its answer."""
    stream: bool
    return_tokens: bool
    response_fields: tuple[str, ...]
    settings: dict          # generation_settings, as llama-server reports them
    n_probs: int = 0        # completion_probabilities: each token's, with its n_probs likeliest
    post_sampling: bool = False  # ... after the sampler chain: prob and top_probs
    per_token: bool = False      # the stream's steps and progress reports carry the timings so far


def parse(data: object, prompt: list[int], spec_types: str = "", defaults: Defaults = Defaults(),
          eog: Sequence[int] = (), vocab: Vocab | None = None) -> tuple[Generation, Options]:
    """The sampling and stopping fields of a /completion or /infill body, for `prompt` (tokens);
    `spec_types` and `eog` (the model's end-of-generation tokens): for generation_settings; what
    the body leaves out, the server's `defaults` (its command line, as llama-server's); `vocab`
    (the target) reads logit_bias."""
    assert isinstance(data, dict)
    refuse_unsupported(data, _NEUTRAL, strict_types=False)
    n_predict = int(_number(data, ("n_predict", "max_completion_tokens", "max_tokens"), defaults.n_predict, -1,
                            INT32_MAX, hard=True, integer=True))
    base = defaults.sampling
    sequence = _sequence(data, base.sequence)
    temp = _number(data, ("temperature",), base.temp, 0.0, math.inf)
    seed = int(_number(data, ("seed",), base.seed, -1, UINT32_MAX, integer=True))
    sampling = SamplerSettings(
        # without a temperature sampler llama-server draws from the chain whatever the temperature
        temp=temp if "t" in sequence or temp > 0 else 1.0,
        top_k=int(_number(data, ("top_k",), base.top_k, 0, INT32_MAX, integer=True)),
        top_p=_number(data, ("top_p",), base.top_p, 0.0, 1.0),
        min_p=_number(data, ("min_p",), base.min_p, 0.0, 1.0),
        typical_p=_number(data, ("typical_p",), base.typical_p, 1e-9, 1.0),
        repeat_last_n=int(_number(data, ("repeat_last_n",), base.repeat_last_n, 0, INT32_MAX, hard=True,
                                  integer=True)),
        repeat_penalty=_number(data, ("repeat_penalty",), base.repeat_penalty, 1e-9, math.inf),
        presence_penalty=_number(data, ("presence_penalty",), base.presence_penalty, -math.inf, math.inf),
        frequency_penalty=_number(data, ("frequency_penalty",), base.frequency_penalty, -math.inf, math.inf),
        # llama-server's LLAMA_DEFAULT_SEED (UINT32_MAX) is a random seed, as -1 is here
        sequence=sequence, seed=seed if seed != UINT32_MAX else -1,
        grammar=request_grammar(data, chat=False) or base.grammar,
        logit_bias=logit_bias(data.get("logit_bias"), vocab) if _present(data, "logit_bias") else (),
        n_probs=int(_number(data, ("n_probs", "logprobs"), 0, 0, INT32_MAX, hard=True, integer=True)),
        post_sampling_probs=_bool(data, "post_sampling_probs", False))
    if not _present(data, "response_fields"):
        fields = ()
    elif isinstance(data["response_fields"], list) and all(isinstance(f, str) for f in data["response_fields"]):
        fields = tuple(data["response_fields"])
    else:
        raise _field_error("response_fields", "an array of strings")
    stream = _bool(data, "stream", False)
    generation = Generation(
        chat=False, prompt=None, messages=None, sampling=sampling,
        # n_predict 0 (the editors' cache warm-up) generates one token: llama-server checks its budget after a token
        max_tokens=None if n_predict < 0 else max(n_predict, 1),
        stops=_stops(data), ignore_eos=_bool(data, "ignore_eos", defaults.ignore_eos), stream=stream,
        tokens=tuple(prompt), speculation={**speculation(data), **_shift(data)},
        n_indent=int(_number(data, ("n_indent",), 0, 0, INT32_MAX, hard=True, integer=True)),
        # -1: llama-server's default (task_params); Generation's 0 means the same, no limit
        t_max_predict_ms=int(_number(data, ("t_max_predict_ms",), -1, -1, 2**63 - 1, hard=True, integer=True)),
        cache_prompt=_bool(data, "cache_prompt", True), return_progress=_bool(data, "return_progress", False),
        timings_per_token=_bool(data, "timings_per_token", False),
        n=int(_number(data, ("n_cmpl", "n"), 1, 1, INT32_MAX, hard=True, integer=True)))
    _bool(data, "verbose", False)  # checked as llama-server does, then ignored
    return generation, Options(stream, _bool(data, "return_tokens", False), fields,
                               generation_settings(generation, n_predict, spec_types, eog),
                               sampling.n_probs, sampling.post_sampling_probs, generation.timings_per_token)


def _shift(data: dict) -> dict:
    """The context shift's n_keep (-1: the prompt) and n_discard (0: half), when the body gives them
    (SpecSettings' fields: with --context-shift, what a full context keeps and drops)."""
    return {name: int(_number(data, (name,), 0, lo, INT32_MAX, hard=True, integer=True))
            for name, lo in (("n_keep", -1), ("n_discard", 0)) if _present(data, name)}


def generation_settings(generation: Generation, n_predict: int, spec_types: str = "", eog: Sequence[int] = ()) -> dict:
    """llama-server's `generation_settings` (task_params::to_json) for what this server runs:
    ignore_eos as llama-server applies it, a bias of -infinity (null in JSON) on each token of `eog`."""
    s = generation.sampling
    bias = [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in s.logit_bias]
    bias += [{"bias": None, "token": int(t)} for t in eog] if generation.ignore_eos else []
    return {
        "seed": s.seed if s.seed >= 0 else UINT32_MAX, "temperature": s.temp, "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p, "top_n_sigma": -1.0,
        "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": s.typical_p, "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": s.repeat_penalty, "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
        "dry_penalty_last_n": -1, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
        "stop": list(generation.stops), "max_tokens": n_predict, "n_predict": n_predict,
        "n_keep": generation.speculation.get("n_keep", 0), "n_discard": generation.speculation.get("n_discard", 0),
        "ignore_eos": generation.ignore_eos, "stream": generation.stream, "logit_bias": bias,
        "n_probs": s.n_probs, "min_keep": 0, "grammar": s.grammar, "samplers": [SAMPLER_NAMES[c] for c in s.sequence],
        "speculative.types": spec_types, "timings_per_token": generation.timings_per_token,
        "post_sampling_probs": s.post_sampling_probs,
        "lora": [],
    }


# -- prompts ------------------------------------------------------------------------------


def _object(data: object) -> dict:
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def tokenize_mixed(vocab: Vocab, prompt: object, add_special: bool, parse_special: bool, field: str) -> list[int]:
    """A string, or a list of strings and token ids (llama-server's tokenize_mixed: only a
    leading string gets the special tokens, BOS)."""
    if isinstance(prompt, str):
        return vocab.tokenize(prompt, add_special, parse_special)
    if not isinstance(prompt, list):
        raise ApiError(400, f'"{field}" must be a string or an array of strings and token ids', param=field)
    tokens: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            tokens += vocab.tokenize(part, add_special and i == 0, parse_special)
        elif isinstance(part, int) and not isinstance(part, bool):
            tokens.append(part)
        else:
            raise ApiError(400, f'"{field}" must be a string or an array of strings and token ids', param=field)
    return tokens


def completion_prompts(vocab: Vocab, data: object) -> list[list[int]]:
    """/completion's `prompt`, as llama-server's tokenize_input_prompts reads it: a string, token
    ids, strings and token ids mixed, or {"prompt_string": ...} is one prompt; a list of these
    (a list with no token id in it: of strings, lists or objects) is several, each answered."""
    data = _object(data)
    if "prompt" not in data:
        raise ApiError(400, '"prompt" is required', param="prompt")
    prompt = data["prompt"]
    several = isinstance(prompt, list) and not any(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
    if several and not prompt:
        raise ApiError(400, '"prompt" must not be empty', param="prompt")
    return [_one_prompt(vocab, p) for p in (prompt if several else [prompt])]


def _one_prompt(vocab: Vocab, prompt: object) -> list[int]:
    if isinstance(prompt, dict):
        if "multimodal_data" in prompt:
            raise ApiError(400, "Multimodal data provided, but model does not support multimodal requests.")
        if "prompt_string" not in prompt:
            raise ApiError(400, '"prompt" elements must be a string, a list of tokens, a JSON object containing a '
                                'prompt string, or a list of mixed strings & tokens.', param="prompt")
        prompt = prompt["prompt_string"]
    return tokenize_mixed(vocab, prompt, True, True, "prompt")


def infill_prompt(vocab: Vocab, data: object) -> list[int]:
    """/infill's prompt (server-context.cpp's post_infill and server-common.cpp's
    format_prompt_infill): 501 for a model without FIM_PRE, FIM_SUF and FIM_MID, then

        [FIM_REP]myproject\\n[FIM_SEP]{filename}\\n{text}...[FIM_SEP]filename\\n  (input_extra, newest last)
        [BOS][FIM_PRE]{input_prefix}{prompt}[FIM_SUF]{input_suffix}[FIM_MID]

    the prefix's last 3/4 of a batch (-b), the suffix's first quarter less the prompt and 2,
    and the extra context's last n_ctx - n_batch + 2 tokens (llama-server's -n being -1)."""
    fim = vocab.fim_tokens()
    missing = "".join(f"{what} token is missing. " for what, key in
                      (("prefix", "pre"), ("suffix", "suf"), ("middle", "mid")) if fim[key] is None)
    if missing:  # before the body is read, as llama-server does
        raise ApiError(501, f"Infill is not supported by this model: {missing}")
    data = _object(data)
    if "prompt" in data and not isinstance(data["prompt"], str):
        raise ApiError(400, '"prompt" must be a string', param="prompt")
    for name in ("input_prefix", "input_suffix"):
        if name not in data:
            raise ApiError(400, f'"{name}" is required', param=name)
    extra = data.get("input_extra", [])
    if extra is None:
        extra = []
    if not isinstance(extra, list):
        raise ApiError(400, '"input_extra" must be an array of {"filename": string, "text": string}',
                       param="input_extra")
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise ApiError(400, 'extra_context chunk must contain a "text" field with a string value',
                           param="input_extra")
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise ApiError(400, 'extra_context chunk\'s "filename" field must be a string', param="input_extra")
    prompt = vocab.tokenize(data.get("prompt", ""), False, True)
    prefix = tokenize_mixed(vocab, data["input_prefix"], False, False, "input_prefix")
    suffix = tokenize_mixed(vocab, data["input_suffix"], False, False, "input_suffix")

    def plain(text: str) -> list[int]:
        return vocab.tokenize(text, False, False)

    extra_tokens: list[int] = []
    if fim["rep"] is not None:
        extra_tokens += [fim["rep"], *plain("myproject\n")]
    for chunk in extra:
        if fim["sep"] is not None:
            extra_tokens += [fim["sep"], *plain(chunk.get("filename", "tmp") + "\n")]
        else:
            extra_tokens += plain(CHUNK_SEPARATOR)
        extra_tokens += plain(chunk["text"])
    if fim["sep"] is not None:
        extra_tokens += [fim["sep"], *plain("filename\n")]

    n_batch, n_ctx, n_predict = vocab.n_batch, vocab.n_ctx, -1
    n_prefix_take = min(len(prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    head = [fim["pre"], *prefix[len(prefix) - n_prefix_take:], *prompt]
    tail = [fim["suf"], *suffix[:n_suffix_take]]
    bos = [vocab.bos_token()] if vocab.add_bos and vocab.bos_token() is not None else []
    return [*extra_tokens[len(extra_tokens) - n_extra_take:], *bos, *head, *tail, fim["mid"]]


# -- answers ------------------------------------------------------------------------------

STOP_TYPES = {"length": "limit", "none": "none"}


class Reply:
    """The answer of one /completion or /infill request: the whole one, or its stream."""

    def __init__(self, model: str, options: Options, prompt: Sequence[int], prompt_text: Callable[[], str],
                 n_ctx: int, piece: Callable[[int], bytes] = lambda token: b"", index: int = 0):
        """`piece`: a token's bytes (for probabilities); `index`: the answer's, among a request's
        prompts and their n_cmpl answers each."""
        self.model = model
        self.options = options
        self.prompt = prompt
        self.prompt_text = prompt_text
        self.n_ctx = n_ctx
        self.piece = piece
        self.index = index
        self.n_sent = 0

    def chunks(self, piece: Piece) -> list[dict]:
        """A streamed piece: the text of one step and its tokens; with n_probs a chunk per token,
        each with its probabilities, as llama-server sends every token."""
        if not self.options.n_probs:
            chunks = [self._chunk(piece.text, piece.ids)]
        else:
            chunks = [{**self._chunk(text, (token,)), "completion_probabilities": self._probs((token,), (probs,))}
                      for (text, _), token, probs in zip(piece.parts, piece.ids, piece.probs)]
        return timed(chunks, piece.stats, self.options.per_token)  # on the step's last token's chunk

    def _chunk(self, text: str, ids: Sequence[int]) -> dict:
        self.n_sent += len(ids)
        return {"index": self.index, "content": text, "tokens": list(ids), "stop": False, "id_slot": 0,
                "tokens_predicted": self.n_sent, "tokens_evaluated": len(self.prompt)}

    def progress(self, progress: Progress) -> dict:
        """A streamed report of the prompt's progress (return_progress), with timings_per_token
        the timings so far."""
        chunk = {**self._chunk("", ()), "tokens_predicted": 0, "prompt_progress": progress.json()}
        if self.options.per_token:
            chunk["timings"] = timings(progress.stats())
        return chunk

    def _probs(self, ids: Sequence[int], probs: Sequence) -> list[dict]:
        return probs_json(self.piece, ids, probs, self.options.post_sampling)

    def final(self, final: Final) -> dict:
        """llama-server's final result (to_json_non_oaicompat); streamed, its text and tokens
        came in the chunks."""
        stats = final.stats
        stream = self.options.stream
        if final.reason == "stop":
            stop_type = "word" if final.stop_word else "eos"
        else:
            stop_type = STOP_TYPES.get(final.reason, "limit")
        answer = {
            "index": self.index,
            "content": "" if stream else final.text,
            "tokens": [] if stream or not self.options.return_tokens else list(final.tokens),
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": stats.n_predict,
            "tokens_evaluated": len(self.prompt),
            "generation_settings": {**self.options.settings, "n_ctx": self.n_ctx},
            "prompt": self.prompt_text(),
            "has_new_line": "\n" in final.text,
            "truncated": final.stats.n_shifted > 0 or final.reason == "length" and final.n_kept + 1 >= self.n_ctx,
            "stop_type": stop_type,
            "stopping_word": final.stop_word,
            "tokens_cached": final.n_kept,
            "timings": timings(stats),
        }
        if self.options.n_probs and not stream:
            answer["completion_probabilities"] = self._probs(final.tokens, final.probs)
        return select(answer, self.options.response_fields)


def verbose(model: str, generation: Generation, prompt: Sequence[int], vocab: Vocab, spec_types: str,
            final: Final) -> dict:
    """llama-server's `__verbose` object of an OpenAI answer (a request's `verbose`, or -v): the
    answer as its own endpoints give it (to_json_non_oaicompat), the prompt as text included."""
    n_predict = -1 if generation.max_tokens is None else generation.max_tokens
    settings = generation_settings(generation, n_predict, spec_types, vocab.eog_tokens())
    reply = Reply(model, Options(generation.stream, False, (), settings), prompt,
                  lambda: text_of(vocab, prompt), vocab.n_ctx)
    return reply.final(final)


def select(answer: dict, paths: Sequence[str]) -> dict:
    """`response_fields` (json_get_nested_values): only these, each under its own path as key
    ("timings/prompt_n": the value of answer["timings"]["prompt_n"]); missing ones left out."""
    if not paths:
        return answer
    out = {}
    for path in paths:
        value: object = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


# -- the other endpoints ------------------------------------------------------------------


def tokenize(vocab: Vocab, data: object) -> dict:
    """/tokenize: `content` (a string, or strings and token ids), `add_special` (BOS; default
    false), `parse_special` (default true), `with_pieces` (each token with its text, or its
    bytes where they are not UTF-8)."""
    data = _object(data)
    if "content" not in data:
        return {"tokens": []}
    add_special = _bool(data, "add_special", False)
    parse_special = _bool(data, "parse_special", True)
    tokens = tokenize_mixed(vocab, data["content"], add_special, parse_special, "content")
    if not _bool(data, "with_pieces", False):
        return {"tokens": tokens}
    return {"tokens": [{"id": t, "piece": _piece(vocab.token_bytes(t))} for t in _valid(vocab, tokens)]}


def _piece(piece: bytes) -> str | list[int]:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def _valid(vocab: Vocab, tokens: object, field: str = "tokens") -> list[int]:
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, f'"{field}" must be an array of token ids', param=field)
    bad = [t for t in tokens if not 0 <= t < vocab.n_vocab]
    if bad:
        raise ApiError(400, f"token {bad[0]} is outside this model's vocabulary (0 to {vocab.n_vocab - 1})",
                       param=field)
    return tokens


def detokenize(vocab: Vocab, data: object) -> dict:
    """/detokenize: `tokens` back to text (special tokens as their text, as llama-server)."""
    data = _object(data)
    tokens = _valid(vocab, data.get("tokens", []))
    return {"content": text_of(vocab, tokens)}


def text_of(vocab: Vocab, tokens: Sequence[int]) -> str:
    return b"".join(vocab.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")


def props(vocab: Vocab, model: dict, chat_template: str, build_info: str, metrics: bool, n_slots: int = 1,
          slots: bool = False, defaults: Defaults = Defaults()) -> dict:
    """/props: llama-server's fields that apply to this server; `defaults`: what a request gets
    for what it leaves out."""
    generation = Generation(False, None, None, defaults.sampling, defaults.max_tokens, (), defaults.ignore_eos, False)
    bos, eos = model.get("bos_token", ""), model.get("eos_token", "")
    return {
        "default_generation_settings": {"params": generation_settings(generation, defaults.n_predict,
                                                                      model["meta"]["spec_type"], vocab.eog_tokens()),
                                        "n_ctx": vocab.n_ctx},
        "total_slots": n_slots,
        "model_alias": model["id"],
        "model_path": model.get("path", ""),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": slots,
        "endpoint_props": False,
        "endpoint_metrics": metrics,
        "chat_template": chat_template,
        "bos_token": bos,
        "eos_token": eos,
        "build_info": build_info,
        "is_sleeping": False,
        "speculative": {"draft": model["meta"]["draft"], "spec_type": model["meta"]["spec_type"]},
    }


def prometheus(m: Metrics, processing: int, deferred: int) -> str:
    """/metrics in Prometheus's text format: llama-server's metrics (llamacpp:*, its names and
    help texts) and speculate's own (speculate:*)."""
    window_prompt = m.window[0] / m.window[1] if m.window[1] > 0 else 0.0
    window_predicted = m.window[2] / m.window[3] if m.window[3] > 0 else 0.0
    items = [
        ("counter", "llamacpp:prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
         m.prompt_tokens),
        ("counter", "llamacpp:prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
         m.prompt_cached),
        ("counter", "llamacpp:prompt_seconds_total", "Total time spent processing prompts", m.prompt_seconds),
        ("counter", "llamacpp:tokens_predicted_total", "Number of generation tokens processed", m.predicted),
        ("counter", "llamacpp:tokens_predicted_seconds_total", "Total time spent generating tokens",
         m.predicted_seconds),
        ("counter", "llamacpp:n_decode_total",
         "Total number of llama_decode() calls of the target model (prompts, steps and verifications)", m.n_decode),
        ("counter", "llamacpp:n_tokens_max", "Largest observed sequence length (prompt + generation)",
         m.n_tokens_max),
        ("counter", "llamacpp:spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
         m.drafted),
        ("counter", "llamacpp:spec_decode_num_accepted_tokens_total",
         "Speculative: Total draft tokens accepted by the target model", m.accepted),
        ("counter", "llamacpp:spec_decode_num_drafts_total",
         "Speculative: Total speculative decoding verification steps", m.draft_steps),
        ("gauge", "llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s", window_prompt),
        ("gauge", "llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s",
         window_predicted),
        ("gauge", "llamacpp:requests_processing", "Number of requests processing", processing),
        ("gauge", "llamacpp:requests_deferred", "Number of requests deferred", deferred),
        ("gauge", "llamacpp:n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         m.n_busy_slots / max(m.n_decode, 1)),
        ("counter", "speculate:requests_total", "Generations finished (cancelled and cut-off ones included)",
         m.requests),
        ("counter", "speculate:requests_refused_total", "Requests refused with 503 because the queue was full",
         m.refused),
        ("counter", "speculate:target_passes_total", "Target model forward passes after the prompts", m.steps),
        ("gauge", "speculate:tokens_per_pass", "Generated tokens per target forward pass, since the start",
         m.predicted / m.steps if m.steps else 0.0),
        ("gauge", "speculate:draft_acceptance_rate", "Accepted / drafted tokens, since the start",
         m.accepted / m.drafted if m.drafted else 0.0),
        ("gauge", "speculate:queue_length", "Requests waiting for the models (as requests_deferred)", deferred),
    ]
    return "".join(f"# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {_value(value)}\n"
                   for kind, name, help, value in items)


def _value(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))

