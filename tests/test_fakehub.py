"""The fake hub (tests/fakehub.py) checked against huggingface_hub itself, in-process.

Every call passes endpoint= explicitly (huggingface_hub reads HF_ENDPOINT once, at import) and
token= explicitly (token=None would pick up HF_TOKEN or a saved login from the machine).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import time
import urllib.request

import httpx2
import pytest
from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get

from tests.fakehub import FakeHub, git_blob_sha1, lfs_pointer

GGUF = b"GGUF" + bytes(range(256)) * 20  # 5124 bytes, LFS by name
README = b"# tiny\n"  # a regular git file
SHA256 = hashlib.sha256(GGUF).hexdigest()


@pytest.fixture(autouse=True)
def online(monkeypatch):
    """HF_HUB_OFFLINE is read once, at import: an offline shell must not turn these tests off."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub():
    with FakeHub() as hub:
        yield hub


@pytest.fixture
def repo(hub):
    return hub.add_repo("user/repo", {"model.gguf": GGUF, "README.md": README, "sub/q4.gguf": GGUF[:2000]})


@pytest.fixture
def sleeps(monkeypatch):
    """Record huggingface_hub's back-off sleeps instead of sleeping them."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    return slept


def download(hub, tmp_path, filename="model.gguf", repo_id="user/repo", **kw):
    kw.setdefault("token", False)
    return hf_hub_download(repo_id, filename, endpoint=hub.url, cache_dir=tmp_path, **kw)


def cdn_gets(hub):
    return [r for r in hub.requests if r.server == "cdn" and r.method == "GET"]


# -- metadata ---------------------------------------------------------------------------------

def test_model_info_files_metadata(hub, repo):
    info = HfApi(endpoint=hub.url).model_info("user/repo", files_metadata=True, token=False)
    assert info.sha == repo and info.id == "user/repo" and info.library_name == "gguf"
    assert info.gated is False and info.private is False
    files = {s.rfilename: s for s in info.siblings}
    assert sorted(files) == ["README.md", "model.gguf", "sub/q4.gguf"]
    assert files["model.gguf"].size == len(GGUF)
    assert files["model.gguf"].lfs.sha256 == SHA256
    assert files["model.gguf"].lfs.pointer_size == len(lfs_pointer(SHA256, len(GGUF)))
    assert files["model.gguf"].blob_id == git_blob_sha1(lfs_pointer(SHA256, len(GGUF)))
    assert files["README.md"].lfs is None and files["README.md"].blob_id == git_blob_sha1(README)
    assert "blobs=true" in hub.requests[-1].path


def test_new_commit_moves_main_and_old_sha_stays(hub, repo):
    api = HfApi(endpoint=hub.url)
    second = hub.add_repo("user/repo", {"model.gguf": GGUF + b"v2"})
    assert len(second) == 40 and second != repo
    assert api.model_info("user/repo", token=False).sha == second
    assert api.model_info("user/repo", revision="main", token=False).sha == second
    old = api.model_info("user/repo", revision=repo, token=False)
    assert old.sha == repo and len(old.siblings) == 3
    assert hub.requests[-1].path == f"/api/models/user/repo/revision/{repo}"


def test_list_repo_tree(hub, repo):
    api = HfApi(endpoint=hub.url)
    tree = {e.path: e for e in api.list_repo_tree("user/repo", recursive=True, token=False)}
    assert sorted(tree) == ["README.md", "model.gguf", "sub", "sub/q4.gguf"]
    assert tree["model.gguf"].lfs.sha256 == SHA256 and tree["model.gguf"].size == len(GGUF)
    assert tree["sub/q4.gguf"].lfs.sha256 == hashlib.sha256(GGUF[:2000]).hexdigest()
    assert tree["README.md"].lfs is None and tree["README.md"].blob_id == git_blob_sha1(README)
    assert type(tree["sub"]).__name__ == "RepoFolder"
    top = [e.path for e in api.list_repo_tree("user/repo", token=False)]
    assert top == ["README.md", "model.gguf", "sub"]
    assert [e.path for e in api.list_repo_tree("user/repo", "sub", token=False)] == ["sub/q4.gguf"]
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree("user/repo", "nope", token=False))


def test_llama_cpp_calls(hub, repo):
    """The two API calls llama.cpp's downloader (common/hf-cache.cpp) makes, and its HEAD."""
    def get(path):
        req = urllib.request.Request(hub.url + path, headers={"Accept": "application/json"})
        with urllib.request.urlopen(req) as r:
            return json.load(r)

    refs = get("/api/models/user/repo/refs")
    assert refs == {"branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": repo}],
                    "tags": [], "converts": []}
    tree = {e["path"]: e for e in get(f"/api/models/user/repo/tree/{repo}?recursive=true")}
    assert tree["sub/q4.gguf"]["type"] == "file" and tree["sub"]["type"] == "directory"
    assert tree["model.gguf"]["lfs"]["oid"] == SHA256 and tree["README.md"]["oid"] == git_blob_sha1(README)
    # llama.cpp HEADs the resolve URL following redirects, and reads the final answer.
    head = httpx2.head(f"{hub.url}/user/repo/resolve/{repo}/model.gguf", follow_redirects=True)
    assert head.status_code == 200 and head.url.port != httpx2.URL(hub.url).port
    assert int(head.headers["Content-Length"]) == len(GGUF) and head.headers["Accept-Ranges"] == "bytes"


