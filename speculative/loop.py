"""The draft/verify loop: a generator of events that never prints.

One step:
  1. the drafter proposes d1..dk given everything so far (k may be 0): a chain,
     or a tree whose branches fork where the draft hesitates (tree.py);
  2. the target scores [last, d1..dk] in one batch at positions n-1..n-1+depth,
     each branch as its own cache sequence;
  3. the acceptance rule (verify.py: the target's pick must match, or speculative
     sampling) keeps m drafted tokens, the accepted path down one branch, and
     adds the target's own token (bonus);
  4. the target cache is rolled back to the accepted path.

The target cache always holds every token except the last one, whose logits the
next step computes. Without a drafter k is 0 and the same loop is plain
target-only decoding, so baseline and speculation share every line of code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence, Union

from .backend import Backend
from .drafters import Draft, Drafter, Outcome
from .errors import GenerationError, UsageError
from .sampling import Sampler
from .tree import Tree
from .verify import match_tree, rejection_sample_tree


SPEC_TYPES = ("none", "draft", "ngram-simple", "ngram-map-k", "auto")
SPEC_ACCEPT = ("rejection", "match")  # speculative sampling, or the target samples and drafts must match
DRAFT_MAX_FIXED = 3    # llama.cpp's default --draft-max
DRAFT_MAX_AUTO = 16    # auto's cap: it picks k <= this each step
# n-gram length: llama.cpp's default when every match is drafted blindly; auto weighs
# each proposal by how long its context matches, and re-finds a copied passage
# sooner after an edit with short n-grams (measured on ../shared/prompts/dev.jsonl).
NGRAM_N_FIXED = 12
NGRAM_N_AUTO = 3
MAX_BRANCHES = 16  # -np: more branches than this make verify batches that never pay


@dataclass(frozen=True)
class NgramSettings:
    n: int | None = None   # length of the n-gram looked up; None: NGRAM_N_FIXED or NGRAM_N_AUTO
    m: int = 48            # most tokens proposed after a match
    min_hits: int = 1      # earlier occurrences needed before proposing

    def size(self, auto: bool) -> int:
        return self.n if self.n is not None else NGRAM_N_AUTO if auto else NGRAM_N_FIXED

    def validate(self, flag: str) -> None:
        if not 1 <= self.size(False) <= 1024 or not 1 <= self.m <= 1024:
            raise UsageError(f"{flag}: n-gram sizes must be in [1, 1024], got n={self.n} m={self.m}")
        if self.min_hits < 1:
            raise UsageError(f"{flag}: min-hits must be >= 1, got {self.min_hits}")


@dataclass(frozen=True)
class SpecSettings:
    types: tuple[str, ...] = ("auto",)  # --spec-type: drafters, tried in order, or auto over them
    draft_max: int = DRAFT_MAX_FIXED    # most tokens drafted per step
    draft_min: int = 0      # drafts shorter than this are not verified
    draft_p_min: float = 0.0  # the draft stops when its top candidate is less likely than this
    n_predict: int = -1     # hard cap on generated tokens; -1: until EOS or context full
    ignore_eos: bool = False
    accept: str = "rejection"  # --spec-accept: how sampled drafts are verified (SPEC_ACCEPT)
    branches: int = 1       # -np: the draft model's most branches per step (1: a chain)
    p_split: float = 0.1    # --draft-p-split: a candidate this likely to the draft starts a branch
    ngram_simple: NgramSettings = NgramSettings()
    ngram_map_k: NgramSettings = NgramSettings()

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafter types named, without 'auto' and 'none'."""
        return tuple(t for t in self.types if t not in ("auto", "none"))

    @property
    def auto(self) -> bool:
        return "auto" in self.types

    def validate(self) -> None:
        unknown = [t for t in self.types if t not in SPEC_TYPES]
        if unknown or not self.types:
            raise UsageError(f"--spec-type: unknown type {', '.join(unknown) or '(empty)'} "
                             f"(known: {', '.join(SPEC_TYPES)})")
        if "none" in self.types and len(self.types) > 1:
            raise UsageError("--spec-type none cannot be combined with other types")
        if len(set(self.types)) != len(self.types):
            raise UsageError(f"--spec-type names a type twice: {','.join(self.types)}")
        if self.accept not in SPEC_ACCEPT:
            raise UsageError(f"--spec-accept: expected one of {', '.join(SPEC_ACCEPT)}, got {self.accept!r}")
        if self.draft_max < 1 and self.types != ("none",):
            raise UsageError(f"--draft-max must be >= 1, got {self.draft_max} (--spec-type none: no drafting)")
        if self.draft_min < 0:
            raise UsageError(f"--draft-min must be >= 0, got {self.draft_min}")
        if self.draft_min > self.draft_max:
            raise UsageError(f"--draft-min ({self.draft_min}) is larger than --draft-max ({self.draft_max})")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise UsageError(f"--draft-p-min must be in [0, 1], got {self.draft_p_min}")
        if not 1 <= self.branches <= MAX_BRANCHES:
            raise UsageError(f"draft branches (-np, --draft-branches) must be in [1, {MAX_BRANCHES}], "
                             f"got {self.branches}")
        if not 0.0 <= self.p_split <= 1.0:
            raise UsageError(f"--draft-p-split must be in [0, 1], got {self.p_split}")
        if self.branches > 1 and ("draft" not in self.drafters or self.auto):
            raise UsageError(f"{self.branches} draft branches: draft trees come from a draft model; "
                             "use --spec-type draft (auto plans chains only)")
        if self.n_predict < -1:
            raise UsageError(f"-n/--n-predict must be -1 (no limit) or >= 0, got {self.n_predict}")
        self.ngram_simple.validate("--spec-ngram-simple-*")
        self.ngram_map_k.validate("--spec-ngram-map-k-*")


