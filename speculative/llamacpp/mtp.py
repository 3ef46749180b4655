"""The MTP head: a model's NextN (MTP) layers drafting for it, in a context of their own.

A model loaded with its NextN layers (LlamaModel.mtp_head) runs them here, on its own weights;
those layers may also come as a file of their own (an MTP head, `convert_hf_to_gguf.py --mtp`),
given with -md: the head then runs on that file's weights.

A model may have several NextN layers, trained to predict 1, 2, ... tokens ahead (Step-3.5,
MiMo-V2, Hunyuan-V3). llama.cpp chains them as its draft-mtp driver does: the entries that
follow the target go into every head's layer (one decode per head, each writing its own
layer's keys and values into the same cells), and the i-th drafted token comes from head i,
which decodes the draft region again from the last entry that followed the target
(llama_set_nextn_layer_offset). A draft is then at most as long as there are heads.

A Gemma-4 MTP assistant (architecture gemma4-assistant, a file given with -md) has no keys and
values of its own: its layers attend to the target's last two layers' cache, which its context
mirrors (ctx_other), cells and sequences included. It is a head with `shared_memory`: each of
its entries is decoded alone at the position of the context's last token (each drafted token at
that same position too, as llama.cpp's driver does), nothing is held, and nothing rolls back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import llama_cpp as ll
import numpy as np

from speculative.errors import ModelError
from speculative.files import content_identity
from speculative.llamacpp import ext
from speculative.llamacpp.decode import Batch, head_context_params
from speculative.llamacpp.devices import head_model_params
from speculative.llamacpp.head import HeadContext, HeadOutputs, HeadPart
from speculative.llamacpp.nextn import NextnRows
from speculative.models.gguf_meta import preflight, read_metadata

# Architectures whose llama.cpp MTP graph runs any of several NextN layers (the others assert
# that there is one: llama.cpp aborts the process on a file with more).
CHAINED_HEADS = frozenset({"hy_v3", "mimo2", "step35"})
# Architectures of MTP heads that read the target's KV cache instead of keeping their own (one
# graph runs all their layers).
SHARED_MEMORY = frozenset({"gemma4-assistant"})


class MtpHead(HeadContext):
    """A model's NextN (MTP) layers in a context of their own (llama.cpp's
    LLAMA_CONTEXT_TYPE_MTP on the same weights, or on an MTP head file's: then loaded with
    load_mtp and no context but this one, as llama.cpp loads -md for draft-mtp), as llama.cpp's
    draft-mtp drives them.

    Its entry at position p is the token at p with a hidden row: the target's NextN row at
    p - 1 for the entries that follow the target, the head's own NextN row of the entry
    before for drafted ones; it predicts the token at p + 1, as the target's entry at p does.
    Its KV cache holds the NextN layers' keys and values, one cell per entry; cache.HeadCache
    is its one owner.
    """

    kind = "draft-mtp"

    def __init__(self, target: LlamaModel, rows: Sequence[NextnRows], sidecar: Path | None = None):
        """The head that follows `target` (a model.LlamaModel, whose module imports this one) and
        its rows (one NextnRows per slot), on the target's weights or the file `sidecar`'s."""
        self.n_embd = rows[0].n_embd
        self._rows = rows
        self.rows_key = self.n_embd  # what the target's kept rows are (the prompt cache's identity)
        self.n_batch = target.n_batch
        self._own = None
        self.file = None if sidecar is None else content_identity(sidecar)  # what it runs, by content (its costs)
        self.name = f"{target.name if sidecar is None else sidecar.name} (MTP)"
        model = target._model if sidecar is None else self._load(sidecar, target)
        arch = target.arch if sidecar is None else read_metadata(sidecar, ["general.architecture"]).get(
            "general.architecture")
        self.shared_memory = arch in SHARED_MEMORY
        self._seqs_per_slot = target.n_seq if self.shared_memory else 1  # its sequences are the target's
        self.n_heads = self._heads(model, arch, sidecar)
        self.max_draft = self.n_heads if self.n_heads > 1 else None  # chained: a token per head
        self._create_context(model, target, sidecar)
        self._mem = ll.llama_get_memory(self._ctx)
        self.n_ctx = target.n_ctx
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        self._batch = Batch(self._ctx, self.n_batch, self.n_vocab, n_embd=self.n_embd)
        self.decode([0], 0, np.zeros((1, self.n_embd), dtype=np.float32))  # allocates the compute buffers
        self.trim(0)

    def _heads(self, model, arch: str | None, sidecar: Path | None) -> int:
        """The NextN layers it chains (1: it drafts with one, however many tokens, or runs them
        all in one graph); refused before llama.cpp would abort on them."""
        n = ll.llama_model_n_layer_nextn(model)
        if self.shared_memory:
            return 1
        if n > 1 and arch not in CHAINED_HEADS:
            self.close()
            raise ModelError(f"{sidecar or self.name}: {n} NextN (MTP) layers, but llama.cpp's {arch} graph "
                             f"runs one (it chains several for {', '.join(sorted(CHAINED_HEADS))} only)")
        return max(1, n)

    def _load(self, path: Path, target: LlamaModel):
        """An MTP head file's weights, its NextN layers loaded (its trunk is not in it)."""
        preflight(path)
        mparams, _keep = head_model_params(target)
        mparams.load_mtp = True
        self._own = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._own:
            raise ModelError(f"{path}: llama.cpp could not load this MTP head")
        width = ll.llama_model_n_embd_out(self._own)  # the rows it takes and gives
        if width != self.n_embd:  # llama.cpp asserts they match
            self.close()
            raise ModelError(f"{path}: an MTP head of width {width} cannot draft for {target.name}, whose "
                             f"hidden states have {self.n_embd}")
        return self._own

    def _create_context(self, model, target: LlamaModel, sidecar: Path | None) -> None:
        """The MTP context on `model`'s weights, beside the target's."""
        cparams = head_context_params(target, target.n_slots * self._seqs_per_slot)
        cparams.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
        cparams.ctx_other = target._ctx  # llama.cpp shares the target's memory where the architecture does
        self._ctx = ll.llama_init_from_model(model, cparams)
        if not self._ctx:
            self.close()
            raise ModelError(f"{sidecar or target.path}: llama.cpp could not create an MTP context")
        ext.set_embeddings_nextn(self._ctx, True, False)  # unmasked: rows by batch index
        if sidecar is None:
            target.adapters.set_on(self._ctx)  # the target's adapters change its NextN layers too

    def decode_parts(self, parts: Sequence[HeadPart]) -> list[HeadOutputs | None]:
        """Several slots' entries in one decode (together no more than n_batch; a decode per
        head with chained heads): each part's last entry's logits and NextN row, as `decode`
        gives them (None for every part when llama.cpp fails)."""
        if self.n_heads == 1:
            return super().decode_parts(parts)
        outputs: list[HeadOutputs | None] = [None] * len(parts)
        for head in dict.fromkeys(part.head for part in parts):
            group = [i for i, part in enumerate(parts) if part.head == head]
            # each head writes its layer into the cells of these positions, which it frees first;
            # llama.cpp gives them the same cells again (as its driver relies on); head 0's last
            for layer in ([head] if head is not None else [*range(1, self.n_heads), 0]):
                for i in group:
                    self._roll_back(parts[i].slot, parts[i].pos)
                ext.set_nextn_layer_offset(self._ctx, layer)
                try:
                    done = super().decode_parts([parts[i] for i in group])
                finally:
                    ext.set_nextn_layer_offset(self._ctx, 0)
            for i, out in zip(group, done):
                outputs[i] = None if out is None else (out[0].copy(), out[1].copy())
        return outputs
