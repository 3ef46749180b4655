"""The gate (speculative/decoding/gate.py): requests' decode calls become one batch per model per
step, the draft model's before the target's; members join and leave between batches; a closed
gate or a member that should stop raises Stopped. A fake runner records each batch it runs."""

from __future__ import annotations

import threading

import pytest

from speculative.decoding.gate import Gate, Stopped


class Recorder:
    """A model as the gate runs it: each batch's parts recorded; a part's result is its value
    doubled, or the exception it is."""

    def __init__(self, priority: int, capacity: int = 100):
        self.priority, self.capacity = priority, capacity
        self.batches: list[list] = []

    def size(self, part) -> int:
        return part[1]

    def run(self, parts):
        self.batches.append([p[0] for p in parts])
        return [p[0] if isinstance(p[0], BaseException) else p[0] * 2 for p in parts]


def run_members(gate: Gate, bodies) -> list:
    """Each body(gate) on a thread of its own, a member of the gate: their results, in order."""
    results: list = [None] * len(bodies)
    started = threading.Barrier(len(bodies))  # all join before any submits

    def member(i):
        with gate.member():
            started.wait()
            try:
                results[i] = bodies[i](gate)
            except BaseException as e:
                results[i] = e

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results


def test_every_members_call_runs_in_one_batch():
    target = Recorder(1)
    results = run_members(Gate(), [lambda g, i=i: g.submit(target, (i, 1)) for i in range(4)])
    assert results == [0, 2, 4, 6]
    assert len(target.batches) == 1 and sorted(target.batches[0]) == [0, 1, 2, 3]


def test_the_draft_runs_before_the_target_and_steps_stay_together():
    draft, target = Recorder(0), Recorder(1)

    def step(g, i, drafts):  # `drafts` draft positions, then a verify
        for d in range(drafts):
            g.submit(draft, (i * 10 + d, 1))
        return g.submit(target, (i, 1 + drafts))

    run_members(Gate(), [lambda g: step(g, 1, 3), lambda g: step(g, 2, 1), lambda g: step(g, 3, 0)])
    assert [sorted(b) for b in draft.batches] == [[10, 20], [11], [12]]  # one batch per draft position
    assert [sorted(b) for b in target.batches] == [[1, 2, 3]]  # verified together, after all drafting


def test_calls_beyond_the_capacity_wait_for_the_next_batch():
    target = Recorder(1, capacity=5)
    run_members(Gate(), [lambda g, i=i: g.submit(target, (i, 3)) for i in range(3)])
    assert [len(b) for b in target.batches] == [1, 1, 1]


def test_a_member_that_leaves_does_not_hold_the_others():
    target = Recorder(1)
    results = run_members(Gate(), [lambda g: "left", lambda g: g.submit(target, (5, 1))])
    assert results == ["left", 10]


def test_a_failed_call_fails_alone_and_a_closed_gate_stops_everyone():
    target = Recorder(1)
    boom = ValueError("no cells")
    results = run_members(Gate(), [lambda g: g.submit(target, (boom, 1)), lambda g: g.submit(target, (1, 1))])
    assert results == [boom, 2]
    gate = Gate()
    gate.close()
    with pytest.raises(Stopped):
        gate.submit(target, (1, 1))
    with pytest.raises(Stopped):
        with gate.member():
            pass
    assert gate.abort_wanted()


def test_a_member_that_should_stop_gets_stopped_at_its_next_call():
    gate, target = Gate(), Recorder(1)
    stop = threading.Event()
    with gate.member(stop.is_set):
        assert gate.submit(target, (1, 1)) == 2
        assert not gate.abort_wanted()
        stop.set()
        assert gate.abort_wanted()  # the only member: its batch may stop in its middle
        with pytest.raises(Stopped):
            gate.submit(target, (1, 1))
