"""The grammar a run or a request is constrained by, from however it was given: llama.cpp's flags
(--grammar, --grammar-file, -j/--json-schema, -jf/--json-schema-file), a batch line's or a prompts
file's fields, or a server request's. Always GBNF text that gbnf.check has passed; '' for none."""

from __future__ import annotations

import json
from pathlib import Path

from speculative.errors import GrammarError, UsageError
from speculative.grammar.gbnf import check

FLAGS = ("--grammar", "--grammar-file", "-j/--json-schema", "-jf/--json-schema-file")


def from_flags(grammar: str | None = None, grammar_file: Path | None = None, json_schema: str | None = None,
               json_schema_file: Path | None = None) -> str:
    """The GBNF llama.cpp's four flags ask for (at most one of them)."""
    given = [flag for flag, value in zip(FLAGS, (grammar, grammar_file, json_schema, json_schema_file))
             if value is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)}: give one grammar (a JSON schema is one too)")
    if grammar is not None:
        return checked(grammar, "--grammar")
    if grammar_file is not None:
        return checked(_read(grammar_file, "--grammar-file"), str(grammar_file))
    if json_schema is not None:
        return from_schema(_parse(json_schema, "-j/--json-schema"))
    if json_schema_file is not None:
        return from_schema(_parse(_read(json_schema_file, "-jf/--json-schema-file"), str(json_schema_file)))
    return ""


def checked(text: str, where: str) -> str:
    """`text` as GBNF, checked (GrammarError naming `where`, the line and the column)."""
    if not text.strip():
        raise GrammarError(f"{where}: the grammar is empty")
    try:
        check(text)
    except GrammarError as e:  # "grammar line L, column C: ..." as "WHERE: line L, column C: ..."
        raise GrammarError(f"{where}: {str(e).removeprefix('grammar ')}") from None
    return text


def from_schema(schema: object) -> str:
    """A JSON schema (already parsed) as GBNF, as llama-server converts it."""
    from speculative.grammar.json_schema import schema_to_gbnf

    return checked(schema_to_gbnf(schema), "the grammar of the JSON schema")


def from_fields(grammar: object, json_schema: object, where: str = "") -> str:
    """A request's `grammar` and `json_schema` fields (None: absent); `grammar` wins when both are
    given, as in llama-server. `where`: what to name in an error (a batch line: "line 3: ")."""
    if grammar not in (None, ""):
        if not isinstance(grammar, str):
            raise GrammarError(f"{where}grammar must be a string of GBNF")
        return checked(grammar, f"{where}grammar")
    if json_schema is not None:
        try:
            return from_schema(json_schema)
        except GrammarError as e:
            raise GrammarError(f"{where}{e}") from None
    return ""


def _read(path: Path, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def _parse(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"{where}: not JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
