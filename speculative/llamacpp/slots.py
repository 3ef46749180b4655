"""One loaded model shared by requests that run at once (serve's and batch's -np).

The model's context holds n_slots * n_seq sequences: slot s has sequences s * n_seq to
(s + 1) * n_seq - 1, the first its cache, the others its draft-tree branches. A SlotModel is
the Backend (backend.Backend) of one slot: what a request's caches see is a model of their
own, over its sequences. SharedModel is that model as the scheduler runs it (a
decoding.scheduler.Runner): the decodes the slots' steps need, in one batch; when the cache has
no cell left for them (a unified pool of cells, shared by every request), the one that asks for
the most ends its request (ContextFull) and the rest run.

A drafting head has a sequence per slot too (head.py): SharedHead runs the slots' head entries
of a step in one decode, and SlotHead is one slot's Head, drafting from the rows the target
kept for that slot.

A prompt goes in chunks, each no longer than the prefill budget allows while another request
streams its answer, so a long prompt does not stall a stream's steps: the budget is in seconds
and becomes tokens by what prompt tokens have cost so far. With no stream to keep going (batch,
or answers sent whole) a prompt goes in whole -b chunks, as in llama-server: smaller chunks cost
more per token (a chunk of 40 tokens about twice as much, among four requests, on a 2-core CPU),
and nobody sees the gaps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from speculative.decoding.backend import Decode, HeadDecode, Outputs
from speculative.errors import ContextFull, GenerationError
from speculative.llamacpp.decode import Part
from speculative.llamacpp.model import LlamaModel
from speculative.llamacpp.head import HeadContext, HeadOutputs, HeadPart, decode_chunks

if TYPE_CHECKING:
    from speculative.decoding.scheduler import Request, Scheduler

FIRST_CHUNK = 32  # prompt tokens in a batch with others before their cost is known
LEAST_CHUNK = 4   # however tight the budget, a prompt moves on by at least this much per batch
LEARN_FROM = 8    # batches of this many tokens or more say what a prompt token costs
BUDGET_SHARE = 0.8  # of the budget, what a chunk's decode may take: the rest of the step (sampling,
                    # the other requests' own work) and a dearer batch than the last fit in the rest


class SharedModel:
    """A LlamaModel as the scheduler runs it (decoding.scheduler.Runner)."""

    def __init__(self, model: LlamaModel, priority: int, prefill_budget: float):
        """`priority`: 0 for a draft model, which runs before the target; `prefill_budget`: the
        seconds of prompt a batch may carry while another request streams (0: no limit)."""
        self.model = model
        self.priority = priority
        self.capacity = model.n_batch
        self.prefill_budget = prefill_budget
        self._token_seconds: float | None = None  # what a prompt token in a batch has cost

    def run(self, needs: Sequence[Decode]) -> None:
        """The decodes in one batch; one the cache has no cells for fails with ContextFull (the
        largest first), and the others run without it. Each is told what the others put in it."""
        parts = [need.model.part(need) for need in needs]
        live = list(range(len(parts)))
        while live:
            busy = self.model.busy_seconds
            try:
                results = self.model.decode_parts([parts[i] for i in live])
            except ContextFull as e:
                largest = max(live, key=lambda i: len(parts[i].tokens))
                needs[largest].fail(e)
                live.remove(largest)
                continue
            except GenerationError as e:
                for i in live:
                    needs[i].fail(e)
                return
            self._learn(sum(len(parts[i].tokens) for i in live), self.model.busy_seconds - busy)
            ran = [i for i, r in zip(live, results) if not isinstance(r, ContextFull)]
            tokens = sum(len(parts[i].tokens) for i in ran)
            scored = sum(parts[i].outputs == "all" for i in ran)
            for i, r in zip(live, results):  # rows, or a ContextFull of a part decoded alone
                if isinstance(r, ContextFull):
                    needs[i].fail(r)
                    continue
                mine = parts[i].outputs == "all"
                needs[i].others, needs[i].others_scored = tokens - len(parts[i].tokens), scored - mine
                needs[i].done(r)
            return

    def _learn(self, n_tokens: int, seconds: float) -> None:
        if n_tokens >= LEARN_FROM:  # mostly a prompt's chunk: what a prompt token costs now
            cost, known = seconds / n_tokens, self._token_seconds
            # dearer at once, cheaper slowly: a chunk must not overrun the budget
            self._token_seconds = cost if known is None or cost > known else known + 0.25 * (cost - known)

    def chunk(self, request: Request, scheduler: Scheduler) -> int:
        """The prompt tokens `request` may put in the next batch."""
        streams = any(r.streaming for r in scheduler.requests if r is not request)
        if len(scheduler.requests) <= 1 or self.prefill_budget <= 0 or not streams:
            return self.capacity  # no stream waits on it
        if self._token_seconds is None:
            return FIRST_CHUNK
        return max(LEAST_CHUNK, min(self.capacity, int(BUDGET_SHARE * self.prefill_budget / self._token_seconds)))

    def slot(self, index: int) -> "SlotModel":
        return SlotModel(self.model, index)


class SlotModel:
    """One request's sequences of a shared model: its Backend. Its decodes alone (`decode`,
    `decode_branches`: a recurrent state's rewind) run at once; those its steps need go in the
    scheduler's batches (SharedModel.run, with `part`)."""

    def __init__(self, model: LlamaModel, slot: int):
        self.shared = model  # the model whose sequences these are
        self.slot = slot
        self._seqs = model.memory.slots[slot]
        self._base = self._seqs.base  # its first sequence
        self.name, self.n_vocab, self.n_ctx, self.n_batch = model.name, model.n_vocab, model.n_ctx, model.n_batch
        self.n_seq, self.n_slots, self.rollback_limit = model.n_seq, model.n_slots, model.rollback_limit
        self.kv_unified, self.recurrent = model.kv_unified, model.recurrent
        self.tokenize, self.token_bytes, self.is_eog = model.tokenize, model.token_bytes, model.is_eog
        self.eog_tokens, self.identity, self.cache_identity = model.eog_tokens, model.identity, model.cache_identity

    def part(self, need: Decode) -> Part:
        """A decode this slot's step needs, as its part of a batch of several slots."""
        seqs = ([(self._base,)] * len(need.tokens) if need.seqs is None
                else [tuple(self._base + s for s in ids) for ids in need.seqs])
        if len(need.tokens) > self.n_batch and need.outputs == "all":
            raise GenerationError(f"batch of {len(need.tokens)} tokens exceeds -b/--batch-size {self.n_batch}")
        return Part(list(need.tokens), list(need.positions), seqs, need.outputs, self.slot)

    def decode(self, tokens: Sequence[int], pos: int, outputs: Outputs) -> list[np.ndarray]:
        rows = []
        step = max(1, len(tokens)) if outputs == "all" else self.n_batch  # "all": one batch (part refuses > -b)
        for start in range(0, len(tokens), step):
            end = min(len(tokens), start + step)
            rows = self._alone(Decode(self, tokens[start:end], range(pos + start, pos + end), None,
                                      outputs if end == len(tokens) else "none"))
        return rows

    def decode_branches(self, tokens: Sequence[int], positions: Sequence[int],
                        seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return self._alone(Decode(self, tokens, positions, seqs, "all"))

    def _alone(self, need: Decode) -> list[np.ndarray]:
        (result,) = self.shared.decode_parts([self.part(need)])
        if isinstance(result, ContextFull):
            raise result
        return result

    def nextn_state(self, n_tokens: int) -> bytes | None:
        return self.shared.tap.state(n_tokens, self.slot)

    def load_nextn_state(self, data: bytes, n_tokens: int) -> bool:
        return self.shared.tap.load_state(data, n_tokens, self.slot)

    def trim(self, n_keep: int) -> None:
        self._seqs.trim(n_keep)

    def copy_branch(self, src: int, dst: int) -> None:
        self._seqs.copy_branch(src, dst)

    def keep_branch(self, seq: int, n_keep: int) -> None:
        self._seqs.keep_branch(seq, n_keep)

    def save_state(self, partial: bool = False) -> bytes:
        return self._seqs.save_state(partial)

    def load_state(self, data: bytes, n_tokens: int, partial: bool = False) -> bool:
        return self._seqs.load_state(data, n_tokens, partial)


class SharedHead:
    """A drafting head as the scheduler runs it (decoding.scheduler.Runner): the slots' entries of
    a step in one decode."""

    def __init__(self, head: HeadContext, priority: int):
        self.head = head
        self.priority = priority
        self.capacity = head.n_batch

    def chunk(self, request: Request, scheduler: Scheduler) -> int:
        return self.capacity

    def run(self, needs: Sequence[HeadDecode]) -> None:
        parts = [HeadPart(need.tokens, need.pos, need.rows, need.head.slot, need.index) for need in needs]
        for need, out in zip(needs, self.head.decode_parts(parts)):
            need.done(out)

    def slot(self, index: int) -> "SlotHead":
        return SlotHead(self.head, index)


class SlotHead:
    """One slot's sequence of a shared drafting head: its Head (backend.Head, or BlockHead), whose
    entries decode in the scheduler's batches (SharedHead.run), from the target's rows of that slot."""

    def __init__(self, head: HeadContext, slot: int):
        self.shared = head  # the head whose sequences these are
        self.slot = slot
        for name in ("kind", "name", "file", "rows_key", "n_embd", "n_vocab", "n_ctx", "n_batch", "n_heads",
                     "max_draft", "shared_memory", "anchor", "confidence", "lattice", "selector_top_k"):
            if hasattr(head, name):  # a block head's are BlockHead's
                setattr(self, name, getattr(head, name))

    @property
    def busy_seconds(self) -> float:
        """The shared head's time inside llama.cpp, every slot's."""
        return self.shared.busy_seconds

    def target_rows(self, start: int, end: int) -> np.ndarray | None:
        return self.shared.target_rows(start, end, self.slot)

    def decode(self, tokens: Sequence[int], pos: int, rows: np.ndarray, head: int | None = None) -> HeadOutputs | None:
        """Alone (a decode of its own), in chunks of at most n_batch."""
        return decode_chunks(lambda part: self.shared.decode_parts([part])[0], tokens, pos, rows, self.slot,
                             self.n_batch, head)

    def trim(self, n_keep: int) -> None:
        self.shared.trim(n_keep, self.slot)

    def block(self, token: int, pos: int, k: int):
        """A DFlash or DSpark head's block for this slot (dflash.DflashHead.block), alone."""
        return self.shared.block(token, pos, k, self.slot)
