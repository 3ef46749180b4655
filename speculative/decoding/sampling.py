"""The sampler chain: turns one row of logits into a token.

Mirrors llama.cpp's common sampler: the samplers named by `--sampling-seq` run in
that order over the candidate set, then one token is drawn from what is left
(llama.cpp's `dist` sampler). A temperature of 0 or less is greedy (argmax).

Letters, as in llama.cpp: e penalties, d dry, s top-n-sigma, k top-k, y typical,
p top-p, m min-p, x xtc, t temperature, i infill (llama-server's fill-in-the-middle
filter, which llama.vim and llama.vscode ask for). d, s and x have no flags here; they are
accepted so llama.cpp's default sequence works, and do nothing, exactly as in
llama.cpp at their default parameters.

Penalties depend on the tokens so far (the prompt and the output, the last
--repeat-last-n of them), so every position of a verified batch is sampled with
its own history. As in llama.cpp they apply with --temp 0 too.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from speculative.decoding.constraint import GrammarState, admissible, best, best_one
from speculative.decoding.events import TokenProbs
from speculative.decoding.settings import SamplerSettings

Dist = tuple[np.ndarray, np.ndarray]  # token ids and their probabilities (summing to 1)


def one_hot(token: int) -> Dist:
    return np.array([token]), np.ones(1)


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


def penalize(ids: np.ndarray, logits: np.ndarray, history: Sequence[int],
             s: SamplerSettings) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's penalties over the last repeat_last_n tokens of `history`: a seen
    token's logit is divided by the repeat penalty (multiplied when negative), then
    lowered by count x frequency penalty + presence penalty."""
    window = np.asarray(history[-s.repeat_last_n:] if s.repeat_last_n > 0 else history, dtype=np.int64)
    if not len(window):
        return ids, logits
    seen, counts = np.unique(window, return_counts=True)
    at = np.searchsorted(seen, ids)
    hit = (at < len(seen)) & (seen[np.minimum(at, len(seen) - 1)] == ids)
    z = np.array(logits, dtype=np.float32)
    c = counts[at[hit]]
    zh = z[hit]
    zh = np.where(zh <= 0, zh * s.repeat_penalty, zh / s.repeat_penalty)
    z[hit] = zh - c * s.frequency_penalty - s.presence_penalty
    return ids, z


