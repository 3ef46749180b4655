"""The conversation (`speculate` with no prompt on a terminal, or -cnv): as a person uses it,
through a real pseudo-terminal, and as a script does, through a pipe; every turn's greedy answer
is the one a `batch` line with the same messages gets, and each turn processes only what is new.

A test that stops an answer with Ctrl-C runs under tests/probe.py (PROBE_PIECES), which holds
the answer after a few pieces of text and says so: the signal is sent then, never raced."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli.conversation import read_message, turn_line
from speculative.decoding.cache import Cache
from speculative.decoding.events import Prefilled
from tests.fakes import generate
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.decoding.stats import Stats
from speculative.drafters import NgramSimple
from speculative.drafters.auto import Auto
from speculative.drafters.model import ModelDrafter
from speculative.engine.conversation import Conversation, ConversationFull
from speculative.errors import UsageError

from tests.conftest import SMOL, SPECULATE, probe_command, speculate
from tests.fakes import FakeBackend, ToyModel

GREEDY = SamplerSettings(temp=0.0)
WAIT = 300.0  # seconds a pseudo-terminal test waits for what the program says before failing


# -- reading a message ---------------------------------------------------------------------------


def lines(*given: str):
    queue = list(given)
    return lambda first: queue.pop(0) if queue else None


def test_a_message_goes_on_after_a_backslash_and_with_mli_until_a_slash():
    assert read_message(lines("one", "two"), multiline=False) == "one"
    assert read_message(lines("one\\", "two\\", "three", "four"), multiline=False) == "one\ntwo\nthree"
    assert read_message(lines("one", "", "two/", "three"), multiline=True) == "one\n\ntwo"
    assert read_message(lines("one", "two\\"), multiline=True) == "one\ntwo"
    assert read_message(lines("/usr/"), multiline=False) == "/usr/"  # a slash ends nothing without -mli
    assert read_message(lines("one", "two"), multiline=True) == "one\ntwo"  # the end of input ends it
    assert read_message(lines(), multiline=False) is None


def test_a_conversations_statistics_add_up_its_turns():
    first, second = Stats(n_prompt=10, n_predict=5, n_drafted=4, n_accept=3, t_decode=1.0, t_load=2.0),\
        Stats(n_prompt=20, n_cached=9, n_predict=7, t_decode=0.5, t_load=2.0, finish_reason="stop")
    first._add_draft(4, 3)
    second._add_draft(6, 6)
    first.merge(second)
    assert (first.n_prompt, first.n_cached, first.n_predict, first.n_draft_steps) == (30, 9, 12, 2)
    assert first.t_decode == 1.5 and first.t_load == 2.0 and first.finish_reason == "stop"
    assert first.drafted_at == [2, 2, 2, 2, 1, 1] and first.accepted_lengths == {3: 1, 6: 1}
    line = turn_line(second)
    assert "7 tokens" in line and "11 new, 9 kept" in line and "drafted 6, accepted 6 (100%)" in line


# -- what a turn keeps ------------------------------------------------------------------------


def test_a_regenerated_answer_comes_back_to_the_prompts_checkpoint_after_drafts_took_others():
    """A recurrent target that drafts past its snapshots takes a checkpoint per draft; the one at
    the prompt's end stays, so the same prompt again (/regen) keeps all of it but the last token."""
    model = ToyModel()
    target, draft = FakeBackend(model), FakeBackend(model.perturbed(0.4, seed=7), name="draft")
    target.rollback_limit, draft.rollback_limit = 1, 0
    cache, prompt = Cache(target), [1, 2, 3, 4, 5, 6, 7, 8]
    settings = SpecSettings(n_predict=30, draft_max=6)
    drafter = ModelDrafter(Cache(draft))
    list(generate(cache, prompt, Sampler(GREEDY, 1), settings, drafter))
    assert target.checkpoints["saved"] > 1  # drafts took checkpoints of their own
    events = list(generate(cache, prompt, Sampler(GREEDY, 1), settings, drafter))
    assert next(e for e in events if isinstance(e, Prefilled)).n_cached == len(prompt) - 1


