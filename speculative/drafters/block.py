"""The block drafters (llama.cpp's draft-dflash and draft-dspark): a DFlash or DSpark model
drafts a whole block of tokens in one decode (llamacpp/dflash.py), from the target's layer
inputs, which its cache follows as an MTP head's does (cache.HeadCache).

Each drafted token is a block position's: greedy, its best token (DFlash stops at the first
whose probability among the best 10 is below --draft-p-min, DSpark at the first whose
confidence is); sampled, drawn from that position's distribution after the sampler chain and
kept as the Draft's q, so speculative sampling stays exact. DFlash2 walks its candidate
lattice instead: each position's candidate that scores best after the one chosen before it
(deterministic, no q).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from speculative.decoding.backend import Work
from speculative.decoding.drafter import Draft
from speculative.decoding.constraint import stepped
from speculative.drafters.head import HeadDrafter
from speculative.drafters.model import pick


class BlockDrafter(HeadDrafter):
    """draft-dflash or draft-dspark: the head (cache.head) says which."""

    rows = "layer inputs"

    def proposing(self, context: Sequence[int], k: int) -> Work[Draft]:
        head = self.cache.head
        # the block sits at positions len(context) - 1 on
        k = min(k, head.max_draft, head.n_ctx - len(context) + (1 if head.anchor else 0))
        if k <= 0 or not self.can_draft(context) or (yield from self.cache.sync(context)) is None:
            return self.nothing()
        block = head.block(context[-1], len(context) - 1, k)
        if block is None:
            return self.nothing()
        if head.lattice:
            return Draft(walk_lattice(block.rows, head.selector_top_k, self.p_min), self.name)
        tokens: list[int] = []
        q: list = []
        grammar = self.constraint.state if self.constraint is not None else None
        for i in range(0 if head.anchor else 1, len(block.logits)):
            if head.confidence and self.p_min > 0 and block.rows[i, 0] < self.p_min:
                break
            picked = pick(block.logits[i], 0.0 if head.kind == "draft-dspark" else self.p_min, self.sampler,
                          lambda: [*context, *tokens], grammar)
            if picked is None:
                break
            tokens.append(picked[0])
            q.append(picked[1])
            if i + 1 < len(block.logits):
                grammar = stepped(grammar, tokens[-1])
        return Draft(tokens, self.name, q=tuple(q) if self.sampler is not None else None)


def walk_lattice(rows: np.ndarray, top_k: int, p_min: float) -> list[int]:
    """DFlash2's draft (common/speculative.cpp): position i's row holds its top_k candidate
    tokens, then for each candidate of position i - 1 the scores of its own top_k after it;
    from the block's first position, each next token is the best-scoring candidate after the
    one chosen before, cut where its softmax probability among them is below p_min."""
    tokens: list[int] = []
    predecessor = 0
    for row in rows[1:]:
        scores = row[top_k + predecessor * top_k : top_k + (predecessor + 1) * top_k]
        predecessor = int(np.argmax(scores))
        if p_min > 0 and 1.0 / float(np.exp(scores - scores[predecessor]).sum()) < p_min:
            break
        tokens.append(int(row[predecessor]))
    return tokens
