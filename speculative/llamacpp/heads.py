"""The heads that draft from a model's hidden states, and the rows they draft from: LlamaModel's
part in draft-mtp (its NextN layers, or an MTP head file's) and draft-eagle3 (an EAGLE-3
drafter of its own file, reading the inputs of three of the model's layers).

Once a head drafts, the model copies the rows it reads after every decode (llama.cpp hands
them out only until the next one), per slot, into nextn.NextnRows; the prompt cache saves
them beside the model's cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import llama_cpp as ll
import numpy as np

from speculative.errors import ModelError
from speculative.llamacpp import ext
from speculative.llamacpp.decode import Context
from speculative.llamacpp.dflash import DflashHead
from speculative.llamacpp.eagle3 import EagleHead
from speculative.llamacpp.features import target_layers
from speculative.llamacpp.head import HeadContext
from speculative.llamacpp.mtp import MtpHead
from speculative.llamacpp.nextn import NextnRows
from speculative.models.gguf_meta import feature_drafter_kind


class HeadRows(Context):
    """Needs, besides Context's: _model, name, arch, n_vocab, n_slots, nextn_layers, and _nextn
    (each slot's kept rows, NextN-wide until an EAGLE-3 head says otherwise)."""

    _model = None
    _head: HeadContext | None = None
    _nextn: list[NextnRows]
    _layers: tuple[int, ...] = ()  # the layers whose inputs an EAGLE-3 head reads (else NextN rows)

    def _keep_nextn(self, spans: Sequence[tuple[int | None, int, int]]) -> None:
        """Copy the latest decode's NextN rows while an MTP head drafts from them (llama.cpp
        keeps them only until the next decode): (slot, first position, count) for each run of
        the batch's tokens in order, a slot of None for rows not kept."""
        if self._head is not None:
            rows = self._latest_rows(sum(n for _, _, n in spans))
            start = 0
            for slot, pos, n in spans:
                if slot is not None:
                    self._nextn[slot].put(pos, rows[start : start + n])
                start += n

    def _latest_rows(self, n: int) -> np.ndarray:
        """The latest decode's n rows a head drafts from: NextN rows, or for an EAGLE-3 head the
        inputs of its layers side by side (layer n_layer: the NextN row, its last hidden state)."""
        n_embd = ll.llama_model_n_embd(self._model)
        n_layer = ll.llama_model_n_layer(self._model)
        parts = [ext.get_embeddings_layer_inp(self._ctx, layer) if layer < n_layer else ext.get_embeddings_nextn(self._ctx)
                 for layer in self._layers or (n_layer,)]
        rows = [np.ctypeslib.as_array(part, shape=(n, n_embd)) for part in parts]
        return rows[0] if len(rows) == 1 else np.concatenate(rows, axis=1)

    # -- drafting with its own NextN layers, or an EAGLE-3 drafter -------

    def mtp_head(self, sidecar: Path | None = None) -> "MtpHead":
        """The MTP head on this model's NextN layers, or on those of the MTP head file
        `sidecar` (made on the first call; this model then keeps its NextN rows for it)."""
        if self._head is None:
            if sidecar is None and not self.nextn_layers:
                raise ModelError(f"{self.path}: no NextN (MTP) layers loaded")
            ext.require("draft-mtp")
            self._head = MtpHead(self, self._nextn, sidecar)
            ext.set_embeddings_nextn(self._ctx, True, False)  # unmasked: a row per token
        return self._head

    def feature_head(self, path: Path) -> EagleHead | DflashHead:
        """The drafter at `path` that reads this model's layer inputs: EAGLE-3, DFlash or DSpark, as
        the file says (made on the first call; this model then keeps the inputs of the layers it
        reads). ModelError where it cannot draft for this model."""
        if self._head is None:
            kind = feature_drafter_kind(path)
            ext.require(kind)
            arch = "eagle3" if kind == "draft-eagle3" else "dflash"
            n_layer, n_embd = ll.llama_model_n_layer(self._model), ll.llama_model_n_embd(self._model)
            layers = target_layers(path, arch, self.name, self.arch, n_layer, n_embd, self.n_vocab)
            self._nextn = [NextnRows(len(layers) * n_embd) for _ in range(self.n_slots)]
            self._layers = layers
            self._head = (EagleHead(self, self._nextn, path, layers) if arch == "eagle3" else
                         DflashHead(self, self._nextn, path, layers, dspark=kind == "draft-dspark"))
            for layer in layers:
                if layer < n_layer:
                    ext.set_embeddings_layer_inp(self._ctx, layer, True)
                else:
                    ext.set_embeddings_nextn(self._ctx, True, False)
        return self._head

    def nextn_state(self, n_tokens: int, slot: int = 0) -> bytes | None:
        """The NextN rows of positions 0..n_tokens-1 of slot's cache, for the prompt cache file;
        None when not all are known."""
        rows = self._nextn[slot].get(0, n_tokens) if self._head is not None else None
        return None if rows is None else rows.tobytes()

    def load_nextn_state(self, data: bytes, n_tokens: int, slot: int = 0) -> bool:
        """Rows that nextn_state gave, for a cache that holds those n_tokens again (restored)."""
        rows, kept = np.frombuffer(data, dtype=np.float32), self._nextn[slot]
        if self._head is None or rows.size != n_tokens * kept.n_embd:
            return False
        kept.cut(0)
        kept.put(0, rows.reshape(n_tokens, kept.n_embd))
        return True

