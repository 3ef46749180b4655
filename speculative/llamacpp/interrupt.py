"""Ctrl-C and SIGTERM: stop at once, also in the middle of a llama.cpp call.

Python runs a signal handler only between bytecodes, so a signal that arrives while
llama_decode works through a long prompt (minutes on a CPU) would otherwise wait for
it. llama.cpp polls `poll` as its abort callback, on the thread that decodes (decode.run_decode:
the command line's and `batch`'s main thread; serve's model thread, which leaves signals to the
main one). While the main thread is inside a decode (`waiting()`), the handlers below, run by
the callback, only note the request: llama.cpp stops within a graph node, and the backend
calls `stop`, which raises KeyboardInterrupt. Anywhere else the handlers raise
KeyboardInterrupt straight away, as Python's Ctrl-C does.

A few steps must not be cut in two, such as writing a batch result and counting it:
within `deferred()`, a signal waits for the end of the block.

A generation run for someone else (`speculate serve`, whose client can go away in
the middle of a long prompt) is stopped the same way: `cancel_when(check)` makes
`poll` ask `check` too, and then `stop` raises Cancelled.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, NoReturn

_pending = False
_cancel: Callable[[], bool] | None = None
_deferring = False
_deferred = False  # a signal came during `deferred()`
_waiting = False  # the main thread is inside a decode


class Cancelled(Exception):
    """A decode stopped because the `cancel_when` check said so (not a signal)."""


def install() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt (and stop llama.cpp), unless ignored."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # e.g. nohup, or `cmd &` without job control
            signal.signal(signum, _handler)


def poll(_data=None) -> bool:
    """llama.cpp's abort callback: true once a signal asked to stop, or the check of
    `cancel_when` says so."""
    return _pending or (_cancel is not None and _cancel())


def signalled() -> bool:
    """Whether a signal asked to stop (and `stop` has not raised it yet)."""
    return _pending


@contextmanager
def waiting() -> Iterator[None]:
    """The calling thread waits for llama.cpp within the block: on the main thread, a signal
    meanwhile sets the request `poll` reports instead of raising in the middle of the wait."""
    global _waiting
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _waiting = True
    try:
        yield
    finally:
        _waiting = False


def stop() -> NoReturn:
    """llama.cpp stopped because `poll` said so: clear a signal's request and raise
    KeyboardInterrupt, else raise Cancelled."""
    global _pending
    if _pending:
        _pending = False
        raise KeyboardInterrupt
    raise Cancelled


@contextmanager
def cancel_when(check: Callable[[], bool]) -> Iterator[None]:
    """Within the block, decodes stop (Cancelled) as soon as `check()` is true: it is asked
    inside llama.cpp, at every graph node of a long batch, on the decoding thread."""
    global _cancel
    _cancel = check
    try:
        yield
    finally:
        _cancel = None


@contextmanager
def deferred() -> Iterator[None]:
    """Ctrl-C or SIGTERM during the block raises KeyboardInterrupt at its end, not in its middle."""
    global _deferring, _deferred
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        if _deferred:
            _deferred = False
            raise KeyboardInterrupt


def _handler(signum, frame) -> None:
    global _pending, _deferred
    if _waiting:
        _pending = True  # llama.cpp's thread works for this one: its callback stops it
        return
    if _deferring:
        _deferred = True
        return
    raise KeyboardInterrupt
