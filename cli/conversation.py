"""A conversation in the terminal, as llama-cli has one: `> ` then the person's message, the
answer streamed as the target accepts it, and llama-cli's commands.

    /exit            end (Ctrl-D or Ctrl-C at an empty prompt too)
    /regen           the last answer again
    /clear           forget the conversation (the system message stays)
    /read FILE       a text file for the next message
    /glob PATTERN    every text file under the current directory matching PATTERN (at most 100)
    /stats           the statistics of the conversation so far

A line ending in `\\` goes on on the next line; with -mli every line does, until one that ends
in `/` (or `\\`). Standard input that is not a terminal: each line (so continued) is one turn,
and stdout gets the answers alone (with --json, one JSON object per turn); nothing is prompted.

After each answer one dim line on stderr: tokens, speed, drafted and accepted, tokens per pass,
and how much of the prompt was new. Ctrl-C stops an answer (it stays in the history as far as
it went) and returns to the prompt; at the prompt it ends the conversation with the statistics
of all of it, exit 0 (-st: 130 when the one answer was stopped).

The conversation itself (messages, turns, what fits) is speculative/engine/conversation.py's.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
from pathlib import Path
from typing import Callable

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.errors import UsageError

from . import terminal
from .options import TalkOptions
from speculative.chat.request import Reading

from .render import EXIT_INTERRUPTED, Stdout, loaded, print_stats, result_json, thinking_reader

DIM, RESET = "\x1b[2m", "\x1b[0m"
GLOB_MAX = 100  # files one /glob adds at most, as llama-cli
COMMANDS = ("/exit", "/regen", "/clear", "/read", "/glob", "/stats")
HELP = """commands:
  /exit or Ctrl-D     end the conversation (Ctrl-C at an empty prompt too)
  /regen              the last answer again
  /clear              forget the conversation
  /read FILE          add a text file to the next message
  /glob PATTERN       add the text files matching PATTERN
  /stats              the statistics so far
  Ctrl-C              stop an answer
  a line ending in \\ goes on on the next line"""


def converse(target: ModelSpec, draft: ModelSpec | None, first: str | None, sampling: SamplerSettings,
             spec: SpecSettings, talk: TalkOptions, *, system: str | None, color: bool, json_output: bool,
             prompt_cache: Path | None = None, prompt_cache_ro: bool = False, pool: dict | None = None) -> int:
    """Run a conversation; `first`: the first message (-p/-f), if given. The exit code."""
    from speculative.engine.conversation import Conversation, ConversationFull

    interactive = terminal.is_terminal(sys.stdin)
    with loaded(target, draft, json_output, prompt_cache, prompt_cache_ro, pool) as (status, engine):
        chat = Conversation(engine, sampling, spec, system, talk.context_shift)
        out = Stdout(color, status)
        screen = _Screen(interactive and terminal.is_terminal(sys.stdout), status.say)
        info = screen.info
        if interactive and first is None:
            info(f"speculate: a conversation with {target.name}; /exit or Ctrl-D ends it\n{HELP}")
        lines = _reader(interactive, screen.prompt)
        code = 0
        while True:
            if first is not None:
                text, first = first, None
                if interactive and not talk.single_turn:
                    info(f"> {text[:500]}" + (" ... (truncated)" if len(text) > 500 else ""))
            else:
                try:
                    text = read_message(lines, talk.multiline)
                except KeyboardInterrupt:
                    text = None
                if text is None:
                    break
            if not text:
                continue
            command, _, argument = text.partition(" ")
            if command == "/exit":
                break
            try:
                if _command(command, argument.strip(), chat, info,
                            lambda: _print_totals(chat, spec, target, draft, color, engine)):
                    continue
                turn = chat.regenerate() if command == "/regen" else chat.ask(text)
            except (UsageError, ConversationFull) as e:
                screen.error(str(e))
                continue
            if turn.dropped:
                info(f"(the context is full: the {turn.dropped} oldest exchanges were dropped)")
            interrupted = _answer(chat, turn, out, screen, json_output, talk.show_timings)
            if talk.single_turn:
                code = EXIT_INTERRUPTED if interrupted else 0
                break
        status.clear()
        if not json_output and chat.turns and not talk.single_turn:
            screen.info("")
            _print_totals(chat, spec, target, draft, color, engine)
    return code


def _command(command: str, argument: str, chat, info: Callable[[str], None], totals: Callable[[], None]) -> bool:
    """/read, /glob, /clear and /stats, done (True); anything else is not theirs (False)."""
    if command in ("/read", "/glob"):
        for name in (_read if command == "/read" else _glob)(argument, chat.attach):
            info(f"Loaded text from '{name}'")
    elif command == "/clear":
        chat.clear()
        info("Chat history cleared.")
    elif command == "/stats":
        totals()
    else:
        return False
    return True


def _answer(chat, turn, out: Stdout, screen: "_Screen", json_output: bool, show_timings: bool) -> bool:
    """Stream one answer; it joins the history as far as it went. Whether Ctrl-C stopped it."""
    reading = thinking_reader(chat.engine, turn.prompt_tail) or Reading(None)
    screen.thinking = False
    interrupted = False
    try:
        for piece in turn.stream:
            for part, from_draft in piece.parts:
                changes = reading.push(part)
                if not json_output:  # --json prints the whole answer at its end
                    screen.show(out, changes, from_draft)
    except KeyboardInterrupt:
        interrupted = True
    final = turn.stream.end("interrupted" if interrupted else None)
    changes = [*reading.push(final.tail), *reading.end()]
    if not json_output:
        screen.show(out, changes, False)
    chat.answered(reading.message.content, final)  # its thinking left out of the history, as llama-cli's
    if json_output:
        out.write(json.dumps({"turn": chat.turns, **result_json(final), "seed": turn.seed,
                              "dropped": turn.dropped}, ensure_ascii=False) + "\n")
    else:
        out.write("\n")
    if show_timings and not json_output:
        screen.stats(turn_line(final.stats, interrupted))
    if final.reason == "length" and final.stats.n_prompt + final.stats.n_predict >= chat.engine.target.n_ctx - 1:
        screen.error(f"the context is full ({chat.engine.target.n_ctx} tokens): /clear starts again"
                     + ("" if chat.context_shift else ", or run with --context-shift"))
    return interrupted


def turn_line(stats, interrupted: bool = False) -> str:
    """One answer's figures: tokens and speed, the drafts, tokens per target pass, and how much
    of the prompt was new (the rest was kept in the caches from the previous turn)."""
    drafted = (f"drafted {stats.n_drafted}, accepted {stats.n_accept} ({100 * stats.accept_rate:.0f}%)"
               if stats.n_drafted else "nothing drafted")
    return (f"[ {stats.n_predict} tokens, {stats.decode_tps:.1f} t/s | {drafted} | "
            f"{stats.tokens_per_step:.2f} tokens per pass | prompt: {stats.n_prompt - stats.n_cached} new, "
            f"{stats.n_cached} kept" + (" | stopped" if interrupted else "") + " ]")


def _print_totals(chat, spec: SpecSettings, target: ModelSpec, draft: ModelSpec | None, color: bool,
                  engine) -> None:
    if chat.totals is None:
        print("no answers yet", file=sys.stderr)
        return
    print(f"conversation: {chat.turns} answer{'' if chat.turns == 1 else 's'}", file=sys.stderr)
    print_stats(chat.totals, spec, chat.seed, target, draft, color, engine.notes(),
                (engine.target, engine.draft))


class _Screen:
    """What a person sees beside the answers: notices and errors on stderr, the dim statistics
    line, thinking dimmed (or between llama-cli's markers where nothing is styled)."""

    def __init__(self, styled: bool, say: Callable[[str], None]):
        """`styled`: thinking may be dimmed; `say`: the status line's (StatusLine.say), which
        clears it (loading, calibrating) before a lasting line."""
        self.styled = styled and not os.environ.get("NO_COLOR")
        self.say = say
        self.thinking = False  # the latest text shown was thinking

    def info(self, text: str) -> None:
        self.say(text)

    def error(self, text: str) -> None:
        self.info(f"error: {' '.join(text.split())}")

    def stats(self, line: str) -> None:
        self.info(f"{DIM}{line}{RESET}" if terminal.is_terminal(sys.stderr) and not os.environ.get("NO_COLOR")
                  else line)

    def prompt(self) -> str:
        return "\n> "

    def show(self, out: Stdout, changes: list, from_draft: bool) -> None:
        """What an answer's text added (chat.message.Delta's): its thinking and what it says."""
        for change in changes:
            if change.reasoning_content:
                self.answer(out, change.reasoning_content, from_draft, True)
            if change.content:
                self.answer(out, change.content, from_draft, False)

    def answer(self, out: Stdout, text: str, from_draft: bool, thinking: bool) -> None:
        if thinking != self.thinking:
            self.thinking = thinking
            if not self.styled:
                out.write("[Start thinking]\n" if thinking else "\n[End thinking]\n\n")
        if thinking and self.styled:
            out.write(f"{DIM}{text}{RESET}")
        else:
            out.write(text, from_draft)


def _reader(interactive: bool, prompt: Callable[[], str]) -> Callable[[bool], str | None]:
    """Reads one line (None at the end of input); `first`: the first line of a message, after
    the prompt. On a terminal through readline (line editing, history, Tab completes commands
    and /read's paths), the prompt written where the person reads it."""
    if interactive:
        _set_up_readline()

        def read(first: bool) -> str | None:
            shown = prompt() if first else ""
            try:
                if terminal.is_terminal(sys.stdout):
                    return input(shown)
                sys.stderr.write(shown)
                sys.stderr.flush()
                return input()
            except EOFError:
                sys.stderr.write("\n")
                return None
        return read

    def read_piped(first: bool) -> str | None:
        line = sys.stdin.readline()
        return line.removesuffix("\n") if line else None
    return read_piped


def read_message(read_line: Callable[[bool], str | None], multiline: bool) -> str | None:
    """One message, as llama-cli reads it: a line ending in `\\` goes on on the next line (with
    -mli every line does, and a line ending in `/` or `\\` is the last); None at the end of input."""
    lines: list[str] = []
    while True:
        line = read_line(not lines)
        if line is None:
            return "\n".join(lines) if lines else None
        more = multiline
        if line.endswith("\\"):
            line, more = line[:-1], not multiline
        elif multiline and line.endswith("/"):
            line, more = line[:-1], False
        lines.append(line)
        if not more:
            return "\n".join(lines)


def _read(name: str, attach: Callable[[str, str], None]) -> list[str]:
    """/read FILE: the file's text for the next message."""
    if not name:
        raise UsageError("/read needs a file: /read FILE")
    try:
        text = Path(name).expanduser().read_bytes().decode("utf-8", errors="replace")
    except OSError:
        raise UsageError(f"file does not exist or cannot be opened: '{name}'") from None
    attach(name, text)
    return [name]


def _glob(pattern: str, attach: Callable[[str, str], None]) -> list[str]:
    """/glob PATTERN: every file under the directory PATTERN starts with (the current one by
    default) whose path from there matches the rest (`*` crosses directories), at most GLOB_MAX."""
    if not pattern:
        raise UsageError("/glob needs a pattern: /glob PATTERN")
    wild = next((i for i, c in enumerate(pattern) if c in "*?["), len(pattern))
    root, _, rest = pattern[:wild].rpartition("/")
    base = Path(root).expanduser() if root else Path(".")
    rest += pattern[wild:]
    names = []
    for directory, _, files in os.walk(base):
        for file in sorted(files):
            path = Path(directory) / file
            if fnmatch.fnmatchcase(path.relative_to(base).as_posix(), rest):
                names += _read(str(path), attach)
                if len(names) >= GLOB_MAX:
                    print(f"error: at most {GLOB_MAX} files are added at once", file=sys.stderr)
                    return names
    if not names:
        raise UsageError(f"no file matches {pattern}")
    return names


def _set_up_readline() -> None:
    """Line editing and history where the standard library has readline; Tab completes the
    commands, and /read's and /glob's paths."""
    try:
        import readline
    except ImportError:  # pragma: no cover (Windows without pyreadline)
        return

    def complete(text: str, state: int) -> str | None:
        line = readline.get_line_buffer()
        if " " not in line:
            options = [c + " " for c in COMMANDS if c.startswith(text)]
        elif line.startswith(("/read ", "/glob ")):
            folder, _, start = text.rpartition("/")
            where = Path(folder or ".").expanduser()
            try:
                options = sorted((f"{folder}/" if folder else "") + p.name + ("/" if p.is_dir() else "")
                                 for p in where.iterdir() if p.name.startswith(start))
            except OSError:
                options = []
        else:
            options = []
        return options[state] if state < len(options) else None

    readline.set_completer_delims(" \t\n")
    readline.set_completer(complete)
    readline.parse_and_bind("tab: complete")
