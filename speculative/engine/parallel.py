"""Many requests at once on one engine's models: serve's and batch's -np N.

The models (and the target's drafting head) are loaded once, with N slots of sequences
(llamacpp/slots.py); each slot has an engine of its own (SlotEngine: its caches and drafters
over its sequences). A request is work (decoding/backend.Work: a run of a slot's engine, with
whatever reads its events) that the one scheduler (decoding/scheduler.py) steps with every
other: one batch per model and tick for all of them. One slot is the engine itself, its
models' decodes each alone.

Every llama.cpp call happens on the thread that ticks: `batch`'s main thread, which loaded the
models, or serve's ModelThread, which loads them too. Other threads hand a request over
(`submit`) and wait for its end (Handle.wait).

A request takes the slot llama-server would give it: the free slot whose cache holds the
longest part of its prompt, when that is more than `similarity` of it (-sps), else the one
used least recently; the cache-ram (persist.py) keeps what a slot drops.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Sequence

from speculative.decoding.backend import Backend, Decode, Head, Need
from speculative.decoding.cache import Cache, HeadCache
from speculative.decoding.scheduler import Alone, Request, Runner, Scheduler, Stopped
from speculative.engine.engine import Engine
from speculative.llamacpp.slots import SharedHead, SharedModel

TARGET, DRAFT = 1, 0  # the runners' priorities: a step drafts before it verifies

log = logging.getLogger("speculate.serve")


class Handle:
    """A request handed to the scheduler: `wait` for its end."""

    def __init__(self, prompt: Sequence[int], work: Callable[[Engine], Iterator[Need]],
                 should_stop: Callable[[], object] | None, streaming: bool):
        self.prompt, self.work, self.should_stop, self.streaming = prompt, work, should_stop, streaming
        self.slot = -1
        self.request: Request | None = None  # the scheduler's, once it runs
        self._done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Any:
        """Its work's result, once it has ended; raises what it failed with."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class Parallel:
    def __init__(self, engine: Engine, n_slots: int, prefill_budget: float = 0.0, similarity: float = 0.1):
        """`engine`'s models must have been loaded with n_slots (ModelSpec.n_slots);
        `prefill_budget`: seconds of prompt a batch may carry while another request streams."""
        self.engine = engine
        self.similarity = similarity
        self._runners: dict[int, Runner] = {}  # id of a model or head -> what runs its decodes
        self.engines = [engine] if n_slots == 1 else self._views(engine, n_slots, prefill_budget)
        if n_slots == 1:
            heads = (engine.head_cache.head,) if engine.head_cache else ()
            for model, priority in ((engine.target, TARGET), (engine.draft, DRAFT), *((h, DRAFT) for h in heads)):
                if model is not None:
                    self._runners[id(model)] = Alone(priority)
        self.scheduler = Scheduler(self._runner_of)
        self._free = set(range(n_slots))
        self._last_used = [0.0] * n_slots
        self._lock = threading.Lock()
        self._waiting: list[Handle] = []  # handed over, not running yet
        self._running: dict[int, Handle] = {}  # slot -> its request
        self.on_submit: Callable[[], None] = lambda: None  # what ticks hears of a request handed over

    def _views(self, engine: Engine, n_slots: int, prefill_budget: float) -> list[Engine]:
        """An engine per slot over the shared models (one slot is the engine itself: nothing to
        share, and its MTP head and prompt cache file go on working as for a lone request)."""
        engine.share()
        target = SharedModel(engine.target, TARGET, prefill_budget)
        draft = SharedModel(engine.draft, DRAFT, prefill_budget) if engine.draft else None
        head = SharedHead(engine.head_cache.head, DRAFT) if engine.head_cache else None
        for runner, model in ((target, engine.target), (draft, engine.draft), (head, head and head.head)):
            if runner is not None:
                self._runners[id(model)] = runner
        return [SlotEngine(engine, target.slot(i), draft.slot(i) if draft else None, head.slot(i) if head else None)
                for i in range(n_slots)]

    def _runner_of(self, need: Need) -> Runner | None:
        owner = need.model if isinstance(need, Decode) else need.head
        return self._runners.get(id(getattr(owner, "shared", owner)))  # a slot's: its shared model's

    @property
    def n_slots(self) -> int:
        return len(self.engines)

    def running(self) -> int:
        """Slots with a request now."""
        with self._lock:
            return self.n_slots - len(self._free)

    def submit(self, prompt: Sequence[int], work: Callable[[Engine], Iterator[Need]],
               should_stop: Callable[[], object] | None = None, streaming: bool = False) -> Handle:
        """Hand a request over (from any thread): `work(engine)` runs on a free slot's engine once
        one is free, its decodes with the others' (Stopped raised at its next decode once
        `should_stop()` is true); `streaming`: its answer goes out piece by piece, so others'
        prompts keep to the prefill budget."""
        handle = Handle(prompt, work, should_stop, streaming)
        with self._lock:
            self._waiting.append(handle)
        self.on_submit()
        return handle

    def busy(self) -> bool:
        """Whether a request runs or waits."""
        with self._lock:
            return bool(self._waiting or self._running)

    def tick(self) -> None:
        """On the thread that ticks: requests waiting take the free slots, then one batch runs;
        the requests that ended leave their slots."""
        for handle in self._admit():
            engine = self.engines[handle.slot]
            handle.request = self.scheduler.add(handle.work(engine), should_stop=handle.should_stop,
                                                streaming=handle.streaming)
        self.scheduler.tick()
        with self._lock:
            for slot, handle in list(self._running.items()):
                if handle.request.done:
                    self._release(slot, handle)

    def _admit(self) -> list[Handle]:
        """The waiting requests that get a slot now, in order of arrival."""
        with self._lock:
            admitted = []
            while self._waiting and self._free:
                handle = self._waiting.pop(0)
                handle.slot = self._choose(handle.prompt)
                self._free.discard(handle.slot)
                self._running[handle.slot] = handle
                admitted.append(handle)
            return admitted

    def _release(self, slot: int, handle: Handle) -> None:
        """A request ended: its slot is free (under _lock)."""
        request = handle.request
        handle.result, handle.error = request.result, request.error
        del self._running[slot]
        self._free.add(slot)
        self._last_used[slot] = time.monotonic()
        handle._done.set()

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
        with self._lock:
            busy = [i not in self._free for i in range(self.n_slots)]
        return [{"id": i, "n_ctx": engine.target.n_ctx, "is_processing": busy[i],
                 "n_cached_tokens": len(engine.caches["target"])} for i, engine in enumerate(self.engines)]

    def fail_all(self) -> None:
        """The scheduler failed: every request ends, with Stopped (their caches may hold anything:
        the slots are emptied)."""
        self.scheduler = Scheduler(self._runner_of)
        with self._lock:
            for slot, handle in list(self._running.items()):
                handle.request._end(error=Stopped())
                self.engines[slot].forget()
                self._release(slot, handle)

    def close(self) -> None:
        """Requests running stop at their next decode (scheduler.Stopped); waiting ones at once."""
        self.scheduler.close()
        with self._lock:
            for handle in self._waiting:
                handle.error = Stopped()
                handle._done.set()
            self._waiting.clear()


