"""What a forward pass costs on this machine, by batch size, measured once and kept.

`--spec-type auto` needs v(b), the target's time to score a batch of b tokens,
for b = 1..k_max+1 (the curve is not monotonic on CPUs: kernels change with the
batch size), and the draft's time per token. They are measured on the loaded
model, then cached in $SPECULATE_HOME/calibration.json under a key of everything
that changes them: the model file, threads, GPU layers, batch sizes, the
llama.cpp build and its devices.

With several requests at once (-np N) a step's pass carries the others' tokens too, and
what llama.cpp runs for it depends on the memory: in one unified pool of KV cells, one
batch; with a KV stream per sequence, or a recurrent state, slices of equal length per
sequence (split_equal), so a pass of one request's b tokens and one token of each other
costs what no single-sequence batch shows. `measure_shared` times exactly that pass, for
each number of requests, under a key that adds the sequences and the memory's layout.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np

from speculative.decoding.cache import Cache, MtpCache
from speculative.files import locked, write_atomic
from speculative.llamacpp.decode import Part
from speculative.models.registry import home

FILLER_TOKENS = 32   # the batches are scored after a short context, like a real step
QUICK_REPEATS = 3    # every size is timed this many times, in rounds over the sizes: best of each
DENSE_UP_TO = 9      # kernels switch below here (8 rows on x86): every size is timed ...
SPARSE_STEP = 4      # ... and beyond, every 4th


def cache_path() -> Path:
    return home() / "calibration.json"


def batch_costs(cache: Cache | MtpCache, max_batch: int, identity: dict, notify: Callable[[str], None] | None = None,
                path: Path | None = None, measured_by: Callable[..., list[float]] | None = None) -> list[float]:
    """v(1..max_batch) in seconds, from the cache or measured now (and cached) by
    `measured_by`: `measure` (the default), `measure_shared` or `measure_mtp`."""
    path = path or cache_path()
    key = _key(identity)
    stored = _load(path)
    known = stored.get(key, {}).get("seconds", [])
    if len(known) >= max_batch:
        return known[:max_batch]
    if notify:
        others = identity.get("sequences", 1) - 1
        beside = f" beside a token of {others} other request{'s' * (others > 1)}" if others else ""
        notify(f"calibrating {identity.get('name', 'the model')}: verify cost of batches of 1-{max_batch} "
               f"tokens{beside} (once for this model, threads and build; cached in {path})")
    t0 = time.perf_counter()
    costs = (measured_by or measure)(cache, max_batch)
    if notify:
        notify("calibrated in {:.1f} s: {}".format(
            time.perf_counter() - t0, " ".join(f"{b}:{1000 * c:.0f}ms" for b, c in enumerate(costs, 1))))
    _update(path, lambda stored: stored.update({key: {"identity": identity, "seconds": costs}}))
    return costs


def forget(identity: dict, path: Path | None = None) -> None:
    """Drop a model's calibration, so that the next run measures it again."""
    _update(path or cache_path(), lambda stored: stored.pop(_key(identity), None))


def _key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def measure(cache: Cache, max_batch: int) -> list[float]:
    """v(1..max_batch): one decode of b tokens after FILLER_TOKENS of context is timed
    for every b up to DENSE_UP_TO, and for every SPARSE_STEP-th b beyond, where costs
    change slowly; the sizes between are interpolated. It keeps calibration to seconds.
    The cache is left empty."""
    model = cache.model
    n_fill = max(0, min(FILLER_TOKENS, model.n_ctx - max_batch))  # a tiny -c still calibrates
    cache.sync(_tokens(1000, n_fill, model.n_vocab))
    cache.checkpoint()  # a recurrent state comes back here after each batch
    costs = _timed(max_batch, model.n_vocab, lambda batch: cache.extend(batch, "all"), lambda: cache.rollback(n_fill))
    cache.forget()
    return costs


