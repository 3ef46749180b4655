"""Models from the Hugging Face hub, chosen, stored and found as llama.cpp's `-hf` does.

`USER/REPO[:QUANT]` names a GGUF in a hub repository. The file is chosen as llama.cpp's
common/download.cpp chooses it (QUANT, else Q4_K_M, else Q8_0, else the first GGUF that is
not a projector, imatrix or drafting sidecar; split models whole) and kept in the hub
cache layout (`models--USER--REPO/blobs/<etag>`, `snapshots/<commit>/<path>`, `refs/main`)
that llama.cpp and huggingface_hub share: a file either of them downloaded is found here,
and the reverse. llama.cpp's `LLAMA_CACHE` is looked in first and, when set, downloaded
into, as llama.cpp does (common/hf-cache.cpp).

huggingface_hub does the talking to the hub (model info, headers and tokens, redirects,
retries, HTTP range resumes); this module chooses, verifies and places files. A file is
downloaded to `blobs/<etag>.downloadInProgress` (llama.cpp's name for a partial file),
resumed from there after an interruption, checked against the hub's sha256 (LFS files) or
git blob id (others), and only then renamed to its blob name: nothing that looks complete
is ever unverified.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from speculative.errors import ModelError, UsageError

DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # llama.cpp's sidecar names
PARTIAL = ".downloadInProgress"
CHUNK = 1 << 20

Notice = Callable[[str], None]
Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, what): as pull.Progress


@dataclass(frozen=True)
class HubFile:
    """A file of a repository at one commit, as the hub describes it."""
    path: str
    size: int | None = None
    sha256: str | None = None   # LFS files: the content's sha256, also its blob name
    blob_id: str | None = None  # git blob sha1: regular files' blob name

    @property
    def etag(self) -> str | None:
        return self.sha256 or self.blob_id


@dataclass(frozen=True)
class Split:
    """llama.cpp's reading of a GGUF file name: prefix (tag included), tag, part index, count."""
    prefix: str
    tag: str
    index: int
    count: int


# -- names ------------------------------------------------------------------------------

_REPO = re.compile(r"[A-Za-z0-9_]+([./-][A-Za-z0-9_]+)*")


def split_repo(spec: str, flag: str = "-hf") -> tuple[str, str]:
    """USER/REPO[:QUANT] -> (repo, quant or ""), checked as llama.cpp checks a repo id."""
    repo, _, quant = spec.partition(":")
    if not _REPO.fullmatch(repo) or repo.count("/") != 1 or len(repo) > 256 or ":" in quant:
        raise UsageError(f"{flag}: expected <user>/<model>[:quant], got {spec!r}")
    return repo, quant


def split_info(path: str) -> Split:
    """llama.cpp's get_gguf_split_info: `name-Q4_K_M-00001-of-00003.gguf` is part 1 of 3, tag Q4_K_M."""
    if not path.endswith(".gguf"):
        return Split("", "", 0, 0)
    prefix, index, count = path[:-len(".gguf")], 1, 1
    if m := re.fullmatch(r"(.+)-([0-9]{5})-of-([0-9]{5})", prefix, re.IGNORECASE):
        prefix, index, count = m[1], int(m[2]), int(m[3])
    tag = m[1].upper() if (m := re.search(r"[-.]([A-Z0-9_]+)$", prefix, re.IGNORECASE)) else ""
    return Split(prefix, tag, index, count)


def is_model(path: str) -> bool:
    """A GGUF that is a model, not a projector, imatrix or drafting sidecar (by name, as llama.cpp)."""
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".gguf") and not any(word in name for word in NOT_MODELS)


