"""Ctrl-C and SIGTERM: stop at once, also in the middle of a llama.cpp call.

Python runs a signal handler only between bytecodes, so a signal that arrives while
llama_decode works through a long prompt (minutes on a CPU) would otherwise wait for
it. llama.cpp polls `poll` as its abort callback, on the calling (main) thread, where
the handlers below then run: there they only note the request, llama.cpp stops within
a graph node, and the backend calls `stop`, which raises KeyboardInterrupt. Anywhere
else the handlers raise KeyboardInterrupt straight away, as Python's Ctrl-C does.
"""

from __future__ import annotations

import signal
from typing import NoReturn

_pending = False


def install() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt (and stop llama.cpp), unless ignored."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # e.g. nohup, or `cmd &` without job control
            signal.signal(signum, _handler)


def poll(_data=None) -> bool:
    """llama.cpp's abort callback: true once a signal asked to stop."""
    return _pending


def stop() -> NoReturn:
    """llama.cpp stopped because `poll` said so: clear the request and raise KeyboardInterrupt."""
    global _pending
    _pending = False
    raise KeyboardInterrupt


def _handler(signum, frame) -> None:
    global _pending
    if frame is not None and frame.f_code is poll.__code__:
        _pending = True  # inside llama.cpp's callback, where an exception would be lost
        return
    raise KeyboardInterrupt
