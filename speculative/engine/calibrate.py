"""What a model's passes cost, measured on the loaded model before the first run that needs
it, in a few seconds: the book of costs (costs.py) learns the rest from the passes runs make.

For a target, `--spec-type auto` needs one request's verify passes of b = 1..k_max + 1 tokens
(the curve is not monotonic on CPUs: kernels change with the batch size); for a draft model
or a head, a token alone and one within a batch of CATCHUP_BATCH (factory.py). Each size is
decoded after a short context, like a real step, ROUNDS times in rounds over all the sizes,
so that a moment of load spoils one round's figure of one size and the ratios between sizes
of a round hold.

A calibration that disagrees with itself (a size whose rounds are far apart, a batch that
costs less than a token alone, a single token that costs something else at the end than in
the rounds) was measured while the machine was busy: it is measured again, and if it still
disagrees it is used by this process and not kept, so that a busy moment does not decide
later runs' plans. Several requests' passes (serve's and batch's -np) are not calibrated:
the book derives them from one request's until their own passes have been timed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from speculative.decoding.cache import Cache, HeadCache
from speculative.decoding.scheduler import run
from speculative.engine.costs import ModelCosts

FILLER_TOKENS = 32   # the batches are scored after a short context, like a real step
ROUNDS = 3           # every size is timed this many times, in rounds over the sizes
DENSE_UP_TO = 9      # kernels switch below here (8 rows on x86): every size is timed ...
SPARSE_STEP = 4      # ... and beyond, every 4th
ATTEMPTS = 3         # a calibration that disagrees with itself is measured up to this many times
SPREAD = 1.3         # a size's rounds differ by more than this factor: it met a busy moment ...
NOISY_SHARE = 0.25   # ... and more than this share of sizes did: the calibration disagrees
CHEAPER = 0.75       # a batch timed below this share of one token's time: the token met load
AGAIN = 0.3          # one token re-timed at the end this much off the rounds: the load changed

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Timings:
    """A calibration's measurements: rounds[b][r], round r's seconds for b tokens; `again`, one
    token timed once more after the rounds (None when size 1 was not timed)."""
    rounds: dict[int, list[float]]
    again: float | None = None


def target_sizes(max_batch: int) -> list[int]:
    """The sizes timed for passes of up to max_batch tokens (the ones between are interpolated)."""
    return sorted({*range(1, min(max_batch, DENSE_UP_TO) + 1), *range(DENSE_UP_TO, max_batch + 1, SPARSE_STEP),
                   max_batch})


def calibrate(measure: Callable[[list[int], Progress], Timings], sizes: list[int],
              progress: Progress | None = None) -> tuple[Timings, str | None]:
    """`measure(sizes, progress)` up to ATTEMPTS times, until it agrees with itself: its timings
    and None, or the last attempt's and why they were not trusted."""
    why = None
    for attempt in range(ATTEMPTS):
        report = progress
        if progress is not None and attempt:
            report = lambda text: progress(f"{text} (again: {why})")  # noqa: E731 (why: the last attempt's)
        timings = measure(sizes, report or (lambda text: None))
        why = disagreement(timings)
        if why is None:
            return timings, None
    return timings, why


def into(costs: ModelCosts, name: str, measure: Callable[[list[int], Progress], Timings], sizes: list[int],
         notify: Callable[[str], None] | None = None, progress: Progress | None = None) -> None:
    """Calibrate a model's passes of these sizes into its entry of the book of costs, saying so
    (`notify`) and how far it is (`progress`, cleared with "" at the end); a calibration that
    still disagrees with itself after every attempt is used and not kept (ModelCosts.record_rounds)."""
    what = f"{name}'s passes of {sizes[0]}-{sizes[-1]} tokens" if len(sizes) > 1 else f"{name}'s passes"
    if notify:
        notify(f"calibrating {what} (once for this model file, build and settings)")
    show = progress or (lambda text: None)
    t0 = time.perf_counter()
    try:
        timings, why = calibrate(measure, sizes, lambda text: show(f"calibrating {name}: {text}"))
    finally:
        show("")
    costs.record_rounds(timings.rounds, keep=why is None)
    if notify:
        took = time.perf_counter() - t0
        summary = " ".join(f"{b}:{1000 * float(np.median(t)):.0f}ms" for b, t in timings.rounds.items())
        notify(f"calibrated in {took:.1f} s: {summary}" if why is None else
               f"calibrated in {took:.1f} s while the machine was busy ({why}): used by this run, not kept")


