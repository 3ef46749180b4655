"""The draft/verify loop: a generator of events that never prints.

One step, each a function below:
  propose   the drafter proposes d1..dk given everything so far (k may be 0): a
            chain, or a tree whose branches fork where the draft hesitates (tree.py);
  score     the target scores [last, d1..dk] in one batch, each branch as its own
            cache sequence;
  verify    the acceptance rule (verify.py: the target's pick must match, or
            speculative sampling) keeps m drafted tokens, the accepted path down one
            branch, and adds the target's own token (bonus);
  roll back the target cache keeps the accepted path and drops the rest;
  emit      the accepted tokens and the bonus become Token events, up to an
            end-of-generation token (with n_probs, each with the target's
            probabilities at it, from the row that chose it).

The target cache always holds every token except the last one, whose logits the
next step computes. Without a drafter k is 0 and the same loop is plain
target-only decoding, so baseline and speculation share every line of code.

The loop runs no decode itself: it yields each one it needs (backend.Decode, from the caches
and the drafters) and reads its result when resumed, so that the scheduler (scheduler.py) runs
the decodes of every request running at once together, one batch per model and tick. When their
shared cache has no cell left for one, it ends there (ContextFull), as at the end of its context.
With context shift (shift), a run at the end of its context drops older tokens and goes on.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from speculative.decoding.backend import Work, needs_of
from speculative.decoding.cache import Cache
from speculative.decoding.constraint import Constraint, check_draft, path_states
from speculative.decoding.drafter import Draft, Drafter, Outcome
from speculative.decoding.events import Done, Event, Prefilled, Prefilling, Step, Token, TokenProbs
from speculative.decoding.sampling import Sampler, one_hot, token_probs
from speculative.decoding.settings import SpecSettings, acceptance
from speculative.decoding.tree import Tree
from speculative.decoding.verify import match_tree, rejection_sample_tree, synthetic_keep, synthetic_match
from speculative.errors import ContextFull


def generate(target: Cache, prompt: Sequence[int], sampler: Sampler, settings: SpecSettings,
             drafter: Drafter | None = None, constraint: Constraint | None = None,
             renew: Callable[[Drafter | None], Drafter | None] = lambda drafter: drafter) -> Iterator[Event]:
    """Generate after `prompt` (settings.check_prompt has passed it). The target cache keeps
    the longest prefix of the prompt it already holds, from an earlier run, and only
    processes the rest. With `constraint`, only what its grammar admits (constraint.py).
    `renew(drafter)`: a drafter for a context that lost tokens (shift), from the old one."""
    rule = acceptance(sampler.settings, settings)
    keep = synthetic_keep(settings.synthetic_probs(), sampler.seed, target.model.is_eog) if rule == "synthetic" else None
    t0 = time.perf_counter()
    context = list(prompt)
    try:
        n_cached = yield from prefill(target, drafter, context)
    except ContextFull:
        yield Done("length", 0.0, _cut(constraint), _spent(constraint))
        return
    yield Prefilled(len(context), time.perf_counter() - t0, n_cached)
    t_start = time.perf_counter()  # what the consumer does on Prefilled (save a cache) is not generation
    n_generated = n_shifted = 0
    for index in itertools.count():
        k = room(target, settings, len(context), n_generated) - 1  # a step emits up to k + 1 tokens
        if k < 0 and (dropped := shift_full(target, settings, context, len(prompt), n_generated)):
            drafter = renew(drafter)  # the drafters index a history that only grew: they start again
            yield from needs_of(prefill(target, drafter, context))  # its progress is no prompt's
            n_shifted += dropped
            k = room(target, settings, len(context), n_generated) - 1
        if k < 0:
            yield Done("length", time.perf_counter() - t_start, _cut(constraint), _spent(constraint), n_shifted)
            return
        t_draft = time.perf_counter()
        try:
            draft = yield from propose(drafter, context, min(k, target.model.n_batch - 1), settings)  # one batch
            if constraint is not None:
                draft = check_draft(draft, constraint.state)
            t_verify = time.perf_counter()
            tree = Tree(draft.tree)
            rows = yield from score(target, context[-1], draft, tree)
            raw = [row.copy() for row in rows] if sampler.settings.n_probs else None  # before sampling edits them
            history, state = row_inputs(sampler, context, draft, tree, constraint)
            path, bonus = verify(rule, sampler, draft, tree, rows, history, state, keep)
            branch = roll_back(target, tree, path, len(context))
        except ContextFull:
            yield Done("length", time.perf_counter() - t_start, _cut(constraint), _spent(constraint), n_shifted)
            return
        t_done = time.perf_counter()
        if drafter is not None:
            drafter.accept(Outcome(draft, len(path), bonus, t_verify - t_draft, t_done - t_verify))
        others, others_scored = target.load  # requests at once: what they put in the pass
        yield Step(index, draft.source if draft.tokens else None, len(draft.tokens), len(path),
                   t_verify - t_draft, t_done - t_verify, tree.n_branches, branch, 1 + others_scored,
                   len(draft.tokens) + 1 + others, draft.certain)
        emitted = [*(draft.tokens[j] for j in path), bonus]
        probs = probabilities(sampler, raw, path, emitted, history, state) if raw is not None else None
        if constraint is not None:
            constraint.advance(emitted)
        if (yield from emit(target, settings, context, emitted, len(path), index, probs)):
            yield Done("stop", time.perf_counter() - t_start, False, _spent(constraint), n_shifted)
            return
        n_generated += len(emitted)


def prefill(target: Cache, drafter: Drafter | None, context: list[int]) -> Iterator[Prefilling]:  # and needs
    """Put the prompt in the caches: the target's gets all of it but the last token, which
    the first step scores. Returns how many of its tokens the target cache already held, and
    yields the progress (llama-server's prompt_progress): before the first batch (-b) and after
    each, the last token counted with the last batch, as it follows it at once."""
    n_cached = target.keep_prefix(context, len(context) - 1)
    todo, size = context[n_cached:-1], target.model.n_batch
    yield Prefilling(len(context), n_cached, n_cached)
    for start in range(0, len(todo), size):
        yield from target.extend(todo[start:start + size])
        yield Prefilling(len(context), n_cached, n_cached + start + size if start + size < len(todo) else len(context))
    if not todo:
        yield Prefilling(len(context), n_cached, len(context))
    target.mark()  # a recurrent state: the next run's prompt may share this one, not the output
    if drafter is not None:
        yield from drafter.prefilling(context)
    return n_cached


def shift_full(target: Cache, settings: SpecSettings, context: list[int], n_prompt: int, n_generated: int) -> int:
    """With --context-shift, at a full context (not at the -n cap): shift; how many tokens left."""
    if not (settings.context_shift and len(context) >= target.model.n_ctx and
            (settings.n_predict < 0 or n_generated < settings.n_predict)):
        return 0
    return shift(settings, context, n_prompt)


def shift(settings: SpecSettings, context: list[int], n_prompt: int) -> int:
    """llama.cpp's context shift, at a full context: the first n_keep tokens stay (-1: the
    prompt's), the n_discard after them (0: half of the rest) leave the context. Returns how many
    left (0: none could). The caches then hold what is left as after a prompt: what follows the
    kept tokens is decoded again at its new positions, where llama.cpp moves its cached keys."""
    n_keep = min(n_prompt if settings.n_keep < 0 else settings.n_keep, len(context) - 2)
    n_discard = min(settings.n_discard or (len(context) - n_keep) // 2, len(context) - n_keep - 1)
    if n_discard <= 0:
        return 0
    del context[n_keep:n_keep + n_discard]
    return n_discard


def room(target: Cache, settings: SpecSettings, n_context: int, n_generated: int) -> int:
    """Tokens the run may still emit: what the context and the -n cap leave."""
    left = target.model.n_ctx - n_context
    if settings.n_predict >= 0:
        left = min(left, settings.n_predict - n_generated)
    return left


def propose(drafter: Drafter | None, context: list[int], k: int, settings: SpecSettings) -> Work[Draft]:
    """Up to k drafted tokens (and at most the drafters' limits, --draft-max for most): none
    without a drafter, or when fewer than --draft-min would come."""
    k = min(k, settings.step_max)
    if drafter is None or k < max(1, settings.draft_min):
        return Draft([], "none")
    draft = yield from drafter.proposing(context, k)
    return draft.head(k if len(draft.tokens) >= settings.draft_min else 0)


def score(target: Cache, last: int, draft: Draft, tree: Tree) -> Work[list[np.ndarray]]:
    """The target's logits after the last token and after each drafted token, in one batch;
    each branch is a cache sequence of its own, so a token sees only its ancestors. A recurrent
    state may need a copy to come back to (Cache.checkpoint) before drafted tokens."""
    for b in range(1, tree.n_branches):  # every branch sees the cache so far
        target.fork(0, b)
    return (yield from target.decode_tree([last, *draft.tokens], [tuple(range(tree.n_branches)), *tree.seqs],
                                          ahead=len(draft.tokens)))


def row_inputs(sampler: Sampler, context: list[int], draft: Draft, tree: Tree, constraint: Constraint | None
               ) -> tuple[Callable[[int], list[int]], Callable[[int], object]]:
    """What each row of the verified batch is sampled after: the tokens it follows (for
    penalties, else nothing) and the grammar's state there (None without one)."""
    history = _history(sampler, context, draft.tokens, tree)
    state = (path_states(constraint.state, draft.tokens, draft.tree) if constraint is not None
             else lambda i: None)
    return history, state


def verify(rule: str, sampler: Sampler, draft: Draft, tree: Tree, rows: list[np.ndarray],
           history: Callable[[int], list[int]], state: Callable[[int], object],
           keep: Callable[[int, int], bool] | None = None) -> tuple[list[int], int]:
    """The accepted path (drafted nodes, root to leaf) and the target's own token after it,
    each row sampled after what row_inputs gives. Under a grammar each row is sampled among
    what it admits after the path to it, and a row where it admits one token only
    (Draft.certain) needs no sampling. `keep`: the synthetic rule's choice
    (verify.synthetic_keep)."""
    if rule == "synthetic":
        return synthetic_match(draft.tokens, lambda i: sampler.sample(rows[i], history(i), state(i)), keep)
    if rule == "rejection":
        return rejection_sample_tree(
            draft.tokens, tree, draft.q, lambda i: one_hot(draft.tokens[i]) if i < draft.certain
            else sampler.distribution(rows[i], history(i), state(i)), sampler.rng)
    return match_tree(draft.tokens, tree, lambda i: draft.tokens[i] if i < draft.certain
                      else sampler.sample(rows[i], history(i), state(i)))


def roll_back(target: Cache, tree: Tree, path: list[int], n_context: int) -> int:
    """The target cache keeps the context and the accepted path; the branch it ran along."""
    branch = tree.branch[path[-1]] if path else 0
    target.keep_branch(branch, n_context + len(path))
    return branch


def probabilities(sampler: Sampler, raw: list[np.ndarray], path: list[int], emitted: list[int],
                  history: Callable[[int], list[int]], state: Callable[[int], object]) -> list[TokenProbs]:
    """Each emitted token's probabilities (sampling.token_probs), from the row that chose it: the
    first token's is row 0, each next one's the row after the drafted node before it."""
    rows = [0, *(node + 1 for node in path)]
    return [token_probs(sampler, raw[r], token, history(r), state(r)) for r, token in zip(rows, emitted)]


def emit(target: Cache, settings: SpecSettings, context: list[int], tokens: list[int], n_accepted: int,
         step: int, probs: list[TokenProbs] | None = None) -> Iterator[Token]:
    """The step's tokens as events, each added to the context; True when one ends generation."""
    for i, token in enumerate(tokens):
        if target.model.is_eog(token) and not settings.ignore_eos:
            return True
        context.append(token)
        yield Token(token, from_draft=i < n_accepted, step=step, probs=probs[i] if probs else None)
    return False


def _cut(constraint: Constraint | None) -> bool:
    """Whether a run ended by its length leaves its grammar incomplete (the JSON unfinished)."""
    return constraint is not None and not constraint.complete()


def _spent(constraint: Constraint | None) -> float:
    return constraint.seconds if constraint is not None else 0.0


def _history(sampler: Sampler, tokens: list[int], drafted: list[int], tree: Tree) -> Callable[[int], list[int]]:
    """The tokens each row of a verified batch follows, for penalties (else nothing):
    row 0 the context, row i + 1 the context and the path to drafted node i."""
    if not sampler.settings.penalties:
        return lambda i: []
    n = sampler.settings.repeat_last_n
    recent = tokens[-n:] if n > 0 else tokens
    return lambda i: [*recent, *(drafted[j] for j in tree.path(i - 1))]
