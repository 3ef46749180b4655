"""`--help` as llama.cpp prints its own: every flag name whole, with its value's name, then
what it does, beside the names when they fit in the names column, else on the lines below.
Typer's rich tables give each of a flag's names a column and cut what does not fit
(`--model-draft,--sp…` in an 80-column terminal), which hides the very names users look for.
The flags stay grouped under their panel's title (Models, Speculation, Sampling, ...).

`--help` is short where the whole page is long: the sub-commands first, then only the flags
of COMMON_FLAGS (and the command's own in COMMAND_FLAGS), in their panels; `--help-all`, on
every command, prints every flag.

Every command and group of the app is made by `App`, so all of them print their help here;
the width is click's (the terminal's, at most 80 columns)."""

from __future__ import annotations

import copy
import inspect
import re
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

# What a short --help shows, by flag name (any of a flag's names; --help-all shows every flag):
# what llama-cli's and llama-server's users reach for first, and what the README's examples use.
COMMON_FLAGS = frozenset((
    "--model", "--model-draft", "--hf-repo", "--ctx-size", "--threads", "--n-gpu-layers",  # Models
    "--prompt", "--file", "--chat", "--system-prompt", "--conversation",                    # Prompt
    "--n-predict", "--temp", "--top-k", "--top-p", "--seed",                                # Sampling
    "--spec-type", "--draft-max",                                                           # Speculation
    "--json", "--help", "--help-all",
))
# A sub-command's own flags that its short --help shows besides (-np is the draft trees' on
# `speculate` itself, a flag for the few, and the requests at once of serve, batch and doctor).
COMMAND_FLAGS = {
    "serve": ("--host", "--port", "--api-key", "--parallel", "--cache-ram", "--metrics"),
    "batch": ("--output", "--summary", "--parallel"),
    "bench": ("--config", "--sweep", "--repeat", "--category", "--limit", "--output", "--per-prompt"),
    "doctor": ("--flash-attn", "--parallel"),
}
SHORT_ENOUGH = 40  # a help page of at most this many lines is printed whole by --help
HELP_ALL = "--help-all"


def write_help(command: Any, ctx: Any, formatter: Any) -> None:
    """The help page of `command` into click's `formatter`: usage, description, the sub-commands,
    the arguments and options panel by panel, the epilogue. All of it with --help-all, or where
    the whole page is short; else the description's first paragraph, the common flags (with
    their first names and first sentences), and where the rest is."""
    width = formatter.width
    every = _page(command, ctx, width, command.help, _panels(command, ctx))
    if not ctx.meta.get(HELP_ALL) and len(every) > SHORT_ENOUGH:
        common = _panels(command, ctx, COMMON_FLAGS | set(COMMAND_FLAGS.get(command.name, ())))
        description = inspect.cleandoc(command.help or "").split("\n\n")[0]
        every = _page(command, ctx, width, description, common,
                      _more(command, ctx, common, cut=description != inspect.cleandoc(command.help or "")))
    formatter.write("\n".join(every) + "\n")


def _page(command: Any, ctx: Any, width: int, description: str | None,
          panels: list[tuple[str, list[tuple[str, str]]]], more: str = "") -> list[str]:
    """The lines of a help page: usage, `description`, `panels`, `more` (where the rest is), the
    epilogue."""
    blocks = [_paragraphs(text, width) for text in (description,) if text]
    blocks += [[f"{title}:", *_rows(rows, width)] for title, rows in panels]
    blocks += [_paragraphs(text, width) for text in (more, command.epilog) if text]
    usage = _wrap(f"Usage: {ctx.command_path} {' '.join(command.collect_usage_pieces(ctx))}", width, "",
                  " " * INDENT)
    return usage + [line for block in blocks for line in ("", *block)]


def _more(command: Any, ctx: Any, shown: list[tuple[str, list[tuple[str, str]]]], cut: bool) -> str:
    """Where the flags a short help leaves out are (how many, in which panels), and the rest of
    the description if it was `cut`."""
    left = [(title, len(rows) - len(dict(shown).get(title, ()))) for title, rows in _panels(command, ctx)]
    left = [(title, n) for title, n in left if n > 0]
    what = [f"{sum(n for _, n in left)} more flags ({', '.join(title for title, _ in left)})"] if left else []
    what += ["the whole description"] if cut else []
    command_line = f"{ctx.command_path} {HELP_ALL}".replace(" ", _KEEP)  # one piece, never split
    return f"{' and '.join(what)}: {command_line}" if what else ""


