"""One scheduler: every running request's decodes of one model in one llama_decode per tick.

A request is a generator (backend.Work: a run of the loop, with whatever reads its events) that
yields each decode it needs (backend.Decode, HeadDecode) and, resumed, reads its result. A tick
runs the decodes waiting of one model, the one first by `priority` (the draft model and the
drafting heads before the target, so requests draft together and then verify together), in one
batch as that model's Runner makes it (llamacpp/slots.py), and resumes each request with its
result, up to the decode it needs next. A long prompt goes in chunks, a chunk a tick, as the
runner allows, so it does not stall the others' steps; its request is resumed after its last.
A decode no runner batches runs at once. What is no batch of several requests' (a DFlash or
DSpark block, an EAGLE-3 encoder's pass, a recurrent state's rewind) is called as it is: it runs
within the tick, on the same thread.

Requests join (`add`) and leave between ticks. One that should stop (its client is gone) has
Stopped raised at the decode it waits for, at the next tick; `close` stops them all. What else a
request yields (a run's events) goes to its sink. Everything runs on the thread that ticks: the
llama.cpp contexts see one caller, and a request alone runs through the same ticks (`run_alone`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol, Sequence

from speculative.decoding.backend import NEEDS, HeadDecode, Need, T, Work


class Stopped(Exception):
    """The scheduler closed (Ctrl-C, a server stopping), or the request should stop: it ends
    where it is."""


class Runner(Protocol):
    """One shared model as the scheduler runs it."""
    priority: int  # lower runs first when several models have decodes waiting
    capacity: int  # the most tokens one batch takes

    def chunk(self, request: "Request", scheduler: "Scheduler") -> int:
        """The most tokens of a decode that may go in chunks (a prompt's, a head's entries)
        `request` may put in this tick's batch."""
        ...

    def run(self, needs: Sequence[Need]) -> None:
        """The needs in one batch: each one `done` or `fail`ed, and told what else ran with it."""
        ...


class Request:
    """A running request: its work, the decode it waits for, and how it ended."""

    def __init__(self, work: Iterator, sink: Callable[[Any], None], should_stop: Callable[[], object] | None,
                 streaming: bool):
        self.work = work
        self.sink = sink
        self.should_stop = should_stop or (lambda: False)
        self.streaming = streaming  # its answer goes out piece by piece: others' prompts keep to a budget
        self.need: Need | None = None
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None

    def _end(self, result: Any = None, error: BaseException | None = None) -> None:
        self.done, self.result, self.error, self.need = True, result, error, None


class Scheduler:
    def __init__(self, runner_of: Callable[[Need], Runner | None] = lambda need: None):
        """`runner_of(need)`: the runner that batches it with others (None: it runs alone)."""
        self._runner_of = runner_of
        self.requests: list[Request] = []
        self.closed = False
        self._batch: list[Request] = []  # the requests of the batch running now

    def add(self, work: Iterator, sink: Callable[[Any], None] = lambda item: None,
            should_stop: Callable[[], object] | None = None, streaming: bool = False) -> Request:
        """A request joins: it runs up to the first decode it needs (or to its end)."""
        request = Request(work, sink, should_stop, streaming)
        self._advance(request)
        if not request.done:
            self.requests.append(request)
        return request

    def tick(self) -> None:
        """Stop those that should, then run one batch: the waiting decodes of one model."""
        for request in list(self.requests):
            if self.closed or request.should_stop():
                request.need.fail(Stopped())
                self._advance(request)
        self.requests = [r for r in self.requests if not r.done]
        waiting = [r for r in self.requests if r.need is not None]
        if not waiting:
            return
        runner = min((self._runner_of(r.need) for r in waiting), key=lambda runner: runner.priority)
        batch, needs = self._take(runner, [r for r in waiting if self._runner_of(r.need) is runner])
        self._batch = batch
        try:
            runner.run(needs)
        except Exception as e:  # the batch itself failed (stopped inside llama.cpp): each decode in it
            for need in needs:
                need.fail(e)
        finally:
            self._batch = []
        for request, need in zip(batch, needs):
            if need is not request.need:  # a chunk of its prompt ran: the rest waits, unless it failed
                try:
                    if need.result() is not None or not isinstance(need, HeadDecode):
                        continue
                    request.need.done(None)  # a head's entries that failed: none of the rest is of use
                except Exception as e:
                    request.need.fail(e)
            self._advance(request)
        self.requests = [r for r in self.requests if not r.done]

    def _take(self, runner: Runner, waiting: list[Request]) -> tuple[list[Request], list[Need]]:
        """The requests whose decodes go in this batch, and what of each: up to the runner's
        capacity (the first whatever its size); a prompt's chunk where the runner allows less."""
        batch, needs, n = [], [], 0
        for request in waiting:
            need = request.need
            room = runner.capacity - n
            if need.splits:  # a prompt's, or a head's entries: it may go in chunks
                size = min(len(need.tokens), runner.chunk(request, self), room)
                if size <= 0:
                    continue
                if size < len(need.tokens):
                    need = need.split(size)
            elif batch and len(need.tokens) > room:
                continue
            batch.append(request)
            needs.append(need)
            n += len(need.tokens)
        return batch, needs

    def _advance(self, request: Request) -> None:
        """Resume a request up to the next decode it needs (running at once what no runner
        batches), passing what else it yields to its sink; or to its end."""
        try:
            while True:
                item = next(request.work)
                if not isinstance(item, NEEDS):
                    request.sink(item)
                elif self._runner_of(item) is None:
                    _run(item)
                else:
                    request.need = item
                    return
        except StopIteration as end:
            request._end(end.value)
        except Exception as e:  # its own failure: its owner hears of it (Ctrl-C stops the ticks)
            request._end(error=e)

    def abort_wanted(self) -> bool:
        """Whether the batch running should stop in its middle (llama.cpp's abort callback): the
        scheduler closed, or every request in it should stop."""
        batch = self._batch
        return self.closed or (bool(batch) and all(r.should_stop() for r in batch))

    def close(self) -> None:
        """Every request stops at its next tick (the batch running finishes)."""
        self.closed = True


def _run(need: Need) -> None:
    """One decode, alone."""
    try:
        need.done(need.run())
    except Exception as e:
        need.fail(e)


class Alone:
    """The runner of a model one request runs on at a time: its decode as it is, alone."""
    capacity = 1 << 30

    def __init__(self, priority: int = 0):
        self.priority = priority

    def chunk(self, request: Request, scheduler: Scheduler) -> int:
        return self.capacity

    def run(self, needs: Sequence[Need]) -> None:
        for need in needs:
            _run(need)


def run_alone(work: Iterator) -> Iterator:
    """A request alone, through the ticks of a scheduler of its own, on this thread: what it
    yields besides its decodes, as it comes; returns its result (raises its error)."""
    alone = Alone()
    scheduler, out = Scheduler(lambda need: alone), []
    request = scheduler.add(work, out.append)
    try:
        while True:
            yield from out
            out.clear()
            if request.done:
                break
            scheduler.tick()
    finally:
        if not request.done:  # its consumer stopped it: it ends now, where it waits
            work.close()
    if request.error is not None:
        raise request.error
    return request.result


def run(work: Work[T]) -> T:
    """What a work that is no request returns (calibration, a cache's rewind, a tool, a test),
    its decodes each run alone, at once, on this thread."""
    while True:
        try:
            need = next(work)
        except StopIteration as end:
            return end.value
        _run(need)
