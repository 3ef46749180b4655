"""`speculate batch`: a JSONL file of requests, a JSONL file of results, resumable."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.drafters import registry
from speculative.errors import UsageError
from speculative.files import write_atomic
from speculative.serving import batch

from . import options
from .progress import StatusLine
from .render import EXIT_INTERRUPTED

stderr = Console(stderr=True, highlight=False, soft_wrap=True)  # log lines stay whole in files
PLAIN_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal


@options.with_options(options.MODELS, options.SAMPLING, options.SPECULATION.but(
    branches=(int, options.DRAFT_BRANCHES)), options.POOL,
    options.SLOTS.only("parallel", "kv_unified", "slot_prompt_similarity"))
def batch_command(
    models: options.ModelOptions,
    sampling: SamplerSettings,
    spec: SpecSettings,
    pool: options.PoolOptions,
    slots: options.SlotOptions,
    requests: Path = typer.Argument(
        ..., metavar="REQUESTS.jsonl",
        help="One request per line: an `id` (string or integer) and a `prompt` or chat `messages`; optional "
             "n_predict, temperature, top_p, seed, stop (a string or a list) override the flags."),
    output: Path = typer.Option(
        ..., "-o", "--output", "--output-file", metavar="RESULTS.jsonl",
        help="Results, one line per request, appended as each finishes. Requests it already has a line for "
             "are skipped, so rerunning the same command resumes an interrupted batch."),
    summary_file: Optional[Path] = typer.Option(
        None, "--summary", metavar="FILE", help="Also write the final summary to FILE as JSON."),
) -> None:
    """Run every request in a JSONL file with the models loaded once, -np of them at once;
    exit 0 when every request has a result, 1 when some failed."""
    _check_files(requests, output, summary_file)
    slots = slots.for_spec(spec)
    items = batch.read_requests(requests, sampling, spec)
    results = batch.Results(output, notify=_notice)
    try:
        todo = batch.pending(items, results)
        engine = parallel = None
        if any(isinstance(item, batch.Request) for item in todo):  # else no model is needed
            from speculative.engine.engine import Engine  # loads llama.cpp: imported when a model runs (start-up time)
            from speculative.engine.parallel import Parallel

            target, draft = models.specs(models.uses_draft(spec), spec.branches, spec.longest_draft,
                                         *registry.heads(spec))
            with StatusLine() as status:  # while the models load and auto measures (a terminal's only)
                def notice(message: str) -> None:
                    status.clear()
                    _notice(message)
                engine = Engine(slots.apply(target), slots.apply(draft), notify=notice, progress=status.update,
                                **pool.engine_args())
                engine.factory.make(spec)  # auto measures its costs now, before requests share the models
            parallel = Parallel(engine, slots.n_slots, **slots.parallel_args())
        _notice(f"batch: {len(items)} requests in {requests}, {len(items) - len(todo)} already in {output}, "
                f"{len(todo)} to run" + (f", {slots.n_slots} at once" if parallel and slots.n_slots > 1 else ""))
        try:
            with _progress(len(todo)) as show:
                summary = batch.run_batch(parallel, items, results, show)
        finally:
            if engine is not None:
                engine.close()
    finally:
        results.close()
    _report(summary, output, summary_file)
    raise typer.Exit(EXIT_INTERRUPTED if summary.interrupted else 0 if summary.all_succeeded else 1)


def _check_files(requests: Path, output: Path, summary_file: Optional[Path]) -> None:
    """Refused before anything runs: results appended to the requests, or a summary that
    replaces the requests or the results at the end."""
    if _same(output, requests):
        raise UsageError("-o/--output must not be the requests file")
    for path, name in ((requests, "the requests file"), (output, "the -o/--output file")):
        if summary_file is not None and _same(summary_file, path):
            raise UsageError(f"--summary must not be {name}")


def _same(a: Path, b: Path) -> bool:
    """One file under two names: the same path once links are followed, or a hard link."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except (OSError, RuntimeError):  # a link loop or an unreadable directory: opening it says so later
        return False


def _notice(message: str) -> None:
    """Notices name files, and a path like data[1].jsonl is not Rich markup."""
    stderr.print(message, markup=False, highlight=False)


class _progress:
    """Progress on stderr: a live bar on a terminal, else a plain line every PLAIN_EVERY seconds."""

    def __init__(self, total: int):
        self.total = total
        self.live = stderr.is_terminal
        self._last = 0.0
        self._bar = Progress(
            TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[running]} running"),
            TextColumn("{task.fields[failed]} failed"),
            TextColumn("{task.fields[tps]:.1f} tokens/s"), TextColumn("ETA"), TimeRemainingColumn(),
            console=stderr, transient=False) if self.live else None

    def __enter__(self):
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task("batch", total=self.total, running=0, failed=0, tps=0.0)
        return self

    def __call__(self, s: batch.Summary) -> None:
        done = s.succeeded + s.failed
        tps = s.to_dict()["tokens_per_second"]
        if self._bar is not None:
            self._bar.update(self._task, completed=done, running=s.running, failed=s.failed, tps=tps)
        elif time.monotonic() - self._last >= PLAIN_EVERY or done == self.total:
            self._last = time.monotonic()
            eta = s.seconds / done * (self.total - done)
            stderr.print(f"batch: {done}/{self.total} done, {s.running} running, {s.failed} failed, {tps:.1f} tokens/s, "
                         f"ETA {_duration(eta)}")

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _report(summary: batch.Summary, output: Path, summary_file: Optional[Path]) -> None:
    s = summary.to_dict()
    earlier = (f" (and {s['earlier_succeeded']} succeeded, {s['earlier_failed']} failed in earlier runs)"
               if s["earlier_succeeded"] or s["earlier_failed"] else "")
    lines = [
        f"batch: {s['requests']} requests: {s['succeeded']} succeeded, {s['failed']} failed{earlier}"
        + (f"; interrupted, {s['remaining']} left: rerun the same command to resume" if s["interrupted"] else ""),
        f"prompt    = {s['n_prompt']} tokens, {s['n_cached']} kept in the cache from the request before "
        f"({100 * s['cached_share']:.0f}%), processed in {s['t_encode_s']:.3f} s",
        f"generated = {s['n_predict']} tokens in {s['seconds']:.1f} s: {s['tokens_per_second']:.2f} tokens/s "
        f"overall, {s['decode_tps']:.2f} while decoding",
        f"accept    = {100 * s['accept_rate']:.1f}% ({s['n_accept']} of {s['n_drafted']} drafted tokens)",
        f"results   = {output}" + (f", summary {summary_file}" if summary_file else ""),
    ]
    stderr.print("\n".join(lines), markup=False)
    if summary_file is not None:
        try:
            write_atomic(summary_file, [(json.dumps(s, indent=1) + "\n").encode()])
        except OSError as e:
            raise UsageError(f"cannot write --summary {summary_file}: {e.strerror or e}") from None
