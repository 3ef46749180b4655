"""Running one prompt and showing it: streamed text on stdout, statistics on stderr,
or one JSON object on stdout with --json."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from rich.console import Console

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.decoding.stats import Stats
from speculative.engine.stream import Final, Stream
from speculative.engine.text import prompt_tail

from .progress import StatusLine

if TYPE_CHECKING:
    from speculative.chat.request import Reading
    from speculative.engine.engine import Engine

GREEN, DIM, RESET = "\x1b[32m", "\x1b[2m", "\x1b[0m"
EXIT_INTERRUPTED = 130


class Stdout:
    """UTF-8 bytes straight to stdout; a closed pipe (| head) ends output quietly. `status`: the
    status line cleared before each write, so that text on a terminal starts on a clean line."""

    def __init__(self, color: bool, status: StatusLine):
        self.color = color
        self.closed = False
        self.status = status

    def write(self, text: str, from_draft: bool = False) -> None:
        if not text or self.closed:
            return
        self.status.clear()
        if self.color and from_draft:
            text = f"{GREEN}{text}{RESET}"
        try:
            sys.stdout.buffer.write(text.encode("utf-8"))
            sys.stdout.buffer.flush()
        except BrokenPipeError:
            self.closed = True
            stdout_gone()


def stdout_gone() -> None:
    """The reader of stdout went away (`| head`): not an error. Python would complain
    about the broken pipe again at exit, so stdout now points at devnull."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class PipeConsole(Console):
    """A rich Console for stdout whose reader may go away (rich would exit 1)."""

    def on_broken_pipe(self) -> None:
        stdout_gone()


