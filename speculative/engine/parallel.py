"""Many requests at once on one engine's models: serve's and batch's -np N.

The models (and the target's MTP head) are loaded once, with N slots of sequences
(llamacpp/slots.py); each slot has an engine of its own (Engine.view: its caches and
drafters over its sequences), and a request
runs on a slot's engine, on a thread of its own, exactly as a lone request runs on an engine.
Their decodes meet in the gate (decoding/gate.py), one batch per step for all of them. One
slot is the engine itself.

A request takes the slot llama-server would give it: the free slot whose cache holds the
longest part of its prompt, when that is more than `similarity` of it (-sps), else the one
used least recently; the cache-ram (persist.py) keeps what a slot drops.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from speculative.decoding.gate import Gate
from speculative.engine.engine import Engine
from speculative.llamacpp.slots import SharedHead, SharedModel

TARGET, DRAFT = 1, 0  # the gate's priorities: a step drafts before it verifies


class Parallel:
    def __init__(self, engine: Engine, n_slots: int, prefill_budget: float = 0.0, similarity: float = 0.1):
        """`engine`'s models must have been loaded with n_slots (ModelSpec.n_slots);
        `prefill_budget`: seconds of prompt a batch may carry while another request streams."""
        self.engine = engine
        self.gate = Gate()
        self.similarity = similarity
        self._streaming: set[int] = set()  # slots whose requests stream their answers
        self.engines = [engine] if n_slots == 1 else self._views(engine, n_slots, prefill_budget)
        self._free = set(range(n_slots))
        self._last_used = [0.0] * n_slots
        self._cv = threading.Condition()

    def _views(self, engine: Engine, n_slots: int, prefill_budget: float) -> list[Engine]:
        """An engine per slot over the shared models (one slot is the engine itself: nothing to
        share, and its MTP head and prompt cache file go on working as for a lone request)."""
        engine.forget()  # its caches are slot 0's sequences: from now on they are the slots'
        engine.may_measure = False
        for model in (engine.target, engine.draft):
            if model is not None:
                model.clear()
        target = SharedModel(engine.target, self.gate, TARGET, prefill_budget, self._streaming)
        draft = SharedModel(engine.draft, self.gate, DRAFT, prefill_budget, self._streaming) if engine.draft else None
        head = SharedHead(engine.head_cache.head, self.gate, DRAFT) if engine.head_cache else None
        return [engine.view(target.slot(i), draft.slot(i) if draft else None, head.slot(i) if head else None)
                for i in range(n_slots)]

    @property
    def n_slots(self) -> int:
        return len(self.engines)

    def running(self) -> int:
        """Slots with a request now."""
        with self._cv:
            return self.n_slots - len(self._free)

    @contextmanager
    def slot(self, prompt: Sequence[int], should_stop: Callable[[], object] | None = None,
             streaming: bool = False) -> Iterator[Engine]:
        """The engine of a free slot for this prompt (waiting for one), its request a member of
        the gate within the block (gate.Stopped once `should_stop()` is true); `streaming`: its
        answer goes out piece by piece, so others' prompts keep to the prefill budget."""
        with self._cv:
            while not self._free:
                self._cv.wait()
            index = self._choose(prompt)
            self._free.discard(index)
            if streaming:
                self._streaming.add(index)
        try:
            with self.gate.member(should_stop):
                yield self.engines[index]
        finally:
            with self._cv:
                self._free.add(index)
                self._streaming.discard(index)
                self._last_used[index] = time.monotonic()
                self._cv.notify()

    def _choose(self, prompt: Sequence[int]) -> int:
        """llama-server's choice: the most similar cached prefix above the threshold, else the
        least recently used."""
        if prompt and self.similarity > 0:
            shared = {i: self.engines[i].caches["target"].shared_prefix(prompt) for i in self._free}
            best = max(sorted(shared), key=lambda i: shared[i])
            if shared[best] / len(prompt) > self.similarity:
                return best
        return min(sorted(self._free), key=lambda i: self._last_used[i])

    def slots(self) -> list[dict]:
        """Each slot as llama-server's /slots shows it: whether a request runs in it, and the
        tokens its cache keeps."""
        with self._cv:
            busy = [i not in self._free for i in range(self.n_slots)]
        return [{"id": i, "n_ctx": engine.target.n_ctx, "is_processing": busy[i],
                 "n_cached_tokens": len(engine.caches["target"])} for i, engine in enumerate(self.engines)]

    def close(self) -> None:
        """Requests running stop at their next decode (gate.Stopped)."""
        self.gate.close()