def _panels(command: Any, ctx: Any, only: frozenset[str] | None = None) -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, rows of (names, help)): the sub-commands, the arguments, the options without a
    panel, then the other panels as their first flag comes. `only`: the flags of these names
    alone, shortened (_short_record); the arguments and sub-commands all the same."""
    panels: dict[tuple[int, str], list[tuple[str, str]]] = {(1, "Arguments"): [], (2, "Options"): []}
    for name in getattr(command, "list_commands", lambda ctx: [])(ctx):
        sub = command.get_command(ctx, name)
        if sub is not None and not sub.hidden:
            title = getattr(sub, "rich_help_panel", None) or "Commands"
            panels.setdefault((0, title), []).append((name, sub.short_help or sub.help or ""))
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        is_argument = param.param_type_name == "argument"
        if record is None or not (is_argument or only is None or only & {*param.opts, *param.secondary_opts}):
            continue  # hidden, or left for --help-all
        kind = 1 if is_argument else 2
        title = getattr(param, "rich_help_panel", None) or ("Arguments", "Options")[kind - 1]
        panels.setdefault((kind, title), []).append(record if only is None else _short_record(param, record))
    ordered = sorted(panels.items(), key=lambda item: item[0][0])  # stable: first come within a kind
    return [(title, rows) for (_, title), rows in ordered if rows]


def _short_record(param: Any, record: tuple[str, str]) -> tuple[str, str]:
    """A flag as a short help shows it: its first short and first long name (-md, --model-draft;
    not --spec-draft-model), and the first sentence of its help, with its default (or its
    environment variable, or [required])."""
    names, text = record
    first = [next(iter(o for o in param.opts if o.startswith("--") == long), None) for long in (False, True)]
    every = ", ".join(param.opts)  # how click's record starts: the names, then " / --no-x" or the metavar
    if names.startswith(every):
        names = ", ".join(name for name in first if name) + names[len(every):]
    text, default = re.match(r"(.*?)\s*(\[[^\]]*\])?$", " ".join(text.split())).groups()  # click's [default: ...]
    sentence = re.match(r"(.*?[.!?])\s+(?=[A-Z])", text)
    return names, " ".join(filter(None, (sentence.group(1) if sentence else text, default)))


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
    text = re.sub(r"[ \t\n\r\f\v]+", " ", text).strip().replace("default: ", "default:" + _KEEP)  # _KEEP kept
    lines = textwrap.wrap(text, width, initial_indent=first, subsequent_indent=further,
                          break_on_hyphens=False, break_long_words=False)
    return [line.replace(_KEEP, " ") for line in lines]


_KEEP = "\u00a0"  # a space textwrap does not break at (it breaks at ASCII whitespace only)


def help_all_option(command: Any, ctx: Any) -> Any:
    """--help-all: the command's --help option (an eager flag that prints and exits), made to
    print every flag."""
    help_option = command.get_help_option(ctx)
    if help_option is None:
        return None

    def show_every_flag(ctx: Any, param: Any, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            ctx.meta[HELP_ALL] = True
            typer.echo(ctx.get_help(), color=ctx.color)
            ctx.exit()

    option = copy.copy(help_option)
    option.opts, option.secondary_opts, option.name = [HELP_ALL], [], "help_all"
    option.callback, option.help = show_every_flag, "Show every flag, by group, and exit."
    return option


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

    def get_params(self, ctx: Any) -> list:
        return _with_help_all(self, ctx, super().get_params(ctx))

    def make_parser(self, ctx: Any) -> WholeFlagParser:
        return _whole_flag_parser(self, ctx)


class HelpGroup(TyperGroup):
    def format_help(self, ctx: Any, formatter: Any) -> None:
        write_help(self, ctx, formatter)

    def get_params(self, ctx: Any) -> list:
        return _with_help_all(self, ctx, super().get_params(ctx))

    def make_parser(self, ctx: Any) -> WholeFlagParser:
        return _whole_flag_parser(self, ctx)

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            # the help is the error's message, which nothing prints (typer's tables were printed
            # while the error was made): `speculate models` shows it on stdout, as it always has
            typer.echo(ctx.get_help())
        return super().parse_args(ctx, args)


def _with_help_all(command: Any, ctx: Any, params: list) -> list:
    """`params` and --help-all, made once per command (click tells its eager options apart by
    identity)."""
    if not hasattr(command, "_help_all"):
        command._help_all = help_all_option(command, ctx)
    return params + [command._help_all] if command._help_all is not None else params


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