def choose(files: list[HubFile], repo: str, quant: str = "", hf_file: str | None = None) -> list[HubFile]:
    """The model file to load and its split siblings, first part first, as llama.cpp's
    common_download_get_hf_plan picks them; a ModelError says what the repository has instead."""
    if hf_file:
        primary = next((f for f in files if f.path == hf_file), None)
        if primary is None:
            raise ModelError(f"{repo} has no file {hf_file!r}{_listing(files)}")
    else:
        primary = _best(files, quant)
        if primary is None:
            if not any(is_model(f.path) for f in files):
                raise ModelError(f"{repo} has no GGUF model file{_listing(files)}")
            raise ModelError(f"{repo} has no {quant} GGUF; it has {', '.join(quants(files)) or 'untagged files only'}"
                             f" (give {repo}:QUANT, or a file with -hff)")
    info = split_info(primary.path)
    if info.count <= 1:
        return [primary]
    parts = sorted((f for f in files if (s := split_info(f.path)).count == info.count and s.prefix == info.prefix),
                   key=lambda f: split_info(f.path).index)
    if [split_info(f.path).index for f in parts] != list(range(1, info.count + 1)):
        raise ModelError(f"{repo}: {primary.path} is part of a {info.count}-part model, but the repository has "
                         f"{len(parts)} of its parts")
    return parts


def _best(files: list[HubFile], quant: str) -> HubFile | None:
    """llama.cpp's find_best_model: the first model file whose name has TAG followed by . or -."""
    first_parts = [f for f in files if is_model(f.path) and split_info(f.path).index <= 1]
    for tag in [quant] if quant else DEFAULT_QUANTS:
        pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        if found := next((f for f in first_parts if pattern.search(f.path)), None):
            return found
    return None if quant else next(iter(first_parts), None)


def quants(files: Iterable[HubFile]) -> list[str]:
    """The quant tags of a repository's model files, in order of first appearance."""
    return list(dict.fromkeys(t for f in files if is_model(f.path) and (t := split_info(f.path).tag)))


def _listing(files: list[HubFile]) -> str:
    ggufs = [f.path for f in files if f.path.endswith(".gguf")]
    if not ggufs:
        return f" ({len(files)} files, none of them .gguf)"
    return f"; its GGUF files: {', '.join(ggufs[:8])}{', ...' if len(ggufs) > 8 else ''}"


# -- caches -----------------------------------------------------------------------------


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def hub_cache() -> Path:
    """huggingface_hub's cache: HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub (~/.cache/huggingface/hub), as huggingface_hub and
    llama.cpp both read them (without importing huggingface_hub: offline runs never need it)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if path := _env_path(name):
            return path
    if path := _env_path("HF_HOME"):
        return path / "hub"
    return (_env_path("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub"


def cache_dirs() -> list[Path]:
    """Where hub models are looked for: llama.cpp's LLAMA_CACHE first (when set), then the hub cache."""
    dirs = [_env_path("LLAMA_CACHE"), hub_cache()]
    return list(dict.fromkeys(d for d in dirs if d is not None))


def download_dir() -> Path:
    """Where hub models are downloaded: where llama.cpp would put them (LLAMA_CACHE, else the hub cache)."""
    return cache_dirs()[0]


def offline() -> str | None:
    """The variable that keeps the hub offline, if one does: HF_HUB_OFFLINE, else (when that
    is unset or empty) TRANSFORMERS_OFFLINE, read as huggingface_hub reads them."""
    name = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    return name if os.environ.get(name, "").upper() in {"1", "ON", "YES", "TRUE"} else None


