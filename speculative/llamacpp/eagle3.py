"""The EAGLE-3 drafter (llama.cpp's draft-eagle3): a one-layer decoder of its own file that drafts
from the target's hidden states, as common/speculative.cpp's driver runs it.

An EAGLE-3 GGUF (architecture `eagle3`) names three of the target's layers
(`eagle3.target_layers`); the target hands out the inputs of those layers for every token it
decodes (llama_set_embeddings_layer_inp; a layer id equal to the target's layer count is its
last hidden state, the NextN row), and the target model copies them after each decode as it
copies NextN rows for an MTP head (nextn.NextnRows, here three layers wide). The draft's encoder
(`fc`) turns a position's three rows into one row g; its decoder entry at KV position P is the
pair (token at P + 1, g at P), and predicts the token at P + 2.

Numbered by the token it carries, that is the MTP head's entry at p = P + 1 (the token at p
with the row of p - 1), so EagleHead is a head as MtpHead is, with two differences: `target_rows` runs the
encoder over the target's rows, and entry p sits at KV position p - 1 (the token at position 0
has no entry: nothing comes before it). cache.HeadCache owns it as it owns an MTP head. Drafted
entries carry the decoder's own pre-norm row of the entry before (llama.cpp's "prenorm"), as a
drafted MTP entry carries the head's NextN row.

A draft without token embeddings or an output projection of its own uses the target's, through
the context's `ctx_other` (llama.cpp makes every draft context so). A draft with a `d2t` map (a
reduced vocabulary) scatters its logits to the target's token ids inside its graph: its logits
are over the target's vocabulary, -inf where it has no row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import llama_cpp as ll
import numpy as np

from speculative.errors import GenerationError, ModelError
from speculative.files import content_identity
from speculative.llamacpp import ext
from speculative.llamacpp.decode import Batch, head_context_params
from speculative.llamacpp.devices import head_model_params
from speculative.llamacpp.head import HeadContext, HeadOutputs, HeadPart
from speculative.llamacpp.nextn import NextnRows

def open_drafter(path: Path, target, what: str):
    """A drafter file's weights and its context beside `target`'s (a model.LlamaModel): as many
    positions and sequences, and the target's context as its ctx_other, whose token embeddings
    and output projection llama.cpp uses where the drafter has none of its own."""
    mparams, _keep = head_model_params(target)
    model = ll.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise ModelError(f"{path}: llama.cpp could not load this {what} drafter")
    cparams = head_context_params(target, target.n_slots)
    cparams.ctx_other = target._ctx
    ctx = ll.llama_init_from_model(model, cparams)
    if not ctx:
        ll.llama_model_free(model)
        raise ModelError(f"{path}: llama.cpp could not create a context for this {what} drafter")
    return model, ctx


class EagleHead(HeadContext):
    """An EAGLE-3 draft in a context of its own beside the target's (see the top): a Head, token
    by token, whose entry p, the token at p with a row g of p - 1, sits at KV position p - 1."""

    kind = "draft-eagle3"
    # llama.cpp's EAGLE-3 decoder graph computes logits and pre-norm rows for every entry and
    # does not pick the outputs asked for: with only the last entry of several asked for, the
    # first entry's row came back as the last's. Every entry is an output instead.
    every_output = True

    def __init__(self, target, features: Sequence[NextnRows], path: Path, layers: tuple[int, ...]):
        """The drafter at `path` (checked by target_layers) for `target` (a model.LlamaModel), and
        the target's rows of `layers` (one NextnRows per slot)."""
        self._rows = features
        self.layers = layers
        self.rows_key = f"layers {list(layers)}"  # what the target's kept rows are (prompt cache)
        self.n_batch = target.n_batch
        self._own = self._ctx = None
        self._batch = self._encoder = None
        self.file = content_identity(path)
        self.name = f"{path.name} (EAGLE-3)"
        self._own, self._ctx = open_drafter(path, target, "EAGLE-3")
        self.n_embd = ll.llama_model_n_embd(self._own)
        ext.set_embeddings_nextn(self._ctx, True, False)  # the encoder's g rows, the decoder's pre-norm rows
        self._mem = ll.llama_get_memory(self._ctx)
        self.n_ctx = target.n_ctx
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._own))
        self._batch = Batch(self._ctx, self.n_batch, self.n_vocab, n_embd=self.n_embd)
        self._n_encode = ll.llama_n_ubatch(self._ctx)  # the encoder takes one ubatch at a time
        self._encoder = Batch(self._ctx, self._n_encode, self.n_vocab, n_embd=features[0].n_embd, tokens=False)
        self._encode(np.zeros((1, features[0].n_embd), dtype=np.float32))  # allocates the compute buffers
        self.decode([0, 0], 0, np.zeros((2, self.n_embd), dtype=np.float32))
        self.trim(0)

    def target_rows(self, start: int, end: int, slot: int = 0) -> np.ndarray | None:
        """The encoder's rows g for positions start..end-1 of slot's cache (-1: zeros, never
        decoded), from the target's rows of the three layers; None where those are unknown."""
        before = max(0, min(end, 0) - start)  # positions before 0
        features = self._rows[slot].get(max(start, 0), end)
        if features is None:
            return None
        return np.concatenate([np.zeros((before, self.n_embd), dtype=np.float32), self._encode(features)])

    def _encode(self, features: np.ndarray) -> np.ndarray:
        """The encoder's row g of each row of `features`, a ubatch at a time."""
        g = np.empty((len(features), self.n_embd), dtype=np.float32)
        enc = self._encoder
        for i in range(0, len(features), self._n_encode):
            n = min(self._n_encode, len(features) - i)
            enc.embd[:n] = features[i : i + n]
            # the encoder reads no positions; llama.cpp wants them after its sequence 0's cells
            enc.pos[:n] = ll.llama_memory_seq_pos_max(self._mem, 0) + 1 + np.arange(n)
            enc.out[:n] = 1
            if enc.run(n, encode=True) != 0:
                raise GenerationError(f"{self.name}: llama.cpp's encoder failed on {n} rows")
            g[i : i + n] = np.ctypeslib.as_array(ext.get_embeddings_nextn(self._ctx), shape=(n, self.n_embd))
        return g

    def decode_parts(self, parts: Sequence[HeadPart]) -> list[HeadOutputs | None]:
        """As every head's, with entry p at KV position p - 1; the entry of the token at position 0
        is left out (its part gives None when nothing else is in it)."""
        shifted = [HeadPart(p.tokens[1:], 0, p.rows[1:], p.slot) if p.pos == 0 else
                   HeadPart(p.tokens, p.pos - 1, p.rows, p.slot) for p in parts]
        run = [p for p in shifted if len(p.tokens)]
        outputs = iter(super().decode_parts(run) if run else [])
        # copies: another slot's encoder may run before this slot reads them (slots.SlotHead)
        return [None if not len(p.tokens) else _copied(next(outputs)) for p in shifted]

    def trim(self, n_keep: int, slot: int = 0) -> None:
        self._roll_back(slot, max(0, n_keep - 1))

    def close(self) -> None:
        if self._encoder is not None:
            self._encoder.free()
            self._encoder = None
        super().close()


def _copied(out: HeadOutputs | None) -> HeadOutputs | None:
    return None if out is None else (out[0].copy(), out[1].copy())