@dataclass(frozen=True)
class Prefilled:
    """The prompt is in both caches."""
    n_prompt: int
    seconds: float
    n_cached: int = 0     # of n_prompt, tokens the target cache already held (not processed again)


@dataclass(frozen=True)
class Step:
    """One draft + verify step. Its tokens follow as Token events."""
    index: int
    drafter: str | None   # None: nothing was drafted (k = 0)
    n_drafted: int
    n_accepted: int
    t_draft: float
    t_verify: float
    n_branches: int = 1   # branches of the draft tree (1: a chain)
    branch: int = 0       # the branch the accepted path ran along (tree.py numbers them)


@dataclass(frozen=True)
class Token:
    id: int
    from_draft: bool      # an accepted drafted token; False: the target's own
    step: int


@dataclass(frozen=True)
class Done:
    reason: str           # "stop" (end-of-generation token) or "length" (-n or context)
    t_decode: float       # wall time from the end of prefill to here


Event = Union[Prefilled, Step, Token, Done]


def check_prompt(prompt: Sequence[int], n_ctx: int, n_predict: int) -> None:
    """A prompt must leave room in the context for at least one generated token."""
    if not prompt:
        raise GenerationError("the prompt is empty (no tokens)")
    if len(prompt) >= n_ctx:
        raise GenerationError(
            f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}, "
            f"leaving no room to generate; raise -c/--ctx-size (to at least {len(prompt) + max(n_predict, 1)})"
        )


def generate(
    target: Backend,
    prompt: Sequence[int],
    sampler: Sampler,
    settings: SpecSettings,
    drafter: Drafter | None = None,
    n_cached: int = 0,
) -> Iterator[Event]:
    """`n_cached`: the target cache already holds prompt[:n_cached] (a prefix kept from an
    earlier run), and nothing after it; it is less than len(prompt)."""
    check_prompt(prompt, target.n_ctx, settings.n_predict)
    if not 0 <= n_cached < len(prompt):
        raise ValueError(f"n_cached={n_cached} for a prompt of {len(prompt)} tokens")

    t0 = time.perf_counter()
    tokens = list(prompt)
    target.decode(tokens[n_cached:-1], n_cached, "none")
    if drafter is not None:
        drafter.prefill(tokens)
    yield Prefilled(len(prompt), time.perf_counter() - t0, n_cached)
    t_start = time.perf_counter()  # what the consumer does on Prefilled (save a cache) is not generation

    n_generated = 0
    step = 0
    while True:
        # Room left: the -n cap and the context. A step emits at most k + 1 tokens.
        room = target.n_ctx - len(tokens)
        if settings.n_predict >= 0:
            room = min(room, settings.n_predict - n_generated)
        if room <= 0:
            yield Done("length", time.perf_counter() - t_start)
            return
        k = min(settings.draft_max, room - 1, target.n_batch - 1)

        t_draft = time.perf_counter()
        draft = Draft([], "none")
        if drafter is not None and k >= max(1, settings.draft_min):
            draft = drafter.propose(tokens, k)
        draft = draft.head(k if len(draft.tokens) >= settings.draft_min else 0)
        drafted = draft.tokens
        t_verify = time.perf_counter()

        n = len(tokens)
        tree = Tree(draft.tree)
        for b in range(1, tree.n_branches):  # every branch sees the cache so far
            target.copy_branch(0, b)
        rows = target.decode_branches([tokens[-1], *drafted], [n - 1, *(n - 1 + d for d in tree.depth)],
                                      [tuple(range(tree.n_branches)), *tree.seqs])
        history = _history(sampler, tokens, drafted, tree)  # what row i follows, for penalties
        if sampler.settings.greedy or settings.accept == "match":
            path, bonus = match_tree(drafted, tree, lambda i: sampler.sample(rows[i], history(i)))
        else:
            path, bonus = rejection_sample_tree(
                drafted, tree, draft.q, lambda i: sampler.distribution(rows[i], history(i)), sampler.rng)
        m, branch = len(path), tree.branch[path[-1]] if path else 0
        target.keep_branch(branch, n + m)
        t_done = time.perf_counter()
        if drafter is not None:
            drafter.accept(Outcome(draft, m, bonus, t_verify - t_draft, t_done - t_verify))

        yield Step(step, draft.source if drafted else None, len(drafted), m,
                   t_verify - t_draft, t_done - t_verify, tree.n_branches, branch)
        for i, token in enumerate([*(drafted[j] for j in path), bonus]):
            if target.is_eog(token) and not settings.ignore_eos:
                yield Done("stop", time.perf_counter() - t_start)
                return
            tokens.append(token)
            n_generated += 1
            yield Token(token, from_draft=i < m, step=step)
        step += 1


def _history(sampler: Sampler, tokens: list[int], drafted: list[int], tree: Tree):
    """The tokens each row of a verified batch follows, for penalties (else nothing):
    row 0 the context, row i + 1 the context and the path to drafted node i."""
    if not sampler.settings.penalties:
        return lambda i: ()
    n = sampler.settings.repeat_last_n
    recent = tokens[-n:] if n > 0 else tokens
    return lambda i: [*recent, *(drafted[j] for j in tree.path(i - 1))]
