"""Chat templates: the model's own Jinja template (or --chat-template's), rendered in a sandbox, or
llama.cpp's built-in formats (--no-jinja, or one named by --chat-template).

A template read from a GGUF file is untrusted input (CVE-2024-34359 was code
execution through exactly this). It is rendered in jinja2's
ImmutableSandboxedEnvironment (no attribute escapes, no mutation of the values
passed in; jinja2 >= 3.1.6, which closed the last known escape), and bounded:

- in time: a trace hook stops any render still running after RENDER_SECONDS;
- in size: `*`, `**` and `+` on strings, lists and numbers, and every integer
  argument to a call or filter, are checked before Python computes them (a single
  `'a' * 10**9` would otherwise allocate in one step, out of the hook's reach);
  the output is collected piece by piece up to a limit;
- in memory: the trace hook also stops a render that grows the process's peak
  memory by more than MAX_GROWTH (a string doubled in a loop).
"""

from __future__ import annotations

import functools
import json
import math
import resource
import sys
import time
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from speculative.errors import ModelError, SpeculateError, UsageError

MIN_JINJA2 = (3, 1, 6)
RENDER_SECONDS = 2.0
MAX_SIZE = 1 << 20       # characters/items any value may have, beyond the conversation's own size
MAX_GROWTH = 256 << 20   # bytes of peak memory a render may add
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere


class _Stop(Exception):
    """A render broke a limit."""


def check_jinja2_version() -> None:
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_JINJA2:  # an installation problem: exit 1
        raise SpeculateError(
            f"jinja2 {jinja2.__version__} is too old to render untrusted chat templates safely; "
            f"install jinja2>={'.'.join(map(str, MIN_JINJA2))}"
        )


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _check_args(values, limit: int) -> None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > limit:
            raise _Stop(f"an argument of {v} is larger than {limit}")


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self, limit: int, **kw):
        super().__init__(**kw)
        self.limit = limit
        self.filters = {name: self._bounded(f) for name, f in {**self.filters, "tojson": _tojson}.items()}

    def _bounded(self, f):
        @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
        def filter_(*args, **kwargs):
            _check_args([*args, *kwargs.values()], self.limit)
            return f(*args, **kwargs)
        return filter_

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        sized = (str, list, tuple)
        if operator == "+" and isinstance(left, str) != isinstance(right, str) and (
                isinstance(left, jinja2.Undefined) or isinstance(right, jinja2.Undefined)):
            # text + an undefined variable is the text, as llama.cpp's Jinja has it (firefunction's
            # template adds `functions`, which no server defines)
            return left if isinstance(left, str) else right
        if operator == "**" and all(isinstance(v, (int, float)) for v in (left, right)):
            if abs(left) > 1 and right > 0 and right * math.log2(abs(left)) > 1024:
                raise _Stop(f"{left} ** {right} is too large a number")
        elif operator == "*":
            seq, n = (left, right) if isinstance(left, sized) else (right, left)
            if isinstance(seq, sized) and isinstance(n, int) and len(seq) * n > self.limit:
                raise _Stop(f"a repetition would make {len(seq) * n} characters or items")
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            if len(left) + len(right) > self.limit:
                raise _Stop(f"a concatenation would make {len(left) + len(right)} characters or items")
        return super().call_binop(context, operator, left, right)

    def unsafe_undefined(self, obj: Any, attribute: str):
        """An unsafe attribute is an error, not a silent Undefined: such a template is hostile."""
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _check_args([*args, *kwargs.values()], __self.limit)
        return super().call(__context, __obj, *args, **kwargs)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """JSON as chat templates expect it (transformers' and llama.cpp's tojson): keys in their order,
    characters as they are; jinja2's own sorts keys and escapes <, >, & and ' for HTML, so a tool's
    schema or a call's arguments would reach the model other than llama-server writes them."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys,
                      separators=tuple(separators) if separators else None)


class _Guard:
    """A trace hook for the rendering thread: time and peak-memory limits."""

    def __init__(self, seconds: float, growth: int):
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.max_rss = _peak_rss() + growth
        self.growth = growth
        self.events = 0

    def __call__(self, frame, event, arg):
        self.events += 1
        if self.events & 63 == 0:
            if time.monotonic() > self.deadline:
                raise _Stop(f"rendering took longer than {self.seconds:g} s")
            if _peak_rss() > self.max_rss:
                raise _Stop(f"rendering used more than {self.growth >> 20} MiB of memory")
        return self


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT


def render(template: str, messages: list[dict], bos_token: str = "", eos_token: str = "",
           seconds: float = RENDER_SECONDS, tools: list[dict] | None = None, extra: dict | None = None) -> str:
    """Render a conversation with the generation prompt for the assistant's turn. `tools`: the
    template's `tools` variable (OpenAI's function tools, as llama-server --jinja passes them);
    `extra`: more variables (chat_template_kwargs: enable_thinking, ...)."""
    check_jinja2_version()
    limit = MAX_SIZE + 4 * (sum(len(str(m)) for m in messages) + len(str(tools or "")))
    env = _Sandbox(limit, trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    previous = sys.gettrace()
    try:
        compiled = env.from_string(template)
        sys.settrace(_Guard(seconds, MAX_GROWTH))
        parts, size = [], 0
        # what llama.cpp passes every template (common_chat_extra_context): today's date, and
        # enable_thinking, true unless thinking is off
        today = datetime.now()
        variables = {"add_generation_prompt": not continuing(messages), "enable_thinking": True,
                     "date_string": today.strftime("%d %b %Y"), "datetime": today.strftime("%b %d %Y"),
                     **(extra or {}), "messages": messages, "bos_token": bos_token, "eos_token": eos_token}
        if tools:
            variables["tools"] = tools
        for part in compiled.generate(**variables):
            size += len(part)
            if size > limit:
                raise _Stop(f"the output exceeds {limit} characters")
            parts.append(part)
        return _continued("".join(parts), messages)
    except _Stop as e:
        raise ModelError(f"chat template stopped: {e}") from None
    except jinja2.exceptions.SecurityError as e:
        raise ModelError(f"chat template refused by the sandbox: {e}") from None
    except (jinja2.TemplateError, ArithmeticError, TypeError, ValueError, LookupError, MemoryError,
            RecursionError) as e:
        raise ModelError(f"chat template failed: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous)


def continuing(messages: list[dict]) -> bool:
    """A conversation ending with the assistant's message continues that message (llama-server's
    assistant prefill, vLLM's continue_final_message): no generation prompt after it."""
    return bool(messages) and messages[-1].get("role") == "assistant"