def typical(ids: np.ndarray, logits: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Locally typical sampling: keep the tokens whose surprise is closest to the
    entropy, in that order, until their probability passes p (llama.cpp's rule)."""
    if p >= 1.0:
        return ids, logits
    probs = softmax(logits)
    with np.errstate(divide="ignore"):
        surprise = -np.log(probs)
    entropy = float(np.sum(probs[probs > 0] * surprise[probs > 0]))
    order = np.argsort(np.abs(surprise - entropy), kind="stable")
    n_keep = int(np.searchsorted(np.cumsum(probs[order]), p, side="right")) + 1
    keep = order[: min(n_keep, len(order))]
    return ids[keep], logits[keep]


class Vocab(Protocol):
    """What the infill sampler reads of a model's vocabulary (llamacpp.model.LlamaModel)."""

    def is_eog(self, token: int) -> bool: ...
    def token_bytes(self, token: int, special: bool = True) -> bytes: ...
    def end_token(self) -> int: ...


def infill(ids: np.ndarray, logits: np.ndarray, vocab: Vocab) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's infill sampler (llama_sampler_infill_apply), for fill-in-the-middle: when
    end-of-generation tokens weigh enough (3 x their probability x the candidates > the rest),
    only they remain; otherwise a token whose text begins another's takes that one's
    probability (the less likely of the two goes), tokens below 0.2 go, then those below
    1 / (n + 1) of what is left (n: the tokens left that are not end-of-generation); with none
    left, end of turn alone. As in llama.cpp, the survivors keep their own logits: the final
    draw (or argmax) is over those, not over the merged probabilities."""
    order = np.argsort(-logits, kind="stable")
    ids, logits = ids[order], logits[order]
    p = softmax(logits)
    eog = np.array([vocab.is_eog(int(t)) for t in ids], dtype=bool)
    if 3 * p[eog].sum() * len(ids) > p[~eog].sum():
        return ids[eog], logits[eog]
    alive = np.isfinite(logits)
    pieces = [vocab.token_bytes(int(t), special=False) for t in ids]
    for i0 in range(len(ids)):
        for i1 in range(len(ids)):
            if not alive[i0]:
                break
            if i0 == i1 or not alive[i1]:
                continue
            a, b = pieces[i0], pieces[i1]
            if a and len(a) <= len(b) and b.startswith(a):
                dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
                p[dst] += p[src]
                p[src] = 0.0
                alive[src] = False
    keep = alive & ((p >= 0.2) | eog)
    n_text = int((keep & ~eog).sum())
    if n_text == 0:
        return np.array([vocab.end_token()]), np.zeros(1, dtype=np.float32)
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    keep &= (q >= 1.0 / (n_text + 1)) | eog
    return ids[keep], logits[keep]


class Sampler:
    """One model's sampler: settings, a seeded generator, and banned tokens. `vocab`: the
    model's, needed by the infill sampler (letter i) only."""

    def __init__(self, settings: SamplerSettings, seed: int, banned: np.ndarray | None = None,
                 vocab: Vocab | None = None):
        self.settings = settings
        self.seed = seed
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.banned = banned if banned is not None and len(banned) else None
        bias = settings.logit_bias  # llama.cpp's logit-bias sampler, first in its chain
        self.bias = (np.array([t for t, _ in bias], dtype=np.int64),
                     np.array([b for _, b in bias], dtype=np.float32)) if bias else None
        self.vocab = vocab
        if "i" in settings.sequence and vocab is None:
            raise ValueError("the infill sampler needs the model's vocabulary")

    def sample(self, logits: np.ndarray, history: Sequence[int] = (), grammar: GrammarState | None = None) -> int:
        """Draw a token from one row of logits, which followed `history` (needed only
        with penalties), among those `grammar` admits (constraint.py). The row may be
        modified in place."""
        if self.settings.greedy:
            return int(self.distribution(logits, history, grammar)[0][0])
        return draw(self.distribution(logits, history, grammar), self.rng)

    def distribution(self, logits: np.ndarray, history: Sequence[int] = (),
                     grammar: GrammarState | None = None) -> Dist:
        """What `sample` draws from: the chain's surviving ids and their probabilities
        (greedy: the argmax after penalties, with probability 1); with a grammar, the chain
        over the tokens it admits. The row may be modified in place."""
        if self.banned is not None:
            logits[self.banned] = -np.inf
        if self.bias is not None:
            np.add.at(logits, *self.bias)
        if grammar is not None:
            return self._constrained(logits, history, grammar)
        if self.settings.greedy and "i" in self.settings.sequence:  # argmax of what infill leaves
            ids, z = self.candidates(logits, history)
            return one_hot(int(ids[int(np.argmax(z))]))
        if self.settings.greedy:
            return one_hot(int(np.argmax(self._scores(logits, history))))
        ids, z = self.candidates(logits, history)
        return ids, softmax(z)

    def _scores(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The logits after the penalties (the row itself without them)."""
        if not self.settings.penalties:
            return logits
        return penalize(np.arange(len(logits)), logits, history, self.settings)[1]

    def _constrained(self, logits: np.ndarray, history: Sequence[int], grammar: GrammarState) -> Dist:
        """The chain over what the grammar admits. Greedy: the best admissible token (the argmax
        itself, one check, most of the time). A chain whose first cut is top-k: the k best
        admissible tokens are all it can keep (constraint.best). Otherwise every admissible one."""
        s = self.settings
        if s.greedy and "i" not in s.sequence:
            return one_hot(best_one(grammar, self._scores(logits, history)))
        first_cut = s.sequence.lstrip("edsxt")[:1]
        if first_cut == "k" and s.top_k > 0:
            penalized_first = "e" in s.sequence[: s.sequence.index("k")]
            ids = best(grammar, self._scores(logits, history) if penalized_first else logits, s.top_k)
        else:
            ids = admissible(grammar, logits)
        ids, z = self._chain(ids, np.asarray(logits[ids], dtype=np.float32), history)
        if s.greedy:
            return one_hot(int(ids[int(np.argmax(z))]))
        return ids, softmax(z)

    def candidates(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Run the chain: the surviving token ids and their (scaled) logits."""
        return self._chain(np.arange(len(logits)), np.asarray(logits, dtype=np.float32), history)

    def _chain(self, ids: np.ndarray, z: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        s = self.settings
        for letter in s.sequence:
            if letter == "e" and s.penalties:
                ids, z = penalize(ids, z, history, s)
            elif letter == "y":
                ids, z = typical(ids, z, s.typical_p)
            elif letter == "k":
                ids, z = top_k(ids, z, s.top_k)
            elif letter == "p":
                ids, z = top_p(ids, z, s.top_p)
            elif letter == "m":
                ids, z = min_p(ids, z, s.min_p)
            elif letter == "i":
                ids, z = infill(ids, z, self.vocab)
            elif letter == "t" and s.temp > 0:
                z = z / s.temp
        finite = np.isfinite(z)
        if not finite.all():
            ids, z = ids[finite], z[finite]
        return ids, z


def token_probs(sampler: Sampler, row: np.ndarray, token: int, history: Sequence[int] = (),
                grammar: GrammarState | None = None) -> TokenProbs:
    """What llama-server reports of a generated token (n_probs): its probability and the
    n_probs likeliest tokens', from the target's row as it is (a softmax over the vocabulary),
    or with post_sampling_probs from what the sampler chain left (its distribution after
    `history`, under `grammar`). Tokens of probability 0 are left out, as llama-server does."""
    if sampler.settings.post_sampling_probs:
        ids, probs = sampler.distribution(row.copy(), history, grammar)
    else:
        ids, probs = np.arange(len(row)), softmax(row)
    k = min(sampler.settings.n_probs, len(probs))
    best = np.argpartition(-probs, k - 1)[:k] if 0 < k < len(probs) else np.arange(k)
    best = best[np.argsort(-probs[best], kind="stable")]
    hit = np.flatnonzero(ids == token)
    return TokenProbs(float(probs[hit[0]]) if len(hit) else 0.0,
                      tuple((int(ids[i]), float(probs[i])) for i in best if probs[i] > 0.0))