class SlotEngine(Engine):
    """The engine of one of several requests that run at once, on `target`'s, `draft`'s and the
    drafting `head`'s sequences of `engine`'s models (llamacpp.slots): caches, drafters and a
    prompt's persistence of its own; the models, the pool, the book of costs (which it never
    measures into: other requests' sequences are on the models), ngram-mod's tables and the RAM
    cache are `engine`'s. It closes nothing."""

    def __init__(self, engine: Engine, target: Backend, draft: Backend | None, head: Head | None):
        self.progress, self.notify, self.t_load, self.jinja = engine.progress, engine.notify, engine.t_load, engine.jinja
        self.target, self.draft = engine.target, engine.draft
        self.book, self.pool, self.learn, self.pool_file = engine.book, engine.pool, engine.learn, None
        self.head_cache = HeadCache(head) if head is not None else None
        self.caches = {"target": Cache(target), **({"draft": Cache(draft)} if draft else {})}
        self.persist = engine.persist.view(self.caches, self.head_cache)
        self.factory = engine.factory.view(self.caches, self.head_cache, self.costs)
        self.drafter = None
        self._saved_at, self._whole_prompt, self._owner = time.monotonic(), False, False
        self.may_measure = False


class ModelThread:
    """The one thread that runs every llama.cpp call of a server: loading the models (`call`),
    the scheduler's ticks while requests run, freeing them. It blocks SIGINT and SIGTERM (as do
    the OpenMP workers it starts, which inherit its mask), so the kernel gives them to a thread
    that handles them."""

    def __init__(self):
        self.parallel: Parallel | None = None
        self._calls: list[tuple[Callable[[], Any], Future]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="speculate-models", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> Any:
        """fn() on this thread, between ticks: its result (or its exception)."""
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise Stopped()
            self._calls.append((fn, future))
            self._cv.notify_all()
        return future.result()

    def attach(self, parallel: Parallel | None) -> None:
        """The requests handed to `parallel` run on this thread from now on (None: none)."""
        with self._cv:
            self.parallel = parallel
            if parallel is not None:
                parallel.on_submit = self._wake

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _loop(self) -> None:
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        while True:
            with self._cv:
                while not (self._calls or self._closed or (self.parallel is not None and self.parallel.busy())):
                    self._cv.wait()
                calls, self._calls = self._calls, []
                if self._closed and not calls:
                    return
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)
            parallel = self.parallel
            if parallel is not None and parallel.busy():
                try:
                    parallel.tick()
                except Exception:  # a bug of the scheduler's own: the requests end, the thread goes on
                    log.exception("the scheduler failed")
                    parallel.fail_all()

    def close(self) -> None:
        """Once the calls handed over have run, the thread ends."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