def _continued(rendered: str, messages: list[dict]) -> str:
    """The rendered conversation up to the end of the assistant's message it continues (without
    the end of turn the template wrote after it), as transformers' continue_final_message."""
    if not continuing(messages):
        return rendered
    content = messages[-1].get("content") or ""
    at = rendered.rfind(content.strip()) if content.strip() else -1
    if at < 0:
        raise _Stop("the template does not write the assistant's message that is to be continued")
    return rendered[:at + len(content.strip())]


@functools.lru_cache(maxsize=8)
def writes_parallel_calls(template: str) -> bool:
    """Whether a Jinja template writes both calls of an assistant message with two (llama.cpp's
    supports_parallel_tool_calls): llama-server's default for a request's parallel_tool_calls."""
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": {"x": i}}}
             for i, name in enumerate(("first_probe_tool", "second_probe_tool"))]
    messages = [{"role": "user", "content": _PROBE}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_0", "content": "1"}, {"role": "user", "content": _PROBE}]
    try:
        text = render(template, messages)
    except ModelError:
        return False
    return "second_probe_tool" in text


def _thinking_closed(rendered: str, template: str) -> str:
    """Thinking off (enable_thinking false) for a template that thinks: where it did not close the
    thinking block itself, the prompt ends with an empty one, as llama-server writes it."""
    from speculative.chat.formats import detect

    think = detect(template).think
    if think is None or think[0] not in template or rendered.rstrip().endswith(think[1]):
        return rendered
    return rendered + think[1] if rendered.rstrip().endswith(think[0]) else rendered + think[0] + think[1]


def format_chat(template: str, messages: list[dict], jinja: bool = True, bos_token: str = "",
                eos_token: str = "", tools: list[dict] | None = None, extra: dict | None = None) -> str:
    """A conversation as the prompt for the reply: through the Jinja `template` in the sandbox, or
    through llama.cpp's built-in format (--no-jinja, or the name of one given as the template),
    as llama-server formats it. `tools` and `extra` (render's) need the Jinja template, as
    llama-server's do (UsageError without)."""
    from speculative.llamacpp import templates  # llama.cpp's bindings: imported when a chat is formatted

    if jinja and template not in templates.builtin_names():
        rendered = render(template, messages, bos_token=bos_token, eos_token=eos_token, tools=tools, extra=extra)
        return _thinking_closed(rendered, template) if (extra or {}).get("enable_thinking") is False else rendered
    if tools:
        raise UsageError("tools need the model's Jinja chat template (not --no-jinja or a built-in format)")
    return templates.apply(template, messages)


_PROBE = "Hello from speculate."


def check_template(template: str, jinja: bool) -> None:
    """A --chat-template, before any model loads: the name of one of llama.cpp's built-in formats,
    or a template that writes a conversation's text (rendered in the sandbox; with --no-jinja, one
    that llama.cpp recognises). UsageError otherwise."""
    from speculative.llamacpp import templates

    if template in templates.builtin_names():
        return
    try:
        text = format_chat(template, [{"role": "user", "content": _PROBE}], jinja)
    except ModelError as e:
        raise UsageError(f"--chat-template: {e}") from None
    if _PROBE not in text:
        raise UsageError("--chat-template: neither one of llama.cpp's built-in formats "
                         f"({', '.join(templates.builtin_names())}) nor a template that writes the conversation")


def conversation(user: str, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}]


def prompt_or_messages(item) -> tuple[str | None, list | None]:
    """A JSONL line's input: its string `prompt`, or else its chat `messages` (role and
    content strings); ValueError when it has neither."""
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return item["prompt"], None
    messages = item.get("messages") if isinstance(item, dict) else None
    if isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return None, messages
    raise ValueError("needs a string `prompt` or a list of chat `messages`")
