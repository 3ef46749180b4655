"""The scheduler (decoding/scheduler.py) with requests that are plain generators and runners that
record their batches: no threads, no model."""

from __future__ import annotations

import pytest

from speculative.decoding.backend import Decode, HeadDecode
from speculative.decoding.scheduler import Alone, Scheduler, Stopped, run, run_alone


class Model:
    """What a Decode names; its rows are the tokens themselves."""
    n_batch = 64

    def decode(self, tokens, pos, outputs):
        return list(tokens) if outputs == "all" else list(tokens[-1:]) if outputs == "last" else []

    def decode_branches(self, tokens, positions, seqs):
        return list(tokens)


class Runner:
    """Batches of one model, recorded as the tokens of each decode in them."""

    def __init__(self, priority: int, capacity: int = 64, chunk: int = 1 << 30):
        self.priority, self.capacity, self._chunk = priority, capacity, chunk
        self.batches: list[list[list[int]]] = []
        self.fail: Exception | None = None

    def chunk(self, request, scheduler) -> int:
        return self._chunk

    def run(self, needs) -> None:
        self.batches.append([list(need.tokens) for need in needs])
        if self.fail is not None:
            raise self.fail
        for need in needs:
            need.others = sum(len(n.tokens) for n in needs if n is not need)
            need.done(need.run())


def step(model, tokens, outputs="all", seqs=None):
    """A request's decode, as cache.py yields one: its rows."""
    need = Decode(model, tokens, range(len(tokens)), seqs, outputs)
    yield need
    return need.result()


def request(draft, target, name: int, steps: int, log: list):
    """A request of `steps` steps, each a draft decode then a target decode, noting its events."""
    for i in range(steps):
        drafted = yield from step(draft, [name * 100 + i])
        rows = yield from step(target, [name * 100 + i, *drafted])
        log.append((name, i, rows))
    return name


@pytest.fixture
def models():
    draft, target = Model(), Model()
    runners = {id(draft): Runner(0), id(target): Runner(1)}
    return draft, target, runners, Scheduler(lambda need: runners[id(need.model)])


def test_a_tick_runs_every_waiting_decode_of_one_model_in_one_batch_the_draft_first(models):
    draft, target, runners, scheduler = models
    log = []
    first, second = (scheduler.add(request(draft, target, n, 2, log)) for n in (1, 2))
    while scheduler.requests:
        scheduler.tick()
    assert runners[id(draft)].batches == [[[100], [200]], [[101], [201]]]
    assert runners[id(target)].batches == [[[100, 100], [200, 200]], [[101, 101], [201, 201]]]
    assert first.done and first.result == 1 and second.result == 2
    assert log == [(1, 0, [100, 100]), (2, 0, [200, 200]), (1, 1, [101, 101]), (2, 1, [201, 201])]


def test_requests_join_and_leave_between_ticks(models):
    draft, target, runners, scheduler = models
    log = []
    scheduler.add(request(draft, target, 1, 1, log))
    scheduler.tick()  # 1 drafts alone
    scheduler.add(request(draft, target, 2, 1, log))  # joins: its draft goes before 1's verify
    scheduler.tick()
    assert runners[id(draft)].batches == [[[100]], [[200]]] and runners[id(target)].batches == []
    scheduler.tick()  # both verify together; both end
    assert runners[id(target)].batches == [[[100, 100], [200, 200]]] and not scheduler.requests


def test_what_does_not_fit_the_capacity_waits_for_the_next_batch(models):
    draft, target, runners, scheduler = models
    runners[id(target)].capacity = 3
    for n in (1, 2):
        scheduler.add(step(target, [n, n]))
    scheduler.tick()
    scheduler.tick()
    assert runners[id(target)].batches == [[[1, 1]], [[2, 2]]]


def test_a_prompt_goes_in_chunks_and_its_request_resumes_after_the_last(models):
    draft, target, runners, scheduler = models
    runners[id(target)].chunk = lambda request, scheduler: 2
    prompt = scheduler.add(step(target, [1, 2, 3, 4, 5], "last"))
    other = scheduler.add(step(target, [9], "all"))
    scheduler.tick()
    assert not prompt.done and other.done and other.result == [9]
    scheduler.tick()
    scheduler.tick()
    assert runners[id(target)].batches == [[[1, 2], [9]], [[3, 4]], [[5]]]
    assert prompt.done and prompt.result == [5]


def test_a_chunk_that_fails_fails_its_request(models):
    draft, target, runners, scheduler = models
    runners[id(target)].chunk = lambda request, scheduler: 2
    prompt = scheduler.add(step(target, [1, 2, 3, 4], "none"))
    runners[id(target)].fail = RuntimeError("no cells")
    scheduler.tick()
    assert prompt.done and isinstance(prompt.error, RuntimeError)


def test_a_failed_batch_fails_each_of_its_decodes_and_nothing_else(models):
    draft, target, runners, scheduler = models
    log = []
    failing = scheduler.add(step(target, [1]))
    drafting = scheduler.add(request(draft, target, 2, 1, log))
    runners[id(target)].fail = RuntimeError("decode failed")
    scheduler.tick()  # the draft first
    scheduler.tick()
    assert failing.done and str(failing.error) == "decode failed"
    assert drafting.done and str(drafting.error) == "decode failed"  # its verify was in that batch
    assert runners[id(draft)].batches == [[[200]]]


def test_a_request_that_should_stop_gets_stopped_at_its_next_decode(models):
    draft, target, runners, scheduler = models
    stop = []
    log = []
    caught = []

    def stoppable():
        try:
            yield from request(draft, target, 1, 5, log)
        except Stopped:
            caught.append(len(log))
            raise

    stopped = scheduler.add(stoppable(), should_stop=lambda: bool(stop))
    other = scheduler.add(request(draft, target, 2, 2, log))
    scheduler.tick()
    scheduler.tick()
    stop.append(True)
    while scheduler.requests:
        scheduler.tick()
    assert isinstance(stopped.error, Stopped) and caught == [2]  # after its first step
    assert other.result == 2
    assert not scheduler.abort_wanted()


def test_a_closed_scheduler_stops_every_request_and_a_batch_may_abort_only_when_all_in_it_should_stop(models):
    draft, target, runners, scheduler = models
    a = scheduler.add(step(target, [1]), should_stop=lambda: True)
    b = scheduler.add(step(target, [2]))
    scheduler._batch = [a, b]
    assert not scheduler.abort_wanted()
    scheduler._batch = [a]
    assert scheduler.abort_wanted()
    scheduler._batch = []
    scheduler.close()
    assert scheduler.abort_wanted()
    scheduler.tick()
    assert isinstance(a.error, Stopped) and isinstance(b.error, Stopped) and not scheduler.requests


def test_what_else_a_request_yields_goes_to_its_sink_and_a_request_alone_runs_through_ticks():
    model = Model()

    def work():
        yield "before"
        rows = yield from step(model, [1, 2], "last")
        yield ("rows", rows)
        head = HeadDecode(type("Head", (), {"decode": lambda self, t, p, r: ("entry", list(t))})(), [3], 0, [[0.0]])
        yield head
        yield ("head", head.result())
        return "end"

    seen = []
    scheduler = Scheduler(lambda need: Alone())
    r = scheduler.add(work(), seen.append)
    assert seen == ["before"] and not r.done
    runner = run_alone(work())
    assert list(runner) == ["before", ("rows", [2]), ("head", ("entry", [3]))]
    assert run(step(model, [4, 5], "all")) == [4, 5]
