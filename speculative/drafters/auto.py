"""`--spec-type auto`: choose each step's drafter and draft length k to maximise
expected tokens per second, k = 0 (no speculation) included.

For a drafter with per-position acceptance estimates a_1, a_2, ... (a_i: the
chance drafted token i is accepted given the ones before it were), drafting k
tokens is expected to yield

    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k        tokens (the bonus included)
    T(k) = k * c_draft + v(k + 1)                       seconds

where v(b) is the target's cost of verifying a batch of b tokens and c_draft the
drafter's cost per drafted token. Each step runs the (drafter, k) with the
largest E(k) / T(k); k = 0 is plain decoding at 1 / v(1). A target whose recurrent
state cannot undo k drafted tokens (cache.py) adds to T(k) what it pays for them:
a checkpoint, and when more tokens than it can undo are rejected, a restore and
the accepted ones decoded again (Rewind).

Where the numbers come from:
  v(b)     the prices of the target's passes on this machine (speculative/engine/costs.py:
           what its passes have cost, learnt as they run, calibrated first), fixed for the
           run: auto plans with what it is given and times nothing itself, so that a
           request is planned, and its verify passes shaped, the same way every time it
           comes (on a batch-variant build, the shape decides the logits' last bits).
  c_draft  the draft model's price per token likewise; n-gram lookups cost nothing to
           choose (every free drafter proposes every step, chosen or not).
  a_i      running counts that favour the last few dozen tokens. Free drafters
           (n-gram) propose every step and each proposal is scored token by token
           against what the target really produced, verified or not, so their
           estimates follow the text (copying a file: high; free prose: low)
           even while auto declines them. A draft model is only scored when it
           drafts, and the tokens it has to catch up on first are costed; one
           that could not beat plain decoding even at MODEL_ACCEPTANCE_CEILING
           acceptance on this hardware is never tried, and one that is merely
           unpromising is tried again once its estimates fade to the prior.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from speculative.decoding.backend import Work
from speculative.decoding.drafter import DecodingDrafter, Draft, Drafter, Outcome
from speculative.drafters.registry import MODEL_PRIOR, OTHER_PRIOR, TYPES

# Beliefs before any evidence, worth PRIOR_WEIGHT observations: the first drafted token's
# acceptance, each drafter type's by the kind of its proposal (registry.py: a draft model's, an
# n-gram match's by how long its context matched, ...) ...
CONTINUE_PRIOR = 0.85   # ... and of each later token, given the ones before it
PRIOR_WEIGHT = 3.0
DECAY = 0.9                # per step: evidence older than a few dozen tokens fades
MODEL_ACCEPTANCE_CEILING = 0.95
CAUTION = 0.5  # free drafters bet on their first-token estimate less this many standard deviations
SLOTS = (0, 1, 4)  # the first draft position of each pooled acceptance estimate (Acceptance):
                   # a short match often yields a few tokens of a common phrase and stops, a
                   # copied passage goes on for dozens, so tokens 2-4 and 5 on are told apart
MARGIN = 0.03  # a draft must be expected to beat plain decoding by this much: estimates
               # and timings are noisy, and a marginal bet loses as often as it wins


class Acceptance:
    """Running acceptance estimates of one kind of proposal from one drafter.

    One number per slot of draft positions (SLOTS): the chance the first drafted token
    is accepted, and the chance each later one is, given the ones before it were. Drafts
    that start right tend to go on right (a copied passage continues), and pooling the
    later positions into a few slots lets them learn from a few drafts instead of the
    hundreds one estimate per position would need.
    """

    def __init__(self, k_max: int, first_prior: float, continue_prior: float = CONTINUE_PRIOR):
        self.k_max = k_max
        self.prior = np.array([first_prior, *[continue_prior] * (len(SLOTS) - 1)])
        self.accepted = np.zeros(len(SLOTS))
        self.trials = np.zeros(len(SLOTS))
        self.slot_of = np.searchsorted(SLOTS, np.arange(k_max), side="right") - 1  # position -> slot

    def age(self) -> None:
        self.accepted *= DECAY
        self.trials *= DECAY

    def observe(self, position: int, accepted: bool) -> None:
        """Drafted token `position` (0-based), all before it accepted, was or was not."""
        i = self.slot_of[min(position, self.k_max - 1)]
        self.trials[i] += 1
        self.accepted[i] += accepted

    def observe_draft(self, n_drafted: int, n_accepted: int) -> None:
        for i in range(min(n_drafted, n_accepted + 1)):
            self.observe(i, i < n_accepted)

    def rates(self, cautious: bool = False) -> np.ndarray:
        """Per-position acceptance; `cautious`: the first token's taken CAUTION standard
        deviations low, so a bet needs evidence, not a prior alone or one lucky match (for
        free drafters, whose every proposal is scored without drafting it: their evidence
        costs nothing, and there is soon plenty where they are right)."""
        rates = (self.prior * PRIOR_WEIGHT + self.accepted) / (PRIOR_WEIGHT + self.trials)
        if cautious:
            rates[0] -= CAUTION * np.sqrt(rates[0] * (1.0 - rates[0]) / (PRIOR_WEIGHT + self.trials[0]))
            rates[0] = max(rates[0], 0.0)
        return rates[self.slot_of]


def expected_tokens(rates: np.ndarray) -> np.ndarray:
    """E(k) for k = 0..len(rates)."""
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(rates))])


@dataclass(frozen=True)
class Rewind:
    """What drafts cost a target that can undo at most `limit` tokens (a recurrent state
    with that many snapshots): a checkpoint before verifying more (`save` seconds), and
    when more than `limit` are rejected, a restore and the accepted ones decoded again."""
    limit: int
    save: float
    restore: float

    def costs(self, rates: np.ndarray, verify: np.ndarray, k_max: int) -> np.ndarray:
        """The expected extra seconds of a step drafting k = 1..k_max tokens."""
        accepted = np.concatenate([[1.0], np.cumprod(rates[:k_max])])  # the first a accepted, a = 0..k_max
        extra = np.zeros(k_max)
        for k in range(self.limit + 1, k_max + 1):
            a = np.arange(k)  # exactly a accepted: a restore, then [last, d1..da] again
            exactly = accepted[:k] - accepted[1 : k + 1]
            extra[k - 1] = self.save + exactly[k - a > self.limit] @ (self.restore + verify[a[k - a > self.limit] + 1])
        return extra


def _padded(costs: np.ndarray, n: int) -> np.ndarray:
    """costs[0..n-1]: beyond the sizes measured, growing as the last few did."""
    if len(costs) >= n:
        return costs[:n]
    last = len(costs) - 1
    slope = (costs[last] - costs[max(1, last - 4)]) / max(1, last - max(1, last - 4))
    return np.concatenate([costs, costs[last] + max(slope, 0.0) * np.arange(1, n - last)])


def best_plan(rates: np.ndarray, verify: np.ndarray, draft_cost: float, k_max: int,
              fixed_cost: float = 0.0, rewind: Rewind | None = None, others: float = 0.0) -> tuple[int, float]:
    """(k, tokens per second) maximising (others + E(k)) / T(k) over k = 1..k_max; verify[b] is
    the pass's cost with b tokens of this request; `others`: the tokens other requests get from
    the same pass (requests at once), so that a draft pays for what it costs them too."""
    k_max = min(k_max, len(rates), len(verify) - 2)
    if k_max < 1:
        return 0, 0.0
    ks = np.arange(1, k_max + 1)
    cost = fixed_cost + ks * draft_cost + verify[2 : k_max + 2]
    if rewind is not None:
        cost = cost + rewind.costs(rates, verify, k_max)
    speed = (others + expected_tokens(rates[:k_max])[1:]) / cost
    i = int(np.argmax(speed))
    return int(ks[i]), float(speed[i])


class Auto(DecodingDrafter):
    """Chooses among `drafters` and the draft length, step by step."""

    name = "auto"

    def __init__(self, drafters: list[Drafter], verify_costs: Sequence[float], k_max: int,
                 draft_costs: dict[str, float] | None = None, catchup_costs: dict[str, float] | None = None,
                 rewind: Rewind | None = None, load: Callable[[], tuple[int, int]] | None = None,
                 shared_costs: Sequence[Sequence[float]] = ()):
        """`load`: what other requests put in the target's passes (cache.Cache.load: their tokens,
        as if each took a plain step, and those scored), when several run
        at once: each step then plans for the whole pass; shared_costs[o - 1][b - 1] is its
        price with b tokens of this request and one of each of o others."""
        self.drafters = drafters
        self.load = load
        if load is not None and not shared_costs:
            raise ValueError("auto among other requests needs the costs of their passes (shared_costs)")
        self.shared = [np.array([np.inf, *row], dtype=float) for row in shared_costs]  # v_o(b) at index b
        self.rewind = rewind  # what drafting costs a target that cannot undo every draft
        self.k_max = k_max
        self.verify = np.array([np.inf, *verify_costs], dtype=float)  # v(b) at index b
        self.draft_cost = {d.name: (draft_costs or {}).get(d.name, 0.0) for d in drafters}
        # per token a draft model must catch up on before drafting (what it did not see)
        self.catchup_cost = {d.name: (catchup_costs or {}).get(d.name, 0.0) for d in drafters}
        self.acceptance: dict[tuple[str, int], Acceptance] = {}  # (drafter, draft kind) -> estimates
        self.declined: dict[str, str] = {}          # drafter -> why auto never tried it
        self.best_ratio: dict[str, float] = {}      # model drafter -> its best plan's speed / plain decoding's
        self.chosen: set[str] = set()               # drafters that drafted at least once
        self._pending: list[list] = []              # [estimates, where, proposal, scored]
        self._proposals: dict[str, Draft] = {}      # this step's free proposals
        self.t_plan = 0.0   # seconds auto itself spent planning and scoring (not in drafters' calls)
        self._t_drafters = 0.0  # of a propose or accept call, the seconds spent inside the drafters

    def learn_from(self, earlier: "Auto") -> None:
        """Start from what an earlier run's auto learnt (a conversation's earlier turn) rather
        than the priors: its acceptance estimates of the drafters both have, for drafts as long."""
        names = {d.name for d in self.drafters}
        self.acceptance = {key: copy.deepcopy(estimates) for key, estimates in earlier.acceptance.items()
                           if key[0] in names and estimates.k_max == self.k_max}

    def estimates(self, d: Drafter | str, kind: int = 0) -> Acceptance:
        name = d if isinstance(d, str) else d.name
        if (name, kind) not in self.acceptance:
            declared = TYPES.get(name)
            free = next(x.free for x in self.drafters if x.name == name)
            prior = declared.prior_of(kind) if declared else OTHER_PRIOR if free else MODEL_PRIOR
            self.acceptance[(name, kind)] = Acceptance(self.k_max, prior)
        return self.acceptance[(name, kind)]

    def prefilling(self, prompt: Sequence[int]) -> Work[None]:
        """Every drafter's prefill, but a model's that auto would not draft with now, at its
        estimates and in this pass: on a CPU a draft model's prompt costs about a third of the
        target's, which a model never drafted with wastes. It catches up, priced, if that
        changes (fewer requests in the pass, a faster machine)."""
        others, scored = self.load() if self.load is not None else (0, 0)
        verify = self._pass_costs(others)
        plain = (1.0 + scored) * (1.0 + MARGIN) / verify[1]
        for d in self.drafters:
            if d.free or (not self._hopeless(d, self.k_max, verify, scored) and
                          best_plan(self.estimates(d).rates(), verify, self.draft_cost[d.name], self.k_max,
                                    rewind=self.rewind, others=scored)[1] > plain):
                yield from d.prefilling(prompt)

    def proposing(self, context: Sequence[int], k: int) -> Work[Draft]:
        t0, self._t_drafters = time.perf_counter(), 0.0
        try:
            return (yield from self._propose(context, k))
        finally:
            self.t_plan += time.perf_counter() - t0 - self._t_drafters

    def _propose(self, context: Sequence[int], k: int) -> Work[Draft]:
        self._score_pending(context)
        k = min(k, self.k_max)
        others, scored = self.load() if self.load is not None else (0, 0)
        verify = self._pass_costs(others)
        best: tuple[float, Drafter | None, int] = ((1.0 + scored) * (1.0 + MARGIN) / verify[1], None, 0)
        self._proposals = {}
        for d in self.drafters:
            plan = self._plan_free if d.free else self._plan_model
            plan_k, speed = plan(d, context, k, verify, scored)
            if plan_k and speed > best[0]:
                best = (speed, d, plan_k)

        _, chosen, plan_k = best
        if chosen is None:
            return self.nothing()
        self.chosen.add(chosen.name)
        if chosen.free:
            draft = self._proposals[chosen.name]
            return replace(draft.head(plan_k), source=chosen.name)
        t0 = time.perf_counter()
        draft = yield from chosen.proposing(context, plan_k)
        self._t_drafters += time.perf_counter() - t0
        return draft

    def _pass_costs(self, others: int) -> np.ndarray:
        """w(b): what the target's pass costs with b tokens of this request and one of each of
        `others` requests, as priced for that pass; beyond the requests priced, each more adds
        what the last one did."""
        verify = self.verify
        if not others:
            return verify
        rows = self.shared
        o = min(others, len(rows))
        last = _padded(rows[o - 1], len(verify))
        before = _padded(rows[o - 2], len(verify)) if o > 1 else verify
        grown = last.copy()
        grown[1:] += (others - o) * np.maximum(last[1:] - before[1:], 0.0)
        return grown

    def _plan_free(self, d: Drafter, context: Sequence[int], k: int, verify: np.ndarray,
                   others: float = 0.0) -> tuple[int, float]:
        t0 = time.perf_counter()
        draft = d.propose(context, k)
        self._t_drafters += time.perf_counter() - t0
        self._proposals[d.name] = draft
        sure = draft.certain  # tokens a grammar admits alone: accepted whatever the estimates say
        if len(draft.tokens) > sure:  # the others are scored against what really followed
            self._pending.append([self.estimates(d, draft.kind), len(context) + sure, draft.tokens[sure:], 0])
        rates = self.estimates(d, draft.kind).rates(cautious=True)
        rates = np.concatenate([np.ones(sure), rates])[: self.k_max]
        return best_plan(rates, verify, self.draft_cost[d.name], len(draft.tokens), rewind=self.rewind, others=others)

    def _plan_model(self, d: Drafter, context: Sequence[int], k: int, verify: np.ndarray,
                    others: float = 0.0) -> tuple[int, float]:
        cost = self.draft_cost[d.name]
        if not d.can_draft(context) or self._hopeless(d, k, verify, others):
            return 0, 0.0
        # Unused, its estimates fade back to the prior, so it is tried again in time.
        catchup = self.catchup_cost[d.name] * d.behind(context)
        plan = best_plan(self.estimates(d).rates(), verify, cost, k, catchup, self.rewind, others)
        self.best_ratio[d.name] = max(self.best_ratio.get(d.name, 0.0), plan[1] * verify[1] / (1.0 + others))
        return plan

    def _hopeless(self, d: Drafter, k: int, verify: np.ndarray, others: float) -> bool:
        """Whether model drafter d could not beat plain decoding even at MODEL_ACCEPTANCE_CEILING
        acceptance, with this pass (noted in `declined` while it holds)."""
        ceiling = best_plan(np.full(k, MODEL_ACCEPTANCE_CEILING), verify, self.draft_cost[d.name], k,
                            rewind=self.rewind, others=others)
        if ceiling[1] <= (1.0 + others) / verify[1]:
            self.declined[d.name] = (f"slower than the target alone on this hardware even at "
                                     f"{MODEL_ACCEPTANCE_CEILING:.0%} acceptance")
            return True
        self.declined.pop(d.name, None)
        return False

    def _score_pending(self, context: Sequence[int]) -> None:
        """Score free proposals, token by token, against what really followed them."""
        for estimate in self.acceptance.values():
            estimate.age()
        still = []
        for entry in self._pending:
            estimates, where, proposal, scored = entry
            while scored < len(proposal) and where + scored < len(context):
                ok = proposal[scored] == context[where + scored]
                estimates.observe(scored, ok)
                scored += 1
                if not ok:
                    scored = len(proposal)  # decided: drop it
            entry[3] = scored
            if scored < len(proposal):
                still.append(entry)
        self._pending = still[-self.k_max:]

    def accept(self, outcome: Outcome) -> None:
        t0 = time.perf_counter()
        self._learn(outcome)
        self.t_plan += time.perf_counter() - t0
        for d in self.drafters:  # the drafters' own learning is drafting, not planning
            d.accept(outcome)

    def _learn(self, outcome: Outcome) -> None:
        """The model drafters' acceptance, from what verification made of a draft (the free ones'
        is scored against the text: _score_pending)."""
        drafted, m, source = outcome.draft.tokens, outcome.n_accepted, outcome.draft.source
        model = next((d for d in self.drafters if d.name == source and not d.free), None)
        if drafted and model is not None:
            self.estimates(model, outcome.draft.kind).observe_draft(len(drafted), m)

    def summary(self) -> list[str]:
        """Why auto never tried a drafter (a model's, not a free one), if it did not."""
        never = [f"auto never chose {name}: at best it was expected at {ratio:.2f}x the target alone's speed"
                 for name, ratio in self.best_ratio.items() if name not in self.chosen and name not in self.declined]
        return [*(f"auto declined {name}: {why}" for name, why in self.declined.items()), *never,
                *(note for d in self.drafters for note in d.summary())]
