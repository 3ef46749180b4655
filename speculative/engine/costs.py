"""What a model's passes cost on this machine, learnt from every pass speculate runs, and the
prices auto plans with.

A pass's shape is the tokens it scores and the sequences they belong to: one request's verify
of b tokens is (b, 1); b tokens of one request and one of each of o others, (b + o, o + 1).
For each model the book keeps the last SAMPLES timings of each shape passes have shown: the
single token's in seconds, the others' as ratios to the single token's median at the time; an
estimate is a median. A busy moment spoils one sample of a median; a machine that is busy for
a while slows every shape alike, which moves the single token's seconds and leaves the ratios
auto chooses draft lengths by. Beside them, one sequence's sizes as a calibration found them
(calibrate.py), which stand where no pass has shown a size yet, corrected as the nearest
sizes' passes corrected theirs; several requests' passes are estimated from one request's
until their own are timed (`_derived`).

A model is known by what changes its speed, never by the name it was given: the file's
content (files.content_identity), the build, threads, devices and memory settings
(llamacpp/identity.py). The book is $SPECULATE_HOME/costs.json; a model it lacks sizes of is
calibrated first (engine.py), `speculate doctor --reset-costs` forgets what it holds.

auto plans with *prices*: the estimates as they stood when the engine first asked, kept for
the engine's lifetime, and from one process to the next changed only where an estimate has
moved by more than DRIFT. So runs plan alike unless the machine really changed: on a build
whose kernels are batch-variant (llama.cpp's default CPU build), a verify pass's shape decides
the last bits of the logits, and an identical request gives an identical answer only when it
is planned the same way.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import deque
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from speculative.files import locked, write_atomic
from speculative.models.registry import home

SAMPLES = 16     # timings kept per shape: the median of the last this many
DRIFT = 0.10     # a price follows its estimate once they differ by more than this
FORMAT = 2       # of costs.json (calibration.json, format 1, measured once and kept forever)


def book_path() -> Path:
    return home() / "costs.json"


def shape_key(tokens: int, sequences: int = 1, unified: bool = True) -> str:
    """How a shape is written in the book: "5" (one sequence), "6x2" (two sequences in one
    unified KV cache), "6x2s" (a KV stream each, or a recurrent state: llama.cpp splits such a
    batch into slices of equal length per sequence)."""
    return str(tokens) if sequences == 1 else f"{tokens}x{sequences}{'' if unified else 's'}"


class ModelCosts:
    """One model's timings and prices (see the module's description). Thread-safe: the slots of
    serve and batch record their passes from several threads."""

    def __init__(self, identity: dict, stored: dict | None = None):
        stored = stored or {}
        self.identity = identity
        self._lock = threading.Lock()
        self._seconds: deque[float] = deque(stored.get("seconds", ()), maxlen=SAMPLES)
        # one sequence's sizes as the last calibration found them, and every shape as passes found it
        self._calibrated: dict[str, float] = dict(stored.get("calibrated", {}))
        self._ratios: dict[str, deque[float]] = {key: deque(values, maxlen=SAMPLES)
                                                 for key, values in stored.get("ratios", {}).items()}
        self._stored_prices: dict = stored.get("prices", {})  # the last process's
        self._prices: dict[str, float] = {}   # this engine's, fixed once asked for
        self._new: list[tuple[str, float]] = []  # samples to add to the book when saved ("": seconds)
        self._new_calibrated: dict[str, float] = {}
        self._provisional = False  # it holds a calibration not kept (its prices are not kept either)

    # -- what passes cost ------------------------------------------------------

    def record(self, tokens: int, sequences: int = 1, seconds: float = 0.0, unified: bool = True) -> None:
        """A pass of this shape took `seconds`."""
        with self._lock:
            if tokens == 1 and sequences == 1:
                self._seconds.append(seconds)
                self._new.append(("", seconds))
            elif self._seconds:  # (nothing to take a ratio to before)
                key, ratio = shape_key(tokens, sequences, unified), seconds / float(np.median(self._seconds))
                self._ratios.setdefault(key, deque(maxlen=SAMPLES)).append(ratio)
                self._new.append((key, ratio))

    def record_rounds(self, rounds: dict[int, list[float]], keep: bool = True) -> None:
        """A calibration's rounds: rounds[b][r] is round r's time for one sequence's b tokens. Each
        size's ratio is taken to the single token's time of the same round, so that a machine
        slower in one round than in another changes the seconds, not the ratios; a size's ratio
        is the median of its rounds'. `keep`: saved with the book (a calibration that disagreed
        with itself is this process's only)."""
        singles = rounds[1]
        calibrated = {str(b): float(np.median([t / s for t, s in zip(times, singles)]))
                      for b, times in rounds.items() if b != 1}
        with self._lock:
            self._seconds.extend(singles)
            self._calibrated.update(calibrated)
            if keep:
                self._new.extend(("", s) for s in singles)
                self._new_calibrated.update(calibrated)
            self._provisional |= not keep

    def measured(self) -> list[int]:
        """The one-sequence sizes calibrated or timed so far (1 first, when it was)."""
        with self._lock:
            sizes = {int(key) for key in self._calibrated} | {int(k) for k, v in self._ratios.items() if k.isdigit() and v}
            return ([1] if self._seconds else []) + sorted(sizes)

    def seconds(self) -> float | None:
        """The single token's estimate (the machine's speed as last seen), or None."""
        with self._lock:
            return float(np.median(self._seconds)) if self._seconds else None

    def ratio(self, tokens: int, sequences: int = 1, unified: bool = True) -> float:
        """The estimate of a shape's cost as a ratio to a single token's."""
        with self._lock:
            return self._ratio(tokens, sequences, unified)

    def _ratio(self, tokens: int, sequences: int, unified: bool) -> float:
        if tokens == 1 and sequences == 1:
            return 1.0
        timed = self._ratios.get(shape_key(tokens, sequences, unified))
        if timed:
            return float(np.median(timed))
        if sequences > 1:
            return self._derived(tokens, sequences, unified)
        return self._single(tokens)

    def _single(self, b: int) -> float:
        """One sequence's b tokens, not timed by a pass yet: as calibrated, corrected as the passes of
        the nearest sizes corrected theirs (so that one dear draft makes its neighbours dear too,
        not one more bet each), or between the nearest sizes known."""
        timed = {int(k): float(np.median(v)) for k, v in self._ratios.items() if k.isdigit() and v}
        calibrated = {int(k): v for k, v in self._calibrated.items()}
        both = sorted(set(timed) & set(calibrated))
        if b in calibrated:
            xs = [1, *both]
            corrections = [1.0, *(timed[x] / calibrated[x] for x in both)]
            return calibrated[b] * float(np.interp(b, xs, corrections))
        known = {1: 1.0, **calibrated, **timed}
        xs = sorted(known)
        ys = [known[x] for x in xs]
        if b <= xs[-1]:
            return float(np.interp(b, xs, ys))
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 1.0  # beyond: as the last grew
        return float(ys[-1] + max(slope, 0.0) * (b - xs[-1]))

    def _derived(self, tokens: int, sequences: int, unified: bool) -> float:
        """A pass of several sequences no pass has shown yet, from one sequence's: in one unified
        cache, one batch of all the tokens; else (KV streams, recurrent states) llama.cpp's equal
        slices, a token of each sequence and then the rest of the longest part."""
        if unified:
            return self._ratio(tokens, 1, True)
        rest = tokens - sequences
        return self._ratio(sequences, 1, True) + (self._ratio(rest, 1, True) if rest > 0 else 0.0)

    # -- what auto plans with --------------------------------------------------------

    def price(self, tokens: int, sequences: int = 1, unified: bool = True) -> float:
        """What auto prices a pass of this shape at, in seconds: the estimates when this engine
        first asked (kept for its lifetime), where they moved by more than DRIFT since the
        prices of the last process that asked, else those prices. A pass shared with other
        requests is priced at the estimate as it stands: what it costs is learnt while they run,
        and which requests share a pass no identical request repeats anyway."""
        with self._lock:
            if not self._seconds:
                raise LookupError("no pass of this model has been timed")
            level = self._fixed("", float(np.median(self._seconds)), self._stored_prices.get("seconds"))
            if tokens == 1 and sequences == 1:
                return level
            if sequences > 1:
                return level * self._ratio(tokens, sequences, unified)
            key = shape_key(tokens, sequences, unified)
            ratio = self._fixed(key, self._ratio(tokens, sequences, unified),
                                self._stored_prices.get("ratios", {}).get(key))
            return level * ratio

    def _fixed(self, key: str, estimate: float, before: float | None) -> float:
        if key not in self._prices:
            moved = before is None or not before > 0 or abs(estimate / before - 1.0) > DRIFT
            self._prices[key] = estimate if moved else before
        return self._prices[key]

    def to_dict(self, stored: dict | None) -> dict:
        """This model's entry for the book: `stored` (the entry in the file now, which other
        processes may have added to) with this process's new samples, calibration and prices."""
        stored = stored or {}
        with self._lock:
            seconds = [*stored.get("seconds", ()), *(v for k, v in self._new if not k)][-SAMPLES:]
            ratios = {key: list(values) for key, values in stored.get("ratios", {}).items()}
            for key, value in self._new:
                if key:
                    ratios[key] = [*ratios.get(key, ()), value][-SAMPLES:]
            prices = dict(stored.get("prices", {}))
            if not self._provisional:
                if "" in self._prices:
                    prices["seconds"] = self._prices[""]
                prices["ratios"] = {**prices.get("ratios", {}), **{k: v for k, v in self._prices.items() if k}}
            return {"identity": self.identity, "seconds": seconds,
                    "calibrated": {**stored.get("calibrated", {}), **self._new_calibrated}, "ratios": ratios,
                    "prices": prices}

    def saved(self) -> None:
        with self._lock:
            self._new.clear()
            self._new_calibrated.clear()


