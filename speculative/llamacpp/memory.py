"""The KV cache of a model's context, slot by slot: rolled back, forked into draft-tree branches,
a branch kept, saved and restored (Backend's cache-changing methods, for model.LlamaModel).

When several requests run at once (slots.py), each has its own sequences: slot s has sequences
s * n_seq to (s + 1) * n_seq - 1, the first its cache, the rest its branches. A SlotSequences is
one slot's, its sequence ids computed once; it changes only those.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Callable, Sequence

import llama_cpp as ll

from speculative.errors import ContextFull, GenerationError
from speculative.llamacpp.decode import Part, roll_back

if TYPE_CHECKING:
    from speculative.llamacpp.heads import Tap


class Memory:
    """A context's KV cache: a SlotSequences per slot (`slots`), and what one decode of several
    slots' parts must respect (batch_plan). `rows`: the target's hidden rows kept for a head,
    cut wherever a slot's cache is."""

    def __init__(self, name: str, ctx, n_seq: int, n_slots: int, n_ubatch: int, recurrent: bool,
                 rollback_limit: int | None, rows: Tap):
        self.name, self._ctx, self._mem = name, ctx, ll.llama_get_memory(ctx)
        self.n_seq, self.n_ubatch = n_seq, n_ubatch
        self.recurrent, self.rollback_limit = recurrent, rollback_limit
        self.rows = rows
        self._undoable: set[int] = set()  # slots whose latest decode left recurrent snapshots a rollback may use
        self.slots = [SlotSequences(self, slot) for slot in range(n_slots)]

    def clear(self) -> None:
        """Every sequence of every slot empty."""
        self.rows.cut_all()
        self._undoable.clear()
        ll.llama_memory_clear(self._mem, True)

    def decoded(self, slot: int, n_tokens: int) -> None:
        """Slot's sequences took a decode of n_tokens: what of it a rollback may undo."""
        if self.rollback_limit and n_tokens > 1:  # the snapshots of a recurrent state
            self._undoable.add(slot)
        else:
            self._undoable.discard(slot)

    def decode_parts(self, parts: Sequence[Part], together: Callable[[Sequence[Part]], list]) -> list:
        """Several slots' parts decoded by `together` (one llama_decode of the parts given, in
        their order): each part's rows. Raises ContextFull, having decoded nothing, when the cache
        has no cells left for the batch. Where a recurrent state needs its parts decoded one at a
        time (batch_plan), a part that finds no room has its ContextFull in place of its rows,
        and the others run."""
        order, at_once = self.batch_plan(parts)
        results: list = [None] * len(parts)
        if at_once:
            for i, rows in zip(order, together([parts[i] for i in order])):
                results[i] = rows
            return results
        for i in order:
            try:
                results[i] = together([parts[i]])[0]
            except ContextFull as e:
                results[i] = e
                continue
            if i != order[-1]:  # the next decode overwrites what these views read
                results[i] = [row.copy() for row in results[i]]
        return results

    def changed(self, slot: int, n_keep: int) -> None:
        """What slot's cache holds changed from n_keep on: the rows kept for it are cut there,
        and its latest decode can no longer be undone."""
        self.rows.cut(slot, n_keep)
        self._undoable.discard(slot)

    def roll_back(self, seq: int, n_keep: int) -> None:
        """Drop sequence seq's cells from position n_keep on."""
        roll_back(self._mem, self.name, seq, n_keep)

    def batch_plan(self, parts: Sequence[Part]) -> tuple[list[int], bool]:
        """How several slots' parts go to llama.cpp (decode_parts): their order, and
        whether in one decode (else one decode each).

        llama.cpp splits a batch for a recurrent state into ubatches with as many tokens of each
        sequence, and gathers a ubatch's states into adjacent cells: a cell of another sequence
        that lies between them is moved, its state but not its snapshots
        (llama_memory_recurrent::find_slot; build_rs copies plane 0 alone). A slot whose latest
        decode it may still undo would then roll back to some other sequence's state. So parts
        go in one decode only where no such move can hurt: no slot outside it may still undo its
        latest decode, and either every part is one token (nothing to undo) or the parts are of
        one length, of consecutive sequences, and fill one ubatch. A decode of one sequence
        moves nothing. In order of their sequences: llama.cpp puts consecutive ones together."""
        if not self.rollback_limit or len(parts) < 2:  # an attention cache moves nothing
            return list(range(len(parts))), True
        first = [part.seqs[0][0] if len(part.seqs) else -1 for part in parts]
        order = sorted(range(len(parts)), key=first.__getitem__)
        lengths = {len(part.tokens) for part in parts}
        seqs = sorted(first)
        one_ubatch = (len(lengths) == 1 and len(parts[0].tokens) * len(parts) <= self.n_ubatch
                      and seqs == list(range(seqs[0], seqs[0] + len(seqs))))
        outside = self._undoable - {part.slot for part in parts}
        return order, not outside and (lengths == {1} or one_ubatch)