def test_a_turns_auto_starts_from_what_the_previous_turns_learnt():
    """Engine.run(carry=True) hands the previous run's auto to the new one (factory.make): its
    acceptance estimates, copied (the new turn's evidence does not change the old one's), for the
    drafters both have and drafts as long."""
    costs = [0.01 * b for b in range(1, 18)]
    earlier = Auto([NgramSimple(n=2, m=16)], costs, 16)
    for _ in range(40):
        earlier.estimates("ngram-simple", 2).observe(0, True)
    later = Auto([NgramSimple(n=2, m=16)], costs, 16)
    cold = later.estimates("ngram-simple", 2).rates()[0]
    later.learn_from(earlier)
    assert later.estimates("ngram-simple", 2).rates()[0] == earlier.estimates("ngram-simple", 2).rates()[0] > cold
    later.estimates("ngram-simple", 2).observe(0, False)
    assert later.estimates("ngram-simple", 2).rates()[0] < earlier.estimates("ngram-simple", 2).rates()[0]
    shorter = Auto([NgramSimple(n=2, m=8)], costs, 8)
    shorter.learn_from(earlier)  # other draft lengths: other slots, nothing carried
    assert shorter.estimates("ngram-simple", 2).rates()[0] == cold


class _Target:
    name, n_ctx = "toy", 100

    def chat_template(self) -> str:
        return "{% for m in messages %}{{ m.content }}{% endfor %}"

    def token_bytes(self, token: int) -> bytes:
        return b"x"


class _Engine:
    """Just what a Conversation asks of an engine before a turn runs: a message's words are its tokens."""
    target, t_load = _Target(), 0.0

    def chat_tokens(self, messages):
        return [0] + [1 for m in messages for _ in m["content"].split()]

    def run(self, *args):
        yield from ()

    def notes(self) -> list[str]:
        return []


def test_a_conversation_too_long_for_the_context_changes_nothing_or_drops_its_oldest_turns():
    chat = Conversation(_Engine(), GREEDY, SpecSettings(n_predict=20), system="be brief")
    for words in (30, 30):
        turn = chat.ask("w " * words)
        chat.answered("a " * 10, turn.stream.end())
    with pytest.raises(ConversationFull, match="/clear starts again .*--context-shift"):
        chat.ask("w " * 30)
    assert len(chat.messages) == 5  # nothing was added
    chat.context_shift = True
    turn = chat.ask("w " * 30)
    assert turn.dropped == 1 and [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user"]
    with pytest.raises(ConversationFull):  # one message alone too long: nothing left to drop
        chat.ask("w " * 200)
    with pytest.raises(UsageError, match="no answer to regenerate"):
        chat.regenerate()
    chat.clear()
    assert chat.messages == [{"role": "system", "content": "be brief"}]


def test_a_model_without_a_chat_template_cannot_converse():
    engine = _Engine()
    engine.target = type("Bare", (_Target,), {"chat_template": lambda self: ""})()
    with pytest.raises(UsageError, match="has no chat template, which a conversation needs"):
        Conversation(engine, GREEDY, SpecSettings())


# -- through a pipe ---------------------------------------------------------------------------


def converse(*args: str, turns: list[str], env: dict | None = None) -> tuple[list[dict], subprocess.CompletedProcess]:
    proc = speculate(*args, "-cnv", "--json", input="".join(t + "\n" for t in turns).encode(), env=env)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.decode().splitlines()], proc


def batch_texts(tmp_path: Path, requests: list[list[dict]], *flags: str) -> list[str]:
    path, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps({"id": i, "messages": m}) + "\n" for i, m in enumerate(requests)))
    out.unlink(missing_ok=True)
    proc = speculate("batch", str(path), "-o", str(out), "-np", "1", *flags)
    assert proc.returncode == 0, proc.stderr
    results = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])
    return [r["text"] for r in results]


TURNS = ["Write a Python function is_even(n) with a docstring.",
         "Rename it to is_divisible_by_two and write the whole function again.",
         "/regen",
         "Now add type hints, and write it again."]


@pytest.mark.real
@pytest.mark.parametrize("spec_type", ["none", "ngram-simple", "auto"])
def test_every_turn_through_a_pipe_is_the_answer_its_history_gets_alone(model_path, tmp_path, batch_invariant,
                                                                        spec_type):
    """Each answer equals a `batch` line with the conversation so far as its messages (greedy, on the
    invariant build), with or without speculation; after the first, a turn processes only what is
    new (the previous turn's prompt and answer stay in the cache); /regen answers the same again."""
    flags = ("-m", SMOL, "--temp", "0", "-n", "48", "--spec-type", spec_type)
    answers, proc = converse(*flags, "-sys", "You write Python.", turns=TURNS)
    assert [a["turn"] for a in answers] == [1, 2, 3, 4]
    history, requests = [{"role": "system", "content": "You write Python."}], []
    for message, answer in zip(TURNS, answers):
        if message == "/regen":
            history.pop()
        else:
            history.append({"role": "user", "content": message})
        requests.append(list(history))
        history.append({"role": "assistant", "content": answer["text"]})
    assert [a["text"] for a in answers] == batch_texts(tmp_path, requests, *flags)
    assert answers[2]["text"] == answers[1]["text"]
    assert answers[0]["n_cached"] == 0
    for earlier, later in zip(answers, answers[1:]):
        assert later["n_cached"] >= earlier["n_prompt"] - 1, (earlier, later)  # at least its prompt stayed
    if spec_type == "ngram-simple":
        assert answers[1]["n_drafted"] > 0  # the rewrite drafts from the earlier answer
    assert "conversation: " not in proc.stderr  # --json: the objects say it all


