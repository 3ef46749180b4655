"""Draft trees: the shape of a draft that forks (`-np N --draft-p-split P`).

A draft is a list of drafted tokens d0..d(k-1) and their parents: parents[i] is the
index of the token d_i follows, or -1 for the root, the last accepted token (the
one the target has not scored yet). Parents come before their children, so the
first j tokens of a draft are a draft too. A chain, d_i following d(i-1), is the
tree with one branch.

A node's first child continues its branch; every other child starts a new one.
Branch b is the root-to-leaf path through the nodes it started and continued, and
it is scored as KV-cache sequence b: a node belongs to every branch whose path
runs through it, so the target verifies all branches in one batch, each token
seeing only its own ancestors (llama.cpp's sequence ids do that masking).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence


def chain_parents(k: int) -> tuple[int, ...]:
    """The parents of k drafted tokens in a row."""
    return tuple(range(-1, k - 1))


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]

    @cached_property
    def children(self) -> dict[int, list[int]]:
        """node -> its children in order (-1: the root)."""
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(i)
        return children

    @cached_property
    def branch(self) -> tuple[int, ...]:
        """The branch each node starts or continues."""
        branch: list[int] = []
        n_branches = 1
        for i, parent in enumerate(self.parents):
            if self.children[parent][0] == i:
                branch.append(branch[parent] if parent >= 0 else 0)
            else:
                branch.append(n_branches)
                n_branches += 1
        return tuple(branch)

    @property
    def n_branches(self) -> int:
        return 1 + max(self.branch, default=0)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        """1 for the root's children, 2 for theirs, ..."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(depth[parent] + 1 if parent >= 0 else 1)
        return tuple(depth)

    @cached_property
    def seqs(self) -> tuple[tuple[int, ...], ...]:
        """The branches through each node (its own first): its KV-cache sequence ids."""
        seqs = [[b] for b in self.branch]
        for i in reversed(range(len(self.parents))):  # children before parents
            parent = self.parents[i]
            if parent >= 0:
                seqs[parent] += [b for b in seqs[i] if b not in seqs[parent]]
        return tuple(tuple(s) for s in seqs)

    def path(self, node: int) -> list[int]:
        return path_to(self.parents, node)


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (empty for the root); `parents` may
    still be growing (a drafter building its tree)."""
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = parents[node]
    return nodes[::-1]

