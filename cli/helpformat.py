"""`--help` as llama.cpp prints its own: every flag name whole, with its value's name, then
what it does, beside the names when they fit in the names column, else on the lines below.
Typer's rich tables give each of a flag's names a column and cut what does not fit
(`--model-draft,--sp…` in an 80-column terminal), which hides the very names users look for.
The flags stay grouped under their panel's title (Models, Speculation, Sampling, ...).

Every command and group of the app is made by `App`, so all of them print their help here;
the width is click's (the terminal's, at most 80 columns)."""

from __future__ import annotations

import inspect
import textwrap
from typing import Any, Iterable

import typer
from typer.core import TyperCommand, TyperGroup

from . import llama_flags

try:  # typer >= 0.22 vendors click
    from typer._click.exceptions import NoSuchOption
    from typer._click.parser import _OptionParser
except ImportError:  # pragma: no cover
    from click.exceptions import NoSuchOption
    from click.parser import _OptionParser

INDENT = 2        # a row's names start here
NAMES = 28        # names at most this wide have their help beside them
GAP = 2           # between the names and the help beside them
CONTINUED = 4     # names that take more than one line: the further lines' indentation


def write_help(command: Any, ctx: Any, formatter: Any) -> None:
    """The whole help page of `command` into click's `formatter`: usage, description, the
    arguments and options panel by panel, the sub-commands, the epilogue."""
    width = formatter.width
    formatter.write_usage(ctx.command_path, " ".join(command.collect_usage_pieces(ctx)))
    blocks = [_paragraphs(command.help, width)] if command.help else []
    for title, rows in _panels(command, ctx):
        blocks.append([f"{title}:", *_rows(rows, width)])
    if command.epilog:
        blocks.append(_paragraphs(command.epilog, width))
    for block in blocks:
        formatter.write("\n" + "\n".join(block) + "\n")


def _panels(command: Any, ctx: Any) -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, rows of (names, help)) in typer's order: the arguments, the options without a
    panel, the other panels as their first flag comes, then the sub-commands."""
    panels: dict[tuple[int, str], list[tuple[str, str]]] = {(0, "Arguments"): [], (1, "Options"): []}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:  # hidden
            continue
        kind = 0 if param.param_type_name == "argument" else 1
        title = getattr(param, "rich_help_panel", None) or ("Arguments", "Options")[kind]
        panels.setdefault((kind, title), []).append(record)
    for name in getattr(command, "list_commands", lambda ctx: [])(ctx):
        sub = command.get_command(ctx, name)
        if sub is not None and not sub.hidden:
            title = getattr(sub, "rich_help_panel", None) or "Commands"
            panels.setdefault((2, title), []).append((name, sub.short_help or sub.help or ""))
    ordered = sorted(panels.items(), key=lambda item: item[0][0])  # stable: first come within a kind
    return [(title, rows) for (_, title), rows in ordered if rows]


def _rows(rows: Iterable[tuple[str, str]], width: int) -> list[str]:
    """Each row's names whole (wrapped between names, never inside one), its help beside them
    when they fit in the names column, else below them, at the help column."""
    rows = list(rows)
    column = INDENT + min(NAMES, max(len(names) for names, _ in rows)) + GAP
    lines = []
    for names, text in rows:
        help_lines = _wrap(text, width - column)
        if len(names) <= column - INDENT - GAP:
            beside = help_lines.pop(0) if help_lines else ""
            lines.append((" " * INDENT + names.ljust(column - INDENT) + beside).rstrip())
        else:
            lines += _wrap(names, width - INDENT, " " * INDENT, " " * (INDENT + CONTINUED))
        lines += [" " * column + line for line in help_lines]
    return lines


def _paragraphs(text: str, width: int) -> list[str]:
    """A description's paragraphs (blank-line separated), each re-wrapped, a blank line between."""
    out: list[str] = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        if paragraph.strip():
            out += ([""] if out else []) + _wrap(paragraph, width - INDENT, " " * INDENT, " " * INDENT)
    return out


def _wrap(text: str, width: int, first: str = "", further: str = "") -> list[str]:
    """`text` in lines of at most `width` (indentation included), broken only at spaces: a flag
    such as --spec-draft-model is never split at its hyphens, nor "default: 2048" in two."""
    text = " ".join(text.split()).replace("default: ", "default:" + _KEEP)
    lines = textwrap.wrap(text, width, initial_indent=first, subsequent_indent=further,
                          break_on_hyphens=False, break_long_words=False)
    return [line.replace(_KEEP, " ") for line in lines]


_KEEP = "\u00a0"  # a space textwrap does not break at (it breaks at ASCII whitespace only)


class WholeFlagParser(_OptionParser):
    """click's parser reading each argument as one flag name, as llama.cpp does (common/arg.cpp,
    common_params_parse_ex): click would read an argument it does not know, `-cnv`, as short flags
    run together (-c with the value "nv"); here it is refused by its whole name, in one line that
    says what llama.cpp's flag is and what to use (llama_flags.refusal). As in llama.cpp, `--a_b`
    is `--a-b`."""

    def _process_opts(self, arg: str, state: Any) -> None:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        name = arg.partition("=")[0] if arg.startswith("--") else arg
        if name not in self._long_opt and name not in self._short_opt:
            raise NoSuchOption(name, message=self._refusal(name), ctx=self.ctx)
        super()._process_opts(arg, state)

    def _refusal(self, flag: str) -> str:
        own = {name: option.takes_value for name, option in {**self._long_opt, **self._short_opt}.items()}
        root = self.ctx.find_root()
        elsewhere = [path for path, command in _commands(root.command, root.info_name or "speculate")
                     if path != self.ctx.command_path and flag in _flag_names(command, root)]
        return llama_flags.refusal(flag, self.ctx.command_path, own, elsewhere)


def _commands(command: Any, path: str) -> Iterable[tuple[str, Any]]:
    """(command path, command) of `command` and every command under it."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, f"{path} {name}")


def _flag_names(command: Any, ctx: Any) -> set[str]:
    return {name for param in command.get_params(ctx) if param.param_type_name == "option"
            for name in (*param.opts, *param.secondary_opts)}


class HelpCommand(TyperCommand):
    def format_help(self, ctx: Any, formatter: Any) -> None:
        write_help(self, ctx, formatter)

    def make_parser(self, ctx: Any) -> WholeFlagParser:
        return _whole_flag_parser(self, ctx)


class HelpGroup(TyperGroup):
    def format_help(self, ctx: Any, formatter: Any) -> None:
        write_help(self, ctx, formatter)

    def make_parser(self, ctx: Any) -> WholeFlagParser:
        return _whole_flag_parser(self, ctx)

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            # the help is the error's message, which nothing prints (typer's tables were printed
            # while the error was made): `speculate models` shows it on stdout, as it always has
            typer.echo(ctx.get_help())
        return super().parse_args(ctx, args)


def _whole_flag_parser(command: Any, ctx: Any) -> WholeFlagParser:
    """click's Command.make_parser, with WholeFlagParser."""
    parser = WholeFlagParser(ctx)
    for param in command.get_params(ctx):
        param.add_to_parser(parser, ctx)
    return parser


class App(typer.Typer):
    """typer.Typer whose group and commands print their help with `write_help`."""

    def __init__(self, *args: Any, cls: type = HelpGroup, **kwargs: Any):
        super().__init__(*args, cls=cls, **kwargs)

    def command(self, *args: Any, cls: type = HelpCommand, **kwargs: Any):
        return super().command(*args, cls=cls, **kwargs)