@pytest.mark.real
def test_the_pool_keeps_what_a_conversation_said_for_the_next(tmp_path):
    pool = tmp_path / "pool.bin"
    flags = ("-m", SMOL, "--temp", "0", "-n", "24", "--spec-pool", str(pool))
    converse(*flags, turns=["Write a Python function that adds two numbers."])
    first = pool.stat().st_size
    converse(*flags, turns=["Write a Python function that multiplies two numbers."])
    assert 0 < first < pool.stat().st_size


@pytest.mark.real
def test_a_recurrent_target_keeps_its_prompt_across_turns(tmp_path):
    """A Mamba target cannot cut its state to any prefix: where the rendered history parts from
    what it generated, the next turn comes back to the checkpoint at the end of the last prompt."""
    from tests.tiny_model import write_model

    model = write_model("mamba", tmp_path / "mamba.gguf")
    flags = ("-m", str(model), "--chat-template", "chatml", "--temp", "0", "-n", "24", "--spec-type", "ngram-simple")
    turns = ["hello there", "again please", "/regen"]
    answers, _ = converse(*flags, turns=turns)
    assert answers[1]["n_cached"] >= answers[0]["n_prompt"] - 1
    assert answers[2]["n_cached"] == answers[1]["n_prompt"] - 1 and answers[2]["text"] == answers[1]["text"]
    requests = [[{"role": "user", "content": "hello there"}],
                [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": answers[0]["text"]},
                 {"role": "user", "content": "again please"}]]
    assert [a["text"] for a in answers[:2]] == batch_texts(tmp_path, requests, *flags)


@pytest.mark.real
def test_a_full_context_is_said_in_one_line_and_the_conversation_goes_on(tmp_path):
    long = "Tell me about the sea. " * 60
    proc = speculate("-m", SMOL, "-cnv", "-c", "256", "--temp", "0", "-n", "16",
                     input=f"{long}\n/clear\nSay hi.\n".encode())
    assert proc.returncode == 0, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the context holds 256: /clear starts again" in errors[0], proc.stderr
    assert "Chat history cleared." in proc.stderr and "conversation: 1 answer" in proc.stderr
    assert proc.stdout.strip()
    shifted = speculate("-m", SMOL, "-cnv", "-c", "256", "--temp", "0", "-n", "40", "--context-shift",
                        input=b"".join(f"Tell me a fact about the number {n}.\n".encode() for n in range(6)))
    assert shifted.returncode == 0, shifted.stderr
    assert "oldest exchanges were dropped" in shifted.stderr and "conversation: 6 answers" in shifted.stderr


@pytest.mark.real
def test_a_model_without_a_chat_template_is_refused_before_any_turn(tmp_path):
    from tests.gguf_builder import write_tiny_llama

    model = write_tiny_llama(tmp_path / "bare.gguf")  # no chat template
    proc = speculate("-m", str(model), "-cnv", input=b"hello\n")
    assert proc.returncode == 2 and "has no chat template, which a conversation needs" in proc.stderr
    assert proc.stdout == b""


# -- through a pseudo-terminal -------------------------------------------------------------------


class Terminal:
    """A program on a pseudo-terminal, read as a person reads it."""

    def __init__(self, argv: list[str], cwd: Path, env: dict | None = None):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # pragma: no cover (the child)
            # a terminal's Ctrl-C, whatever started the tests: a shell's background job ignores
            # SIGINT, and the program would inherit that
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.chdir(cwd)
            os.environ.update(env or {})
            os.environ["COLUMNS"] = "200"
            os.execv(argv[0], argv)
        self.seen = b""  # everything shown so far
        self._unread = 0  # where expect looks from

    def expect(self, text: str) -> str:
        """Wait for `text` to be shown (after what was expected before); what was shown up to it."""
        marker, end = text.encode(), time.monotonic() + WAIT
        while marker not in self.seen[self._unread:]:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                raise AssertionError(f"{text!r} never came; the screen ends with {self.seen[-800:]!r}")
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                raise AssertionError(f"the program ended before {text!r}; the screen ends with {self.seen[-800:]!r}")
            self.seen += chunk
        at = self.seen.index(marker, self._unread) + len(marker)
        shown, self._unread = self.seen[self._unread:at], at
        return shown.decode("utf-8", "replace")

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def close(self) -> int:
        """Read to the end; the exit code (the program is killed, and the test fails, if it does
        not end within WAIT seconds)."""
        end = time.monotonic() + WAIT
        while time.monotonic() < end:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, end - time.monotonic()))
            try:
                chunk = os.read(self.fd, 65536) if ready else b""
            except OSError:
                break
            if not chunk:
                break
            self.seen += chunk
        done, status = os.waitpid(self.pid, os.WNOHANG)
        while not done and time.monotonic() < end:  # the screen is closed: the program is ending
            time.sleep(0.05)
            done, status = os.waitpid(self.pid, os.WNOHANG)
        if not done:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        os.close(self.fd)
        assert done, f"the program did not end; the screen ends with {self.seen[-800:]!r}"
        return os.waitstatus_to_exitcode(status)


