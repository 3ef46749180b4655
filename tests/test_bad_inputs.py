"""Bad input of every kind: one clear line, a documented exit code, nothing lost.

Hostile GGUF files: tests/test_gguf_preflight.py. Downloads: tests/test_pull.py.
Signals and pipes: tests/test_signals.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speculative.decoding.settings import ModelSpec
from speculative.engine.chat import conversation, render
from speculative.engine.text import TextStream
from speculative.errors import ModelError
from speculative.llamacpp.model import LlamaModel
from tests.conftest import SMOL, assert_refused, speculate, speculate_here, speculate_json
from tests.gguf_builder import write_tiny_llama

# -- chat templates -------------------------------------------------------------

QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, message", [
    ("{{ messages.__class__ }}", "refused by the sandbox: access to attribute '__class__'"),
    ("{{ messages|attr('__class__') }}", "refused by the sandbox: access to attribute '__class__'"),
    ("{{ cycler.__init__.__globals__.os.system('id') }}", "refused by the sandbox"),
    ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "refused by the sandbox"),
    ("{% set x = messages.append(1) %}", "refused by the sandbox"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took longer than"),
    ("{{ 'a' * 10**9 }}", "a repetition would make 1000000000 "),
    ("{{ ([1] * 100000) * 100000 }}", "a repetition would make"),
    ("{{ 10 ** (10 ** 10) }}", "too large a number"),
    ("{{ 'a'|center(10**10) }}", "an argument of 10000000000"),
    ("{{ 'a'.ljust(10**10) }}", "an argument of 10000000000"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "the output exceeds"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "MiB of memory"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{% for %}", "chat template failed"),
])
def test_hostile_chat_templates_stop_with_a_clear_error(template, message):
    """Each limit is met by the template made to meet it: only the endless loop is given a
    time limit it can reach (1 s), the others one far off (it stays a guard against a hang),
    so that a slow machine does not reach the time limit before the limit under test."""
    seconds = 1.0 if message == "took longer than" else 120.0
    t0 = time.monotonic()
    with pytest.raises(ModelError, match="chat template") as e:
        render(template, conversation("hi", None), seconds=seconds)
    assert re.search(message, str(e.value)) and "\n" not in str(e.value)
    assert time.monotonic() - t0 < seconds + 60  # a guard against a render the time limit did not stop


def test_bounded_rendering_still_renders_real_templates_and_long_conversations():
    long = "word " * 50_000
    out = render(QWEN_LIKE, conversation(long, "be brief"))
    assert out.startswith("<|im_start|>system\nbe brief<|im_end|>") and out.endswith("assistant\n")
    assert len(out) > len(long)


@pytest.mark.real
def test_a_model_with_a_hostile_template_exits_3(tmp_path):
    """End to end: the template comes from the GGUF file itself."""
    path = write_tiny_llama(tmp_path / "evil.gguf", chat_template="{{ cycler.__init__.__globals__ }}")
    proc = speculate("-m", str(path), "--chat", "-p", "hi", "-n", "1", timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "refused by the sandbox" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- command lines ----------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (("-p", "x", "--draft-min", "5", "--draft-max", "2"), "--draft-min (5) is larger than --draft-max (2)"),
    (("-p", "x", "--draft-p-min", "1.5"), "--draft-p-min must be in [0, 1]"),
    (("-p", "x", "--draft-p-min", "-0.1"), "--draft-p-min must be in [0, 1]"),
    (("-p", "x", "--draft-max", "0"), "--draft-max must be >= 1"),
    (("-p", "x", "-np", "0"), "draft branches (-np, --draft-branches) must be in [1, 16]"),
    (("-p", "x", "-np", "3"), "3 draft branches: draft trees come from a draft model"),
    (("-p", "x", "-np", "3", "--spec-type", "ngram-simple"), "3 draft branches: draft trees come from a draft model"),
    (("-p", "x", "--draft-p-split", "1.5"), "--draft-p-split must be in [0, 1]"),
    (("-p", "x", "--draft-min", "-1"), "--draft-min must be >= 0"),
    (("-p", "x", "-f", "file.txt"), "not both"),
    ((), "no prompt"),
    (("-f", "/nonexistent/prompt.txt"), "cannot read prompt file"),
    (("-f", "/"), "cannot read prompt file /: Is a directory"),
    (("-p", "x", "--spec-type", "eagle"), "unknown type eagle"),
    (("-p", "x", "--spec-type", "draft-dflash"), "--spec-type draft-dflash needs a DFlash drafter"),
    (("-p", "x", "--spec-type", "draft-eagle3"), "--spec-type draft-eagle3 needs an EAGLE-3 drafter"),
    (("-p", "x", "--spec-type", "ngram-simple,draft-dspark"), "--spec-type draft-dspark needs a DSpark drafter"),
    (("-p", "x", "--spec-type", ""), "unknown type (empty)"),
    (("-p", "x", "--sampling-seq", "kpq"), "unknown sampler letter 'q'"),
    (("-p", "x", "-c", "-5"), "-c/--ctx-size must be >= 0"),
    (("-p", "x", "-b", "0"), "-b/--batch-size must be >= 1"),
    (("-p", "x", "--temp", "-1"), "--temp must be >= 0"),
    (("-p", "x", "--top-k", "-1"), "--top-k must be >= 0"),
    (("-p", "x", "--top-p", "2"), "--top-p must be in [0, 1]"),
    (("-p", "x", "--min-p", "nan"), "--min-p must be in [0, 1]"),
    (("-p", "x", "-n", "-3"), "-n/--n-predict must be -1"),
    (("-p", "x", "--seed", "-5"), "--seed must be -1"),
    (("-p", "x", "--no-such-flag"), "No such option"),
    (("-p", "x", "-t", "0"), "-t/--threads must be >= 1"),
    (("-p", "x", "-ngl", "-2"), "-ngl/--n-gpu-layers must be -1"),
    (("-p", "x", "-fa", "maybe"), "-fa/--flash-attn: expected one of auto, on, off"),
    (("-p", "x", "--spec-ngram-size-n", "0"), "n-gram sizes must be in [1, 1024]"),
    (("-p", "x", "-n", "many"), "Invalid value for '-n'"),
])
def test_bad_command_lines_exit_2_with_one_line(args, message):
    assert_refused(speculate_here(*args), message)



@pytest.mark.parametrize("args", [("--help",), ("serve", "--help-all"), ("-p", "x", "--draft-p-min", "2"),
                                  ("models", "--help")])
def test_help_and_refused_command_lines_load_neither_llama_cpp_nor_numpy(args):
    """They answer at once: importing the engine (llama.cpp's bindings, numpy, gguf) waits for
    a command that runs a model, which is most of `speculate`'s start-up time."""
    script = ("import sys\nfrom speculative.cli.main import main\nsys.argv = ['speculate', *sys.argv[1:]]\ntry:\n    main()\n"
              "except SystemExit as e:\n    heavy = {m.split('.')[0] for m in sys.modules} & {'llama_cpp', 'numpy', 'gguf'}\n"
              "    print('exit', e.code or 0, 'loaded', sorted(heavy), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    helped = any(arg.startswith("--help") for arg in args)
    assert proc.stderr.splitlines()[-1] == f"exit {0 if helped else 2} loaded []", proc.stderr

# -- runtime limits -------------------------------------------------------------


@pytest.mark.real
@pytest.mark.parametrize("spec", [("--spec-type", "none"), ("--spec-type", "auto")])
def test_a_prompt_that_does_not_fit_exits_1_with_the_numbers(model_path, spec):
    proc = speculate("-m", str(model_path(SMOL)), "-p", "word " * 100, "-c", "64", "-n", "10", *spec)
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "calibrat" not in line  # refused before any work
    m = re.search(r"the prompt has (\d+) tokens but the context holds 64, .* raise -c/--ctx-size \(to at least (\d+)\)", line)
    assert m and int(m[1]) > 64 and int(m[2]) == int(m[1]) + 10, line


@pytest.mark.real
def test_tiny_contexts_and_batches_generate_or_refuse_cleanly(model_path):
    smol = str(model_path(SMOL))
    for extra in (("-c", "8", "-b", "3"), ("-c", "3", "-md", smol)):
        # --ignore-eos: "length" wherever this CPU's greedy text would reach EOS
        r = speculate_json("-m", smol, "-p", "x", "-n", "4", "--temp", "0", "--ignore-eos", *extra)
        assert r["finish_reason"] == "length" and r["n_prompt"] + r["n_predict"] <= int(extra[1])


# -- UTF-8 ----------------------------------------------------------------------

UTF8_PROMPTS = ["Emoji: 😀😃😄😁😆🤣", "日本語の文章：今日は天気が", "Combining: e\u0301 a\u0308 o\u0302 n\u0303 e\u0301 u\u0308"]


@pytest.mark.real
@pytest.mark.parametrize("prompt", UTF8_PROMPTS)
def test_streamed_text_is_the_whole_sequence_decoded_at_once(model_path, prompt):
    smol = str(model_path(SMOL))
    common = ("-m", smol, "-md", smol, "--spec-type", "draft", "--draft-max", "3", "-p", prompt, "--temp", "0")
    tokens = speculate_json(*common, "-n", "24")["tokens"]
    with LlamaModel(ModelSpec(model_path(SMOL), name=SMOL, n_ctx=64)) as model:
        pieces = [model.token_bytes(t) for t in tokens]

    def at_once(n: int) -> str:
        return b"".join(pieces[:n]).decode("utf-8", errors="replace")

    for n in range(len(pieces) + 1):  # every cap, every split of a character
        stream = TextStream(lambda i: pieces[i])
        assert "".join(stream.push(i) for i in range(n)) + stream.flush() == at_once(n)
    # through the command line, at the full length and at a cap inside a character
    split = [n for n in range(1, len(pieces)) if at_once(n) != b"".join(pieces[:n]).decode("utf-8", "ignore")]
    for n in [len(pieces), *split[:1]]:
        out = speculate(*common, "-n", str(n))
        assert out.returncode == 0 and out.stdout.decode("utf-8") == at_once(n) + "\n", out.stderr


def test_jinja2_older_than_3_1_6_is_refused_at_start_up():
    code = ("import sys, jinja2; jinja2.__version__ = '3.1.5'; sys.argv = ['speculate', 'models', 'list']\n"
            "from speculative.cli.main import main; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == ("speculate: error: jinja2 3.1.5 is too old to render untrusted chat templates "
                                   "safely; install jinja2>=3.1.6")
