"""What a run reports, in order: Prefilling as the prompt goes in, Prefilled (and PromptCache
when a prompt cache file is used), then per step a Step followed by its Token events, then
Done. The loop (loop.py) and the engine (engine.py) yield them; stream.py and stats.py read
them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Prefilling:
    """The prompt is on its way into the caches: before its first batch, and after each."""
    n_prompt: int
    n_cached: int         # tokens the target cache already held (not processed again)
    n_done: int           # tokens in the cache so far, those included (n_prompt: all)


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
    n_seqs: int = 1       # requests whose tokens the target's pass carried (several: requests at once)
    n_pass: int = 0       # tokens in that pass, every request's
    n_certain: int = 0    # of the drafted, tokens a grammar admitted alone (accepted whatever the target)


@dataclass(frozen=True)
class TokenProbs:
    """The target's probabilities at a generated token (SamplerSettings.n_probs): the token's
    own, and the likeliest tokens' (id, probability), best first."""
    prob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Token:
    id: int
    from_draft: bool      # an accepted drafted token; False: the target's own
    step: int
    probs: TokenProbs | None = None  # with SamplerSettings.n_probs


@dataclass(frozen=True)
class Done:
    reason: str           # "stop" (end-of-generation token) or "length" (-n or context)
    t_decode: float       # wall time from the end of prefill to here
    incomplete: bool = False  # "length" before the run's grammar was complete (its JSON unfinished)
    t_grammar: float = 0.0    # of t_decode, the grammar's own checks (constraint.py)
    n_shifted: int = 0        # tokens context shifts dropped (SpecSettings.context_shift)


@dataclass(frozen=True)
class PromptCache:
    """The prompt cache file's part in this run (after Prefilled)."""
    n_restored: int       # of the prompt's cached tokens, those the file provided
    t_restore: float      # reading and loading it (before the prompt was processed)
    t_save: float         # writing this prompt's caches to it (after)


Event = Union[Prefilling, Prefilled, PromptCache, Step, Token, Done]
