"""`--help` of every command and sub-command is readable in an 80-column terminal: short where
the whole page is long (the sub-commands first, then the common flags, and where the rest is),
and `--help-all` prints every flag name whole (a table that cuts `--model-draft,--sp…` tells
the user nothing); no line is wider than the terminal. The commands and their flags are found
in the click app itself, so a command or a flag added later is checked too."""

from __future__ import annotations

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from speculative.cli.helpformat import COMMAND_FLAGS, COMMON_FLAGS, SHORT_ENOUGH
from speculative.cli.main import app

try:  # typer >= 0.22 vendors click
    from typer._click.core import Context
except ImportError:  # pragma: no cover
    from click import Context

COLUMNS = 80


def commands(command=None, path: tuple[str, ...] = ()):
    """(path of sub-command names, click command) for the app and everything under it."""
    command = command or get_command(app)
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            yield from commands(sub, (*path, name))


ALL = list(commands())


def flag_names(command) -> list[str]:
    """Every name of every visible option, the help option included."""
    params = command.get_params(Context(command))
    return [name for p in params if p.param_type_name == "option" and not p.hidden
            for name in (*p.opts, *p.secondary_opts)]


def help_text(path: tuple[str, ...], flag: str = "--help") -> str:
    result = CliRunner().invoke(app, [*path, flag], env={"COLUMNS": str(COLUMNS), "TERMINAL_WIDTH": None},
                                terminal_width=COLUMNS)
    assert result.exit_code == 0, result.output
    return result.output


def printed_names(text: str) -> set[str]:
    return set(text.replace(",", " ").replace("/", " ").split())


def too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > COLUMNS]


def test_every_command_is_found():
    found = {" ".join(path) for path, _ in ALL}
    assert {"", "serve", "batch", "bench", "doctor", "rpc-server", "models", "models list"} <= found


IDS = [" ".join(p) or "speculate" for p, _ in ALL]


@pytest.mark.parametrize("path,command", ALL, ids=IDS)
def test_help_all_prints_every_flag_name_whole_within_80_columns(path, command):
    text = help_text(path, "--help-all")
    cut = [name for name in flag_names(command) if name not in printed_names(text)]
    assert not cut, f"flag names not printed whole in `{' '.join(('speculate', *path))} --help-all`: {cut}\n{text}"
    assert not too_wide(text), f"lines wider than {COLUMNS} columns:\n" + "\n".join(too_wide(text))


@pytest.mark.parametrize("path,command", ALL, ids=IDS)
def test_help_is_short_lists_the_commands_first_and_names_help_all(path, command):
    text, every = help_text(path), help_text(path, "--help-all")
    lines = text.splitlines()
    assert not too_wide(text), f"lines wider than {COLUMNS} columns:\n" + "\n".join(too_wide(text))
    assert "--help-all" in printed_names(text)
    if len(every.splitlines()) <= SHORT_ENOUGH:  # a short page is printed whole
        assert text == every
        return
    assert len(lines) < len(every.splitlines()) and len(lines) <= 70, text
    flag_rows = [i for i, line in enumerate(lines) if line.lstrip().startswith("-")]
    if getattr(command, "commands", None):
        listed = [i for i, line in enumerate(lines) if line.split()[:1] and line.split()[0] in command.commands]
        assert listed and max(listed) < min(flag_rows), f"the commands are not listed before the flags:\n{text}"
    # every common flag the command has is there, and the rest is where the last lines say
    shown = COMMON_FLAGS | set(COMMAND_FLAGS.get(command.name, ()))
    params = [p for p in command.get_params(Context(command)) if p.param_type_name == "option" and not p.hidden]
    common = [p.opts for p in params if shown & {*p.opts, *p.secondary_opts}]
    assert all(printed_names(text) & set(opts) for opts in common), text
    assert f"{' '.join(('speculate', *path))} --help-all" in " ".join(lines[-2:]), text


def test_the_common_flags_are_flags_of_the_commands_they_are_listed_for():
    """A name misspelt in COMMON_FLAGS or COMMAND_FLAGS would silently show nothing."""
    everywhere = {name for _, command in ALL for name in flag_names(command)}
    assert COMMON_FLAGS <= everywhere, COMMON_FLAGS - everywhere
    by_name = {command.name: command for _, command in ALL}
    for name, flags in COMMAND_FLAGS.items():
        assert set(flags) <= set(flag_names(by_name[name])), (name, set(flags) - set(flag_names(by_name[name])))


def test_speculate_help_is_well_under_80_lines_with_what_a_newcomer_needs():
    text = help_text(())
    assert len(text.splitlines()) < 75, text
    for flag in ("-m", "-md", "-p", "-n", "--temp", "--spec-type", "--draft-max", "-c", "-t", "-ngl", "--chat",
                 "--json", "--help-all"):
        assert flag in printed_names(text), flag
    for flag in ("--spec-ngram-mod-n-match", "-ctkd", "--lora-scaled"):  # one --help-all away
        assert flag not in printed_names(text) and flag in printed_names(help_text((), "--help-all")), flag


def test_help_all_works_after_other_flags_and_prints_the_whole_description():
    runner = CliRunner()
    result = runner.invoke(app, ["-m", "x", "serve", "--help-all"], env={"COLUMNS": str(COLUMNS)})
    assert result.exit_code == 0 and "--max-waiting" in result.output  # not serve's short help
    whole = help_text((), "--help-all")
    assert "Exit codes" in whole and "Exit codes" not in help_text(())


def test_every_command_prints_its_help_with_the_app_renderer():
    """A command registered without cli.helpformat.App would fall back to typer's tables."""
    from speculative.cli.helpformat import HelpCommand, HelpGroup

    assert [" ".join(p) for p, c in ALL if not isinstance(c, (HelpCommand, HelpGroup))] == []