class SlotSequences:
    """One slot's sequences: `base` holds its cache, base + 1 ... its draft-tree branches."""

    def __init__(self, memory: Memory, slot: int):
        self.memory, self.slot = memory, slot
        self.base = slot * memory.n_seq
        self.ids = range(self.base, self.base + memory.n_seq)
        self._mem = memory._mem

    def trim(self, n_keep: int) -> None:
        self.memory.changed(self.slot, n_keep)
        for seq in self.ids:
            self.memory.roll_back(seq, n_keep)

    def copy_branch(self, src: int, dst: int) -> None:
        src, dst = self.base + src, self.base + dst
        ll.llama_memory_seq_rm(self._mem, dst, -1, -1)
        ll.llama_memory_seq_cp(self._mem, src, dst, -1, -1)  # shares the cells, copies nothing

    def keep_branch(self, seq: int, n_keep: int) -> None:
        self.memory.changed(self.slot, n_keep)
        kept = self.base + seq
        for other in self.ids:  # cells of other branches are freed
            if other != kept:
                ll.llama_memory_seq_rm(self._mem, other, -1, -1)
        self.memory.roll_back(kept, n_keep)
        if kept != self.base:
            ll.llama_memory_seq_cp(self._mem, kept, self.base, -1, -1)
            ll.llama_memory_seq_rm(self._mem, kept, -1, -1)

    def save_state(self, partial: bool = False) -> bytes:
        """Its cache (its cells and their keys and values) as llama.cpp serialises it; `partial`:
        a recurrent model's state alone, without the attention cells (a checkpoint)."""
        flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else ll.LLAMA_STATE_SEQ_FLAGS_NONE
        ctx = self.memory._ctx
        size = ll.llama_state_seq_get_size_ext(ctx, self.base, flags)
        buf = (ctypes.c_uint8 * size)()
        n = ll.llama_state_seq_get_data_ext(ctx, buf, size, self.base, flags)
        if n == 0:
            raise GenerationError(f"{self.memory.name}: llama.cpp could not copy the KV cache")
        return ctypes.string_at(buf, n)

    def load_state(self, data: bytes, n_tokens: int, partial: bool = False) -> bool:
        """Make its cache hold exactly positions 0..n_tokens-1 from `data` (save_state's); on any
        failure the cache is left empty and False returned. `partial`: the recurrent state of a
        checkpoint, over the attention cells kept up to n_tokens."""
        flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else ll.LLAMA_STATE_SEQ_FLAGS_NONE
        self.memory.changed(self.slot, n_tokens if partial else 0)  # a restored cache comes without its hidden rows
        if not partial:
            self.trim(0)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        loaded = ll.llama_state_seq_set_data_ext(self.memory._ctx, buf, len(data), self.base, flags) == len(data)
        if loaded and partial:
            loaded = bool(ll.llama_memory_seq_rm(self._mem, self.base, n_tokens, -1))  # the attention cells after it
        # a recurrent state is one cell at the last position: only attention caches start at 0
        if loaded and n_tokens and (ll.llama_memory_seq_pos_max(self._mem, self.base) != n_tokens - 1 or
                                    not self.memory.recurrent
                                    and ll.llama_memory_seq_pos_min(self._mem, self.base) != 0):
            loaded = False
        if not loaded or not n_tokens:
            self.trim(0)
        return loaded
