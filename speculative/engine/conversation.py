"""A conversation with the target: its messages, and each turn run on the engine.

Every turn renders the whole conversation through the chat template, as a `batch` line or
a server request with those messages would be, so each answer is the one that request gets
(greedy: the same tokens). What makes a turn cheap is the engine's caches: they still hold
the previous turn's prompt and answer, which the new prompt starts with, so only the new
message is processed (Stats.n_cached says how much was kept); a recurrent target comes back
to the checkpoint at the end of the previous prompt (cache.py's marks) where the rendered
history parts from what it generated. The drafters index the whole prompt, so they draft
from everything said so far (answers, files read), and auto starts each turn from what the
previous turn's auto learnt (Engine.run's `carry`).

The front end (cli/conversation.py) reads the person's input and shows the answers; this
module knows nothing of terminals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.decoding.stats import Stats
from speculative.engine.stream import Final, Stream
from speculative.engine.text import prompt_tail
from speculative.errors import GenerationError, UsageError

if TYPE_CHECKING:  # annotations only: importing the engine loads llama.cpp
    from speculative.engine.engine import Engine

ANSWER_SHARE = 4  # --context-shift leaves an answer at least 1/ANSWER_SHARE of the context (or -n)


class ConversationFull(GenerationError):
    """The conversation no longer fits the context; nothing was changed."""


@dataclass
class Turn:
    """A turn under way: its stream, its seed, and how many earlier exchanges were dropped to
    make room (--context-shift)."""
    stream: Stream
    seed: int
    dropped: int = 0
    prompt_tail: str = ""  # the prompt's last few tokens as text (does it open the model's thinking?)


@dataclass
class Conversation:
    engine: Engine
    sampling: SamplerSettings
    spec: SpecSettings
    system: str | None = None
    context_shift: bool = False  # drop the oldest exchanges when the conversation outgrows the context
    messages: list[dict[str, str]] = field(default_factory=list)
    attached: list[str] = field(default_factory=list)  # files read (/read, /glob) for the next message
    totals: Stats | None = None  # every turn's statistics summed
    turns: int = 0
    seed: int = -1  # the latest turn's

    def __post_init__(self) -> None:
        if not self.engine.target.chat_template():
            raise UsageError(f"{self.engine.target.name} has no chat template, which a conversation needs: "
                             "give one with --chat-template, or give the prompt with -p and -no-cnv")
        self.clear()

    def clear(self) -> None:
        """Start again: the system message alone (the caches keep it, so it is not processed again)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.attached = []

    def attach(self, name: str, text: str) -> None:
        """A file's text for the next message, headed by its name as llama-cli heads it."""
        self.attached.append(f"--- File: {name} ---\n{text}")

    def ask(self, text: str) -> Turn:
        """The person's message (after the files attached since the last one): the answer's turn.
        ConversationFull, and nothing changed, when it cannot fit."""
        messages = [*self.messages, {"role": "user", "content": "".join(self.attached) + text}]
        turn = self._run(messages)
        self.attached = []
        return turn

    def can_regenerate(self) -> bool:
        return bool(self.messages) and self.messages[-1]["role"] == "assistant"

    def regenerate(self) -> Turn:
        """The last answer again, from the same history (a new one where the sampler draws)."""
        if not self.can_regenerate():
            raise UsageError("no answer to regenerate yet")
        return self._run(self.messages[:-1])

    def answered(self, content: str, final: Final) -> None:
        """The turn ended (finished, cut by the context, or stopped): its answer (`content`, the
        reasoning left out) joins the history, its statistics the totals."""
        self.messages.append({"role": "assistant", "content": content})
        self.turns += 1
        if self.totals is None:
            self.totals = final.stats
        else:
            self.totals.merge(final.stats)

    def _run(self, messages: list[dict[str, str]]) -> Turn:
        tokens, dropped = self._fit(messages)
        self.seed = self.sampling.resolved_seed()  # --seed: every turn's; else a fresh one each (llama-server's -1)
        stream = Stream(self.engine, tokens, self.sampling, self.spec, self.seed, carry=self.turns > 0)
        self.messages = self._drop(messages, dropped)
        return Turn(stream, self.seed, dropped, prompt_tail(self.engine.target, tokens))

    def _fit(self, messages: list[dict[str, str]]) -> tuple[list[int], int]:
        """The prompt of `messages`, and how many of its oldest exchanges had to go for it to fit
        (only with --context-shift; else ConversationFull when it does not)."""
        n_ctx = self.engine.target.n_ctx
        room = n_ctx // ANSWER_SHARE
        if self.spec.n_predict > 0:
            room = min(room, self.spec.n_predict)
        dropped = 0
        while True:
            tokens = self.engine.chat_tokens(self._drop(messages, dropped))
            fits = len(tokens) < n_ctx and (not self.context_shift or len(tokens) + room <= n_ctx)
            if fits:
                return tokens, dropped
            if not self.context_shift or not self._can_drop(messages, dropped + 1):
                break
            dropped += 1
        raise ConversationFull(
            f"the conversation is {len(tokens)} tokens and the context holds {n_ctx}: /clear starts again"
            + ("" if self.context_shift else " (or run with --context-shift to drop the oldest turns, or a larger -c)"))

    def _drop(self, messages: list[dict[str, str]], n: int) -> list[dict[str, str]]:
        """`messages` less its n oldest exchanges (a user message and the answer to it), the
        system message kept."""
        head = 1 if messages and messages[0]["role"] == "system" else 0
        return messages[:head] + messages[head + 2 * n:]

    def _can_drop(self, messages: list[dict[str, str]], n: int) -> bool:
        """Whether n exchanges can go and the latest message stay."""
        head = 1 if messages and messages[0]["role"] == "system" else 0
        return head + 2 * n < len(messages)
