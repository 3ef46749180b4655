"""A fake Hugging Face hub on loopback, for download tests that must not reach huggingface.co.

    with FakeHub() as hub:
        sha = hub.add_repo("user/repo", {"model.gguf": b"GGUF...", "README.md": b"hi"})
        hf_hub_download("user/repo", "model.gguf", endpoint=hub.url, cache_dir=tmp)

It answers what huggingface.co answers for the calls huggingface_hub 2.4.0 makes (model_info,
list_repo_tree, list_repo_refs, HEAD/GET /resolve) and for the two API calls llama.cpp's own
downloader makes (GET /api/models/{repo}/refs, then /tree/{commit}?recursive=true; llama.cpp
reads MODEL_ENDPOINT before HF_ENDPOINT, see `env`).  Stdlib only.

Two listeners on 127.0.0.1, like the real hub and its CDN: `url` (the hub) and `cdn_url` (LFS
content).  The CDN must be another origin: huggingface_hub 2.4.0 follows a HEAD /resolve
redirect (Location resolved with urljoin, so relative ones too) only while it stays on the same
origin; the real 302 points at another host, so it stops there and reads X-Repo-Commit and
X-Linked-* from the 302 itself, then GETs the Location without the Authorization header.  A
same-origin /cdn path would be followed and lose X-Repo-Commit.  Git (non-LFS) files of public
repos get what huggingface.co gives them: a *relative* 307 to /api/resolve-cache/... (followed).

Storage rule: files named *.gguf and files over LFS_THRESHOLD bytes are LFS files (blob id =
sha1 of the pointer, content addressed by sha256); the rest are git files (blob id = git sha1).
No X-Xet-* headers or xet Link entries are ever sent, so clients use plain HTTP.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_THRESHOLD = 1024  # bytes; the real hub's git limit is 10 MB, kept small so tests stay small


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


class File(NamedTuple):
    path: str
    content: bytes
    oid: str  # git blob id (of the pointer file, for LFS files): the ETag /resolve sends
    sha256: str | None  # set for LFS files only
    pointer_size: int

    @classmethod
    def make(cls, path: str, content: bytes) -> File:
        if path.endswith(".gguf") or len(content) > LFS_THRESHOLD:
            sha = hashlib.sha256(content).hexdigest()
            pointer = lfs_pointer(sha, len(content))
            return cls(path, content, git_blob_sha1(pointer), sha, len(pointer))
        return cls(path, content, git_blob_sha1(content), None, 0)


class Request(NamedTuple):
    method: str
    path: str  # including the query string
    headers: dict  # lower-cased names
    server: str  # "hub" or "cdn"


class FakeHub:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.repos: dict[str, dict] = {}
        self.connections = 0  # TCP connections accepted, on both listeners
        self.requests: list[Request] = []
        self._cut: tuple[int, int] | None = None  # (nbytes, times)
        self._corrupt: set[str] = set()  # oids (sha256 or git sha1) served with a flipped byte
        self._fail: int | None = None
        self._servers = [_Server(self, "hub"), _Server(self, "cdn")]
        self.url, self.cdn_url = (f"http://127.0.0.1:{s.server_address[1]}" for s in self._servers)

    # -- life cycle ----------------------------------------------------------------------
    def __enter__(self) -> FakeHub:
        for s in self._servers:
            threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for s in self._servers:
            s.shutdown()
            s.server_close()

    @property
    def env(self) -> dict[str, str]:
        """Environment for a subprocess (huggingface_hub reads HF_ENDPOINT at import time)."""
        return {"HF_ENDPOINT": self.url, "MODEL_ENDPOINT": self.url + "/"}

    # -- content ---------------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: dict[str, bytes], *, gated: bool | str = False,
                 private: bool = False, token: str | None = None) -> str:
        """Add a repo, or a new commit to it (its tree is exactly `files`); main points at it."""
        with self._lock:
            repo = self.repos.setdefault(repo_id, {"commits": {}, "main": None})
            tree = {p: File.make(p, c) for p, c in sorted(files.items())}
            seed = f"{repo_id}\0{repo['main']}\0" + "".join(f"{p}\0{f.oid}\0" for p, f in tree.items())
            sha = hashlib.sha1(seed.encode()).hexdigest()
            date = f"2024-01-01T00:{len(repo['commits']) % 60:02d}:00.000Z"
            repo["commits"][sha] = {"files": tree, "date": date}
            repo.update(main=sha, private=private, token=token,
                        gated="auto" if gated is True else gated,
                        _id=hashlib.md5(repo_id.encode()).hexdigest()[:24])
            return sha

    def cut_next(self, nbytes: int, times: int = 1) -> None:
        """The next `times` CDN GETs send full headers, then close the connection after nbytes of body."""
        self._cut = (nbytes, times)

    def corrupt(self, repo_id: str, path: str) -> None:
        """Serve that file's content with one byte flipped; metadata still describes the original."""
        f = self.repos[repo_id]["commits"][self.repos[repo_id]["main"]]["files"][path]
        self._corrupt.add(f.sha256 or f.oid)  # by content: another repo with the same bytes too

    def fail_all(self, status: int | None) -> None:
        """Answer every request with `status` (e.g. 500, 503); None to recover."""
        self._fail = status

    def _content(self, oid: str) -> bytes | None:
        """The bytes served for a content id; corrupted ones have their last byte flipped."""
        with self._lock:
            files = [f for r in self.repos.values() for c in r["commits"].values() for f in c["files"].values()]
        for f in files:
            if oid in (f.sha256, f.oid):
                if oid not in self._corrupt or not f.content:
                    return f.content
                return f.content[:-1] + bytes([f.content[-1] ^ 0xFF])
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: FakeHub, role: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hub, self.role = hub, role

    def get_request(self):
        conn = super().get_request()
        with self.hub._lock:
            self.hub.connections += 1
        return conn


