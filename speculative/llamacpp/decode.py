"""The decode path the target (model.LlamaModel) and its drafting heads (head.HeadContext) share.

A context's parameters as speculate sets them, and one llama_batch per context reused for
every call: its arrays filled through numpy views, run with llama_decode (the time inside
counted), and the logits read as zero-copy numpy views of llama.cpp's own buffer. Both are
a Context: a llama.cpp context and its Batch. Every llama_decode of the process runs on one
thread (run_decode).
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import llama_cpp as ll
import numpy as np
from gguf import GGMLQuantizationType

from speculative.errors import GenerationError
from speculative.llamacpp import interrupt
from speculative.llamacpp.devices import batch_variant_kernels

_abort = ll.ggml_abort_callback(interrupt.poll)  # Ctrl-C and SIGTERM stop a decode within a graph node
_no_abort = ll.ggml_abort_callback()  # NULL
# llama.cpp calls the abort callback at every graph node, which costs ~2% of decoding speed;
# only batches this large (prompt chunks, seconds to minutes on a CPU) are made abortable.
# A draft step, at most a few hundred ms, finishes before the signal is handled.
ABORTABLE_FROM = 64


def run_decode(ctx, raw, encode: bool = False) -> int:
    """llama_decode(ctx, raw) (llama_encode with `encode`), on the calling thread: the one that
    runs every llama.cpp call of the process (the command line's main thread, or the scheduler's
    of `batch` and `serve`, engine/parallel.py). llama.cpp's CPU backend runs a graph on an
    OpenMP team of the calling thread's; each calling thread keeps a team of its own, and once
    the process holds more of their workers than there are cores, libgomp stops spinning at a
    graph's barriers and sleeps instead (decodes from several threads took 50 ms a token
    against 36: the 1.5B target, 2 cores). A signal meanwhile only asks llama.cpp to stop
    (interrupt.waiting)."""
    with interrupt.waiting():
        ret = (ll.llama_encode if encode else ll.llama_decode)(ctx, raw)
        ll.llama_synchronize(ctx)  # GPU backends return early; count the real work
    return ret


def flash_attn_type(mode: str, on_gpu: bool, quantized_v: bool = False) -> int:
    """llama.cpp's flash-attention setting for -fa MODE. `auto` is llama.cpp's auto on this
    machine's GPUs and off elsewhere: on the CPU the flash-attention kernel is batch-variant (see
    LlamaModel.kernels) and decodes no faster, and an RPC server's device may be a CPU. A
    quantized V cache needs it: auto turns it on (options.py has said so, and refused -fa off)."""
    if mode == "on" or (mode == "auto" and quantized_v):
        return ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
    if mode == "off" or not on_gpu:
        return ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return ll.LLAMA_FLASH_ATTN_TYPE_AUTO


def context_kernels(on_gpu: bool, fa_type: int, repack: bool = True) -> list[str]:
    """The batch-variant kernels a context runs (see devices.batch_variant_kernels): the build's
    (REPACK only where weights are repacked: not with -nr), and flash attention on the CPU,
    which splits a lone query's cache over the threads (from 512 cells) and tiles many queries:
    the same position then scores differently alone and inside a batch."""
    fa_on_cpu = not on_gpu and fa_type != ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    build = [k for k in batch_variant_kernels() if repack or k != "REPACK"]
    return build + (["FLASH_ATTN"] if fa_on_cpu else [])


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def context_params(n_ctx: int, n_batch: int, threads: int, fa_type: int, n_seq: int = 1, kv_unified: bool = True,
                   n_ubatch: int = 512, cache_types: tuple[str, str] = ("f16", "f16"), threads_batch: int | None = None):
    """llama.cpp's context parameters as speculate sets them for every context: the KV cache of
    cache_types (K, V); `threads_batch` decode batches of more than one token (llama.cpp's -tb;
    None: `threads`)."""
    cparams = ll.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = n_batch
    cparams.n_ubatch = min(n_batch, n_ubatch)
    cparams.type_k, cparams.type_v = (GGMLQuantizationType[t.upper()] for t in cache_types)  # enum ggml_type
    cparams.n_seq_max = n_seq
    # branches share the prompt's cells: one cache, not n_seq slices (unless asked: --no-kv-unified)
    cparams.kv_unified = kv_unified
    cparams.n_threads = threads
    cparams.n_threads_batch = threads_batch or threads
    cparams.swa_full = True  # sliding-window caches keep everything, so rollback is exact
    cparams.no_perf = True
    cparams.flash_attn_type = fa_type
    return cparams


def head_context_params(target, n_seq: int):
    """Context parameters for a head drafting beside `target` (a LlamaModel): its context's size,
    batches and attention, the draft's -ctkd/-ctvd."""
    return context_params(ll.llama_n_ctx(target._ctx), target.n_batch, target.n_threads, target._flash_attn_type,
                          n_seq, target.kv_unified, target.n_ubatch, target.spec.head_cache_types, target.n_threads_batch)