def measure_shared(cache: Cache, max_batch: int, n_seqs: int) -> list[float]:
    """v_n(1..max_batch): one pass with b tokens of one request and one token of each of
    n_seqs - 1 others (each slot's first sequence, after FILLER_TOKENS of its own), timed as
    `measure` times one sequence's batches: what a step costs a request planning its draft
    among n_seqs - 1 others that decode plainly (drafters/auto.py). Every sequence of the
    model must be free (it runs before the slots take requests); all are left empty."""
    model = cache.model
    cache.forget()
    n_fill = max(0, min(FILLER_TOKENS, model.n_ctx - max_batch, model.n_batch // n_seqs))
    slots = range(n_seqs)
    fill = [Part(_tokens(1000 + 97 * s, n_fill, model.n_vocab), range(n_fill), [(s * model.n_seq,)] * n_fill,
                 "none", s) for s in slots]

    def filled() -> None:
        if n_fill:
            model.decode_parts(fill)

    def undo() -> None:
        if model.rollback_limit is None:  # attention caches drop the pass's cells
            for s in slots:
                model.trim(n_fill, s)
        else:  # a recurrent state rolls back once, and only so far: start again from the filler
            model.clear()
            filled()

    def decode(batch: list[int]) -> None:
        model.decode_parts([Part(batch, range(n_fill, n_fill + len(batch)), [(0,)] * len(batch), "all", 0),
                            *(Part([(3000 + s) % model.n_vocab], [n_fill], [(s * model.n_seq,)], "all", s)
                              for s in slots[1:])])

    filled()
    try:
        return _timed(max_batch, model.n_vocab, decode, undo)
    finally:
        model.clear()


def measure_mtp(mtp: MtpCache, max_batch: int) -> list[float]:
    """An MTP head's v(1..max_batch), measured as `measure` does: entries decoded after
    FILLER_TOKENS of its own, on rows of zeros (what a row holds does not change the cost).
    The head is left empty."""
    head = mtp.head
    if head.shared_memory:  # no cache of its own: it only ever decodes one entry, b of them b times
        row = np.zeros((1, head.n_embd), dtype=np.float32)
        one = _timed(1, head.n_vocab, lambda batch: head.decode(batch[-1:], 0, row), lambda: None)[0]
        return [one * b for b in range(1, max_batch + 1)]
    n_fill = max(0, min(FILLER_TOKENS, head.n_ctx - max_batch))
    rows = np.zeros((n_fill + max_batch, head.n_embd), dtype=np.float32)
    mtp.forget()
    if n_fill:
        mtp.extend(_tokens(1000, n_fill, head.n_vocab), rows[:n_fill])
    costs = _timed(max_batch, head.n_vocab, lambda batch: mtp.extend(batch, rows[: len(batch)]),
                   lambda: mtp.rollback(n_fill))
    mtp.forget()
    return costs


def _tokens(first: int, n: int, n_vocab: int) -> list[int]:
    return [(first + i) % n_vocab for i in range(n)]


def _timed(max_batch: int, n_vocab: int, decode: Callable[[list[int]], object],
           undo: Callable[[], None]) -> list[float]:
    """Seconds `decode` takes for batches of 1..max_batch tokens, `undo` after each: every size
    up to DENSE_UP_TO, every SPARSE_STEP-th beyond, the ones between interpolated.

    Each size is timed QUICK_REPEATS times, in rounds over all the sizes, and its best time
    kept: a moment of load (another process, a noisy VM) then spoils one round's figure, not
    one size's, and the ratios between sizes, by which auto chooses draft lengths, hold."""
    sizes = sorted({*range(1, min(max_batch, DENSE_UP_TO) + 1),
                    *range(DENSE_UP_TO, max_batch + 1, SPARSE_STEP), max_batch})
    batches = [_tokens(2000, b, n_vocab) for b in sizes]
    for batch in batches:  # untimed: a batch of a new size sets up its graph first (over RPC, in
        decode(batch)      # round trips: seconds on a slow link, once, where generation repeats sizes)
        undo()
    best = [float("inf")] * len(sizes)
    for _ in range(QUICK_REPEATS):
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            decode(batch)
            best[i] = min(best[i], time.perf_counter() - t0)
            undo()
    return [float(c) for c in np.interp(np.arange(1, max_batch + 1), sizes, best)]


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: measure again


def _update(path: Path, change: Callable[[dict], object]) -> None:
    """Change the stored calibrations, one process at a time (others may calibrate too)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path):
            stored = _load(path)
            change(stored)
            write_atomic(path, [json.dumps(stored, indent=1).encode()])
    except OSError:
        pass  # a read-only home only costs a new calibration next time


def checkpoint_costs(cache: Cache, repeats: int = QUICK_REPEATS) -> tuple[float, float]:
    """Seconds to copy a recurrent state into a checkpoint and to restore it (cache.py), best
    of a few after FILLER_TOKENS of context. Milliseconds to measure, so not kept. The cache
    is left empty."""
    model = cache.model
    n_fill = max(1, min(FILLER_TOKENS, model.n_ctx // 2))
    cache.sync(_tokens(1000, n_fill, model.n_vocab))
    save = restore = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.save_state(partial=True)  # what Cache.checkpoint does; it changes nothing
        save = min(save, time.perf_counter() - t0)
    cache.checkpoint()
    past_limit = _tokens(2000, (model.rollback_limit or 0) + 1, model.n_vocab)
    for _ in range(repeats):
        cache.extend(past_limit)
        t0 = time.perf_counter()
        cache.rollback(n_fill)  # past what the model can undo: from the checkpoint
        restore = min(restore, time.perf_counter() - t0)
    cache.forget()
    return save, restore
