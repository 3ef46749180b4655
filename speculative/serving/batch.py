"""`speculate batch`: many requests through one Engine, every result kept as soon as it exists.

Requests start in file order, -np of them at once (engine/parallel.py: one slot each, their
steps decoded together), with the models loaded once; a request that starts like one a slot
ran before (the same system prompt or document) keeps that prefix in the caches instead of
processing it again (its stats say how much: n_cached).

Nothing is lost: each result is appended to the results file as one JSON line, flushed
and synced, as soon as it finishes (so in completion order). A rerun with the same results
file skips every request that already has a line there, so a process killed in the middle
loses at most the requests in flight; a half-written last line (killed while writing) is cut
off and that request runs again. A line that cannot be a request (not UTF-8, not JSON, no
usable id, a duplicate id, a bad setting) and a request that fails (a prompt longer than
the context, a model error) get an error line with their line number, and the batch
goes on.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterator, Union

from speculative.decoding.scheduler import Stopped
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.engine.chat import prompt_or_messages
from speculative.engine.stream import Final, completing
from speculative.serving.generation import is_int, is_number
from speculative.errors import GrammarError, SpeculateError, UsageError
from speculative.grammar import given
from speculative.llamacpp import interrupt

if TYPE_CHECKING:  # annotations only: importing the engine loads llama.cpp
    from speculative.engine.parallel import Handle, Parallel

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock, one batch per results file is on the user
    fcntl = None

# No prompt that fits a context comes near this; a longer line is refused unread.
MAX_LINE_BYTES = 16 << 20
# A request nests a few levels (chat messages: objects in a list in an object); the checks
# below recurse, so a line nested much deeper is refused rather than risk the stack.
MAX_DEPTH = 64
# Every record is one json.dumps line with its id first (Results.append): a half-written
# last line begins like this, and a file whose last line does not is not ours to cut.
RECORD_START = b'{"id": '


def _is_stop(v) -> bool:
    return (isinstance(v, str) and v != "") or (
        isinstance(v, list) and all(isinstance(s, str) and s != "" for s in v))


# Per-request settings over the command line's defaults: (valid?, what it must be).
SETTINGS: dict[str, tuple[Callable[[object], bool], str]] = {
    "n_predict": (lambda v: is_int(v) and v >= -1, "an integer >= -1"),
    "temperature": (lambda v: is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "seed": (lambda v: is_int(v) and -1 <= v < 2**32, "an integer in [-1, 2^32)"),
    "stop": (_is_stop, "a non-empty string or a list of them"),
}
FIELDS = ("id", "prompt", "messages", *SETTINGS, "grammar", "json_schema")  # a grammar: given.from_fields


@dataclass(frozen=True)
class Request:
    id: str | int
    line: int
    prompt: str | None
    messages: list | None
    sampling: SamplerSettings
    spec: SpecSettings
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rejected:
    """An input line that is not a request. `id` is None unless the line has a usable id of
    its own (a duplicate's id belongs to the first line that has it)."""
    line: int
    id: str | int | None
    error: str


Item = Union[Request, Rejected]


def id_key(value) -> str:
    """Ids compare as JSON values: 1 and "1" are different requests."""
    return json.dumps(value)


# -- the input -------------------------------------------------------------


def read_requests(path: Path, sampling: SamplerSettings, spec: SpecSettings) -> list[Item]:
    """Every non-blank line of the JSONL file, as a request over these defaults or as
    the reason it is not one."""
    try:
        with open(path, "rb") as f:
            return _parse_all(_lines(f), sampling, spec)
    except OSError as e:
        raise UsageError(f"cannot read requests file {path}: {e.strerror or e}") from None


def _lines(f: BinaryIO) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes), with None for a line over MAX_LINE_BYTES (skipped unread)."""
    number = 0
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        number += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = f.readline(1 << 20)
            yield number, None
        else:
            yield number, line


def _parse_all(lines: Iterator[tuple[int, bytes | None]], sampling: SamplerSettings,
               spec: SpecSettings) -> list[Item]:
    items: list[Item] = []
    first_line: dict[str, int] = {}  # id key -> the line that has it
    for number, raw in lines:
        if raw is not None and not raw.strip():
            continue
        item = _parse(number, raw, sampling, spec)
        if item.id is not None:
            key = id_key(item.id)
            if key in first_line:
                item = Rejected(number, None, f"duplicate id {key} (first on line {first_line[key]})")
            else:
                first_line[key] = number
        items.append(item)
    return items


def _parse(number: int, raw: bytes | None, sampling: SamplerSettings, spec: SpecSettings) -> Item:
    if raw is None:
        return Rejected(number, None, f"line longer than {MAX_LINE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Rejected(number, None, f"not valid UTF-8 (byte {e.start})")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Rejected(number, None, f"not JSON ({e.msg} at column {e.colno})")
    except ValueError:  # Python refuses to read an integer this long (int_max_str_digits)
        return Rejected(number, None, f"not usable JSON (a number over {_max_digits()} digits)")
    except RecursionError:
        return Rejected(number, None, f"not usable JSON (nested over {MAX_DEPTH} levels deep)")
    if not isinstance(obj, dict):
        return Rejected(number, None, "not a JSON object")
    if _depth(obj) > MAX_DEPTH:
        return Rejected(number, None, f"not usable JSON (nested over {MAX_DEPTH} levels deep)")
    if not _utf8(obj):  # JSON's \ud800 escapes decode to text that has no UTF-8 form
        return Rejected(number, None, "not valid UTF-8 (a lone surrogate escape)")
    request_id = obj.get("id")
    if not ((isinstance(request_id, str) and request_id) or is_int(request_id)):
        return Rejected(number, None, "needs an `id`: a non-empty string or an integer")
    error = _check(obj)
    if error:
        return Rejected(number, request_id, error)
    prompt, messages = prompt_or_messages(obj)
    stop = obj.get("stop", ())
    try:
        grammar = given.from_fields(obj.get("grammar"), obj.get("json_schema")) or sampling.grammar
    except GrammarError as e:
        return Rejected(number, request_id, str(e))
    return Request(
        request_id, number, prompt, messages,
        replace(sampling, temp=float(obj.get("temperature", sampling.temp)),
                top_p=float(obj.get("top_p", sampling.top_p)), seed=obj.get("seed", sampling.seed),
                grammar=grammar),
        replace(spec, n_predict=obj.get("n_predict", spec.n_predict)),
        (stop,) if isinstance(stop, str) else tuple(stop))


def _check(obj: dict) -> str | None:
    """What is wrong with a request that has an id, if anything."""
    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        return f"unknown field {unknown[0]!r} (known: {', '.join(FIELDS)})"
    for name, (valid, must_be) in SETTINGS.items():
        if name in obj and not valid(obj[name]):
            return f"`{name}` must be {must_be}, got {_shown(obj[name])}"
    try:
        prompt_or_messages(obj)
    except ValueError as e:
        return str(e)
    return None


def _max_digits() -> int:
    return sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300


def _depth(value) -> int:
    """How deep a parsed JSON value nests, found without recursion (json.loads reads far
    deeper than the recursive checks below could go)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(value, (dict, list)):
            stack += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return deepest