def _repo_dir(cache: Path, repo: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


@dataclass(frozen=True)
class Cached:
    repo: str
    commit: str
    file: HubFile
    path: Path   # the snapshot entry (a link into blobs/, or the file itself)


def cached(repo: str | None = None, revision: str = "main") -> Iterator[Cached]:
    """GGUF-or-not files in the caches' snapshots of `revision` (a branch name or a commit),
    repository by repository (every repository when `repo` is None), as llama.cpp's
    get_cached_files finds them. Dangling links (a blob removed) are skipped."""
    for cache in cache_dirs():
        repo_dirs = [_repo_dir(cache, repo)] if repo else sorted(cache.glob("models--*--*"))
        for repo_dir in repo_dirs:
            name = repo or repo_dir.name[len("models--"):].replace("--", "/")
            commit = _ref(repo_dir, revision)
            snapshot = repo_dir / "snapshots" / commit if commit else None
            if snapshot is None or not snapshot.is_dir():
                continue
            for path in sorted(snapshot.rglob("*")):
                if path.is_file():  # follows the link: a dangling one is not a file
                    yield Cached(name, commit, HubFile(path.relative_to(snapshot).as_posix(), path.stat().st_size),
                                 path)


def _ref(repo_dir: Path, revision: str) -> str | None:
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    try:
        commit = (repo_dir / "refs" / revision).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None


def find_blob(repo: str, etag: str, size: int | None) -> Path | None:
    """A verified blob of `repo` named `etag` (sha256 or git sha1) in any cache, of the right size."""
    for cache in cache_dirs():
        blob = _repo_dir(cache, repo) / "blobs" / etag
        if blob.is_file() and (size is None or blob.stat().st_size == size):
            return blob
    return None


def _link(blob: Path, snapshot_path: Path) -> Path:
    """snapshots/<commit>/<path> -> ../../blobs/<etag>, as huggingface_hub links them (a copy
    where links cannot be made)."""
    snapshot_path.parent.mkdir(parents=True, exist_ok=True)
    if snapshot_path.is_file():
        return snapshot_path
    snapshot_path.unlink(missing_ok=True)  # a dangling link
    try:
        snapshot_path.symlink_to(os.path.relpath(blob, snapshot_path.parent))
    except OSError:
        shutil.copyfile(blob, snapshot_path)
    return snapshot_path


def _write_ref(repo_dir: Path, revision: str, commit: str) -> None:
    if revision == commit:
        return
    ref = repo_dir / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
    tmp.write_text(commit, encoding="utf-8")
    os.replace(tmp, ref)


# -- the hub ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hub:
    """How to reach the hub: token (-hft, else HF_TOKEN or the stored login) and what to show."""
    token: str | None = None
    notice: Notice = lambda message: None
    progress: Progress | None = None
    offline: bool = False  # llama.cpp's --offline: the caches only, as HF_HUB_OFFLINE=1

    def fetch(self, spec: str, hf_file: str | None = None, flag: str = "-hf") -> Path:
        """USER/REPO[:QUANT] (and -hff FILE) -> the local path of the model (its first part),
        downloaded and verified if no cache has it."""
        repo, quant = split_repo(spec, flag)
        if variable := ("--offline" if self.offline else offline()):
            return self._from_cache(repo, quant, hf_file, f"{variable} is set",
                                    f"run once without {variable} to download it")
        try:
            commit, files = self.listing(repo)
        except _Unreachable as e:
            return self._from_cache(repo, quant, hf_file, f"the hub is unreachable ({e})",
                                    "check the connection (or HF_ENDPOINT) and run again")
        parts = choose(files, repo, quant, hf_file)
        # the parts of a split model side by side, in the cache that has the first (llama.cpp
        # finds the others by name next to it), else where downloads go
        first = find_blob(repo, parts[0].etag, parts[0].size) if parts[0].etag else None
        home = first.parents[2] if first else download_dir()
        return [self.ensure(repo, commit, "main", part, home) for part in parts][0]

    def fetch_pinned(self, repo: str, path: str, revision: str, sha256: str, size: int) -> Path:
        """A registry model's hub source: `path` at `revision`, which must be the file the registry pins."""
        if blob := find_blob(repo, sha256, size):
            return blob
        if variable := ("--offline" if self.offline else offline()):
            raise ModelError(f"{repo}/{path} is not in the cache and {variable} is set")
        try:
            commit, files = self.listing(repo, revision)
        except _Unreachable as e:
            raise ModelError(f"cannot download {repo}/{path}: the hub is unreachable ({e})") from None
        file = next((f for f in files if f.path == path), None)
        if file is None:
            raise ModelError(f"{repo} has no file {path!r} at {revision}")
        if (file.sha256, file.size) != (sha256, size):
            raise ModelError(f"{repo}/{path} at {revision} is not the registry's file: the hub says sha256 "
                             f"{file.sha256}, {file.size} bytes; the registry pins {sha256}, {size} bytes")
        self.ensure(repo, commit, revision, file, download_dir())
        return find_blob(repo, sha256, size)  # as the next run's `locate` finds it

    def listing(self, repo: str, revision: str | None = None) -> tuple[str, list[HubFile]]:
        """(commit, files) of `repo` at `revision` (the default branch), from the hub."""
        _endpoint_from_llama_cpp()
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import HfHubHTTPError
        try:
            info = HfApi(token=self.token).model_info(repo, revision=revision, files_metadata=True,
                                                      timeout=constants.HF_HUB_ETAG_TIMEOUT)
        except HfHubHTTPError as e:
            self._refused(e, repo, revision)
            status = e.response.status_code if e.response is not None else None
            raise _Unreachable(f"HTTP {status}" if status else str(e).splitlines()[0]) from None
        except Exception as e:  # connection refused, DNS, timeout: httpx's errors and OSError
            if not _is_network_error(e):
                raise
            raise _Unreachable(f"{type(e).__name__} after at most {constants.HF_HUB_ETAG_TIMEOUT} s: "
                               f"{e or 'no answer'}") from None
        files = [HubFile(s.rfilename, s.lfs.size if s.lfs else s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
                 for s in info.siblings or ()]
        return info.sha, files

    def ensure(self, repo: str, commit: str, revision: str, file: HubFile, home: Path) -> Path:
        """The path of `file` in the snapshot of `commit` in the cache `home`: linked to the blob
        any cache has, else to one downloaded into `home` and verified."""
        if file.etag is None:
            raise ModelError(f"{repo}/{file.path}: the hub gave no checksum for it; refusing an unverifiable file")
        repo_dir = _repo_dir(home, repo)
        blob = find_blob(repo, file.etag, file.size) or self._download(repo, file, repo_dir / "blobs", commit)
        _write_ref(repo_dir, revision, commit)
        return _link(blob, repo_dir / "snapshots" / commit / file.path)

    def _download(self, repo: str, file: HubFile, blobs: Path, commit: str) -> Path:
        from filelock import FileLock
        from huggingface_hub import hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers, logging

        logging.set_verbosity_error()  # its retries are not the user's business; the outcome is

        blobs.mkdir(parents=True, exist_ok=True)
        blob, partial = blobs / file.etag, blobs / (file.etag + PARTIAL)
        lock = blobs.parent.parent / ".locks" / blobs.parent.name / f"{file.etag}.lock"  # huggingface_hub's lock
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock)):
            if blob.is_file() and blob.stat().st_size == file.size:
                return blob  # another process finished it meanwhile
            done = partial.stat().st_size if partial.is_file() else 0
            if file.size is not None and done > file.size:
                partial.unlink()
                done = 0
            _check_space(blobs, (file.size or 0) - done, f"{repo}/{file.path}")
            what = f"{repo}/{file.path}"
            self.notice(f"downloading {what} ({_mb(file.size)})"
                        + (f", resuming after {_mb(done)}" if done else "") + f" into {blobs.parent}")
            try:
                with open(partial, "ab") as out:
                    http_get(hf_hub_url(repo, file.path, revision=commit), out, resume_size=done,
                             headers=build_hf_headers(token=self.token, library_name="speculate"),
                             expected_size=file.size,  # of the whole file: http_get counts from resume_size
                             displayed_filename=what, tqdm_class=self._bar(what, file.size))
            except Exception as e:  # httpx's errors, huggingface_hub's HTTP errors (OSErrors), a short file
                if partial.is_file() and partial.stat().st_size == 0:
                    partial.unlink()  # nothing to resume
                self._refused(e, repo)
                if not _is_network_error(e):
                    raise
                kept = partial.stat().st_size if partial.is_file() else 0
                reason = f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__
                again = f"{_mb(kept)} kept: run the same command again to resume" if kept else \
                    "run the same command again"
                raise ModelError(f"download of {what} failed ({reason}); {again}") from None
            got = _digest(partial, sha256=file.sha256 is not None)
            if got != file.etag:
                partial.unlink(missing_ok=True)
                kind = "sha256" if file.sha256 else "git blob id"
                raise ModelError(f"{what}: the download does not match the hub's {kind} (got {got}, expected "
                                 f"{file.etag}); it was removed, nothing was kept")
            os.chmod(partial, 0o644)
            os.replace(partial, blob)
        return blob

    def _refused(self, e: Exception, repo: str, revision: str | None = None) -> None:
        """The hub's answers that no retry mends, as a ModelError that says what to do; other
        errors pass. (The hub shows a gated repository's listing to anyone and refuses its files.)"""
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
        token = "give a token with access: -hft TOKEN or HF_TOKEN"
        if isinstance(e, GatedRepoError):  # a RepositoryNotFoundError too: first
            raise ModelError(f"{repo} is gated: accept its terms on its hub page, then {token}") from None
        if isinstance(e, RepositoryNotFoundError):
            hint = "check the name, or" if self._has_token() else "check the name; if it is private,"
            raise ModelError(f"repository {repo} not found on the hub ({hint} {token})") from None
        if isinstance(e, RevisionNotFoundError):
            raise ModelError(f"{repo} has no revision {revision!r}") from None
        status = e.response.status_code if isinstance(e, HfHubHTTPError) and e.response is not None else None
        if status in (401, 403):
            raise ModelError(f"{repo}: the hub refused access (HTTP {status}); {token}") from None

    def _from_cache(self, repo: str, quant: str, hf_file: str | None, why: str, advice: str) -> Path:
        files = list(cached(repo))
        if not files:
            raise ModelError(f"{repo} is not in the cache ({', '.join(map(str, cache_dirs()))}) and {why}: {advice}")
        try:
            parts = choose([c.file for c in files], repo, quant, hf_file)
        except ModelError as e:
            raise ModelError(f"{e}, in the cache; and {why}: {advice}") from None
        self.notice(f"{why}: using the cached {repo}/{parts[0].path} ({files[0].commit[:12]})")
        by_path = {c.file.path: c.path for c in files}
        return by_path[parts[0].path]

    def _has_token(self) -> bool:
        if self.token:
            return True
        from huggingface_hub import get_token
        return get_token() is not None

    def _bar(self, what: str, total: int | None):
        """A tqdm-shaped class that huggingface_hub's http_get drives, reporting to `progress`."""
        progress = self.progress

        class Bar:
            def __init__(self, *args, initial: int = 0, **kwargs):
                self.done = initial

            def update(self, n: int) -> None:
                self.done += n
                if progress:
                    progress(self.done, total or 0, what)

            def close(self) -> None:
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                pass

        return Bar


