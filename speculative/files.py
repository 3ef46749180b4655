"""Files that are whole or absent: what speculate writes for later runs to read."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable


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