def _shown(value, limit: int = 80) -> str:
    """A bad value as an error message quotes it: a 400-digit number or a long list cut short."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _utf8(value) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_utf8(k) and _utf8(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_utf8(v) for v in value)
    return True


# -- the results file --------------------------------------------------------


class Results:
    """The JSONL results file: what earlier runs recorded, and appending one line at a time."""

    def __init__(self, path: Path, notify: Callable[[str], None] | None = None):
        self.path = path
        self.succeeded: dict[str, bool] = {}  # id key -> whether its recorded request succeeded
        self.rejected_lines: set[int] = set()  # lines recorded as not being requests
        try:
            self._file = open(path, "ab+")
        except OSError as e:
            raise UsageError(f"cannot open results file {path}: {e.strerror or e}") from None
        try:
            self._lock()
            self._read(notify)
        except BaseException:
            self._file.close()
            raise

    def _lock(self) -> None:
        """Two batches appending to one file would run requests twice."""
        if fcntl is None:
            return
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UsageError(f"{self.path} is in use by another speculate batch") from None

    def _read(self, notify: Callable[[str], None] | None) -> None:
        """Every line checked before anything is cut: a file that is not a results file is
        refused as it is, byte for byte."""
        self._file.seek(0)
        data = self._file.read()
        whole = data.rfind(b"\n") + 1
        lines = data[:whole].split(b"\n")[:-1]
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = _record(line)
            if record is None:
                raise self._not_ours(number)
            if record["id"] is None:
                self.rejected_lines.add(record["line"])
            else:
                self.succeeded[id_key(record["id"])] = "error" not in record
        if whole < len(data):
            if not _half_written(data[whole:]):
                raise self._not_ours(len(lines) + 1)
            self._file.truncate(whole)  # killed while writing it: that request runs again
            if notify:
                notify(f"{self.path}: dropped a half-written last line ({len(data) - whole} bytes)")

    def _not_ours(self, number: int) -> UsageError:
        return UsageError(f"{self.path}:{number}: not a speculate batch result; "
                          "refusing to append to this file (choose another -o)")

    def recorded(self, item: Item) -> bool | None:
        """Whether an earlier run's record for this item says it succeeded; None: no record."""
        if item.id is None:
            return False if item.line in self.rejected_lines else None
        return self.succeeded.get(id_key(item.id))

    def append(self, record: dict) -> None:
        """One line, written with one call, on disk before this returns; its id first, so
        that a half-written one is recognised (RECORD_START)."""
        record = {"id": record["id"], **record}
        self._file.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _record(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None
    ok = isinstance(record, dict) and is_int(record.get("line")) and "id" in record
    return record if ok else None


def _half_written(tail: bytes) -> bool:
    """Whether a last line without its newline is the start of a record (cut anywhere, even
    inside RECORD_START), and not a whole line of something else."""
    if not (tail.startswith(RECORD_START) or RECORD_START.startswith(tail)):
        return False
    try:
        json.loads(tail)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return True  # cut short: it cannot be read
    return _record(tail) is not None  # whole but for the newline: a record, or not ours


# -- running -----------------------------------------------------------------


@dataclass
class Summary:
    requests: int = 0             # lines in the input (requests and lines that are not)
    succeeded: int = 0            # this run
    failed: int = 0               # this run (rejected lines included)
    earlier_succeeded: int = 0    # recorded by an earlier run, skipped now
    earlier_failed: int = 0
    n_prompt: int = 0             # this run's successful requests, summed
    n_cached: int = 0
    n_predict: int = 0
    n_drafted: int = 0
    n_accept: int = 0
    t_encode: float = 0.0
    t_decode: float = 0.0
    t_load: float = 0.0
    seconds: float = 0.0          # wall clock of this run, from the first request
    interrupted: bool = False
    running: int = 0              # requests generating now
    _started: float = field(default_factory=time.perf_counter, repr=False)

    @property
    def remaining(self) -> int:
        return self.requests - self.succeeded - self.failed - self.earlier_succeeded - self.earlier_failed

    @property
    def all_succeeded(self) -> bool:
        return not self.failed and not self.earlier_failed and not self.remaining

    def add(self, record: dict) -> None:
        self.seconds = time.perf_counter() - self._started
        if "error" in record:
            self.failed += 1
            return
        self.succeeded += 1
        stats = record["stats"]
        for name in ("n_prompt", "n_cached", "n_predict", "n_drafted", "n_accept"):
            setattr(self, name, getattr(self, name) + stats[name])
        self.t_encode += stats["t_encode_s"]
        self.t_decode += stats["t_decode_s"]

    def to_dict(self) -> dict:
        return {
            "requests": self.requests, "succeeded": self.succeeded, "failed": self.failed,
            "earlier_succeeded": self.earlier_succeeded, "earlier_failed": self.earlier_failed,
            "remaining": self.remaining, "all_succeeded": self.all_succeeded, "interrupted": self.interrupted,
            "n_prompt": self.n_prompt, "n_cached": self.n_cached,
            "cached_share": self.n_cached / self.n_prompt if self.n_prompt else 0.0,
            "n_predict": self.n_predict, "n_drafted": self.n_drafted, "n_accept": self.n_accept,
            "accept_rate": self.n_accept / self.n_drafted if self.n_drafted else 0.0,
            "decode_tps": self.n_predict / self.t_decode if self.t_decode > 0 else 0.0,
            "tokens_per_second": self.n_predict / self.seconds if self.seconds > 0 else 0.0,
            "t_encode_s": self.t_encode, "t_decode_s": self.t_decode, "t_load_s": self.t_load,
            "seconds": self.seconds,
        }


def pending(items: list[Item], results: Results) -> list[Item]:
    """The items that `results` has no record of."""
    return [item for item in items if results.recorded(item) is None]


def run_batch(parallel: Parallel | None, items: list[Item], results: Results,
              on_record: Callable[[Summary], None] | None = None) -> Summary:
    """Run every item that `results` has no record of, appending one record each as it
    finishes, -np requests at once (`parallel` may be None when none of them is a request), the
    scheduler ticking on this thread. Ctrl-C or SIGTERM stops after recording what finished (the
    requests in flight run again next time); the summary says so."""
    summary = Summary(requests=len(items), t_load=parallel.engine.t_load if parallel else 0.0)
    for item in items:
        earlier = results.recorded(item)
        if earlier is not None:
            summary.earlier_succeeded += earlier
            summary.earlier_failed += not earlier
    todo = iter(pending(items, results))
    running: list[tuple[Request, int, Handle]] = []  # each with its seed

    def record(entry: dict) -> None:
        with interrupt.deferred():  # a record in the file is one the summary counts
            results.append(entry)
            summary.add(entry)
        summary.running = len(running)
        if on_record:
            on_record(summary)

    # a decode in progress stops once the scheduler closes (llama.cpp's abort callback asks it)
    with interrupt.cancel_when(parallel.scheduler.abort_wanted if parallel else lambda: False):
        try:
            while True:
                while parallel is None or len(running) < parallel.n_slots:  # hand over what fits in the slots
                    item = next(todo, None)
                    if item is None:
                        break
                    started = start_request(parallel, item) if isinstance(item, Request) else None
                    if isinstance(started, tuple):
                        running.append(started)
                    else:
                        record(started or error_record(item, item.error))
                if not running:
                    break
                parallel.tick()
                for request, seed, handle in [r for r in running if r[2].done]:
                    running.remove((request, seed, handle))
                    try:
                        entry = result_record(request, seed, handle.wait())
                    except (Stopped, interrupt.Cancelled):  # stopping: this request runs again next time
                        continue
                    except SpeculateError as e:
                        entry = error_record(request, str(e))
                    record(entry)
        except KeyboardInterrupt:
            summary.interrupted = True
        finally:
            if parallel is not None:
                parallel.close()  # what still runs stops at its next decode
    return summary


def error_record(item: Item, error: str) -> dict:
    return {"id": item.id, "line": item.line, "finish_reason": "error", "error": error}


def start_request(parallel: Parallel, request: Request) -> tuple[Request, int, Handle] | dict:
    """Hand one request over to run to its end (or its first stop string) in a slot of its own;
    its error record when it cannot run."""
    seed = request.sampling.resolved_seed()
    engine = parallel.engine
    try:
        prompt = (engine.chat_tokens(request.messages) if request.messages is not None
                  else engine.prompt_tokens(request.prompt))
    except SpeculateError as e:
        return error_record(request, str(e))
    handle = parallel.submit(prompt, lambda slot: completing(slot, prompt, request.sampling, request.spec, seed,
                                                              request.stop))
    return request, seed, handle


def result_record(request: Request, seed: int, final: Final) -> dict:
    """A request's result record."""
    stats = final.stats.to_dict()
    del stats["finish_reason"]
    return {"id": request.id, "line": request.line, "text": final.text, "finish_reason": final.reason,
            "seed": seed, "stats": stats}