def _endpoint_from_llama_cpp() -> None:
    """llama.cpp reads MODEL_ENDPOINT before HF_ENDPOINT; huggingface_hub reads HF_ENDPOINT only,
    once, when imported: so MODEL_ENDPOINT becomes HF_ENDPOINT before that, where not set."""
    if os.environ.get("MODEL_ENDPOINT") and not os.environ.get("HF_ENDPOINT"):
        os.environ["HF_ENDPOINT"] = os.environ["MODEL_ENDPOINT"].rstrip("/")


class _Unreachable(Exception):
    """The hub did not answer (refused, timed out, 5xx)."""


def _is_network_error(e: BaseException) -> bool:
    """httpx's transport errors (huggingface_hub's HTTP client) and the OS's."""
    return isinstance(e, (OSError, TimeoutError)) or any(
        cls.__name__ in ("TransportError", "TimeoutException", "NetworkError", "ProtocolError")
        for cls in type(e).__mro__)


def _digest(path: Path, sha256: bool) -> str:
    """sha256 of the file, or its git blob id (sha1 of "blob SIZE\\0" + content)."""
    digest = hashlib.sha256() if sha256 else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_space(where: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    if needed > free:
        raise ModelError(f"not enough disk space for {what}: {_mb(needed)} needed in {where}, {_mb(free)} free")


def _mb(size: int | None) -> str:
    return "size unknown" if size is None else f"{size / 1e6:,.1f} MB"
