"""speculate: speculative decoding over local GGUF models.

The command line is thin: parse and validate, resolve model names, call the
library, render. Every failure the user can cause ends as one line on stderr
and a documented exit code.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.drafters import registry
from speculative.engine.chat import check_jinja2_version
from speculative.engine.prompt_cache import check_writable
from speculative.errors import SpeculateError, UsageError
from speculative.llamacpp import interrupt

from . import models as models_cli
from . import options
from .batch import batch_command
from .conversation import converse
from .bench import bench_command
from .doctor import doctor_command
from .helpformat import App
from .prompt import read_prompt, read_system_prompt
from .render import run_and_render
from .rpc_server import rpc_server_command
from .serve import build_info, serve_command

try:  # typer >= 0.22 vendors click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException

EXIT_CODES = (
    "Exit codes: 0 success (also rpc-server stopped by Ctrl-C or SIGTERM); 1 generation failed "
    "(an RPC server lost in the middle of one included); 2 usage error; 3 model or registry problem "
    "(missing or invalid file, unknown name, vocabulary or checksum mismatch; an RPC server not there, "
    "or a build without RPC); "
    "130 interrupted (Ctrl-C or SIGTERM: the partial text and statistics are printed first)."
)

app = App(
    name="speculate",
    help="Speculative decoding over local GGUF models, through llama.cpp.\n\n"
         "A cheap drafter (a small model, or n-gram lookup in the prompt and output) proposes "
         "tokens; the target model verifies them all in one forward pass. Greedy output is exactly "
         "the target's greedy output. By default (--spec-type auto) speculate measures what a "
         "target pass costs on this machine and drafts only when it pays.\n\n" + EXIT_CODES,
    add_completion=False,
    invoke_without_command=True,
    no_args_is_help=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(models_cli.app, name="models")
# short_help: the line `speculate --help` lists each command with, within 80 columns
app.command("bench", help="Measure speedup over target-only decoding on a prompt file, on this machine.",
            short_help="Measure speedup over target-only decoding on this machine.")(bench_command)
app.command("batch", help="Run a JSONL file of requests with the models loaded once; resumable, one result "
                         "line per request.",
            short_help="Run a JSONL file of requests, the models loaded once; resumable.")(batch_command)
app.command("serve", help="Serve the models over an OpenAI-compatible HTTP API, as llama-server does.",
            short_help="Serve the models over HTTP (OpenAI's API), as llama-server does.")(serve_command)
app.command("rpc-server", help="Serve this machine's CPU or GPUs to llama.cpp RPC clients (speculate --rpc), "
                              "as llama.cpp's rpc-server does.",
            short_help="Serve this machine's CPU or GPUs to --rpc clients (rpc-server).")(rpc_server_command)
app.command("doctor", help="Show the llama.cpp build and measure whether greedy speculation is exact on it.",
            short_help="Show the llama.cpp build; measure whether speculation is exact.")(doctor_command)

P, O = "Prompt", "Output"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(build_info().replace(", ", "\n", 1))
        raise typer.Exit(0)


SYSTEM_PROMPT_FILE = typer.Option(
    None, "-sysf", "--system-prompt-file", rich_help_panel=P, metavar="FNAME",
    help="As -sys, the message read from FNAME (one trailing newline dropped).")
VERSION = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                       help="Print speculate's version and llama.cpp's, and exit.")


@app.callback()
@options.with_options(options.MODELS, options.SAMPLING, options.SPECULATION, options.POOL, options.TALK)
def run(
    ctx: typer.Context,
    models: options.ModelOptions,
    sampling: SamplerSettings,
    spec: SpecSettings,
    pool: options.PoolOptions,
    talk: options.TalkOptions,
    prompt: Optional[str] = typer.Option(
        None, "-p", "--prompt", rich_help_panel=P, help="The prompt; '-' reads it from standard input."),
    file: Optional[str] = typer.Option(
        None, "-f", "--file", rich_help_panel=P, metavar="FILE",
        help="Read the prompt from FILE ('-': standard input)."),
    escape: bool = typer.Option(
        True, "--escape/--no-escape", "-e", rich_help_panel=P,
        help="Process escapes (\\n, \\t, \\\\, ...) in -p and -sys text (not in files)."),
    use_chat: bool = typer.Option(
        False, "--chat", rich_help_panel=P,
        help="Wrap the prompt in the model's own chat template (one user turn), rendered in a sandbox."),
    system_prompt: Optional[str] = typer.Option(
        None, "-sys", "--system-prompt", rich_help_panel=P,
        help="System message; the prompt goes through the chat template (--chat), as in llama-cli."),
    system_prompt_file: Optional[Path] = SYSTEM_PROMPT_FILE,
    prompt_cache: Optional[Path] = typer.Option(
        None, "--prompt-cache", rich_help_panel=P, metavar="FILE",
        help="Restore the models' caches for the longest prefix this prompt shares with the prompt saved "
             "in FILE, and save this prompt's caches there after processing it. A file from other models "
             "or settings is ignored with a notice; a file that is not a prompt cache is never overwritten."),
    prompt_cache_ro: bool = typer.Option(
        False, "--prompt-cache-ro", rich_help_panel=P, help="Use --prompt-cache FILE, but never write it."),
    color: bool = typer.Option(
        False, "--color", rich_help_panel=O,
        help="Colour accepted draft tokens (green) apart from the target's own (NO_COLOR disables)."),
    json_output: bool = typer.Option(
        False, "--json", rich_help_panel=O,
        help="Print one JSON object (text, statistics, settings) instead of streaming text."),
    version: bool = VERSION,
) -> None:
    """Generate text from a prompt, or hold a conversation, with speculative decoding."""
    if ctx.invoked_subcommand is not None:
        return
    use_draft = models.uses_draft(spec)
    given = prompt is not None or file is not None
    chatting = talk.holds(given, "-" in (prompt, file))
    text = read_prompt(prompt, file, escape) if given or not chatting else None
    if prompt_cache_ro and prompt_cache is None:
        raise UsageError("--prompt-cache-ro needs --prompt-cache FILE")
    if prompt_cache is not None and not prompt_cache_ro:
        check_writable(prompt_cache)  # refused now, not after loading the models
    system_prompt = read_system_prompt(system_prompt, system_prompt_file, escape)
    use_chat = use_chat or system_prompt is not None  # llama-cli's -sys: a system message is a chat
    target, draft = models.specs(use_draft, spec.branches, spec.longest_draft, *registry.heads(spec))
    shown = dict(system=system_prompt, color=color and not os.environ.get("NO_COLOR"), json_output=json_output,
                 prompt_cache=prompt_cache, prompt_cache_ro=prompt_cache_ro, pool=pool.engine_args())
    if chatting:
        raise typer.Exit(converse(target, draft, text, sampling, spec, talk, **shown))
    raise typer.Exit(run_and_render(target, draft, text, sampling, spec, use_chat=use_chat, **shown))


def main() -> None:
    """Console entry point: one-line errors and documented exit codes, never a traceback."""
    interrupt.install()  # SIGTERM too ends as Ctrl-C does: partial output, statistics, 130
    try:
        check_jinja2_version()  # refused at start-up, not at the first chat template
        code = app(args=join_lora_scaled(sys.argv[1:]), standalone_mode=False, prog_name="speculate")
    except SpeculateError as e:
        _fail(str(e), e.exit_code)
    except ClickException as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # help was shown, nothing went wrong
            sys.exit(0)
        _fail(e.format_message(), 2)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:
        _fail("interrupted", 130)
    except Exception as e:  # a bug or an unforeseen OS error: still one line, unless debugging
        if os.environ.get("SPECULATE_DEBUG"):
            raise
        _fail(f"unexpected {type(e).__name__}: {e} (set SPECULATE_DEBUG=1 for the traceback)", 1)
    sys.exit(code if isinstance(code, int) else 0)


def join_lora_scaled(args: list[str]) -> list[str]:
    """llama.cpp's two forms of --lora-scaled, FNAME SCALE (older) and FNAME:SCALE (newer):
    a flag option cannot take two values and repeat, so the first becomes the second."""
    out: list[str] = []
    i = 0
    while i < len(args):
        out.append(args[i])
        if args[i] == "--lora-scaled" and i + 2 < len(args) and _is_number(args[i + 2]):
            out.append(f"{args[i + 1]}:{args[i + 2]}")
            i += 3
            continue
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _fail(message: str, code: int) -> None:
    first_line = " ".join(message.split())
    print(f"speculate: error: {first_line}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
