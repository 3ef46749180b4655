"""Shared fixtures. Real-model tests use the registry's models from the local cache
(pulled on first use, as `speculate` itself would) and run the installed CLI."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from speculative.models.registry import Registry

# llama.cpp's x86 tiled matmul (8+ rows) scores positions in a batch differently from
# alone; off, the CPU build of scripts/test.sh is batch-invariant (see docs/exactness-and-builds.md). Set
# before anything loads llama.cpp, and inherited by every `speculate` the tests run.
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

# The pinned llama-cpp-python's source distribution, which scripts/test.sh keeps: the llama.cpp
# it vendors is what some tests hold our work against (its n-gram cache code, llama.vim).
SDIST = Path(__file__).resolve().parent.parent / ".cache" / "sdist" / "llama_cpp_python-0.3.36.tar.gz"
FETCH_SDIST = ("python -m pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d .cache/sdist "
               "(scripts/test.sh does it)")


def vendored(path: str) -> bytes:
    """A file of the pinned llama.cpp (`vendor/llama.cpp/PATH` in the sdist)."""
    if not SDIST.is_file():
        pytest.fail(f"{SDIST} is missing: run {FETCH_SDIST}")
    with tarfile.open(SDIST) as tar:
        return tar.extractfile(f"llama_cpp_python-0.3.36/vendor/llama.cpp/{path}").read()


def vendored_tree(dest: Path, *paths: str) -> Path:
    """Files and whole folders of the pinned llama.cpp copied under `dest` as they lie in
    `vendor/llama.cpp`, in one read of the sdist (vendored() reads it once per file: a second each)."""
    if not SDIST.is_file():
        pytest.fail(f"{SDIST} is missing: run {FETCH_SDIST}")
    root = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
    found: set[str] = set()
    with tarfile.open(SDIST) as tar:
        for member in tar:
            name = member.name[len(root):] if member.name.startswith(root) else None
            wanted = [p for p in paths if name == p or (name or "").startswith(p.rstrip("/") + "/")]
            if member.isfile() and wanted:
                found.update(wanted)
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                (dest / name).write_bytes(tar.extractfile(member).read())
    assert found == set(paths), f"not in {SDIST.name}: {sorted(set(paths) - found)}"
    return dest


SPECULATE = shutil.which("speculate") or str(Path(sys.executable).with_name("speculate"))
SMOL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-1.5b-instruct"
QWEN_DRAFT = "qwen2.5-coder-0.5b-instruct"


def speculate(*args: str, env: dict | None = None, input: bytes | None = None,
              timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the installed `speculate` command; stdout as bytes, stderr as text."""
    proc = subprocess.run([SPECULATE, *args], input=input, capture_output=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd)
    proc.stderr = proc.stderr.decode("utf-8", errors="replace")
    return proc


def speculate_here(*args: str, env: dict | None = None, input: bytes = b"") -> subprocess.CompletedProcess:
    """`speculate ARGS` run in this process through the console entry point, as speculate()
    runs it (`env` added to the environment, stdin `input`; stdout as bytes, stderr as text):
    for runs that load no model, where starting a process would be most of the test's time.
    What the entry point changes (the signal handlers) and the environment are put back."""
    from speculative.cli.main import main

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    out, err = io.BytesIO(), io.StringIO()
    stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    stdin = io.TextIOWrapper(io.BytesIO(input), encoding="utf-8")
    saved = sys.argv, sys.stdin, dict(os.environ)
    sys.argv, sys.stdin, code = ["speculate", *args], stdin, 0
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code or 0
    finally:
        sys.argv, sys.stdin = saved[:2]
        os.environ.clear()
        os.environ.update(saved[2])
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    stdout.flush()
    return subprocess.CompletedProcess([SPECULATE, *args], code, out.getvalue(), err.getvalue())


def assert_refused(proc: subprocess.CompletedProcess, message: str) -> None:
    """A command line refused as every usage error is: exit 2, one line on stderr that says
    `message`, nothing on stdout."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculate: error: ") and message in lines[0], proc.stderr
    assert proc.stdout == b""


PROBE = Path(__file__).resolve().with_name("probe.py")


def probe_command(*args: str) -> list[str]:
    """`speculate ARGS` under tests/probe.py, whose probes (chosen by PROBE_* variables in the
    environment) report the moments a test waits for and hold the run there."""
    return [sys.executable, str(PROBE), *args]


def plant_costs(home: Path, cost) -> None:
    """Make the book of costs under `home` (SPECULATE_HOME, which a run has calibrated in) say that
    a pass of b tokens of the model of an entry's identity costs cost(identity, b) seconds, and
    nothing else, for every size a run may ask (whether or not the machine let the calibration be
    kept): what auto plans with then does not depend on this machine's load. Live passes go, and
    the prices of earlier runs, so that the next run prices what is planted."""
    path = home / "costs.json"
    book = json.loads(path.read_text())
    assert book["models"], "nothing calibrated under " + str(home)
    for entry in book["models"].values():
        one = cost(entry["identity"], 1)
        entry.update(seconds=[one] * 16, ratios={}, prices={},
                     calibrated={str(b): cost(entry["identity"], b) / one for b in range(2, 65)})
    path.write_text(json.dumps(book))


def speculate_json(*args: str, **kw) -> dict:
    proc = speculate(*args, "--json", **kw)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def model_path():
    """name -> path of a pulled registry model (pulling it if needed)."""
    registry = Registry.load()

    def get(name: str) -> Path:
        entry = registry.get(name)
        if not registry.is_pulled(entry):
            proc = speculate("models", "pull", name)
            assert proc.returncode == 0, proc.stderr
        return registry.locate(entry)

    return get


@pytest.fixture(scope="session")
def batch_invariant():
    """Identity tests need a llama.cpp build whose CPU kernels do not change with batch size."""
    from speculative.llamacpp.devices import batch_variant_kernels

    kernels = batch_variant_kernels()
    if kernels:
        pytest.fail(
            f"llama.cpp was built with batch-size dependent kernels ({', '.join(kernels)}); "
            "greedy identity tests can flip near-ties. Build it as scripts/test.sh does: "
            'CMAKE_ARGS="-DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=OFF", with GGML_CPU_TILED_MM=0'
        )


SLOT_PROMPTS = ["once upon a time there were a cat and a dog. once upon a time there were", "the dog and the cat",
                "once upon a time", "a cat, a dog, a cat, a dog,", "there were"]


def alone_and_together(tmp_path: Path, *args: str, slots: int = 3) -> dict[int, dict]:
    """`speculate batch` of SLOT_PROMPTS (greedy, 12 + 9 i tokens each) with ARGS, at -np 1 and at
    -np `slots` with KV streams of their own (so that cells sit where they sit alone): for each,
    request id -> (text, n_drafted, n_accept)."""
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "prompt": p, "n_predict": 12 + 9 * i}) + "\n"
                                for i, p in enumerate(SLOT_PROMPTS)))
    results = {}
    for n in (1, slots):
        out = tmp_path / f"np{n}.jsonl"
        proc = speculate("batch", str(requests), "-o", str(out), *args, "--temp", "0", "-t", "1",
                         "-c", str(512 * n), "-np", str(n), "--no-kv-unified")
        assert proc.returncode == 0, proc.stderr
        results[n] = {r["id"]: (r["text"], r["stats"]["n_drafted"], r["stats"]["n_accept"])
                      for r in map(json.loads, out.read_text().splitlines())}
    return results
