"""The MTP head: a model's NextN (MTP) layers drafting for it, in a context of their own.

A model loaded with its NextN layers (LlamaModel.mtp_head) runs them here, on its own weights;
those layers may also come as a file of their own (an MTP head, `convert_hf_to_gguf.py --mtp`),
given with -md: the head then runs on that file's weights.

With several requests at once (slots.py) the head's context has a sequence per slot, as the
target's has: slot s's entries are in sequence s, drafted from slot s's NextN rows, and the
slots' entries of one step go in one decode (decode_parts).

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

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import llama_cpp as ll
import numpy as np

from speculative.errors import ModelError
from speculative.files import content_identity
from speculative.llamacpp import ext
from speculative.llamacpp.decode import Batch, Context, head_context_params
from speculative.llamacpp.devices import head_model_params
from speculative.llamacpp.nextn import NextnRows
from speculative.models.gguf_meta import preflight, read_metadata

# Architectures whose llama.cpp MTP graph runs any of several NextN layers (the others assert
# that there is one: llama.cpp aborts the process on a file with more).
CHAINED_HEADS = frozenset({"hy_v3", "mimo2", "step35"})
# Architectures of MTP heads that read the target's KV cache instead of keeping their own (one
# graph runs all their layers).
SHARED_MEMORY = frozenset({"gemma4-assistant"})


@dataclass(frozen=True)
class HeadPart:
    """One slot's entries in a decode of several (MtpHead.decode_parts): tokens at positions pos,
    pos+1, ... with their hidden rows."""
    tokens: Sequence[int]
    pos: int
    rows: np.ndarray
    slot: int
    head: int | None = None  # chained heads: the one head that decodes it; None: every head


HeadOutputs = tuple[np.ndarray, np.ndarray]  # an entry's logits and NextN row


def decode_chunks(run: Callable[[HeadPart], HeadOutputs | None], tokens: Sequence[int], pos: int,
                  rows: np.ndarray, slot: int, size: int, head: int | None = None) -> HeadOutputs | None:
    """Entries for tokens[i] with rows[i] at positions pos, pos+1, ... in slot's sequence, a chunk
    of at most `size` per `run` (a decode of its own, or a place in the gate's batch): the last
    entry's outputs, or None at the first chunk that fails."""
    out = None
    for start in range(0, len(tokens), size):
        end = min(len(tokens), start + size)
        out = run(HeadPart(tokens[start:end], pos + start, rows[start:end], slot, head))
        if out is None:
            return None
    return out


class MtpHead(Context):
    """A model's NextN (MTP) layers in a context of their own (llama.cpp's
    LLAMA_CONTEXT_TYPE_MTP on the same weights, or on an MTP head file's: then loaded with
    load_mtp and no context but this one, as llama.cpp loads -md for draft-mtp), as llama.cpp's
    draft-mtp drives them.

    Its entry at position p is the token at p with a hidden row: the target's NextN row at
    p - 1 for the entries that follow the target, the head's own NextN row of the entry
    before for drafted ones; it predicts the token at p + 1, as the target's entry at p does.
    Its KV cache holds the NextN layers' keys and values, one cell per entry; cache.MtpCache
    is its one owner.
    """

    kind = "draft-mtp"  # the --spec-type it drafts for
    every_output = False  # whether a decode must ask for every entry's outputs to get the last one's

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
            target._set_loras(self._ctx)  # the target's adapters change its NextN layers too

    def target_rows(self, start: int, end: int, slot: int = 0) -> np.ndarray | None:
        """The target's NextN rows for positions start..end-1 of slot's cache (-1: zeros), None
        where unknown."""
        return self._rows[slot].get(start, end)

    def decode(self, tokens: Sequence[int], pos: int, rows: np.ndarray, head: int | None = None) -> HeadOutputs | None:
        """Entries for tokens[i] with rows[i] at positions pos, pos+1, ... after the pos the
        cache holds (with chained heads: in every head's layer, or in `head`'s alone): the last
        entry's logits and NextN row (views, valid until the next decode; head 0's for every
        head), or None when llama.cpp fails (the cache may then hold some of them)."""
        return decode_chunks(lambda part: self.decode_parts([part])[0], tokens, pos, rows, 0, self.n_batch, head)

    def decode_parts(self, parts: Sequence[HeadPart]) -> list[HeadOutputs | None]:
        """Several slots' entries in one decode (together no more than n_batch; a decode per
        head with chained heads): each part's last entry's logits and NextN row, as `decode`
        gives them (None for every part when llama.cpp fails)."""
        if self.n_heads == 1:
            return self._decode_parts(parts)
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
                    done = self._decode_parts([parts[i] for i in group])
                finally:
                    ext.set_nextn_layer_offset(self._ctx, 0)
            for i, out in zip(group, done):
                outputs[i] = None if out is None else (out[0].copy(), out[1].copy())
        return outputs

    def _decode_parts(self, parts: Sequence[HeadPart]) -> list[HeadOutputs | None]:
        batch, end = self._batch, 0
        ends = []
        for part in parts:
            start, end = end, end + len(part.tokens)
            batch.tok[start:end] = part.tokens
            batch.pos[start:end] = np.arange(part.pos, part.pos + len(part.tokens))
            batch.embd[start:end] = part.rows
            batch.out[start:end] = self.every_output
            batch.out[end - 1] = 1
            ends.append(end - 1)
        batch.set_seqs([(part.slot * self._seqs_per_slot,) for part in parts for _ in part.tokens])
        if batch.run(end) != 0:
            return [None] * len(parts)
        return [self._outputs(i) for i in ends]

    def _outputs(self, i: int) -> HeadOutputs:
        """The logits and NextN row of the latest decode's entry i."""
        hidden = ext.get_embeddings_nextn_ith(self._ctx, i)
        return self._batch.logits(i), np.ctypeslib.as_array(hidden, shape=(self.n_embd,))

    def trim(self, n_keep: int, slot: int = 0) -> None:
        if not self.shared_memory:  # the target's cells are the target's to roll back
            self._roll_back(slot, n_keep)

    def close(self) -> None:
        self._free_context()
        if self._own:  # an MTP head file's weights: freed after the context on them
            ll.llama_model_free(self._own)
            self._own = None