class CostBook:
    """The models' costs of this machine, read from `path` (default: costs.json in speculate's
    home) when a model is first asked for, and written back by `save`."""

    def __init__(self, path: Path | None = None):
        self.path = path or book_path()
        self._models: dict[str, ModelCosts] = {}
        self._lock = threading.Lock()

    def model(self, identity: dict) -> ModelCosts:
        key = _key(identity)
        with self._lock:
            if key not in self._models:
                self._models[key] = ModelCosts(identity, _load(self.path).get(key))
            return self._models[key]

    def save(self) -> None:
        """Add what this process learnt to the file, one process at a time (others may add theirs).
        A read-only home costs only a calibration next time."""
        with self._lock:
            models = dict(self._models)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with locked(self.path):
                stored = _load(self.path)
                for key, costs in models.items():
                    stored[key] = costs.to_dict(stored.get(key))
                write_atomic(self.path, [json.dumps({"format": FORMAT, "models": stored}, indent=1).encode()])
        except OSError:
            return
        for costs in models.values():
            costs.saved()


def reset(path: Path | None = None, keep: Callable[[dict], bool] = lambda identity: False) -> int:
    """Forget the stored costs of every model whose identity `keep` does not keep (default: all);
    how many were forgotten. The format-1 calibrations beside it go too."""
    path = path or book_path()
    old = path.with_name("calibration.json")
    try:
        old.unlink()
    except FileNotFoundError:
        pass
    if not path.exists():
        return 0
    with locked(path):
        stored = _load(path)
        kept = {key: entry for key, entry in stored.items() if keep(entry.get("identity", {}))}
        write_atomic(path, [json.dumps({"format": FORMAT, "models": kept}, indent=1).encode()])
    return len(stored) - len(kept)


def _key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def _load(path: Path) -> dict:
    """The stored models, by key ({} for no book, a damaged one or another format: timed again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("models"), dict):
        return {}
    return {key: entry for key, entry in data["models"].items() if _valid(entry)}


def _valid(entry: object) -> bool:
    """An entry this version can read: numbers where numbers belong (a hand-edited or damaged one
    is dropped, not trusted)."""
    def numbers(values: Iterable) -> bool:
        return all(isinstance(v, (int, float)) and v > 0 and np.isfinite(v) for v in values)
    try:
        ratios, calibrated = entry.get("ratios", {}), entry.get("calibrated", {})
        return (isinstance(entry.get("identity"), dict) and numbers(entry.get("seconds", []))
                and all(numbers(values) for values in ratios.values()) and numbers(calibrated.values())
                and all(key.isdigit() for key in calibrated))
    except (AttributeError, TypeError):
        return False