@dataclass(frozen=True)
class Part:
    """One request's share of a batch that several run together (model.LlamaModel.decode_parts):
    tokens at positions, each in the (absolute) sequences of seqs, and which rows it wants
    ("all", "last" or "none", as Backend.decode)."""
    tokens: Sequence[int]
    positions: Sequence[int]
    seqs: Sequence[Sequence[int]]
    outputs: str
    slot: int = 0  # whose part it is


class Batch:
    """A context's llama_batch of `size` entries, each in sequence 0 until set_seqs says
    otherwise; tok, pos, out (and embd, for a batch of hidden rows) are numpy views of its arrays.
    `interruptible`: Ctrl-C and SIGTERM stop its long decodes (llama.cpp's abort callback).
    A batch of hidden rows carries tokens too (an MTP head's entries), unless `tokens` is False
    (an encoder's input)."""

    def __init__(self, ctx, size: int, n_vocab: int, *, n_seq: int = 1, n_embd: int = 0,
                 interruptible: bool = False, tokens: bool = True):
        self._ctx = ctx
        self.size = size
        self.n_vocab = n_vocab
        self.busy_seconds = 0.0  # time spent inside llama_decode: the rest is Python
        self.last_seconds = 0.0  # ... by the latest one
        self.runs = self.run_slots = 0  # llama_decode calls done, and the requests (slots) each served, summed
        self._interruptible = interruptible
        self._abortable = False  # whether the context's abort callback is set now
        self._n_branched = 0  # leading entries whose sequence ids set_seqs changed
        self._raw = ll.llama_batch_init(size, n_embd, n_seq)
        self._tokens = None
        if n_embd and tokens:  # an embeddings batch has no token array; the graph needs both
            self._tokens = (ll.llama_token * size)()
            self._raw.token = self._tokens
        for i in range(size):
            self._raw.n_seq_id[i] = 1
            self._raw.seq_id[i][0] = 0
        self.tok = np.ctypeslib.as_array(self._raw.token, shape=(size,)) if self._raw.token else None
        self.pos = np.ctypeslib.as_array(self._raw.pos, shape=(size,))
        self.out = np.ctypeslib.as_array(self._raw.logits, shape=(size,))
        self.embd = np.ctypeslib.as_array(self._raw.embd, shape=(size, n_embd)) if n_embd else None

    def chunks(self, tokens: Sequence[int], pos: int) -> Iterator[tuple[int, int]]:
        """Fill the batch with each chunk of tokens in turn, at positions from pos on, no output
        asked for: (start, n) of each, for the caller to mark outputs and run it."""
        for start in range(0, len(tokens), self.size):
            chunk = tokens[start : start + self.size]
            n = len(chunk)
            self.tok[:n] = chunk
            self.pos[:n] = np.arange(pos + start, pos + start + n)
            self.out[:n] = 0
            yield start, n

    def set_seqs(self, seqs: Sequence[Sequence[int]]) -> None:
        """The sequence ids of the first len(seqs) entries (a draft tree's branches, or the
        sequences of several requests)."""
        for i, ids in enumerate(seqs):
            self._raw.n_seq_id[i] = len(ids)
            for j, s in enumerate(ids):
                self._raw.seq_id[i][j] = s
        self._n_branched = max(self._n_branched, len(seqs))

    def put_parts(self, parts: Sequence[Part], output_all_ends: bool = False) -> list[Sequence[int]]:
        """Several requests' parts, one after another from entry 0: the entries whose rows each
        wants. `output_all_ends`: each part's last entry is an output even where it wants none
        (on RPC servers an output is what waits for the compute)."""
        start, wanted = 0, []
        for part in parts:
            end = start + len(part.tokens)
            self.tok[start:end] = part.tokens
            self.pos[start:end] = part.positions
            self.out[start:end] = part.outputs == "all"
            if part.outputs == "last" or (output_all_ends and part.outputs == "none"):
                self.out[end - 1] = 1
            wanted.append(range(start, end) if part.outputs == "all" else [end - 1] if part.outputs == "last" else [])
            start = end
        self.set_seqs([ids for part in parts for ids in part.seqs])
        return wanted

    def reset_seqs(self) -> None:
        """Every entry back in sequence 0 alone."""
        n, self._n_branched = self._n_branched, 0
        for i in range(n):
            self._raw.n_seq_id[i] = 1
            self._raw.seq_id[i][0] = 0

    def run(self, n: int, encode: bool = False, slots: int = 1) -> int:
        """llama_decode (llama_encode with `encode`) over the first n entries, for `slots` requests
        (serve's -np); its return code (0: done)."""
        self._raw.n_tokens = n
        if self._interruptible and (n >= ABORTABLE_FROM) != self._abortable:
            self._abortable = n >= ABORTABLE_FROM
            ll.llama_set_abort_callback(self._ctx, _abort if self._abortable else _no_abort, None)
        t0 = time.perf_counter()
        ret = run_decode(self._ctx, self._raw, encode)
        self.last_seconds = time.perf_counter() - t0
        self.busy_seconds += self.last_seconds
        if ret == 0:
            self.runs, self.run_slots = self.runs + 1, self.run_slots + slots
        # aborted, or the signal came at the last node; a small batch is not abortable, and a
        # signal that came meanwhile stops the run now
        if ret == 2 or (interrupt.poll() if self._interruptible else interrupt.signalled()):
            interrupt.stop()
        return ret

    def logits(self, i: int) -> np.ndarray:
        """The logits of output i of the latest decode (-1: its last), valid until the next decode."""
        return np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, i), shape=(self.n_vocab,))

    def free(self) -> None:
        if self._raw is not None:
            if self._tokens is not None:  # ours: llama_batch_free must not free it
                self._raw.token = ctypes.POINTER(ll.llama_token)()
            ll.llama_batch_free(self._raw)
            self._raw = None


