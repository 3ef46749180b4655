"""One loaded model shared by requests that run at once (serve's and batch's -np).

The model's context holds n_slots * n_seq sequences: slot s has sequences s * n_seq to
(s + 1) * n_seq - 1, the first its cache, the others its draft-tree branches. A SlotModel is
the Backend (backend.Backend) of one slot: what the loop, the caches and the drafters see
is a model of their own, while its decodes go through the gate (decoding/gate.py) and run
with every other request's in one llama_decode. SharedModel is that model as the gate runs
it: it puts the waiting parts in one batch, and when the cache has no cell left for them
(a unified pool of cells, shared by every request), the part that asks for the most ends
its request (ContextFull) and the rest run.

A drafting head has a sequence per slot too (head.py): SharedHead runs the slots' head
entries of a step in one decode, and SlotHead is one slot's Head, drafting from the
rows the target kept for that slot.

A prompt is decoded a chunk per batch, each no longer than the prefill budget allows while
another request streams its answer, so a long prompt does not stall a stream's steps: the
budget is in seconds and becomes tokens by what prompt tokens have cost so far. With no
stream to keep going (batch, or answers sent whole) a prompt goes in whole -b chunks, as in
llama-server: smaller chunks cost more per token (a chunk of 40 tokens about twice as much,
among four requests, on a 2-core CPU), and nobody sees the gaps.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from speculative.decoding.backend import Outputs
from speculative.decoding.gate import Gate
from speculative.errors import ContextFull, GenerationError
from speculative.llamacpp.decode import Part
from speculative.llamacpp.model import LlamaModel
from speculative.llamacpp.head import HeadContext, HeadOutputs, HeadPart, decode_chunks

FIRST_CHUNK = 32  # prompt tokens in a batch with others before their cost is known
LEAST_CHUNK = 4   # however tight the budget, a prompt moves on by at least this much per batch
LEARN_FROM = 8    # batches of this many tokens or more say what a prompt token costs
BUDGET_SHARE = 0.8  # of the budget, what a chunk's decode may take: the rest of the step (sampling,
                    # the other requests' own work) and a dearer batch than the last fit in the rest


class SharedModel:
    """A LlamaModel as the gate runs it (decoding.gate.Runner)."""

    def __init__(self, model: LlamaModel, gate: Gate, priority: int, prefill_budget: float, streaming: set[int]):
        """`priority`: 0 for a draft model, which runs before the target; `prefill_budget`: the
        seconds of prompt a batch may carry while another request streams (0: no limit);
        `streaming`: the slots whose requests stream now (their owner keeps it)."""
        self.model = model
        self.gate = gate
        self.priority = priority
        self.capacity = model.n_batch
        self.prefill_budget = prefill_budget
        self.streaming = streaming
        self._token_seconds: float | None = None  # what a prompt token in a batch has cost
        self.last_batch: dict[int, tuple[int, bool]] = {}  # slot -> (its tokens, whether it gets a token)

    def size(self, part: Part) -> int:
        return len(part.tokens)

    def run(self, parts: Sequence[Part]) -> list:
        """The parts in one batch; a part the cache has no cells for fails with ContextFull
        (the largest first), and the others run without it."""
        live = list(range(len(parts)))
        results: list = [None] * len(parts)
        while live:
            busy = self.model.busy_seconds
            try:
                rows = self.model.decode_parts([parts[i] for i in live])
            except ContextFull as e:
                largest = max(live, key=lambda i: len(parts[i].tokens))
                results[largest] = e
                live.remove(largest)
                continue
            except GenerationError as e:
                for i in live:
                    results[i] = e
                break
            self._learn(sum(len(parts[i].tokens) for i in live), self.model.busy_seconds - busy)
            self.last_batch = {parts[i].slot: (len(parts[i].tokens), parts[i].outputs == "all")
                               for i, r in zip(live, rows) if not isinstance(r, ContextFull)}
            for i, r in zip(live, rows):  # rows, or a ContextFull of a part decoded alone
                results[i] = r
            break
        return results

    def _learn(self, n_tokens: int, seconds: float) -> None:
        if n_tokens >= LEARN_FROM:  # mostly a prompt's chunk: what a prompt token costs now
            cost, known = seconds / n_tokens, self._token_seconds
            # dearer at once, cheaper slowly: a chunk must not overrun the budget
            self._token_seconds = cost if known is None or cost > known else known + 0.25 * (cost - known)

    def prefill_chunk(self, slot: int) -> int:
        """The prompt tokens slot's request may put in the next batch."""
        if self.gate.members <= 1 or self.prefill_budget <= 0 or not self.streaming - {slot}:
            return self.capacity  # no stream waits on it
        if self._token_seconds is None:
            return FIRST_CHUNK
        return max(LEAST_CHUNK, min(self.capacity, int(BUDGET_SHARE * self.prefill_budget / self._token_seconds)))

    def slot(self, index: int) -> "SlotModel":
        return SlotModel(self, index)