PROMPT = "\n> "


def answered(term: Terminal) -> str:
    """Wait for the dim line after an answer: the answer and that line."""
    return term.expect("tokens per pass | prompt: ") + term.expect(" ]")


@pytest.mark.real
def test_a_conversation_on_a_terminal(tmp_path):
    """Several turns, /read, /regen, /clear, /stats and Ctrl-D, as a person types them."""
    (tmp_path / "code.py").write_text("def add(a, b):\n    return a + b\n")
    term = Terminal([SPECULATE, "-m", SMOL, "--temp", "0", "-n", "24", "--color"], tmp_path)
    assert "/regen" in term.expect(PROMPT)  # no -p on a terminal: a conversation, its commands listed
    term.type("/read code.py\r")
    assert "Loaded text from 'code.py'" in term.expect(PROMPT)
    term.type("What does this function do?\r")
    first = answered(term)
    assert " tokens, " in first and " t/s | " in first and " tokens per pass | prompt: " in first
    assert ", 0 kept" in first  # the first turn: nothing to keep
    term.expect(PROMPT)
    term.type("Say it in other words.\r")
    second = answered(term)
    assert ", 0 kept" not in second  # the first turn stayed in the cache
    term.expect(PROMPT)
    term.type("/regen\r")
    answered(term)
    term.expect(PROMPT)
    term.type("/stats\r")
    stats = term.expect(PROMPT)
    assert "conversation: 3 answers" in stats and "n_predict" in stats
    term.type("/clear\r")
    assert "Chat history cleared." in term.expect(PROMPT)
    term.type("/read missing.txt\r")
    assert "file does not exist or cannot be opened: 'missing.txt'" in term.expect(PROMPT)
    term.type("\x04")  # Ctrl-D at an empty prompt
    assert term.close() == 0
    assert "conversation: 3 answers" in term.seen.decode("utf-8", "replace").split("Chat history cleared.")[1]


@pytest.mark.real
def test_ctrl_c_stops_an_answer_and_the_conversation_goes_on(tmp_path):
    """(Ctrl-C at the prompt ends the conversation too, but Python's readline acts on a signal only
    when it interrupts its wait for a key: one that comes between two of its waits is noticed at
    the next key, a race no test here may run.)"""
    held = {"PROBE_PIECES": "1"}  # every answer holds after its first piece of text until a signal
    term = Terminal(probe_command("-m", SMOL, "--temp", "0", "-n", "200", "--ignore-eos"), tmp_path, held)
    term.expect(PROMPT)
    term.type("Count from one to fifty in words.\r")
    term.expect("probe: 1 pieces")
    term.type("\x03")
    stopped = answered(term)
    assert "stopped ]" in stopped
    term.expect(PROMPT)
    term.type("Go on.\r")  # the stopped answer is in the history: the conversation goes on
    term.expect("probe: 1 pieces")
    term.type("\x03")
    answered(term)
    term.expect(PROMPT)
    term.type("\x04")  # Ctrl-D at the prompt: the end, with the statistics
    assert term.close() == 0
    assert "conversation: 2 answers" in term.seen.decode("utf-8", "replace")


@pytest.mark.real
def test_ctrl_c_in_a_single_turn_exits_130(tmp_path):
    held = {"PROBE_PIECES": "1"}
    term = Terminal(probe_command("-m", SMOL, "--temp", "0", "-n", "200", "--ignore-eos", "-st",
                                  "-p", "Count from one to fifty in words."), tmp_path, held)
    term.expect("probe: 1 pieces")
    term.type("\x03")
    answered(term)
    assert term.close() == 130
    done = speculate("-m", SMOL, "--temp", "0", "-n", "8", "-st", "-p", "Say hi.")
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
