"""Chat templates: the model's own Jinja template, rendered in a sandbox.

A template read from a GGUF file is untrusted input (CVE-2024-34359 was code
execution through exactly this), so it is rendered in jinja2's
ImmutableSandboxedEnvironment: no attribute escapes, no mutation of the values
passed in.
"""

from __future__ import annotations

from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ModelError

MIN_JINJA2 = (3, 1, 6)


def check_jinja2_version() -> None:
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_JINJA2:
        raise ModelError(
            f"jinja2 {jinja2.__version__} is too old to render untrusted chat templates safely; "
            f"install jinja2>={'.'.join(map(str, MIN_JINJA2))}"
        )


def _raise(message: str):
    raise jinja2.TemplateError(message)


def render(template: str, messages: list[dict[str, str]], bos_token: str = "", eos_token: str = "") -> str:
    """Render a conversation with the generation prompt for the assistant's turn."""
    check_jinja2_version()
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_raise,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token,
        )
    except jinja2.exceptions.SecurityError as e:
        raise ModelError(f"chat template refused by the sandbox: {e}") from None
    except jinja2.TemplateError as e:
        raise ModelError(f"chat template failed: {e}") from None


def conversation(user: str, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}]
