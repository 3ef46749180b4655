"""`speculate` with probes: the same speculative.cli.main.main(), which says on stderr when a run reaches
a moment a test must act at, and holds the run there until the test has acted. A test that
signals a run, or closes its output, then waits for an event instead of racing the work.

    python tests/probe.py ARGS...     (as `speculate ARGS...`; the probes by environment variable)

PROBE_DECODE=1   The first time llama.cpp polls its abort callback (inside a decode of a long
                 batch, between graph nodes) the probe says "probe: llama.cpp is decoding" and
                 the callback waits there for a signal; every llama_decode then reports its
                 return code ("probe: llama_decode of N tokens returned 2": 2 is aborted).
PROBE_PIECES=N   After the Nth piece of text of a run: "probe: N pieces", then wait for a signal.
PROBE_REQUEST=ID With PROBE_PIECES, in `speculate batch`: only in the request whose id is ID
                 (as JSON: 2, "q9").
PROBE_STDOUT=B   Once B bytes of text went to stdout, the next write first waits until stdout's
                 reader has gone: "probe: stdout's reader is gone".
PROBE_SERVE=1    In `speculate serve`: a prompt starting with HOLD_STEP is held after its first
                 piece of text (sent to the client) until the request must stop (its client
                 gone, its time up) or, with PROBE_RELEASE=FILE, until FILE exists; one starting
                 with HOLD_PROMPT is held inside llama.cpp, at the first graph node of its
                 prompt's decode (the abort callback), until the request must stop. Each hold
                 says "probe: holding after the first piece" / "... inside llama.cpp's prompt
                 decode" (on stderr: the server's log). Just before a request's answer is
                 posted to its client: "probe: posting a request's answer".

A wait that nothing ends gives up after HOLD_LIMIT seconds, saying so, so that a test whose
event never comes fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from pathlib import Path

HOLD_LIMIT = 300.0
HOLD_STEP = "[hold after the first piece] "
HOLD_PROMPT = "[hold inside the prompt] "

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import speculative.llamacpp.interrupt as interrupt  # noqa: E402  (before llamacpp registers the callback)


def say(line: str) -> None:
    os.write(2, f"probe: {line}\n".encode())


def wait_until(until) -> None:
    """Until `until()` is true, or HOLD_LIMIT seconds have passed."""
    end = time.monotonic() + HOLD_LIMIT
    while not until() and time.monotonic() < end:
        time.sleep(0.01)


def hold_for_a_signal() -> None:
    """Until the signal's handler raises KeyboardInterrupt here (in this Python code), or, on a
    thread of `speculate batch`'s (whose main thread the handler interrupts), until the batch
    stops its requests (interrupt.cancel_when's check)."""
    wait_until(lambda: interrupt._cancel is not None and interrupt._cancel())
    if not (interrupt._cancel is not None and interrupt._cancel()):
        say(f"no signal came in {HOLD_LIMIT:.0f} s")


if os.environ.get("PROBE_DECODE"):
    import llama_cpp  # noqa: E402

    _decode = llama_cpp.llama_decode
    _state = {"decoding": False, "announced": False}

    def _poll(_data=None) -> bool:
        """interrupt.poll; but the first time llama.cpp itself polls it, from inside a decode,
        it waits there for the test's signal (on llama.cpp's thread: the main thread waits for
        the decode, so the signal's handler only notes the request)."""
        if _state["decoding"] and not _state["announced"]:
            _state["announced"] = True
            os.write(2, b"probe: llama.cpp is decoding\n")
            # Inline, not wait_until: the signal's handler must run in this frame.
            end = time.monotonic() + HOLD_LIMIT
            while not interrupt._pending and time.monotonic() < end:
                time.sleep(0.01)
        return interrupt._pending or (interrupt._cancel is not None and interrupt._cancel())

    def _reported_decode(ctx, batch):
        _state["decoding"] = True
        try:
            ret = _decode(ctx, batch)
        finally:
            _state["decoding"] = False
        say(f"llama_decode of {batch.n_tokens} tokens returned {ret}")
        return ret

    interrupt.poll = _poll  # what llamacpp registers as the callback
    llama_cpp.llama_decode = _reported_decode

if os.environ.get("PROBE_PIECES"):
    import speculative.serving.batch as batch  # noqa: E402
    from speculative.engine.stream import Stream  # noqa: E402

    _pieces = int(os.environ["PROBE_PIECES"])
    _request = os.environ.get("PROBE_REQUEST")
    _current: list = []  # the batch request whose work runs now
    _iterate, _start_request = Stream.__iter__, batch.start_request

    def _held_iter(self):
        for n, piece in enumerate(_iterate(self), 1):
            yield piece
            if n == _pieces and (_request is None or (_current and json.dumps(_current[-1]) == _request)):
                say(f"{n} pieces")
                hold_for_a_signal()

    def _tracked(request, work):
        """The request's work, its id in _current while it runs (the scheduler steps several)."""
        while True:
            _current.append(request.id)
            try:
                item = next(work)
            except StopIteration as end:
                return end.value
            finally:
                _current.pop()
            yield item

    def _tracked_start_request(parallel, request):
        submit = parallel.submit
        parallel.submit = lambda prompt, work, *args: submit(prompt, lambda e: _tracked(request, work(e)), *args)
        try:
            return _start_request(parallel, request)
        finally:
            del parallel.submit

    Stream.__iter__ = _held_iter
    batch.start_request = _tracked_start_request

if os.environ.get("PROBE_STDOUT"):
    from speculative.cli import render  # noqa: E402

    _write = render.Stdout.write
    _out = {"sent": 0, "before": int(os.environ["PROBE_STDOUT"]), "waited": False}

    def _write_once_the_reader_is_gone(self, text: str, from_draft: bool = False) -> None:
        if text and _out["sent"] >= _out["before"] and not _out["waited"]:
            _out["waited"] = True
            watch = select.poll()
            watch.register(sys.stdout.fileno(), select.POLLERR)  # a pipe whose reader closed it
            say("stdout's reader is gone" if watch.poll(HOLD_LIMIT * 1000) else
                f"stdout's reader was still there after {HOLD_LIMIT:.0f} s")
        _write(self, text, from_draft)
        _out["sent"] += len(text.encode("utf-8"))

    render.Stdout.write = _write_once_the_reader_is_gone

if os.environ.get("PROBE_SERVE"):
    from speculative.llamacpp import decode as llamacpp_decode
    from speculative.serving import worker as serving  # noqa: E402
    from speculative.engine.stream import Final, Piece  # noqa: E402

    _release = os.environ.get("PROBE_RELEASE")
    _prompt_holds: list = []  # a HOLD_PROMPT request's "must it stop?", for llama.cpp's next abort callback
    _generate = serving.generate

    def _hold(until, where: str) -> None:
        say(f"holding {where}")
        wait_until(until)

    def _abort_callback(_data=None):
        if _prompt_holds:
            _hold(_prompt_holds.pop(), "inside llama.cpp's prompt decode")
        return interrupt.poll()

    def _held_generate(engine, generation, tokens, spec, should_stop, progress=None):
        prompt = generation.prompt or ""
        must_stop = lambda: should_stop() is not None  # noqa: E731
        if prompt.startswith(HOLD_PROMPT):
            _prompt_holds.append(must_stop)
        step = prompt.startswith(HOLD_STEP)
        try:
            for output in _generate(engine, generation, tokens, spec, should_stop, progress):
                yield output
                if step and isinstance(output, Piece):
                    step = False
                    _hold((lambda: os.path.exists(_release)) if _release else must_stop, "after the first piece")
        finally:
            _prompt_holds.clear()

    _post = serving.Job.post

    def _say_and_post(job, output) -> None:
        if isinstance(output, Final):
            say("posting a request's answer")
        _post(job, output)

    llamacpp_decode._abort = llamacpp_decode.ll.ggml_abort_callback(_abort_callback)
    serving.generate = _held_generate
    serving.Job.post = _say_and_post

if __name__ == "__main__":
    from speculative.cli.main import main

    main()