class SlotModel:
    """One request's sequences of a shared model: a Backend whose decodes run in the gate's
    batches. Everything else a LlamaModel has (its tokenizer, its facts) is the model's."""

    def __init__(self, shared: SharedModel, slot: int):
        self.shared = shared
        self.slot = slot
        self._model = shared.model
        self._seqs = self._model.memory.slots[slot]
        self._base = self._seqs.base  # its first sequence

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def decode(self, tokens: Sequence[int], pos: int, outputs: Outputs) -> list[np.ndarray]:
        if outputs == "all":
            return self._submit(tokens, range(pos, pos + len(tokens)), [(self._base,)] * len(tokens), "all")
        rows, start = [], 0
        while start < len(tokens):  # a prompt: a chunk per batch
            end = min(len(tokens), start + self.shared.prefill_chunk(self.slot))
            rows = self._submit(tokens[start:end], range(pos + start, pos + end), [(self._base,)] * (end - start),
                                outputs if end == len(tokens) else "none")
            start = end
        return rows

    def decode_branches(self, tokens: Sequence[int], positions: Sequence[int],
                        seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return self._submit(tokens, positions, [tuple(self._base + s for s in ids) for ids in seqs], "all")

    def _submit(self, tokens, positions, seqs, outputs: str) -> list[np.ndarray]:
        if len(tokens) > self._model.n_batch:
            raise GenerationError(f"batch of {len(tokens)} tokens exceeds -b/--batch-size {self._model.n_batch}")
        return self.shared.gate.submit(self.shared, Part(list(tokens), list(positions), seqs, outputs, self.slot))

    def nextn_state(self, n_tokens: int) -> bytes | None:
        return self._model.tap.state(n_tokens, self.slot)

    def load_nextn_state(self, data: bytes, n_tokens: int) -> bool:
        return self._model.tap.load_state(data, n_tokens, self.slot)

    def load(self, plain: bool = False) -> tuple[int, int]:
        others = [part for slot, part in self.shared.last_batch.items() if slot != self.slot]
        n_scored = sum(scored for _, scored in others)
        return (n_scored if plain else sum(n for n, _ in others)), n_scored

    def trim(self, n_keep: int) -> None:
        with self.shared.gate.lock:
            self._seqs.trim(n_keep)

    def copy_branch(self, src: int, dst: int) -> None:
        with self.shared.gate.lock:
            self._seqs.copy_branch(src, dst)

    def keep_branch(self, seq: int, n_keep: int) -> None:
        with self.shared.gate.lock:
            self._seqs.keep_branch(seq, n_keep)

    def save_state(self, partial: bool = False) -> bytes:
        with self.shared.gate.lock:
            return self._seqs.save_state(partial)

    def load_state(self, data: bytes, n_tokens: int, partial: bool = False) -> bool:
        with self.shared.gate.lock:
            return self._seqs.load_state(data, n_tokens, partial)

    def close(self) -> None:
        """The shared model is its owner's to close."""


class SharedHead:
    """A drafting head as the gate runs it (decoding.gate.Runner): the slots' entries of a step in
    one decode."""

    def __init__(self, head: HeadContext, gate: Gate, priority: int):
        self.head = head
        self.gate = gate
        self.priority = priority
        self.capacity = head.n_batch

    def size(self, part: HeadPart) -> int:
        return len(part.tokens)

    def run(self, parts: Sequence[HeadPart]) -> list:
        return self.head.decode_parts(parts)

    def slot(self, index: int) -> "SlotHead":
        return SlotHead(self, index)


class SlotHead:
    """One slot's sequence of a shared drafting head: a Head whose entries decode in the gate's
    batches, from the target's rows of that slot."""

    def __init__(self, shared: SharedHead, slot: int):
        self.shared = shared
        self.slot = slot
        self._head = shared.head

    def __getattr__(self, name: str):
        return getattr(self._head, name)

    def target_rows(self, start: int, end: int) -> np.ndarray | None:
        with self.shared.gate.lock:  # an EAGLE-3 head's encoder decodes: not beside the gate's batches
            return self._head.target_rows(start, end, self.slot)

    def decode(self, tokens: Sequence[int], pos: int, rows: np.ndarray, head: int | None = None) -> HeadOutputs | None:
        return decode_chunks(lambda part: self.shared.gate.submit(self.shared, part), tokens, pos, rows, self.slot,
                             self.shared.capacity, head)

    def trim(self, n_keep: int) -> None:
        with self.shared.gate.lock:
            self._head.trim(n_keep, self.slot)

    def block(self, token: int, pos: int, k: int):
        """A DFlash or DSpark head's block for this slot (dflash.DflashHead.block), decoded
        between the gate's batches."""
        with self.shared.gate.lock:
            return self._head.block(token, pos, k, self.slot)
