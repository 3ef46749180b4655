"""`speculate models ...` and turning -m/-md into model files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from speculative.engine import ModelSpec
from speculative.errors import ModelError
from speculative.pull import pull
from speculative.registry import ModelEntry, Registry, resolve

from .render import PipeConsole, quiet_pipe

app = typer.Typer(help="List, pull and locate registry models (models.toml).", no_args_is_help=True)
stderr = Console(stderr=True)


def pull_with_progress(entry: ModelEntry, dest: Path, force: bool = False) -> None:
    """Pull a registry model, with a progress bar on stderr."""
    stderr.print(f"pulling {entry.name} ({entry.size / 1e6:,.0f} MB) into {dest.parent}",
                 highlight=False, soft_wrap=True)  # one line, however long the path
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr, transient=True, disable=not stderr.is_terminal) as bar:
        task = bar.add_task(entry.name, total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total or None)

        pull(entry, dest, progress, force=force)
    stderr.print(f"pulled {entry.name}: sha256 verified", highlight=False)


def resolve_models(registry: Registry, model: str | None, model_draft: str | None, use_draft: bool, *,
                   ctx: tuple[int, int | None], ngl: tuple[int, int | None],
                   threads: tuple[int | None, int | None], n_batch: int, flash_attn: str = "auto",
                   loras: tuple[tuple, tuple] = ((), ())) -> tuple[ModelSpec, ModelSpec | None]:
    """-m/-md (paths or names; defaults from the registry) -> model specs, pulling as needed."""
    target_path, target_name = resolve(model or registry.default_target, registry, pull_with_progress)
    target = ModelSpec(target_path, target_name, n_ctx=ctx[0], n_batch=n_batch,
                       n_gpu_layers=ngl[0], n_threads=threads[0], flash_attn=flash_attn, loras=loras[0])
    if not use_draft:
        return target, None
    spec = model_draft or registry.default_draft
    if spec is None:
        raise ModelError("no draft model given and the registry has no default draft")
    draft_path, draft_name = resolve(spec, registry, pull_with_progress)
    draft = ModelSpec(draft_path, draft_name,
                      n_ctx=ctx[1] if ctx[1] is not None else ctx[0], n_batch=n_batch,
                      n_gpu_layers=ngl[1] if ngl[1] is not None else ngl[0],
                      n_threads=threads[1] if threads[1] is not None else threads[0],
                      flash_attn=flash_attn, loras=loras[1])
    return target, draft


@app.command("list")
def list_models(json_output: bool = typer.Option(False, "--json", help="One JSON object per line.")) -> None:
    """The registry's models: name, size, whether pulled, and where."""
    registry = Registry.load()
    rows = []
    for entry in registry.entries.values():
        role = [r for r, n in (("default target", registry.default_target),
                               ("default draft", registry.default_draft)) if n == entry.name]
        rows.append({"name": entry.name, "aliases": list(entry.aliases), "description": entry.description,
                     "size": entry.size, "pulled": registry.is_pulled(entry),
                     "path": str(registry.path(entry)), "default": ", ".join(role)})
    with quiet_pipe():
        _print_models(rows, json_output, registry.cache_dir)


def _print_models(rows: list[dict], json_output: bool, cache_dir: Path) -> None:
    if json_output:
        for row in rows:
            print(json.dumps(row))
        return
    table = Table(title=f"models (cache: {cache_dir})", title_justify="left")
    for col in ("name", "size", "pulled", "default", "path"):
        table.add_column(col, justify="right" if col == "size" else "left", overflow="fold")
    for row in rows:
        table.add_row(row["name"] + (f" ({', '.join(row['aliases'])})" if row["aliases"] else ""),
                      f"{row['size'] / 1e6:,.0f} MB", "yes" if row["pulled"] else "no",
                      row["default"], row["path"])
    PipeConsole().print(table)


@app.command("pull")
def pull_model(name: str = typer.Argument(..., help="Registry name or alias."),
               force: bool = typer.Option(False, "--force", help="Pull again even if already pulled.")) -> None:
    """Download, assemble and verify a model, then move it into the cache."""
    registry = Registry.load()
    entry = registry.get(name)
    dest = registry.path(entry)
    if registry.is_pulled(entry) and not force:
        stderr.print(f"{entry.name} is already pulled", highlight=False)
    else:  # a forced pull replaces the old file only once the new one is verified
        pull_with_progress(entry, dest, force=force)
    with quiet_pipe():
        print(dest)


@app.command("path")
def model_path(name: Optional[str] = typer.Argument(None, help="Registry name or alias.")) -> None:
    """Print where a pulled model lives (exit 3 if it is not pulled)."""
    registry = Registry.load()
    if name is None:
        path = registry.cache_dir
    else:
        entry = registry.get(name)
        if not registry.is_pulled(entry):
            raise ModelError(f"{entry.name} is not pulled yet; run `speculate models pull {entry.name}`")
        path = registry.path(entry)
    with quiet_pipe():
        print(path)
