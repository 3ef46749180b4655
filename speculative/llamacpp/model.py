"""LlamaModel: a GGUF model with its context, the backend the loop talks to (backend.Backend).

Built on the low-level C API, not on `llama_cpp.Llama`: one llama_batch reused
for every call and logits read as zero-copy numpy views of llama.cpp's own buffer (decode.py),
and rollback with llama_memory_seq_rm. Sequence 0 is the cache; draft trees add
sequences 1..n_seq-1 for their other branches (see backend.Backend). Sequence 0's
cache can be saved and restored (llama_state_seq_*) for the prompt cache.

Recurrent and hybrid models (Mamba, RWKV, LFM2, Qwen3.5, ...) keep a state per
sequence instead of a token per cell. Where llama.cpp supports it (its
llm_arch_supports_rs_rollback) the context keeps n_rs_seq snapshots of that state,
so the latest decode can be undone by up to that many tokens; everything else goes
through checkpoints of the recurrent state (cache.py).

A model with NextN (MTP) layers, loaded with ModelSpec.mtp, drafts for itself: `tap.mtp_head()`
gives the MtpHead (mtp.py), a second context on the same weights that runs only those layers, and
from then on the model copies its NextN hidden rows after every decode (nextn.py). Those
layers may also come as a file of their own (an MTP head, `convert_hf_to_gguf.py --mtp`),
given with -md: `tap.mtp_head(path)` loads it and runs the head on its weights instead. EAGLE-3,
DFlash and DSpark drafters (eagle3.py, dflash.py) draft from the inputs of some of its layers:
`tap.feature_head(path)`. The tap (heads.py) keeps those rows; the memory (memory.py) its
sequences, a SlotSequences per slot.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import llama_cpp as ll
import numpy as np

from speculative.decoding.backend import Outputs
from speculative.decoding.settings import CACHE_TYPES, ModelSpec
from speculative.errors import ContextFull, GenerationError, ModelError
from speculative.llamacpp import identity
from speculative.llamacpp.decode import (Batch, Context, Part, context_kernels, context_params, default_threads,
                                         flash_attn_type)
from speculative.llamacpp.devices import init_once, log_errors, model_params, placement
from speculative.llamacpp.heads import Tap
from speculative.llamacpp.load import Adapters, check_file, load_weights
from speculative.llamacpp.memory import Memory
from speculative.llamacpp.tokenizer import Tokenizer
from speculative.models.gguf_meta import kv_cache_bytes


class LlamaModel(Context, Tokenizer):
    """A GGUF model with one context: sequence 0 is its cache, and n_seq - 1 more hold draft-tree
    branches within a step (see backend.Backend). Loaded as `spec` says (its mtp_sidecar is
    the engine's: see heads.Tap.mtp_head)."""

    rollback_limit: int | None = None  # an attention cache drops any suffix; see _create_context for recurrent ones

    def __init__(self, spec: ModelSpec):
        self.arch, nextn, causal = check_file(spec.path, spec.loras)
        init_once()
        self.name = spec.name
        self.path = Path(spec.path)
        self.loras = tuple((Path(lora), float(scale)) for lora, scale in spec.loras)
        self._model = None
        self.tap: Tap | None = None  # its hidden rows, for a head that drafts from them (heads.py)
        self.adapters: Adapters | None = None  # its LoRA adapters (load.py)
        self.devices = None if spec.devices is None else tuple(spec.devices)  # None: llama.cpp's choice
        self.n_gpu_layers = spec.n_gpu_layers
        self.flash_attn = spec.flash_attn
        self.spec = spec  # how it loads (heads beside it load as it did: split, load mode)
        # NextN (MTP) layers cost memory and load time: loaded only where they may draft
        self._load_weights(spec.mtp and nextn != "none", causal)
        self._create_context(spec)
        try:
            self.adapters = Adapters(self._model, self.loras, self.path.name)
        except ModelError:
            self.close()
            raise
        self.adapters.set_on(self._ctx)  # before the warm-up decode sizes the compute buffers
        Tokenizer.__init__(self, ll.llama_model_get_vocab(self._model))
        self.tap = Tap(self)
        self.memory = Memory(self.name, self._ctx, self.n_seq, self.n_slots, self.n_ubatch, self.recurrent,
                             self.rollback_limit, self.tap)
        self._cache = self.memory.slots[0]  # a request alone: slot 0's sequences
        self._batch = Batch(self._ctx, self.n_batch, self.n_vocab, n_seq=self.n_seq, interruptible=True)
        self._warm_up()

    def _load_weights(self, load_mtp: bool, causal: bool) -> None:
        spec = self.spec
        mparams, _keep = model_params(self.n_gpu_layers, self.devices, spec.split_mode, spec.main_gpu,
                                      spec.tensor_split, spec.load_mode, spec.overrides, spec.repack)
        mparams.load_mtp = load_mtp
        model = self._model = load_weights(self.path, mparams, self.arch, causal)
        # A recurrent state (Mamba, RWKV; the hybrids' recurrent layers) is one per sequence:
        # it cannot be copied into draft-tree branches, and it rolls back only through snapshots.
        self.recurrent = bool(ll.llama_model_is_recurrent(model) or ll.llama_model_is_hybrid(model))
        self.nextn_layers = ll.llama_model_n_layer_nextn(model) if load_mtp else 0

    def _create_context(self, spec: ModelSpec) -> None:
        self.n_threads = spec.n_threads or default_threads()
        self.n_threads_batch = spec.n_threads_batch or self.n_threads
        # by the devices the layers are on: llama_supports_gpu_offload() is true in any RPC build
        self.placement = placement(spec.n_gpu_layers, self.devices)
        self.cache_types = (spec.cache_type_k, spec.cache_type_v)
        fa = flash_attn_type(spec.flash_attn, self.placement == "gpu", CACHE_TYPES[spec.cache_type_v] > 1)
        cparams = context_params(spec.n_ctx, spec.n_batch, self.n_threads, fa, spec.n_seq * spec.n_slots,
                                 spec.kv_unified, spec.n_ubatch, self.cache_types, self.n_threads_batch)
        cparams.n_rs_seq = spec.n_rs_seq if self.recurrent else 0  # llama.cpp clamps it to 0 where unsupported
        log_errors()  # only this call's
        ctx = ll.llama_init_from_model(self._model, cparams)
        if not ctx:
            self.close()
            slots = f", {spec.n_slots} parallel sequences" if spec.n_slots > 1 else ""
            why = log_errors()
            raise ModelError(f"{self.path}: llama.cpp could not create a context (n_ctx={spec.n_ctx}{slots})"
                             + (f": {why}" if why else ""))
        self._ctx = ctx
        self._mem = ll.llama_get_memory(ctx)
        # llama.cpp pads the context (to 256); the limit is still what was asked for. Without a
        # unified cache each request's sequence has its own share of it (-c / n_slots).
        allocated = ll.llama_n_ctx(ctx)
        self.n_ctx = min(spec.n_ctx, allocated) if spec.n_ctx > 0 else allocated
        if not spec.kv_unified:
            self.n_ctx = min(self.n_ctx // spec.n_slots, ll.llama_n_ctx_seq(ctx))
        self.n_batch = ll.llama_n_batch(ctx)
        self.n_ubatch = ll.llama_n_ubatch(ctx)
        self.n_seq = spec.n_seq
        self.n_slots = spec.n_slots
        self.kv_unified = spec.kv_unified
        if self.recurrent:  # the latest decode's last n_rs_seq tokens can be undone, once
            self.rollback_limit = ll.llama_n_rs_seq(ctx)
        # what llama.cpp allocated for its KV cache (its "llama_kv_cache: size = ..." line), from the
        # metadata and the cache types: None where the metadata does not say (gguf_meta.kv_cache_bytes)
        self.kv_cells = allocated
        self.kv_bytes = kv_cache_bytes(self.path, allocated, *self.cache_types)
        self._flash_attn_type = cparams.flash_attn_type
        self.flash_attn_on = self._flash_attn_type != ll.LLAMA_FLASH_ATTN_TYPE_DISABLED  # auto: a GPU's choice
        self.kernels = context_kernels(self.placement == "gpu", self._flash_attn_type, spec.repack)

    def _warm_up(self) -> None:
        """One throw-away decode, as llama.cpp's tools do: the first decode allocates
        compute buffers and would otherwise be charged to prompt processing."""
        bos = ll.llama_vocab_bos(self._vocab)
        self.decode([bos if bos >= 0 else 0], 0, "last")
        ll.llama_memory_clear(self._mem, True)

    # -- model facts -----------------------------------------------------

    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self._model, buf, len(buf))
        return buf.value.decode(errors="replace")

    def chat_template(self) -> str | None:
        """--chat-template's, else the model's own (None: it has none)."""
        if self.spec.chat_template:
            return self.spec.chat_template
        raw = ll.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8", errors="replace") if raw else None

    def identity(self) -> dict:
        """Everything that changes how fast this model runs here (for calibration)."""
        return identity.speed_identity(self)

    def cache_identity(self) -> dict:
        """Everything that decides what the KV cache holds for given tokens (for the prompt cache)."""
        return identity.cache_identity(self)

    # -- the cache -------------------------------------------------------

    def decode(self, tokens: Sequence[int], pos: int, outputs: Outputs) -> list[np.ndarray]:
        if outputs == "all" and len(tokens) > self.n_batch:
            raise GenerationError(f"batch of {len(tokens)} tokens exceeds -b/--batch-size {self.n_batch}")
        self._batch.reset_seqs()
        for start, n in self._batch.chunks(tokens, pos):
            if outputs == "all":
                self._batch.out[:n] = 1
            elif (outputs == "last" or self.placement == "rpc") and start + n == len(tokens):
                # on RPC servers, reading an output is what waits for the compute: ggml's RPC
                # synchronize only waits for the commands to be sent, so without one a prompt's
                # processing would end in the first generated token's time
                self._batch.out[n - 1] = 1
            self._run(n, pos + start)
            self.memory.decoded(0, n)
            self.tap.keep([(0, pos + start, n)])
            self._timed(n, scored=outputs == "all" or (outputs == "last" and len(tokens) == 1))
        if outputs == "all":
            return [self._batch.logits(i) for i in range(len(tokens))]
        if outputs == "last" and tokens:
            return [self._batch.logits(-1)]  # -1: the last output of the last chunk
        return []

    def decode_branches(self, tokens: Sequence[int], positions: Sequence[int],
                        seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        n = len(tokens)
        if n > self.n_batch:
            raise GenerationError(f"batch of {n} tokens exceeds -b/--batch-size {self.n_batch}")
        self._batch.tok[:n] = tokens
        self._batch.pos[:n] = positions
        self._batch.out[:n] = 1
        self._batch.set_seqs(seqs)
        self._run(n, min(positions, default=0))
        self.memory.decoded(0, n)
        self._timed(n)
        if all(len(ids) == 1 and ids[0] == 0 for ids in seqs):  # a chain: positions follow each other
            self.tap.keep([(0, positions[0], n)])
        else:  # rows of other branches would sit at the same positions
            self.tap.cut(0, min(positions))
        return [self._batch.logits(i) for i in range(n)]

    def decode_parts(self, parts: Sequence[Part]) -> list:
        """Several requests' tokens in one llama_decode (slots.py), as the memory plans them
        (memory.Memory.decode_parts): each part's rows, as decode and decode_branches give them."""
        return self.memory.decode_parts(parts, self._decode_together)

    def _decode_together(self, parts: Sequence[Part]) -> list[list[np.ndarray]]:
        """The parts in one llama_decode, in this order (decode_parts)."""
        n = sum(len(part.tokens) for part in parts)
        if n > self.n_batch:
            raise GenerationError(f"batch of {n} tokens exceeds -b/--batch-size {self.n_batch}")
        spans = []
        for part in parts:
            # its hidden rows kept for its slot's head: a chain's; a draft tree's branches would
            # sit at the same positions, so its slot keeps only what came before them
            chain = all(tuple(ids) == (self.memory.slots[part.slot].base,) for ids in part.seqs)
            if not chain:
                self.tap.cut(part.slot, min(part.positions))
            spans.append((part.slot if chain else None, part.positions[0] if part.tokens else 0, len(part.tokens)))
        batch = self._batch
        wanted = batch.put_parts(parts, output_all_ends=self.placement == "rpc")
        ret = batch.run(n, slots=len({part.slot for part in parts}))
        if ret == 1:  # llama.cpp found no cells for it before decoding anything
            raise ContextFull(f"{self.name}: the KV cache has no room left for a batch of {n} tokens")
        if ret != 0:
            raise GenerationError(f"llama_decode failed on {self.name} (code {ret})")
        self.tap.keep(spans)
        for part in parts:
            self.memory.decoded(part.slot, len(part.tokens))
        self._timed(n, len(parts), scored=sum(map(len, wanted)) == n)
        return [[batch.logits(i) for i in rows] for rows in wanted]

    def trim(self, n_keep: int) -> None:
        self._cache.trim(n_keep)

    def copy_branch(self, src: int, dst: int) -> None:
        self._cache.copy_branch(src, dst)

    def keep_branch(self, seq: int, n_keep: int) -> None:
        self._cache.keep_branch(seq, n_keep)

    def save_state(self, partial: bool = False) -> bytes:
        return self._cache.save_state(partial)

    def load_state(self, data: bytes, n_tokens: int, partial: bool = False) -> bool:
        return self._cache.load_state(data, n_tokens, partial)

    def clear(self) -> None:
        """Every sequence of every slot empty."""
        self.memory.clear()

    def nextn_state(self, n_tokens: int) -> bytes | None:
        """The hidden rows kept for its cache's positions 0..n_tokens-1 (the prompt cache's)."""
        return self.tap.state(n_tokens)

    def load_nextn_state(self, data: bytes, n_tokens: int) -> bool:
        return self.tap.load_state(data, n_tokens)

    def _run(self, n: int, pos: int) -> None:
        """llama_decode over the batch's first n entries."""
        ret = self._batch.run(n)
        if ret != 0:
            raise GenerationError(f"llama_decode failed on {self.name} (code {ret}) at position {pos}")

    # -- lifetime --------------------------------------------------------

    def close(self) -> None:
        if self.tap is not None:
            self.tap.close()
        self._free_context()
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "LlamaModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