API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(tree|revision|refs)(?:/([^/]+)(?:/(.*))?)?)?$")
RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
RESOLVE_CACHE = re.compile(r"^/api/resolve-cache/models/([^/]+/[^/]+)/([0-9a-f]{40})/(.+)$")
RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as clients pool connections
    timeout = 30

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._handle(head=False)

    def do_HEAD(self) -> None:
        self._handle(head=True)

    def _handle(self, head: bool) -> None:
        hub: FakeHub = self.server.hub
        self.head = head
        with hub._lock:
            hub.requests.append(Request(self.command, self.path,
                                        {k.lower(): v for k, v in self.headers.items()}, self.server.role))
        url = urlsplit(self.path)
        self.query = parse_qs(url.query)
        try:
            if hub._fail is not None:
                raise HubError(hub._fail, None, "Internal Error - We're working hard to fix this as soon as possible!")
            if self.server.role == "cdn":
                return self._cdn(url.path)
            if m := RESOLVE.match(url.path):
                return self._resolve(*map(unquote, m.groups()))
            if m := RESOLVE_CACHE.match(url.path):
                return self._resolve(*map(unquote, m.groups()), cached=True)
            if (m := API.match(url.path)) and not head:
                return self._api(*(unquote(g) if g else g for g in m.groups()))
            raise HubError(404, None, "Sorry, we can't find the page you are looking for.")
        except HubError as e:
            headers = {"X-Error-Message": e.message, "Content-Type": "application/json; charset=utf-8"}
            if e.code:
                headers["X-Error-Code"] = e.code
            if e.commit:  # EntryNotFound carries it; huggingface_hub caches a .no_exist entry with it
                headers["X-Repo-Commit"] = e.commit
            self._send(e.status, headers, json.dumps({"error": e.message}).encode())

    # -- plumbing ----------------------------------------------------------------------------
    def _send(self, status: int, headers: dict, body: bytes = b"", cut: int | None = None) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body)))  # the whole body, even when cut
        self.end_headers()
        if not self.head:
            self.wfile.write(body if cut is None else body[:cut])
            if cut is not None:  # headers promised more: the client sees a connection cut mid-body
                self.wfile.flush()
                self.close_connection = True

    def _send_json(self, data) -> None:
        self._send(200, {"Content-Type": "application/json; charset=utf-8"}, json.dumps(data).encode())

    def _send_content(self, data: bytes, headers: dict, cut: int | None = None) -> None:
        """200, or 206 for `Range: bytes=N-[M]`, or 416 for a range starting past the end."""
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream", **headers}
        m = RANGE.match(self.headers.get("Range", "").replace(" ", ""))
        if not m or m.groups() == ("", ""):
            return self._send(200, headers, data, cut=cut)
        start, end = m.groups()
        if start == "":  # suffix range: the last N bytes
            start, end = max(len(data) - int(end), 0), len(data) - 1
        start, end = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
        if start >= len(data) or start > end:
            return self._send(416, {"Content-Range": f"bytes */{len(data)}"})
        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        self._send(206, headers, data[start:end + 1], cut=cut)

    def _bearer(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[7:] if auth.startswith("Bearer ") else None

    def _repo(self, repo_id: str, files: bool) -> dict:
        """The repo, or the error the real hub gives; `files`: a file download (gating applies)."""
        repo, token = self.server.hub.repos.get(repo_id), self._bearer()
        if repo is None or (repo["private"] and token != repo["token"]):
            # The hub hides whether the repo exists: 401 to anonymous callers, 404 with a token.
            raise HubError(404 if token else 401, "RepoNotFound", "Repository not found")
        if files and repo["gated"] and token != repo["token"]:
            # Metadata and file list of a gated repo are public; its files are not.
            if token is None:
                raise HubError(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have"
                               " access to it and be authenticated to access it. Please log in.")
            raise HubError(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in"
                           f" the authorized list. Visit https://huggingface.co/{repo_id} to ask for access.")
        return repo

    def _commit(self, repo: dict, revision: str) -> str:
        sha = repo["main"] if revision == "main" else revision
        if sha not in repo["commits"]:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha

    # -- endpoints -------------------------------------------------------------------------
    def _api(self, repo_id: str, kind: str | None, revision: str | None, path: str | None) -> None:
        repo = self._repo(repo_id, files=False)
        if kind == "refs":
            refs = {"branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": repo["main"]}],
                    "tags": [], "converts": []}
            if self.query.get("include_prs"):
                refs["pullRequests"] = []
            return self._send_json(refs)
        sha = self._commit(repo, revision or "main")
        commit = repo["commits"][sha]
        if kind == "tree":
            return self._send_json(self._tree(commit, sha, path or ""))
        siblings = []
        for f in commit["files"].values():
            sib = {"rfilename": f.path}
            if self._flag("blobs"):  # files_metadata=True
                sib.update(blobId=f.oid, size=len(f.content))
                if f.sha256:
                    sib["lfs"] = {"sha256": f.sha256, "size": len(f.content), "pointerSize": f.pointer_size}
            siblings.append(sib)
        info = {"_id": repo["_id"], "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
                "sha": sha, "lastModified": commit["date"], "createdAt": "2024-01-01T00:00:00.000Z",
                "private": repo["private"], "gated": repo["gated"], "disabled": False, "downloads": 0,
                "likes": 0, "tags": ["gguf", "region:us"], "library_name": "gguf", "siblings": siblings,
                "spaces": [], "usedStorage": sum(len(f.content) for f in commit["files"].values())}
        if self._flag("securityStatus"):
            info["securityRepoStatus"] = {"scansDone": True, "filesWithIssues": []}
        if expand := self.query.get("expand"):  # only the asked properties, plus _id and id
            info = {k: v for k, v in info.items() if k in ("_id", "id", *expand)}
        self._send_json(info)

    def _flag(self, name: str) -> bool:
        return self.query.get(name, ["false"])[-1].lower() in ("1", "true")

    def _tree(self, commit: dict, sha: str, base: str) -> list:
        """One page (no Link header, so no pagination): directories and files under `base`, by path."""
        base = base.strip("/")
        prefix = base + "/" if base else ""
        paths = [p for p in commit["files"] if p.startswith(prefix)]
        if base and not paths:
            raise HubError(404, "EntryNotFound", f"{base} does not exist on \"{sha}\"", sha)
        recursive, expand = self._flag("recursive"), self._flag("expand")
        entries: dict[str, dict] = {}
        for p in paths:
            parts = p[len(prefix):].split("/")
            for i in range(1, len(parts) if recursive else min(len(parts), 2)):
                d = prefix + "/".join(parts[:i])
                entries[d] = {"type": "directory", "oid": hashlib.sha1(f"{sha}:{d}".encode()).hexdigest(),
                              "size": 0, "path": d}
            if recursive or len(parts) == 1:
                f = commit["files"][p]
                entries[p] = {"type": "file", "oid": f.oid, "size": len(f.content), "path": p}
                if f.sha256:
                    entries[p]["lfs"] = {"oid": f.sha256, "size": len(f.content), "pointerSize": f.pointer_size}
        if expand:
            for e in entries.values():
                e["lastCommit"] = {"id": sha, "title": "Upload", "date": commit["date"]}
                if e["type"] == "file":
                    e["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False},
                                               "pickleImportScan": None}
        return [entries[k] for k in sorted(entries)]

    def _resolve(self, repo_id: str, revision: str, path: str, cached: bool = False) -> None:
        repo = self._repo(repo_id, files=True)
        sha = self._commit(repo, revision)
        f = repo["commits"][sha]["files"].get(path)
        if f is None:
            raise HubError(404, "EntryNotFound", "Entry not found", sha)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{f.oid}"'}
        if f.sha256 is None and not (cached or repo["private"] or repo["gated"] or not f.content):
            # Git files of public repos: a *relative* 307 to a commit-pinned, cacheable URL on the
            # same host (huggingface_hub's HEAD follows it; 0-byte, private, gated: served here).
            location = (f"/api/resolve-cache/models/{repo_id}/{sha}/{quote(path)}?"
                        + quote(f"/{repo_id}/resolve/{revision}/{path}", safe="") + f"=&etag=%22{f.oid}%22")
            return self._send(307, {"X-Repo-Commit": sha, "Location": location,
                                    "Content-Type": "text/plain; charset=utf-8"},
                              f"Temporary Redirect. Redirecting to {location}".encode())
        if f.sha256 is None:
            return self._send_content(self.server.hub._content(f.oid), headers)
        # LFS: an absolute 302 to the CDN (a signed URL on another host, in reality). X-Linked-*
        # describe the real file; ETag is the pointer's blob id; the body is the redirect text.
        name = quote(path.rsplit("/", 1)[-1])
        location = (f"{self.server.hub.cdn_url}/repos/{f.sha256}?response-content-disposition="
                    + quote(f"attachment; filename*=UTF-8''{name}; filename=\"{name}\";"))
        self._send(302, {**headers, "Location": location, "X-Linked-Etag": f'"{f.sha256}"',
                         "X-Linked-Size": len(f.content), "Content-Type": "text/plain; charset=utf-8"},
                   f"Found. Redirecting to {location}".encode())

    def _cdn(self, path: str) -> None:
        m = re.match(r"^/repos/([0-9a-f]{64})$", path)
        data = self.server.hub._content(m.group(1)) if m else None
        if data is None:
            raise HubError(404, None, "Not Found")
        headers = {"ETag": f'"{m.group(1)}"'}
        if disposition := self.query.get("response-content-disposition"):
            headers["Content-Disposition"] = disposition[0]
        cut, hub = None, self.server.hub
        with hub._lock:
            if hub._cut and not self.head:
                cut, times = hub._cut
                hub._cut = (cut, times - 1) if times > 1 else None
        self._send_content(data, headers, cut)
