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

from speculative.errors import SpeculateError, UsageError
from speculative.loop import SpecSettings
from speculative.registry import Registry
from speculative.sampling import DEFAULT_SEQUENCE, SamplerSettings

from . import models as models_cli
from .prompt import process_escapes, read_prompt
from .render import run_and_render

try:  # typer >= 0.22 vendors click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException

EXIT_CODES = (
    "Exit codes: 0 success; 1 generation failed; 2 usage error; 3 model or registry problem "
    "(missing or invalid file, unknown name, vocabulary or checksum mismatch); "
    "130 interrupted (Ctrl-C: the partial text and statistics are printed first)."
)

app = typer.Typer(
    name="speculate",
    help="Speculative decoding over local GGUF models, through llama.cpp.\n\n"
         "A cheap draft model proposes tokens, the target model verifies them all in one "
         "forward pass. Greedy output is exactly the target's greedy output.\n\n" + EXIT_CODES,
    add_completion=False,
    invoke_without_command=True,
    no_args_is_help=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(models_cli.app, name="models")

M, P, S, D, O = "Models", "Prompt", "Sampling", "Speculation", "Output"


@app.callback()
def run(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(
        None, "-m", "--model", rich_help_panel=M, metavar="PATH|NAME",
        help="Target model: a GGUF file or a registry name (default: the registry's default target)."),
    model_draft: Optional[str] = typer.Option(
        None, "-md", "--model-draft", "--spec-draft-model", rich_help_panel=M, metavar="PATH|NAME",
        help="Draft model: a GGUF file or a registry name (default with no -m: the default draft)."),
    ctx_size: int = typer.Option(
        4096, "-c", "--ctx-size", rich_help_panel=M, help="Target context size in tokens (0: the model's own)."),
    ctx_size_draft: Optional[int] = typer.Option(
        None, "-cd", "--ctx-size-draft", rich_help_panel=M, help="Draft context size (default: -c)."),
    n_gpu_layers: int = typer.Option(
        -1, "-ngl", "--n-gpu-layers", "--gpu-layers", rich_help_panel=M,
        help="Target layers to offload to the GPU (-1: all that the build can)."),
    n_gpu_layers_draft: Optional[int] = typer.Option(
        None, "-ngld", "--n-gpu-layers-draft", "--spec-draft-ngl", rich_help_panel=M,
        help="Draft layers to offload to the GPU (default: -ngl)."),
    threads: Optional[int] = typer.Option(
        None, "-t", "--threads", rich_help_panel=M, help="CPU threads for the target (default: all available)."),
    threads_draft: Optional[int] = typer.Option(
        None, "-td", "--threads-draft", "--spec-draft-threads", rich_help_panel=M,
        help="CPU threads for the draft (default: -t)."),
    batch_size: int = typer.Option(
        2048, "-b", "--batch-size", rich_help_panel=M, help="Most tokens in one forward pass."),
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
        None, "-sys", "--system-prompt", rich_help_panel=P, help="System message for --chat."),
    n_predict: int = typer.Option(
        -1, "-n", "--n-predict", "--predict", rich_help_panel=S,
        help="Most tokens to generate (-1: until end of generation or a full context)."),
    temp: float = typer.Option(
        0.8, "--temp", "--temperature", rich_help_panel=S, help="Temperature; 0 is greedy."),
    top_k: int = typer.Option(40, "--top-k", rich_help_panel=S, help="Top-k sampling (0: off)."),
    top_p: float = typer.Option(0.95, "--top-p", rich_help_panel=S, help="Top-p sampling (1.0: off)."),
    min_p: float = typer.Option(0.05, "--min-p", rich_help_panel=S, help="Min-p sampling (0.0: off)."),
    seed: int = typer.Option(-1, "-s", "--seed", rich_help_panel=S, help="Random seed (-1: random, reported)."),
    sampling_seq: str = typer.Option(
        DEFAULT_SEQUENCE, "--sampling-seq", "--sampler-seq", rich_help_panel=S,
        help="Sampler order, llama.cpp letters: k top-k, p top-p, m min-p, t temperature "
             "(e d s y x accepted, inactive)."),
    ignore_eos: bool = typer.Option(
        False, "--ignore-eos", rich_help_panel=S, help="Never stop at end-of-generation tokens."),
    spec_type: Optional[str] = typer.Option(
        None, "--spec-type", rich_help_panel=D, metavar="TYPE",
        help="'draft' (a draft model; implied by -md) or 'none' (target only, same code path)."),
    draft_max: int = typer.Option(
        3, "--draft-max", "--draft", "--spec-draft-n-max", rich_help_panel=D,
        help="Most tokens drafted per step."),
    draft_min: int = typer.Option(
        0, "--draft-min", "--spec-draft-n-min", rich_help_panel=D,
        help="Drafts shorter than this are not verified."),
    draft_p_min: float = typer.Option(
        0.0, "--draft-p-min", "--spec-draft-p-min", rich_help_panel=D,
        help="Stop drafting when the draft's top candidate is less likely than P."),
    color: bool = typer.Option(
        False, "--color", rich_help_panel=O,
        help="Colour accepted draft tokens (green) apart from the target's own (NO_COLOR disables)."),
    json_output: bool = typer.Option(
        False, "--json", rich_help_panel=O,
        help="Print one JSON object (text, statistics, settings) instead of streaming text."),
) -> None:
    """Generate text from a prompt, with speculative decoding."""
    if ctx.invoked_subcommand is not None:
        return
    sampling = SamplerSettings(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                               sequence=sampling_seq, seed=seed)
    spec = SpecSettings(draft_max=draft_max, draft_min=draft_min, draft_p_min=draft_p_min,
                        n_predict=n_predict, ignore_eos=ignore_eos)
    sampling.validate()
    spec.validate()
    for flag, value, least in (("-c/--ctx-size", ctx_size, 0), ("-b/--batch-size", batch_size, 1),
                               ("-cd/--ctx-size-draft", ctx_size_draft, 0),
                               ("-t/--threads", threads, 1), ("-td/--threads-draft", threads_draft, 1)):
        if value is not None and value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    use_draft = _spec_type(spec_type, model, model_draft)
    text = read_prompt(prompt, file, escape)
    if system_prompt is not None and escape:
        system_prompt = process_escapes(system_prompt)

    registry = Registry.load()
    target, draft = models_cli.resolve_models(
        registry, model, model_draft, use_draft,
        ctx=(ctx_size, ctx_size_draft), ngl=(n_gpu_layers, n_gpu_layers_draft),
        threads=(threads, threads_draft), n_batch=batch_size,
    )
    code = run_and_render(
        target, draft, text, sampling, spec, use_chat=use_chat, system=system_prompt,
        color=color and not os.environ.get("NO_COLOR"), json_output=json_output,
    )
    raise typer.Exit(code)


def _spec_type(spec_type: str | None, model: str | None, model_draft: str | None) -> bool:
    """Whether a draft model is used, from --spec-type and what was given."""
    if spec_type is None:
        return model_draft is not None or model is None
    kinds = [k.strip() for k in spec_type.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in ("none", "draft")]
    if unknown or not kinds:
        raise UsageError(f"--spec-type: unknown type {', '.join(unknown) or repr(spec_type)} "
                         "(this version knows: none, draft)")
    if "none" in kinds:
        if len(kinds) > 1:
            raise UsageError("--spec-type none cannot be combined with other types")
        return False
    if model is not None and model_draft is None:
        raise UsageError("--spec-type draft needs a draft model: give -md PATH|NAME")
    return True


def main() -> None:
    """Console entry point: one-line errors and documented exit codes, never a traceback."""
    try:
        code = app(standalone_mode=False, prog_name="speculate")
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


def _fail(message: str, code: int) -> None:
    first_line = " ".join(message.split())
    print(f"speculate: error: {first_line}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