def test_resolve_headers_and_no_xet(hub, repo):
    lfs = httpx2.head(f"{hub.url}/user/repo/resolve/main/model.gguf")
    assert lfs.status_code == 302 and lfs.headers["Location"].startswith(hub.cdn_url + "/repos/" + SHA256)
    assert lfs.headers["X-Repo-Commit"] == repo and lfs.headers["X-Linked-Etag"] == f'"{SHA256}"'
    assert lfs.headers["X-Linked-Size"] == str(len(GGUF))
    assert lfs.headers["ETag"] == f'"{git_blob_sha1(lfs_pointer(SHA256, len(GGUF)))}"'
    # A git file of a public repo: a relative 307 to a commit-pinned URL, then the file itself.
    hop = httpx2.head(f"{hub.url}/user/repo/resolve/main/README.md")
    assert hop.status_code == 307 and hop.headers["X-Repo-Commit"] == repo
    assert hop.headers["Location"].startswith(f"/api/resolve-cache/models/user/repo/{repo}/README.md?")
    plain = httpx2.get(f"{hub.url}/user/repo/resolve/main/README.md", follow_redirects=True)
    assert plain.status_code == 200 and plain.content == README
    assert plain.headers["ETag"] == f'"{git_blob_sha1(README)}"' and plain.headers["X-Repo-Commit"] == repo
    for r in (lfs, hop, plain):
        assert not [h for h in r.headers if h.lower().startswith("x-xet")] and "link" not in r.headers


# -- downloads -------------------------------------------------------------------------------

def test_hf_hub_download_lfs_file_into_cache_layout(hub, repo, tmp_path):
    path = download(hub, tmp_path)
    storage = tmp_path / "models--user--repo"
    assert path == str(storage / "snapshots" / repo / "model.gguf")
    assert os.path.islink(path) and os.path.realpath(path) == str(storage / "blobs" / SHA256)
    assert open(path, "rb").read() == GGUF
    assert (storage / "refs" / "main").read_text() == repo
    # One HEAD on the hub (not following the 302), then the GET straight to the CDN's Location.
    assert [(r.method, r.server) for r in hub.requests] == [("HEAD", "hub"), ("GET", "cdn")]


def test_hf_hub_download_regular_file(hub, repo, tmp_path):
    path = download(hub, tmp_path, "README.md")
    storage = tmp_path / "models--user--repo"
    assert os.path.realpath(path) == str(storage / "blobs" / git_blob_sha1(README))
    assert open(path, "rb").read() == README and (storage / "refs" / "main").read_text() == repo
    # HEAD follows the same-host 307; the GET goes to where the HEAD ended.
    assert [(r.method, r.path.split("?")[0]) for r in hub.requests] == [
        ("HEAD", "/user/repo/resolve/main/README.md"),
        ("HEAD", f"/api/resolve-cache/models/user/repo/{repo}/README.md"),
        ("GET", f"/api/resolve-cache/models/user/repo/{repo}/README.md")]
    nested = download(hub, tmp_path, "sub/q4.gguf")
    assert nested == str(storage / "snapshots" / repo / "sub" / "q4.gguf")