def roll_back(mem, name: str, seq: int, n_keep: int) -> None:
    """Drop sequence seq's cells (-1: every sequence's) from position n_keep on, in the memory
    `mem` of the context of `name`."""
    if not ll.llama_memory_seq_rm(mem, seq, n_keep, -1):
        raise GenerationError(f"{name}: the KV cache refused to roll back to position {n_keep}")


class Context:
    """A llama.cpp context and the Batch it decodes with, as the target and its MTP head hold them."""

    name: str
    _ctx = None
    _mem = None
    _batch: Batch | None = None
    # told (tokens, sequences, seconds) of every decode that scores each row it decodes, the
    # passes that verify drafts and decode tokens (what auto prices: engine/costs.py)
    on_pass: Callable[[int, int, float], None] | None = None

    @property
    def busy_seconds(self) -> float:
        """Time spent inside llama_decode: the rest is Python."""
        return self._batch.busy_seconds if self._batch is not None else 0.0

    @property
    def decodes(self) -> tuple[int, int]:
        """llama_decode calls done so far, and the requests (slots) they served, summed (serve's /metrics)."""
        return (self._batch.runs, self._batch.run_slots) if self._batch is not None else (0, 0)

    def _timed(self, tokens: int, sequences: int = 1, scored: bool = True) -> None:
        """The latest decode was a pass of this shape: told to on_pass where it `scored` every row."""
        if scored and self.on_pass is not None:
            self.on_pass(tokens, sequences, self._batch.last_seconds)

    def _roll_back(self, seq: int, n_keep: int) -> None:
        """Drop sequence seq's cells (-1: every sequence's) from position n_keep on."""
        roll_back(self._mem, self.name, seq, n_keep)

    def _free_context(self) -> None:
        if self._batch is not None:
            self._batch.free()
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
