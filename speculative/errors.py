"""Errors the command line turns into one-line messages and documented exit codes."""

from __future__ import annotations


class SpeculateError(Exception):
    """Base class: `exit_code` is what the command line exits with."""

    exit_code = 1


class GenerationError(SpeculateError):
    """Generation failed at run time (decode error, prompt does not fit the context)."""

    exit_code = 1


class UsageError(SpeculateError):
    """The command line or a setting makes no sense."""

    exit_code = 2


class ModelError(SpeculateError):
    """A model or registry problem: missing or invalid file, unknown name,
    vocabulary mismatch, checksum mismatch, unsupported cache type."""

    exit_code = 3


class ContextFull(GenerationError):
    """A shared KV cache (several requests at once) has no cell left for this request's next
    batch: the request ends there, as at the end of its context (finish reason `length`)."""


class GrammarError(UsageError):
    """A grammar (GBNF) or JSON schema that cannot constrain generation: it does not parse, names
    a rule it never defines, is left-recursive, has a rule that can never complete, or uses what
    the schema converter cannot express. The message names the place: line and column of the
    grammar, or the schema path."""