def test_http_get_resumes_with_range(hub, repo):
    url = f"{hub.cdn_url}/repos/{SHA256}"
    out = io.BytesIO(GGUF[:1000])
    out.seek(1000)
    http_get(url, out, resume_size=1000, headers={"X-Test": "1"}, expected_size=len(GGUF))
    assert out.getvalue() == GGUF
    assert hub.requests[-1].headers["range"] == "bytes=1000-" and hub.requests[-1].headers["x-test"] == "1"
    r = httpx2.get(url, headers={"Range": "bytes=1000-"})
    assert r.status_code == 206 and r.headers["Content-Range"] == f"bytes 1000-{len(GGUF) - 1}/{len(GGUF)}"
    r = httpx2.get(url, headers={"Range": f"bytes={len(GGUF)}-"})
    assert r.status_code == 416 and r.headers["Content-Range"] == f"bytes */{len(GGUF)}"


def test_cut_connection_is_seen_by_a_plain_get(hub, repo):
    url = f"{hub.cdn_url}/repos/{SHA256}"
    hub.cut_next(1000)
    with pytest.raises(httpx2.RemoteProtocolError, match="received 1000 bytes, expected 5124"):
        httpx2.get(url)
    assert httpx2.get(url).content == GGUF  # once only


def test_http_get_after_a_cut_restarts_below_one_chunk(hub, repo, sleeps):
    """Bytes are only counted in whole DOWNLOAD_CHUNK_SIZE (10 MiB) chunks: a cut file smaller than
    that is fetched again from byte 0, without a Range."""
    hub.cut_next(1000)
    out = io.BytesIO()
    http_get(f"{hub.cdn_url}/repos/{SHA256}", out, expected_size=len(GGUF))
    assert out.getvalue() == GGUF and sleeps == [1]
    assert [r.headers.get("range") for r in cdn_gets(hub)] == [None, None]


def test_http_get_after_a_cut_resumes_from_last_whole_chunk(hub, repo, sleeps, monkeypatch):
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 256)
    hub.cut_next(1000)
    out = io.BytesIO()
    http_get(f"{hub.cdn_url}/repos/{SHA256}", out, expected_size=len(GGUF))
    assert out.getvalue() == GGUF and sleeps == [1]
    assert [r.headers.get("range") for r in cdn_gets(hub)] == [None, "bytes=768-"]


def test_hf_hub_download_survives_a_cut_but_not_six(hub, repo, tmp_path, sleeps):
    hub.cut_next(1000)
    assert open(download(hub, tmp_path), "rb").read() == GGUF
    assert len(cdn_gets(hub)) == 2
    hub.cut_next(10, times=6)
    with pytest.raises(httpx2.RemoteProtocolError):
        download(hub, tmp_path / "again")
    assert len(cdn_gets(hub)) == 2 + 6 and sleeps == [1] * 6
    assert not list((tmp_path / "again").rglob("*.incomplete"))


def test_corrupt_content_is_stored_by_hf_hub_download_without_complaint(hub, repo, tmp_path):
    hub.corrupt("user/repo", "model.gguf")
    info = HfApi(endpoint=hub.url).model_info("user/repo", files_metadata=True, token=False)
    assert {s.rfilename: s.lfs for s in info.siblings}["model.gguf"].sha256 == SHA256
    path = download(hub, tmp_path)  # huggingface_hub checks the size, not the sha256
    data = open(path, "rb").read()
    assert len(data) == len(GGUF) and data != GGUF and os.path.basename(os.path.realpath(path)) == SHA256
    assert hashlib.sha256(data).hexdigest() != SHA256


# -- errors, auth, connections --------------------------------------------------------------

def test_unknown_and_private_repo(hub, repo, tmp_path):
    hub.add_repo("user/private", {"model.gguf": GGUF}, private=True, token="hf_owner")
    for repo_id, token, status in [("user/none", False, 401), ("user/none", "hf_x", 404),
                                   ("user/private", False, 401), ("user/private", "hf_x", 404)]:
        with pytest.raises(RepositoryNotFoundError) as e:
            download(hub, tmp_path, repo_id=repo_id, token=token)
        assert type(e.value) is RepositoryNotFoundError and e.value.response.status_code == status
        with pytest.raises(RepositoryNotFoundError):
            HfApi(endpoint=hub.url).model_info(repo_id, token=token)
    assert open(download(hub, tmp_path, repo_id="user/private", token="hf_owner"), "rb").read() == GGUF


