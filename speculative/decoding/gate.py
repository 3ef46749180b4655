"""Many requests at once: the gate that makes one batch per step out of their decode calls.

Each request runs the loop (loop.py) unchanged, on a thread of its own, against its own
sequences of a shared model (llamacpp/slots.py). A request joins the gate while it runs
(`member`). Its decode calls do not run at once: `submit` hands each to the gate, which
waits until every member is waiting on one, then runs the calls of one model together, in
one batch. Models run in order of `priority` (the draft model before the target), so
requests that draft are drafted together, one batch per draft position, and verified
together. A request joins or leaves only between batches.

A member may say when it should stop (its client is gone): its next call raises Stopped
instead of waiting, so a request stops between batches, even in the middle of its prompt.
A batch itself stops (llama.cpp's abort callback asks `abort_wanted`) only when the gate
closes, or when the one member it runs for should stop.

What else touches a shared model (rolling a cache back, forking a branch, saving a state)
holds `lock`, as every batch does: llama.cpp's contexts take one call at a time.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence


class Stopped(Exception):
    """The gate closed (Ctrl-C, a server stopping): the request ends where it is."""


class Runner(Protocol):
    """One shared model as the gate runs it."""
    priority: int  # lower runs first when several models have calls waiting
    capacity: int  # the most tokens one batch takes

    def size(self, part: Any) -> int:
        """The tokens a call puts in the batch."""
        ...

    def run(self, parts: Sequence[Any]) -> list[Any]:
        """Run the calls in one batch: each call's result, or the exception it raises."""
        ...


@dataclass(eq=False)  # each call is itself: two alike are still two
class _Call:
    runner: Runner
    part: Any
    result: Any = None
    done: bool = False


class Gate:
    def __init__(self):
        self.lock = threading.RLock()
        self._cv = threading.Condition()
        self._members = 0
        self._waiting: list[_Call] = []
        self._running = False
        self._closed = False
        self._checks: dict[int, Callable[[], object]] = {}  # member thread -> should it stop?

    @property
    def members(self) -> int:
        return self._members

    @property
    def closed(self) -> bool:
        return self._closed

    @contextmanager
    def member(self, should_stop: Callable[[], object] | None = None) -> Iterator[None]:
        """Within the block, this thread's request is one the gate waits for; once
        `should_stop()` is true, its calls raise Stopped."""
        with self._cv:
            while self._running:  # join between batches
                self._cv.wait()
            if self._closed:
                raise Stopped
            self._members += 1
            if should_stop is not None:
                self._checks[threading.get_ident()] = should_stop
        try:
            yield
        finally:
            with self._cv:
                self._members -= 1
                self._checks.pop(threading.get_ident(), None)
                self._cv.notify_all()  # those left may all be waiting now

    def abort_wanted(self) -> bool:
        """Whether the batch running should stop in its middle (llama.cpp's abort callback):
        the gate closed, or the only member should stop."""
        if self._closed:
            return True
        checks = list(self._checks.values())
        return self._members == 1 and len(checks) == 1 and bool(checks[0]())

    def submit(self, runner: Runner, part: Any) -> Any:
        """Run one call in the next batch of its model; its result (or its exception)."""
        call = _Call(runner, part)
        check = self._checks.get(threading.get_ident())
        if check is not None and check():
            raise Stopped
        with self._cv:
            self._waiting.append(call)
            try:
                while not call.done:
                    if self._closed:
                        raise Stopped
                    if not self._running and len(self._waiting) >= self._members:
                        self._run_next()
                    else:
                        self._cv.wait()
            finally:
                if call in self._waiting:
                    self._waiting.remove(call)
        if isinstance(call.result, BaseException):
            raise call.result
        return call.result

    def _run_next(self) -> None:
        """Run the waiting calls of the first model by priority that fit in one batch (the
        condition's lock held on entry and exit, released while the batch runs)."""
        runner = min((c.runner for c in self._waiting), key=lambda r: r.priority)
        calls, n_tokens = [], 0
        for call in self._waiting:
            if call.runner is runner and (not calls or n_tokens + runner.size(call.part) <= runner.capacity):
                calls.append(call)
                n_tokens += runner.size(call.part)
        for call in calls:
            self._waiting.remove(call)
        self._running = True
        self._cv.release()
        try:
            with self.lock:
                results = runner.run([call.part for call in calls])
        except BaseException as e:  # the batch itself failed: every call in it fails
            results = [e] * len(calls)
        finally:
            self._cv.acquire()
            self._running = False
        for call, result in zip(calls, results):
            call.result, call.done = result, True
        self._cv.notify_all()

    def close(self) -> None:
        """Every waiting call and every later one raises Stopped (the batch running finishes)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
