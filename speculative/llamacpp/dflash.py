"""DFlash and DSpark drafters (llama.cpp's draft-dflash and draft-dspark): a block of tokens
drafted in one decode, as common/speculative.cpp's driver runs them.

A DFlash GGUF (architecture `dflash`) names layers of its target (`dflash.target_layers`).
Its KV cache holds, at every position the target has decoded, keys and values made from the
target's inputs of those layers at that position (its `fc` fuses them inside the decode that
injects them: an entry of hidden rows and no token). To draft after a context whose last
token the target has not decoded yet, it decodes the block [last token, mask, mask, ...] at
the positions from there, attending over that cache and the whole block (non-causally unless
`dflash.attention.causal`), and each mask's logits draft a token: up to block_size - 1 in one
decode. The block is then dropped from its cache.

Numbered by the token it follows, the injection at position p - 1 is an MTP head's entry p
(the token at p with the row of p - 1; the token itself goes unused), so DflashHead is a head
(head.HeadContext) as the EAGLE-3 head is one, and cache.HeadCache keeps its cache in step with the
target's, through rollbacks, prefix reuse, the prompt cache and slots.

DSpark (a DFlash GGUF with a Markov head, `markov_w1`) drafts the same way, from the block's
first position on where `dflash.sample_from_anchor` says so (a whole block_size of tokens), and
a confidence head (`conf_proj`, `dflash.has_confidence_head`) cuts a draft where the position's
confidence (its pre-norm row's first value) falls below --draft-p-min. DFlash2 (a
`dflash.selector_top_k`) reads its drafts from a candidate lattice instead of logits: each
position's row holds its top-k candidate tokens and the scores of each after each candidate of
the position before (drafters/block.py walks it).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import llama_cpp as ll
import numpy as np

from speculative.decoding.backend import Block
from speculative.errors import ModelError
from speculative.files import content_identity
from speculative.llamacpp import ext
from speculative.llamacpp.decode import Batch
from speculative.llamacpp.eagle3 import open_drafter
from speculative.llamacpp.head import HeadContext, HeadOutputs, HeadPart
from speculative.llamacpp.nextn import NextnRows

DEFAULT_BLOCK = 16  # llama.cpp's block size where the file names none


class DflashHead(HeadContext):
    """A DFlash or DSpark drafter in a context of its own beside the target's (see the top): a
    BlockHead whose entry p injects the target's rows of position p - 1 there, and which drafts
    a block at a time (`block`)."""

    def __init__(self, target, features: Sequence[NextnRows], path: Path, layers: tuple[int, ...], dspark: bool):
        """The drafter at `path` (checked by features.target_layers) for `target` (a
        model.LlamaModel), and the target's rows of `layers` (one NextnRows per slot)."""
        self.kind = "draft-dspark" if dspark else "draft-dflash"
        self._rows = features
        self.layers = layers
        self.rows_key = f"layers {list(layers)}"  # what the target's kept rows are (prompt cache)
        self.n_embd = features[0].n_embd  # an entry's row: the target's layer inputs side by side
        self.n_batch = target.n_batch
        self._batch = self._inject = None
        self.file = content_identity(path)
        self.name = f"{path.name} ({'DSpark' if dspark else 'DFlash'})"
        self._own, self._ctx = open_drafter(path, target, "DSpark" if dspark else "DFlash")
        self._read_settings(path, dspark)
        ext.set_embeddings_nextn(self._ctx, True, not self.lattice)  # DFlash2: every position's lattice row
        ll.llama_set_causal_attn(self._ctx, self.causal)
        self._mem = ll.llama_get_memory(self._ctx)
        self.n_ctx = target.n_ctx
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._own))
        self.n_embd_dec = ll.llama_model_n_embd(self._own)
        self._batch = Batch(self._ctx, self.n_batch, self.n_vocab)
        self._inject = Batch(self._ctx, self.n_batch, self.n_vocab, n_embd=self.n_embd, tokens=False)
        self.decode([0, 0], 0, np.zeros((2, self.n_embd), dtype=np.float32))  # allocates the compute buffers
        self.block(0, 1, 1)
        self.trim(0)

    def _read_settings(self, path: Path, dspark: bool) -> None:
        meta = {key: _meta(self._own, f"dflash.{key}") for key in
                ("block_size", "sample_from_anchor", "attention.causal", "has_confidence_head")}
        self.block_size = int(meta["block_size"]) if meta["block_size"] else DEFAULT_BLOCK
        self.anchor = dspark and meta["sample_from_anchor"] != "false"  # the block's first row drafts too
        self.causal = meta["attention.causal"] == "true"
        self.confidence = dspark and meta["has_confidence_head"] != "false"
        self.selector_top_k = ext.model_dflash_selector_top_k(self._own)
        self.lattice = self.selector_top_k > 0  # DFlash2
        self.mask = ll.llama_vocab_mask(ll.llama_model_get_vocab(self._own))
        if self.mask < 0:
            self.close()
            raise ModelError(f"{path}: a DFlash drafter without a mask token (tokenizer.ggml.mask_token_id)")
        self.max_draft = self.block_size if self.anchor else self.block_size - 1

    def decode_parts(self, parts: Sequence[HeadPart]) -> list[HeadOutputs | None]:
        """The injections of several slots' entries in one decode: entry p's row at position
        p - 1 (entry 0 has none). Each part gives empty outputs, or None when llama.cpp fails."""
        shifted = [HeadPart(p.tokens[1:], 0, p.rows[1:], p.slot) if p.pos == 0 else
                   HeadPart(p.tokens, p.pos - 1, p.rows, p.slot) for p in parts]
        batch, end = self._inject, 0
        for part in shifted:
            start, end = end, end + len(part.tokens)
            batch.embd[start:end] = part.rows
            batch.pos[start:end] = np.arange(part.pos, part.pos + len(part.tokens))
            batch.out[start:end] = 0
        batch.set_seqs([(part.slot,) for part in shifted for _ in part.tokens])
        if end and batch.run(end) != 0:
            return [None] * len(parts)
        nothing = (np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.float32))
        return [nothing if len(part.tokens) else None for part in shifted]

    def block(self, token: int, pos: int, k: int, slot: int = 0) -> Block | None:
        """Draft up to k tokens after `token` at position `pos` (the cache holds 0..pos-1): the
        block [token, mask, ...] decoded there, and dropped again; None when llama.cpp fails."""
        n = k if self.anchor else k + 1
        batch = self._batch
        batch.tok[:n] = [token] + [self.mask] * (n - 1)
        batch.pos[:n] = np.arange(pos, pos + n)
        batch.out[:n] = 0 if self.lattice else 1
        batch.set_seqs([(slot,)] * n)
        try:
            if batch.run(n) != 0:
                return None
            logits = None if self.lattice else np.stack([batch.logits(i) for i in range(n)])
            rows = None
            if self.lattice or self.confidence:
                rows = np.ctypeslib.as_array(ext.get_embeddings_nextn(self._ctx), shape=(n, self.n_embd_dec)).copy()
            return Block(logits, rows)
        finally:
            self._roll_back(slot, pos)  # the block is no part of what it holds

    def trim(self, n_keep: int, slot: int = 0) -> None:
        self._roll_back(slot, max(0, n_keep - 1))

    def close(self) -> None:
        if self._inject is not None:
            self._inject.free()
            self._inject = None
        super().close()


def _meta(model, key: str) -> str | None:
    """A metadata value of a loaded model, as text (None: absent)."""
    buf = (ctypes.c_char * 64)()
    if ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf)) < 0:
        return None
    return buf.value.decode(errors="replace")
