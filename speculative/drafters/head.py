"""The drafters of a head that drafts from the target's hidden states (decoding.backend.Head):
HeadDrafter, what they share, and TokenHeadDrafter, a head drafting token by token: the
target's own NextN (multi-token prediction) layers, an MTP head file or a Gemma-4 assistant
(llama.cpp's draft-mtp), or an EAGLE-3 drafter (draft-eagle3). DFlash and DSpark draft a block
at a time: block.py.

The head's first entry of a step is the context's last token with the target's hidden
row of the token before it (cache.HeadCache brings it in step with the target first,
decoding the entries the accepted tokens added); each drafted token then goes back in
with the head's own row. Greedy, each token is the head's best one; for speculative
sampling each is drawn from the head's distribution after the sampler chain, kept as
the Draft's q, as the draft model does (drafters/model.py), so acceptance stays exact.
"""
from __future__ import annotations

from typing import Callable, Sequence

from speculative.decoding.backend import Work
from speculative.decoding.cache import HeadCache
from speculative.decoding.drafter import DecodingDrafter, Draft
from speculative.decoding.sampling import Sampler
from speculative.decoding.constraint import stepped
from speculative.drafters.model import pick


class HeadDrafter(DecodingDrafter):
    """What the drafters of a head that follows the target's hidden states share (cache.HeadCache):
    its prompt work, whether it can follow a context, and what it says when it could not."""

    rows = "NextN hidden states"  # what of the target it follows, for its note

    def __init__(self, cache: HeadCache, p_min: float = 0.0, sampler: Sampler | None = None):
        self.name = cache.head.kind
        self.cache = cache
        self.p_min = p_min
        self.sampler = sampler
        self.lost = 0  # steps it could not follow the target in (drafting nothing)

    def prefilling(self, prompt: Sequence[int]) -> Work[None]:
        yield from self.cache.sync(prompt[:-1], last=False)  # the target holds those, and its rows of them

    def can_draft(self, context: Sequence[int]) -> bool:
        """Whether the head can follow the target to the end of `context` (see HeadCache)."""
        ok = self.cache.can_follow(context)
        self.lost += not ok
        return ok

    def summary(self) -> list[str]:
        if not self.lost:
            return []
        return [f"{self.name} drafted nothing in {self.lost} steps: the target's {self.rows} for the start of "
                "the context were not known (its cache came from a prompt cache file written without them)"]

    def behind(self, context: Sequence[int]) -> int:
        """Entries to decode before drafting: the tokens the head has not followed yet."""
        return len(context) - self.cache.shared_prefix(context)


class TokenHeadDrafter(HeadDrafter):
    """draft-mtp or draft-eagle3, token by token: the head (cache.head) says which."""

    def __init__(self, cache: HeadCache, is_eog: Callable[[int], bool], p_min: float = 0.0,
                 sampler: Sampler | None = None):
        super().__init__(cache, p_min, sampler)
        self.is_eog = is_eog
        if self.name == "draft-eagle3":
            self.rows = "layer inputs"

    def proposing(self, context: Sequence[int], k: int) -> Work[Draft]:
        # drafted entries go up to position len(context) + k - 2; chained heads draft a token each
        k = min(k, self.cache.head.n_ctx - len(context) + 1, self.cache.head.max_draft or k)
        start = (yield from self.cache.sync(context)) if k > 0 and self.can_draft(context) else None
        if start is None:
            return self.nothing()
        logits, hidden = start
        tokens: list[int] = []
        q: list = []
        grammar = self.constraint.state if self.constraint is not None else None
        while (picked := pick(logits, self.p_min, self.sampler, lambda: [*context, *tokens], grammar)) is not None:
            tokens.append(picked[0])
            q.append(picked[1])
            if len(tokens) == k or self.is_eog(tokens[-1]):
                break
            grammar = stepped(grammar, tokens[-1])
            step = yield from self.cache.draft(tokens[-1], hidden)
            if step is None:
                break
            logits, hidden = step
        return Draft(tokens, self.name, q=tuple(q) if self.sampler is not None else None)
