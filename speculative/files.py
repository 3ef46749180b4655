"""Files that are whole or absent: what speculate writes for later runs to read."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator

from speculative.errors import UsageError


def write_atomic(path: Path, chunks: Iterable[bytes]) -> None:
    """Write `chunks` to a temporary file beside `path`, sync it, and rename it over `path`:
    a crash or a full disk leaves the old file (or none), never half of the new one. A
    symbolic link is followed: its target is replaced, and the link stays."""
    path = Path(path).resolve()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(path: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """One process at a time works on `path` (an advisory lock on the hidden `.NAME.lock`
    beside it, where the OS has fcntl): pulls of one model, saves of one pool file.
    `waiting` is called when another process holds it, before waiting for it."""
    with open(Path(path).parent / f".{Path(path).name}.lock", "a+b") as handle:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            yield
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                waiting()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_ours(path: Path, flag: str, stranger: Callable[[BinaryIO], str | None], *, needs_folder: bool = False,
               directory: str = "is a directory", unreadable: str = "cannot read it: {}",
               refusal: str = "exists and is {}; refusing to overwrite it (choose another file)") -> None:
    """Refuse, before any work, a FILE given to `flag` that a run would replace at its end but
    that is not ours: a directory, a file that cannot be read, or one that `stranger` (reading
    it from its start) names as something else (it returns None for ours). A missing file is
    created then; `needs_folder`: only where its folder exists. Each flag words its refusals
    (after "FLAG PATH: ") as its own messages always have: `directory`, `unreadable` (given the
    error) and `refusal` (given what `stranger` said)."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: {directory}")
    if needs_folder and not path.exists() and not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: no directory {path.parent}")
    try:
        with open(path, "rb") as f:
            what = stranger(f)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"{flag} {path}: {unreadable.format(e.strerror or e)}") from None
    if what is not None:
        raise UsageError(f"{flag} {path}: {refusal.format(what)}")


def content_identity(path: Path) -> dict:
    """A file by its content: its size and a hash of its first and last MiB (a GGUF's header and
    its last tensors), whatever its name or folder: the same file reached through another name,
    or downloaded again, is the same file."""
    stat = Path(path).stat()
    return _content_identity(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _content_identity(path: str, size: int, mtime_ns: int) -> dict:  # read once per version of a file
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            digest.update(f.read())
    return {"size": size, "sha256_head_tail": digest.hexdigest()[:32]}