def test_gated_repo(hub, tmp_path):
    hub.add_repo("user/gated", {"model.gguf": GGUF}, gated=True, token="hf_ok")
    assert HfApi(endpoint=hub.url).model_info("user/gated", token=False).gated == "auto"  # public metadata
    for token, status in [(False, 401), ("hf_wrong", 403)]:
        with pytest.raises(GatedRepoError) as e:
            download(hub, tmp_path, repo_id="user/gated", token=token)
        assert e.value.response.status_code == status
    assert open(download(hub, tmp_path, repo_id="user/gated", token="hf_ok"), "rb").read() == GGUF


def test_unknown_revision_and_file(hub, repo, tmp_path):
    with pytest.raises(RevisionNotFoundError):
        download(hub, tmp_path, revision="nope")
    with pytest.raises(RevisionNotFoundError):
        HfApi(endpoint=hub.url).model_info("user/repo", revision="nope", token=False)
    with pytest.raises(EntryNotFoundError) as e:
        download(hub, tmp_path, "missing.gguf")
    assert e.value.response.status_code == 404
    # huggingface_hub remembers the miss under .no_exist/<commit> (from X-Repo-Commit)
    assert (tmp_path / "models--user--repo" / ".no_exist" / repo / "missing.gguf").exists()


def test_authorization_header_reaches_the_hub_but_not_the_cdn(hub, tmp_path):
    hub.add_repo("user/private", {"model.gguf": GGUF, "README.md": README}, private=True, token="hf_owner")
    HfApi(endpoint=hub.url).model_info("user/private", token="hf_owner")
    download(hub, tmp_path, repo_id="user/private", token="hf_owner")
    download(hub, tmp_path, "README.md", repo_id="user/private", token="hf_owner")
    auth = [(r.method, r.server, r.headers.get("authorization")) for r in hub.requests]
    assert auth == [("GET", "hub", "Bearer hf_owner"), ("HEAD", "hub", "Bearer hf_owner"),
                    ("GET", "cdn", None), ("HEAD", "hub", "Bearer hf_owner"), ("GET", "hub", "Bearer hf_owner")]


def test_connections_are_counted(hub, repo, tmp_path, monkeypatch):
    assert hub.connections == 0
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read once at import: patch, not env
    with pytest.raises(LocalEntryNotFoundError):
        download(hub, tmp_path)
    with pytest.raises(OfflineModeIsEnabled):
        HfApi(endpoint=hub.url).model_info("user/repo", token=False)
    assert hub.connections == 0 and hub.requests == []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    download(hub, tmp_path)
    assert hub.connections >= 2  # the hub and the CDN are two origins


def test_hub_down(hub, repo, tmp_path, sleeps):
    hub.fail_all(503)
    with pytest.raises(HfHubHTTPError) as e:
        HfApi(endpoint=hub.url).model_info("user/repo", token=False)
    assert e.value.response.status_code == 503 and len(hub.requests) == 1 and sleeps == []
    # hf_hub_download: one HEAD without retries, then (no cached copy) six with back-off
    with pytest.raises(LocalEntryNotFoundError) as e:
        download(hub, tmp_path)
    assert isinstance(e.value.__cause__, HfHubHTTPError)
    assert len(hub.requests) == 1 + 7 and sleeps == [1, 2, 4, 8, 8]
    hub.fail_all(None)
    assert open(download(hub, tmp_path), "rb").read() == GGUF


def test_refused_connection(tmp_path, sleeps):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there
    with pytest.raises(httpx2.ConnectError):
        HfApi(endpoint=url).model_info("user/repo", token=False)
    with pytest.raises(LocalEntryNotFoundError) as e:
        hf_hub_download("user/repo", "model.gguf", endpoint=url, cache_dir=tmp_path, token=False)
    assert isinstance(e.value.__cause__, httpx2.ConnectError) and sleeps == [1, 2, 4, 8, 8]
