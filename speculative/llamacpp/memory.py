"""The KV cache's sequences of a model's context: rolled back, forked into draft-tree branches,
a branch kept, saved and restored (Backend's cache-changing methods, for model.LlamaModel).

When several requests run at once (slots.py), each has its own sequences: `slot` s has
sequences s * n_seq to (s + 1) * n_seq - 1, the first its cache, the rest its branches; every
method changes only the sequences of the slot it is given.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import llama_cpp as ll

from speculative.errors import GenerationError
from speculative.llamacpp.decode import Context, Part
from speculative.llamacpp.nextn import NextnRows


class Sequences(Context):
    """Needs, besides Context's: n_seq (sequences per slot), recurrent, rollback_limit, n_ubatch,
    and _nextn (each slot's NextN rows kept for an MTP head, cut where its cache is)."""

    n_seq: int
    n_ubatch: int
    recurrent: bool
    rollback_limit: int | None
    _nextn: list[NextnRows]
    _undoable: set[int]  # slots whose latest decode left recurrent snapshots a rollback may use

    def clear(self) -> None:
        """Every sequence of every slot empty."""
        for rows in self._nextn:
            rows.cut(0)
        self._undoable.clear()
        ll.llama_memory_clear(self._mem, True)

    def _decoded(self, slot: int, n_tokens: int) -> None:
        """Slot's sequences took a decode of n_tokens: what of it a rollback may undo."""
        if self.rollback_limit and n_tokens > 1:  # the snapshots of a recurrent state
            self._undoable.add(slot)
        else:
            self._undoable.discard(slot)

    def batch_plan(self, parts: Sequence[Part]) -> tuple[list[int], bool]:
        """How several slots' parts go to llama.cpp (model.decode_parts): their order, and
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

    def trim(self, n_keep: int, slot: int = 0) -> None:
        self._nextn[slot].cut(n_keep)
        self._undoable.discard(slot)
        for seq in self._slot_seqs(slot):
            self._roll_back(seq, n_keep)

    def copy_branch(self, src: int, dst: int, slot: int = 0) -> None:
        src, dst = src + slot * self.n_seq, dst + slot * self.n_seq
        ll.llama_memory_seq_rm(self._mem, dst, -1, -1)
        ll.llama_memory_seq_cp(self._mem, src, dst, -1, -1)  # shares the cells, copies nothing

    def keep_branch(self, seq: int, n_keep: int, slot: int = 0) -> None:
        self._nextn[slot].cut(n_keep)
        self._undoable.discard(slot)
        base = slot * self.n_seq
        for other in self._slot_seqs(slot):  # cells of other branches are freed
            if other != base + seq:
                ll.llama_memory_seq_rm(self._mem, other, -1, -1)
        self._roll_back(base + seq, n_keep)
        if seq != 0:
            ll.llama_memory_seq_cp(self._mem, base + seq, base, -1, -1)
            ll.llama_memory_seq_rm(self._mem, base + seq, -1, -1)

    def _slot_seqs(self, slot: int) -> range:
        return range(slot * self.n_seq, (slot + 1) * self.n_seq)

    def save_state(self, partial: bool = False, slot: int = 0) -> bytes:
        """Sequence 0's cache (its cells and their keys and values) as llama.cpp serialises it;
        `partial`: a recurrent model's state alone, without the attention cells (a checkpoint)."""
        flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else ll.LLAMA_STATE_SEQ_FLAGS_NONE
        seq = slot * self.n_seq
        size = ll.llama_state_seq_get_size_ext(self._ctx, seq, flags)
        buf = (ctypes.c_uint8 * size)()
        n = ll.llama_state_seq_get_data_ext(self._ctx, buf, size, seq, flags)
        if n == 0:
            raise GenerationError(f"{self.name}: llama.cpp could not copy the KV cache")
        return ctypes.string_at(buf, n)

    def load_state(self, data: bytes, n_tokens: int, partial: bool = False, slot: int = 0) -> bool:
        """Make sequence 0 hold exactly positions 0..n_tokens-1 from `data` (save_state's); on
        any failure the cache is left empty and False returned. `partial`: the recurrent state
        of a checkpoint, over the attention cells kept up to n_tokens."""
        flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else ll.LLAMA_STATE_SEQ_FLAGS_NONE
        self._nextn[slot].cut(n_tokens if partial else 0)  # a restored cache comes without its NextN rows
        self._undoable.discard(slot)
        seq = slot * self.n_seq
        if not partial:
            self.trim(0, slot)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        loaded = ll.llama_state_seq_set_data_ext(self._ctx, buf, len(data), seq, flags) == len(data)
        if loaded and partial:
            loaded = bool(ll.llama_memory_seq_rm(self._mem, seq, n_tokens, -1))  # the attention cells after it
        # a recurrent state is one cell at the last position: only attention caches start at 0
        if loaded and n_tokens and (ll.llama_memory_seq_pos_max(self._mem, seq) != n_tokens - 1 or
                                    not self.recurrent and ll.llama_memory_seq_pos_min(self._mem, seq) != 0):
            loaded = False
        if not loaded or not n_tokens:
            self.trim(0, slot)
        return loaded