def disagreement(timings: Timings) -> str | None:
    """Why these timings do not agree with themselves (None: they do)."""
    rounds = timings.rounds
    spreads = {b: max(times) / min(times) for b, times in rounds.items()}
    noisy = [b for b, spread in spreads.items() if spread > SPREAD]
    if len(noisy) > NOISY_SHARE * len(spreads):
        b = max(noisy, key=spreads.get)
        return f"{len(noisy)} of {len(spreads)} sizes differ between rounds, {b} tokens by {spreads[b]:.1f}x"
    if 1 not in rounds:
        return None
    single = float(np.median(rounds[1]))
    cheaper = [b for b, times in rounds.items() if b > 1 and np.median(times) < CHEAPER * single]
    if cheaper:
        return f"{cheaper[0]} tokens took {np.median(rounds[cheaper[0]]) / single:.2f}x one token's time"
    if timings.again is not None and abs(timings.again / single - 1.0) > AGAIN:
        return f"one token took {timings.again / single:.2f}x as long at the end"
    return None


def measure(cache: Cache, sizes: list[int], progress: Progress) -> Timings:
    """A model's passes of one sequence's b tokens, all rows scored, after FILLER_TOKENS of
    context. The cache is left empty."""
    model = cache.model
    n_fill = max(0, min(FILLER_TOKENS, model.n_ctx - max(sizes)))  # a tiny -c still calibrates
    run(cache.sync(_tokens(1000, n_fill, model.n_vocab)))
    cache.checkpoint()  # a recurrent state comes back here after each batch
    try:
        return _timed(sizes, model.n_vocab, lambda batch: run(cache.extend(batch, "all")),
                      lambda: cache.rollback(n_fill), progress)
    finally:
        cache.forget()


def measure_mtp(mtp: HeadCache, sizes: list[int], progress: Progress) -> Timings:
    """An MTP head's entries, timed as `measure` times a model's, after FILLER_TOKENS of its own,
    on rows of zeros (what a row holds does not change the cost). The head is left empty."""
    head = mtp.head
    if head.shared_memory:  # no cache of its own: it only ever decodes one entry, b of them b times
        row = np.zeros((1, head.n_embd), dtype=np.float32)
        one = _timed([1], head.n_vocab, lambda batch: head.decode(batch[-1:], 0, row), lambda: None, progress)
        return Timings({b: [t * b for t in one.rounds[1]] for b in sizes}, one.again)
    n_fill = max(0, min(FILLER_TOKENS, head.n_ctx - max(sizes)))
    rows = np.zeros((n_fill + max(sizes), head.n_embd), dtype=np.float32)
    mtp.forget()
    if n_fill:
        run(mtp.extend(_tokens(1000, n_fill, head.n_vocab), rows[:n_fill]))
    try:
        return _timed(sizes, head.n_vocab, lambda batch: run(mtp.extend(batch, rows[: len(batch)])),
                      lambda: mtp.rollback(n_fill), progress)
    finally:
        mtp.forget()


def _tokens(first: int, n: int, n_vocab: int) -> list[int]:
    return [(first + i) % n_vocab for i in range(n)]


def _timed(sizes: list[int], n_vocab: int, decode: Callable[[list[int]], object], undo: Callable[[], None],
           progress: Progress) -> Timings:
    """Seconds `decode` takes for batches of each size, `undo` after each: ROUNDS rounds over all
    the sizes after an untimed one (a batch of a new size sets up its graph first: over RPC, in
    round trips), then one token once more, which `disagreement` compares with the rounds."""
    batches = [_tokens(2000, b, n_vocab) for b in sizes]
    rounds: dict[int, list[float]] = {b: [] for b in sizes}
    total, done = (ROUNDS + 1) * len(sizes), 0
    t0 = time.perf_counter()
    for r in range(ROUNDS + 1):
        for b, batch in zip(sizes, batches):
            if done:
                left = (time.perf_counter() - t0) / done * (total - done)
                progress(f"round {r + 1} of {ROUNDS + 1}, {b} token{'s' * (b > 1)} (about {left:.0f} s left)")
            start = time.perf_counter()
            decode(batch)
            if r:  # round 0 is the untimed one
                rounds[b].append(time.perf_counter() - start)
            undo()
            done += 1
    if sizes[0] != 1:
        return Timings(rounds)
    start = time.perf_counter()
    decode(batches[0])
    again = time.perf_counter() - start
    undo()
    return Timings(rounds, again)


def checkpoint_costs(cache: Cache, repeats: int = ROUNDS) -> tuple[float, float]:
    """Seconds to copy a recurrent state into a checkpoint and to restore it (cache.py), best
    of a few after FILLER_TOKENS of context. Milliseconds to measure. The cache is left empty."""
    model = cache.model
    n_fill = max(1, min(FILLER_TOKENS, model.n_ctx // 2))
    run(cache.sync(_tokens(1000, n_fill, model.n_vocab)))
    save = restore = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.save_state(partial=True)  # what Cache.checkpoint does; it changes nothing
        save = min(save, time.perf_counter() - t0)
    cache.checkpoint()
    past_limit = _tokens(2000, (model.rollback_limit or 0) + 1, model.n_vocab)
    for _ in range(repeats):
        run(cache.extend(past_limit))
        t0 = time.perf_counter()
        cache.rollback(n_fill)  # past what the model can undo: from the checkpoint
        restore = min(restore, time.perf_counter() - t0)
    cache.forget()
    return save, restore
