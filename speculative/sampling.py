"""The sampler chain: turns one row of logits into a token.

Mirrors llama.cpp's common sampler: the samplers named by `--sampling-seq` run in
that order over the candidate set, then one token is drawn from what is left
(llama.cpp's `dist` sampler). A temperature of 0 or less is greedy (argmax).

Letters, as in llama.cpp: e penalties, d dry, s top-n-sigma, k top-k, y typical,
p top-p, m min-p, x xtc, t temperature. Only k, p, m and t have flags here; the
others are accepted so llama.cpp's default sequence works, and they do nothing,
exactly as in llama.cpp when their parameters are at the defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .errors import UsageError

DEFAULT_SEQUENCE = "edskypmxt"
ACTIVE_SAMPLERS = {"k": "top-k", "p": "top-p", "m": "min-p", "t": "temperature"}
NEUTRAL_SAMPLERS = {"e": "penalties", "d": "dry", "s": "top-n-sigma", "y": "typical", "x": "xtc"}


@dataclass(frozen=True)
class SamplerSettings:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    sequence: str = DEFAULT_SEQUENCE
    seed: int = -1  # -1: a random seed, reported so the run can be repeated

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0

    def validate(self) -> None:
        for letter in self.sequence:
            if letter not in ACTIVE_SAMPLERS and letter not in NEUTRAL_SAMPLERS:
                known = "".join([*NEUTRAL_SAMPLERS, *ACTIVE_SAMPLERS])
                raise UsageError(
                    f"--sampling-seq: unknown sampler letter {letter!r} (known letters: {known})"
                )
        if not self.temp >= 0.0:
            raise UsageError(f"--temp must be >= 0 (0: greedy), got {self.temp}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 (0: off), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise UsageError(f"--top-p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise UsageError(f"--min-p must be in [0, 1], got {self.min_p}")
        if self.seed < -1 or self.seed >= 2**32:
            raise UsageError(f"--seed must be -1 (random) or in [0, 2^32), got {self.seed}")

    def resolved_seed(self) -> int:
        """The seed actually used: the given one, or a fresh random one for -1."""
        if self.seed >= 0:
            return self.seed
        return int.from_bytes(os.urandom(4), "little")


Dist = tuple[np.ndarray, np.ndarray]  # token ids and their probabilities (summing to 1)


def draw(dist: Dist, rng: np.random.Generator) -> int:
    """One token from a distribution, with one uniform number from `rng`."""
    ids, probs = dist
    i = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return int(ids[min(i, len(ids) - 1)])


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max()
    e = np.exp(z, dtype=np.float64)
    return e / e.sum()


def top_k(ids: np.ndarray, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    if k <= 0 or k >= len(ids):
        return ids, logits
    keep = np.argpartition(-logits, k - 1)[:k]
    return ids[keep], logits[keep]


def top_p(ids: np.ndarray, logits: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep the smallest most-likely prefix whose probability reaches p (at least one)."""
    if p >= 1.0:
        return ids, logits
    order = np.argsort(-logits, kind="stable")
    cum = np.cumsum(softmax(logits[order]))
    n_keep = int(np.searchsorted(cum, p, side="left")) + 1
    keep = order[: min(n_keep, len(order))]
    return ids[keep], logits[keep]


def min_p(ids: np.ndarray, logits: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep tokens whose probability is at least p times the top token's."""
    if p <= 0.0:
        return ids, logits
    keep = logits >= logits.max() + np.log(p)
    return ids[keep], logits[keep]


class Sampler:
    """One model's sampler: settings, a seeded generator, and banned tokens."""

    def __init__(self, settings: SamplerSettings, seed: int, banned: np.ndarray | None = None):
        self.settings = settings
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.banned = banned if banned is not None and len(banned) else None

    def sample(self, logits: np.ndarray) -> int:
        """Draw a token from one row of logits. The row may be modified in place."""
        if self.settings.greedy:
            if self.banned is not None:
                logits[self.banned] = -np.inf
            return int(np.argmax(logits))
        return draw(self.distribution(logits), self.rng)

    def distribution(self, logits: np.ndarray) -> Dist:
        """What `sample` draws from: the chain's surviving ids and their probabilities
        (greedy: the argmax, with probability 1). The row may be modified in place."""
        if self.banned is not None:
            logits[self.banned] = -np.inf
        if self.settings.greedy:
            return np.array([int(np.argmax(logits))]), np.ones(1)
        ids, z = self.candidates(logits)
        return ids, softmax(z)

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run the chain: the surviving token ids and their (scaled) logits."""
        s = self.settings
        ids = np.arange(len(logits))
        z = np.asarray(logits, dtype=np.float32)
        for letter in s.sequence:
            if letter == "k":
                ids, z = top_k(ids, z, s.top_k)
            elif letter == "p":
                ids, z = top_p(ids, z, s.top_p)
            elif letter == "m":
                ids, z = min_p(ids, z, s.min_p)
            elif letter == "t":
                z = z / s.temp
        finite = np.isfinite(z)
        if not finite.all():
            ids, z = ids[finite], z[finite]
        return ids, z