@contextlib.contextmanager
def quiet_pipe():
    """Output of a command whose reader may go away: it then just ends, exit 0."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_gone()


@contextlib.contextmanager
def loaded(target: ModelSpec, draft: ModelSpec | None, json_output: bool, prompt_cache: Path | None = None,
           prompt_cache_ro: bool = False, pool: dict | None = None) -> Iterator[tuple[StatusLine, Engine]]:
    """The models loaded (progress on the status line, unless --json), and the status line."""
    from speculative.engine.engine import Engine  # loads llama.cpp: imported when a model runs (start-up time)

    with StatusLine(enabled=not json_output) as status, Engine(
            target, draft, notify=status.say, progress=status.update, prompt_cache_file=prompt_cache,
            prompt_cache_ro=prompt_cache_ro, **(pool or {})) as engine:
        yield status, engine


def result_json(final: Final, reading: Reading | None = None) -> dict:
    """A run's text, tokens and statistics, as --json prints them; a thinking model's thoughts
    (`reading`'s) apart in reasoning_content."""
    if reading is None:
        return {"text": final.text, "tokens": final.tokens, **final.stats.to_dict()}
    message = reading.whole(final.text)
    return {"text": message.content, "reasoning_content": message.reasoning_content, "tokens": final.tokens,
            **final.stats.to_dict()}


def thinking_reader(engine: Engine, prompt_tail: str) -> Reading | None:
    """How a chat answer is read when the target's template thinks (its thoughts then go apart
    from the answer, as llama-server's reasoning_content); None when it does not. `prompt_tail`:
    Engine.prompt_tail's (does the prompt open the thinking?)."""
    from speculative.chat.request import Reading, plan

    template = engine.target.chat_template() or ""
    chosen = plan(template) if engine.jinja and template else None
    if chosen is None or not chosen.syntax.extract_reasoning:
        return None
    return Reading(chosen.after_prompt(prompt_tail))


def show(out: Stdout, text: str, from_draft: bool, reading: Reading | None, end: bool = False) -> None:
    """Text of the answer on stdout; through `reading`, its thoughts dimmed on stderr instead."""
    if reading is None:
        out.write(text, from_draft)
        return
    for change in [*reading.push(text), *(reading.end() if end else [])]:
        out.write(change.content, from_draft)
        if change.reasoning_content:
            out.status.clear()
            styled = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
            sys.stderr.write(f"{DIM}{change.reasoning_content}{RESET}" if styled else change.reasoning_content)
            sys.stderr.flush()


def run_and_render(target: ModelSpec, draft: ModelSpec | None, text: str, sampling: SamplerSettings,
                   spec: SpecSettings, *, use_chat: bool, system: str | None, color: bool,
                   json_output: bool, prompt_cache: Path | None = None, prompt_cache_ro: bool = False,
                   pool: dict | None = None) -> int:
    seed = sampling.resolved_seed()
    with loaded(target, draft, json_output, prompt_cache, prompt_cache_ro, pool) as (status, engine):
        prompt = engine.prompt_tokens(text, use_chat, system)
        out = Stdout(color, status)
        reading = thinking_reader(engine, prompt_tail(engine.target, prompt)) if use_chat else None
        stream = Stream(engine, prompt, sampling, spec, seed,
                        should_stop=lambda: "output closed" if out.closed else None)
        interrupted = False
        try:
            for piece in stream:
                if not json_output:  # --json prints the whole text at the end
                    for part, from_draft in piece.parts:
                        show(out, part, from_draft, reading)
        except KeyboardInterrupt:
            interrupted = True
        final = stream.end("interrupted" if interrupted else None)
        if not json_output:
            show(out, final.tail, False, reading, end=True)
        status.clear()
        if json_output:
            result = {**result_json(final, reading),
                      "target": _model_info(target, engine.target),
                      "draft": _model_info(draft, engine.draft) if draft else None,
                      "settings": _settings(sampling, spec, seed, use_chat, engine),
                      "notes": final.notes}
            out.write(json.dumps(result, ensure_ascii=False) + "\n")
        else:
            out.write("\n")
            print_stats(final.stats, spec, seed, target, draft, color, final.notes, (engine.target, engine.draft))
    return EXIT_INTERRUPTED if interrupted else 0


def print_stats(stats: Stats, spec: SpecSettings, seed: int, target: ModelSpec, draft: ModelSpec | None,
                color: bool, notes: list[str], engine_models: tuple = (None, None)) -> None:
    """llama.cpp's block first (as llama-speculative prints it), then what it does not show."""
    lines = [
        "",
        f"encoded {stats.n_prompt:4d} tokens in {stats.t_encode:8.3f} seconds, speed: {stats.encode_tps:8.3f} t/s"
        + cached_note(stats),
        f"decoded {stats.n_predict:4d} tokens in {stats.t_decode:8.3f} seconds, speed: {stats.decode_tps:8.3f} t/s",
        "",
        f"n_draft   = {spec.step_max if spec.drafters or spec.auto else 0}",
        f"n_predict = {stats.n_predict}",
        f"n_drafted = {stats.n_drafted}",
        f"n_accept  = {stats.n_accept}",
        f"accept    = {100 * stats.accept_rate:.3f}%",
        "",
        f"steps     = {stats.n_steps} target passes, {stats.n_draft_steps} verified a draft, "
        f"{stats.tokens_per_step:.2f} tokens per pass",
    ]
    if stats.n_draft_steps:
        histogram = " ".join(f"{m}:{n}" for m, n in sorted(stats.accepted_lengths.items()))
        by_position = "  ".join(f"#{i + 1} {100 * r:.1f}%" for i, r in enumerate(stats.accept_rate_by_position))
        lines += [
            f"accepted  = {stats.mean_accepted_length:.2f} drafted tokens per drafting step "
            f"(accepted length: steps = {histogram})",
            f"position  = {by_position}",
        ]
    if stats.n_tree_steps:
        by_branch = ", ".join(f"#{b} {stats.branch_steps[b]} steps ({stats.branch_accepted[b]} tokens)"
                              for b in sorted(stats.branch_steps)) or "none"
        lines.append(f"branches  = {stats.n_tree_steps} steps drafted a tree of up to {stats.max_branches} "
                     f"branches; accepted along {by_branch}")
    plans = ", ".join(f"{d} k={k}: {n}" if d != "none" else f"no draft: {n}"
                      for (d, k), n in sorted(stats.plans.items(), key=lambda item: -item[1]))
    lines.append(f"plans     = {plans} (steps by drafter and draft length)")
    other = max(stats.t_decode - stats.t_draft - stats.t_verify, 0.0)
    total = stats.t_decode or 1.0
    lines += [
        f"time      = draft {stats.t_draft:.3f} s ({100 * stats.t_draft / total:.1f}%), "
        f"verify {stats.t_verify:.3f} s ({100 * stats.t_verify / total:.1f}%), other {other:.3f} s",
        f"python    = {1000 * stats.python_seconds_per_token:.2f} ms per token outside llama.cpp "
        f"({100 * stats.python_share:.1f}% of generation time)"
        + (f"; auto's planning {1000 * stats.t_plan:.1f} ms ({100 * stats.t_plan / total:.2f}%)" if spec.auto else ""),
        f"load      = {stats.t_load:.3f} s (target {target.name}"
        + (f", draft {draft.name}" if draft else "")
        + (f", MTP head {target.mtp_sidecar.name}" if target.mtp_sidecar else "")
        + (f", drafter {target.feature_drafter.name}" if target.feature_drafter else "") + ")",
        f"finish    = {stats.finish_reason}, seed {seed}",
    ]
    kv = [kv_line(role, model) for role, model in zip(("target", "draft"), engine_models) if model is not None]
    lines += [f"kv cache  = {', '.join(kv)}"] if kv else []
    lines += [f"note      = {note}" for note in notes]
    if color and (spec.drafters or spec.auto):
        lines.append(f"colors    = {GREEN}accepted draft tokens{RESET}, plain: the target's own tokens")
    print("\n".join(lines), file=sys.stderr)


def kv_line(role: str, model) -> str:
    """A model's KV cache: its size (as llama.cpp allocated it), types and cells."""
    size = f"{model.kv_bytes / 2**20:.2f} MiB" if model.kv_bytes is not None else "size unknown"
    return f"{role} {size} (K {model.cache_types[0]}, V {model.cache_types[1]}, {model.kv_cells} cells)"


def cached_note(stats: Stats) -> str:
    """How much of the prompt was not processed, and where it came from."""
    if stats.n_restored:
        return f" ({stats.n_restored} from the prompt cache, restored in {stats.t_restore:.3f} s)"
    return f" ({stats.n_cached} kept in the cache)" if stats.n_cached else ""


def _model_info(spec: ModelSpec, model) -> dict:
    return {"name": spec.name, "path": str(spec.path), "n_ctx": model.n_ctx,
            "n_gpu_layers": spec.n_gpu_layers, "n_threads": model.n_threads, "loras": spec.lora_info(),
            "nextn_layers": model.nextn_layers,  # NextN (MTP) layers loaded to draft with (draft-mtp)
            "mtp_head": str(spec.mtp_sidecar) if spec.mtp_sidecar else None,  # an MTP head file (-md) instead
            "feature_drafter": str(spec.feature_drafter) if spec.feature_drafter else None,  # EAGLE-3, DFlash, DSpark (-md)
            "cache_type_k": model.cache_types[0], "cache_type_v": model.cache_types[1], "kv_bytes": model.kv_bytes,
            "flash_attn": model.flash_attn_on, "n_ubatch": model.n_ubatch, "overrides": [list(o) for o in spec.overrides]}


def _settings(sampling: SamplerSettings, spec: SpecSettings, seed: int, use_chat: bool, engine: Engine) -> dict:
    return {"temp": sampling.temp, "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p,
            "typical_p": sampling.typical_p, "repeat_penalty": sampling.repeat_penalty,
            "repeat_last_n": sampling.repeat_last_n, "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "sampling_seq": sampling.sequence, "seed": seed, "n_predict": spec.n_predict,
            "draft_max": spec.step_max, "draft_min": spec.draft_min, "draft_p_min": spec.draft_p_min,
            "n_parallel": spec.branches, "draft_p_split": spec.p_split,
            "ignore_eos": spec.ignore_eos, "chat": use_chat,
            "prompt_cache": str(engine.persist.file) if engine.persist.file else None,
            "prompt_cache_ro": engine.persist.read_only,
            "spec_type": ",".join(spec.types), "spec_accept": spec.accept, "n_batch": engine.target.n_batch,
            **{name: {"n": ngram.size(spec.auto), "m": ngram.m, "min_hits": ngram.min_hits}
               for name, ngram in (("ngram_simple", spec.ngram_simple), ("ngram_map_k", spec.ngram_map_k),
                                   ("ngram_map_k4v", spec.ngram_map_k4v))},
            "ngram_mod": {"n_match": spec.ngram_mod.n_match, "n_min": spec.ngram_mod.n_min,
                          "n_max": spec.ngram_mod.n_max},
            "lookup_cache_static": str(spec.ngram_cache.static) if spec.ngram_cache.static else None,
            "lookup_cache_dynamic": str(spec.ngram_cache.dynamic) if spec.ngram_cache.dynamic else None}
