"""The tap on a model's hidden states: LlamaModel's part in the heads that draft from them, the
head it makes (its NextN layers or an MTP head file's: draft-mtp; a drafter of its own file
reading the inputs of some of its layers: EAGLE-3, DFlash, DSpark), and the rows they draft from.

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
from speculative.llamacpp.dflash import DflashHead
from speculative.llamacpp.eagle3 import EagleHead
from speculative.llamacpp.features import target_layers
from speculative.llamacpp.head import HeadContext
from speculative.llamacpp.mtp import MtpHead
from speculative.llamacpp.nextn import NextnRows
from speculative.models.gguf_meta import feature_drafter_kind


class Tap:
    """The rows `model` (a model.LlamaModel, whose module imports this one) keeps for the head
    drafting from its hidden states, a NextnRows per slot: NextN rows, or the inputs of the
    layers an EAGLE-3, DFlash or DSpark head reads; and that head, made on the first call."""

    def __init__(self, model):
        self.model = model
        self.head: HeadContext | None = None
        self.rows = [NextnRows(ll.llama_model_n_embd(model._model)) for _ in range(model.n_slots)]
        self._layers: tuple[int, ...] = ()  # the layers whose inputs the head reads (else NextN rows)

    def keep(self, spans: Sequence[tuple[int | None, int, int]]) -> None:
        """Copy the latest decode's rows while a head drafts from them (llama.cpp keeps them only
        until the next decode): (slot, first position, count) for each run of the batch's tokens
        in order, a slot of None for rows not kept."""
        if self.head is not None:
            rows = self._latest(sum(n for _, _, n in spans))
            start = 0
            for slot, pos, n in spans:
                if slot is not None:
                    self.rows[slot].put(pos, rows[start : start + n])
                start += n

    def cut(self, slot: int, n_keep: int) -> None:
        """Slot's rows from n_keep on are gone (its cache was cut there)."""
        self.rows[slot].cut(n_keep)

    def cut_all(self) -> None:
        for rows in self.rows:
            rows.cut(0)

    def _latest(self, n: int) -> np.ndarray:
        """The latest decode's n rows a head drafts from: NextN rows, or the inputs of its layers
        side by side (layer n_layer: the NextN row, the model's last hidden state)."""
        model, ctx = self.model._model, self.model._ctx
        n_embd, n_layer = ll.llama_model_n_embd(model), ll.llama_model_n_layer(model)
        parts = [ext.get_embeddings_layer_inp(ctx, layer) if layer < n_layer else ext.get_embeddings_nextn(ctx)
                 for layer in self._layers or (n_layer,)]
        rows = [np.ctypeslib.as_array(part, shape=(n, n_embd)) for part in parts]
        return rows[0] if len(rows) == 1 else np.concatenate(rows, axis=1)

    def mtp_head(self, sidecar: Path | None = None) -> MtpHead:
        """The MTP head on the model's NextN layers, or on those of the MTP head file `sidecar`
        (made on the first call; the model then keeps its NextN rows for it)."""
        model = self.model
        if self.head is None:
            if sidecar is None and not model.nextn_layers:
                raise ModelError(f"{model.path}: no NextN (MTP) layers loaded")
            ext.require("draft-mtp")
            self.head = MtpHead(model, self.rows, sidecar)
            ext.set_embeddings_nextn(model._ctx, True, False)  # unmasked: a row per token
        return self.head

    def feature_head(self, path: Path) -> EagleHead | DflashHead:
        """The drafter at `path` that reads the model's layer inputs: EAGLE-3, DFlash or DSpark, as
        the file says (made on the first call; the model then keeps the inputs of the layers it
        reads). ModelError where it cannot draft for the model."""
        model = self.model
        if self.head is None:
            kind = feature_drafter_kind(path)
            ext.require(kind)
            arch = "eagle3" if kind == "draft-eagle3" else "dflash"
            n_layer, n_embd = ll.llama_model_n_layer(model._model), ll.llama_model_n_embd(model._model)
            layers = target_layers(path, arch, model.name, model.arch, n_layer, n_embd, model.n_vocab)
            self.rows = [NextnRows(len(layers) * n_embd) for _ in range(model.n_slots)]
            self._layers = layers
            self.head = (EagleHead(model, self.rows, path, layers) if arch == "eagle3" else
                         DflashHead(model, self.rows, path, layers, dspark=kind == "draft-dspark"))
            for layer in layers:
                if layer < n_layer:
                    ext.set_embeddings_layer_inp(model._ctx, layer, True)
                else:
                    ext.set_embeddings_nextn(model._ctx, True, False)
        return self.head

    def state(self, n_tokens: int, slot: int = 0) -> bytes | None:
        """The rows of positions 0..n_tokens-1 of slot's cache, for the prompt cache file; None
        when not all are known."""
        rows = self.rows[slot].get(0, n_tokens) if self.head is not None else None
        return None if rows is None else rows.tobytes()

    def load_state(self, data: bytes, n_tokens: int, slot: int = 0) -> bool:
        """Rows that state gave, for a cache that holds those n_tokens again (restored)."""
        rows, kept = np.frombuffer(data, dtype=np.float32), self.rows[slot]
        if self.head is None or rows.size != n_tokens * kept.n_embd:
            return False
        kept.cut(0)
        kept.put(0, rows.reshape(n_tokens, kept.n_embd))
        return True

    def close(self) -> None:
        if self.head is not None:
            self.head.close()
            self.head = None
