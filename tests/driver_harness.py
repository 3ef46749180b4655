"""llama.cpp's own speculative drivers, built from the pinned sdist and run: tests/spec_driver_harness.cpp.

build_driver_harness compiles the harness against the sdist's headers and links it to the
installed wheel's libllama-common (common/speculative.cpp: common_speculative_init, _process,
_begin, _draft, _accept) and libllama; run_driver_harness runs it on a target and a draft GGUF
and returns each step's {"step", "draft", "accepted", "next"}, so a test can hold speculate's
ports of those drivers to llama.cpp's drafts. Also the C++ build helpers the n-gram harnesses
of tests/test_ngram_llama.py use.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

import pytest

from tests.conftest import vendored_tree

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "spec_driver_harness.cpp"
# what the harness includes of the pinned llama.cpp: common.h, speculative.h and log.h, with llama.h's and ggml's
HEADERS = ("include", "ggml/include", "common/common.h", "common/speculative.h", "common/log.h")


def compile_cxx(*args: str | Path) -> None:
    # $CXX, else what built llama-cpp-python here (CMake finds c++, g++ or clang++)
    compiler = next(filter(None, map(shutil.which, [os.environ.get("CXX") or "g++", "c++", "clang++"])), None)
    if compiler is None:
        pytest.fail("no C++ compiler (g++, or $CXX): install one (apt-get install g++) to build the llama.cpp "
                    "cross-check")
    proc = subprocess.run([compiler, "-std=c++17", "-O1", *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"building a llama.cpp harness failed:\n{proc.stderr[-4000:]}")


def wheel_libs() -> Path:
    """The installed llama-cpp-python's lib/ (beside llama_cpp/ in site-packages), with libllama-common."""
    spec = importlib.util.find_spec("llama_cpp")
    libs = Path(spec.origin).resolve().parent.parent / "lib" if spec and spec.origin else None
    if libs is None or not (libs / "libllama-common.so").is_file():
        pytest.fail(f"no libllama-common.so in {libs}: the installed llama-cpp-python lacks it (the 0.3.36 build "
                    "scripts/test.sh installs has it)")
    return libs


def build_driver_harness(tmp_dir: Path) -> Path:
    """tests/spec_driver_harness.cpp built in `tmp_dir` with the sdist's headers, linked against
    the wheel's libllama-common and libllama (an RPATH to the wheel's lib/); the executable's path."""
    src = vendored_tree(Path(tmp_dir) / "llama-cpp", *HEADERS)
    libs, out = wheel_libs(), Path(tmp_dir) / "spec_driver_harness"
    compile_cxx(*(f"-I{src / d}" for d in ("common", "include", "ggml/include")), SOURCE,
                f"-L{libs}", "-lllama-common", "-lllama",
                f"-Wl,--disable-new-dtags,-rpath,{libs}", "-o", out)  # an RPATH: libllama-common finds libllama too
    return out


def run_driver_harness(harness: Path, spec_type: str, target: Path, draft: Path | str | None, n_max: int,
                       n_steps: int, tokens: Sequence[int], timeout: float = 300) -> list[dict]:
    """llama.cpp's `spec_type` driver (its name: draft-eagle3, ...) drafting for `target` from
    `draft` (None or "-": no draft model, e.g. draft-mtp on a target with its MTP head) after the
    prompt `tokens` (BOS included), greedy, for n_steps steps of at most n_max drafted tokens:
    one {"step", "draft", "accepted", "next"} per step. The first generated token (the target's
    argmax after the prompt) is step 0's last token, not reported. A failure of the harness fails
    the test with its stderr."""
    args = [str(harness), spec_type, str(target), "-" if draft is None else str(draft), str(n_max), str(n_steps),
            *map(str, tokens)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args[:6])} ...: exit status {proc.returncode}\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines()]


def harness_drafts(harness: Path, spec_type: str, target: Path, draft: Path | None, n_max: int,
                   prompt: Sequence[int], n_steps: int = 24) -> dict[int, list[int]]:
    """llama.cpp's drafts (run_driver_harness) by the length of the context each follows: its
    first after the prompt and its first generated token, then after each step's tokens."""
    drafts, n = {}, len(prompt) + 1
    for step in run_driver_harness(harness, spec_type, target, draft, n_max, n_steps, prompt):
        drafts[n] = step["draft"]
        n += step["accepted"] + 1
    return drafts


def record_drafts(monkeypatch, drafter: type) -> dict[int, list[int]]:
    """From now on, what `drafter` drafts (its proposing, as the loop asks), by the length of the
    context it follows."""
    drafts: dict[int, list[int]] = {}
    proposing = drafter.proposing

    def recorded(self, context, k):
        draft = yield from proposing(self, context, k)
        drafts[len(context)] = draft.tokens
        return draft

    monkeypatch.setattr(drafter, "proposing", recorded)
    return drafts
