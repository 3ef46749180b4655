"""tests/tiny_drafters.py's DFlash, DSpark and Gemma-4 assistant drafters (and hy_v3's chained
NextN heads) load in the pinned llama.cpp and run as its drivers (common/speculative.cpp) run them.

Each drafter is written with its target into a temporary directory and driven through the
low-level bindings: a DFlash/DSpark draft context on the target's (ctx_other) takes the
target's layer inputs as an embeddings batch (the KV injection) and decodes a block of
[last token, mask, ...]; DFlash2 hands out its selector lattice and DSpark its confidences
through the NextN rows; a Gemma-4 assistant's MTP context shares its target's KV cache and
decodes (token, target hidden state) pairs. A short greedy speculative loop, as the drivers
run it, checks that the drafts are accepted some of the time (not never, not always) and
that the text is the target's own greedy text.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gguf
import llama_cpp as ll

from speculative.llamacpp import ext
from speculative.llamacpp.devices import init_once
from tests.tiny_drafters import (DFLASH_BLOCK_SIZE, DFLASH_MASK, DFLASH_TARGET_LAYERS, DRAFTER_INFO, DRAFTERS,
                                   target_path, write_drafter)
from tests.tiny_model import SPECIALS, tokenizer_vocab, write_model

pytestmark = pytest.mark.real

os.environ.setdefault("GGML_CPU_TILED_MM", "0")  # as conftest: batch-invariant CPU matmuls

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time there was a tiny model"
N_VOCAB = len(tokenizer_vocab()[0])


@pytest.fixture(scope="module", autouse=True)
def _backend():
    init_once()


# -- the bindings, thinly -------------------------------------------------------------


def load(path: Path, load_mtp: bool = False):
    params = ll.llama_model_default_params()
    params.n_gpu_layers = 0
    params.load_mtp = load_mtp
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp could not load {path}"
    return model


def cparams(**kw):
    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 256, 64, 64, 1
    params.n_threads = params.n_threads_batch = 2
    params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.no_perf = True
    for key, value in kw.items():
        setattr(params, key, value)
    return params


def tokenize(model, text: str) -> list[int]:
    vocab = ll.llama_model_get_vocab(model)
    buf = (ll.llama_token * 256)()
    n = ll.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, len(buf), True, True)
    assert n > 0
    return list(buf[:n])


class Batch:
    """A llama_batch of tokens, of embeddings (width), or of both (an MTP batch: the embeddings
    batch given a token array of its own)."""

    def __init__(self, width: int = 0, tokens: bool = True):
        self.width = width
        self.raw = ll.llama_batch_init(64, width, 1)
        self._tokens = None
        if width and tokens:
            self._tokens = (ll.llama_token * 64)()
            self.raw.token = self._tokens

    def fill(self, pos: list[int], tokens: list[int] | None = None, embd: np.ndarray | None = None,
             logits: bool = True) -> "Batch":
        for i, p in enumerate(pos):
            if tokens is not None:
                self.raw.token[i] = tokens[i]
            self.raw.pos[i], self.raw.n_seq_id[i], self.raw.logits[i] = p, 1, logits
            self.raw.seq_id[i][0] = 0
        if embd is not None:
            np.ctypeslib.as_array(self.raw.embd, shape=(64, self.width))[: len(pos)] = embd
        self.raw.n_tokens = len(pos)
        return self

    def free(self) -> None:
        if self._tokens is not None:
            self.raw.token = ctypes.POINTER(ll.llama_token)()
        ll.llama_batch_free(self.raw)


def decode(ctx, batch: Batch) -> None:
    assert ll.llama_decode(ctx, batch.raw) == 0


def logits(ctx, i: int) -> np.ndarray:
    return np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(N_VOCAB,)).copy()


def nextn_rows(ctx, n: int, width: int) -> np.ndarray:
    return np.ctypeslib.as_array(ext.get_embeddings_nextn(ctx), shape=(n, width)).copy()


def meta(model, key: str) -> str | None:
    buf = ctypes.create_string_buffer(64)
    return buf.value.decode() if ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf)) >= 0 else None


def greedy(ctx, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy text: n tokens after the prompt, in a fresh memory."""
    ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    batch = Batch()
    decode(ctx, batch.fill(list(range(len(prompt))), prompt))
    out, row = [], logits(ctx, len(prompt) - 1)
    for i in range(n):
        out.append(int(np.argmax(row)))
        decode(ctx, batch.fill([len(prompt) + i], out[-1:]))
        row = logits(ctx, 0)
    batch.free()
    return out


def n_accepted(rows: list[np.ndarray], drafts: list[int]) -> int:
    """How many drafts the target's greedy rows of [last, drafts] accept."""
    n = 0
    while n < len(drafts) and int(np.argmax(rows[n])) == drafts[n]:
        n += 1
    return n


def drop_after(ctx, pos: int) -> None:
    ll.llama_memory_seq_rm(ll.llama_get_memory(ctx), 0, pos, -1)


# -- DFlash / DSpark ----------------------------------------------------------------------


class DFlash:
    """A DFlash/DSpark draft context on its target's, set up as common_speculative's DFlash
    driver sets them up: the target hands out its target layers' inputs, the draft takes the
    target's tensors through ctx_other, its attention as dflash.attention.causal says, and its
    NextN rows (DFlash2's lattice, DSpark's confidences)."""

    def __init__(self, path: Path, *, ctx_other: bool = True):
        self.target_model = load(target_path(path))
        self.model = load(path)
        self.target = ll.llama_init_from_model(self.target_model, cparams())
        assert self.target
        n = ext.model_target_layer_ids_n(self.model)
        ids = ext.model_target_layer_ids(self.model)
        self.layers = [ids[i] for i in range(n)]
        for layer in self.layers:
            ext.set_embeddings_layer_inp(self.target, layer, True)
        self.ctx = ll.llama_init_from_model(self.model, cparams(**({"ctx_other": self.target} if ctx_other else {})))
        assert self.ctx, "llama.cpp could not create the draft context"
        self.n_embd = ll.llama_model_n_embd(self.model)
        self.top_k = ext.model_dflash_selector_top_k(self.model)
        self.block = int(meta(self.model, "dflash.block_size"))
        self.dspark = meta(self.model, "dflash.has_confidence_head") is not None
        self.anchor_first = self.dspark and meta(self.model, "dflash.sample_from_anchor") != "false"
        self.confidence = self.dspark and meta(self.model, "dflash.has_confidence_head") == "true"
        ll.llama_set_causal_attn(self.ctx, meta(self.model, "dflash.attention.causal") == "true")
        ext.set_embeddings_nextn(self.ctx, True, self.top_k == 0)
        self.mask = ll.llama_vocab_mask(ll.llama_model_get_vocab(self.model))
        self.tokens = Batch()
        self.features = Batch(len(self.layers) * ll.llama_model_n_embd(self.target_model), tokens=False)

    def target_decode(self, tokens: list[int], pos: int) -> list[np.ndarray]:
        """The target decodes tokens at pos; the draft's cache takes their features (process())."""
        decode(self.target, self.tokens.fill(list(range(pos, pos + len(tokens))), tokens))
        rows = [logits(self.target, i) for i in range(len(tokens))]
        n_t = ll.llama_model_n_embd(self.target_model)
        feats = np.concatenate([np.ctypeslib.as_array(ext.get_embeddings_layer_inp(self.target, layer),
                                                      shape=(len(tokens), n_t)) for layer in self.layers], axis=1)
        decode(self.ctx, self.features.fill(list(range(pos, pos + len(tokens))), embd=feats, logits=False))
        return rows

    def draft(self, last: int, pos: int) -> tuple[list[int], np.ndarray | None]:
        """The drafts of the block [last, mask, ...] at pos (DFlash: the masks' rows; DSpark
        anchor-first: every row; DFlash2: the selector's walk of its lattice), and DSpark's
        confidences."""
        block = [last] + [self.mask] * (self.block - 1)
        decode(self.ctx, self.tokens.fill(list(range(pos, pos + len(block))), block, logits=self.top_k == 0))
        conf = None
        if self.top_k:
            lattice = nextn_rows(self.ctx, len(block), self.n_embd)
            drafts, pred = [], 0
            for row in lattice[1:]:
                scores = row[self.top_k + pred * self.top_k: self.top_k + (pred + 1) * self.top_k]
                pred = int(np.argmax(scores))
                drafts.append(int(row[pred]))
        else:
            rows = [logits(self.ctx, i) for i in range(len(block))]
            assert all(not np.isnan(r).any() and np.isfinite(r.max()) for r in rows)  # -inf off a d2t vocabulary
            drafts = [int(np.argmax(r)) for r in rows[0 if self.anchor_first else 1:]]
            if self.confidence:
                conf = nextn_rows(self.ctx, len(block), self.n_embd)[:, 0]
        drop_after(self.ctx, pos)  # the block's own K/V go: the target's features come there
        return drafts, conf

    def speculate(self, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
        """Greedy speculative decoding of n tokens or so: (the text, each step's accepted count)."""
        rows = self.target_decode(prompt, 0)
        pos, last = len(prompt), int(np.argmax(rows[-1]))
        out, accepted = [last], []
        while len(out) < n:
            drafts, _ = self.draft(last, pos)
            rows = self.target_decode([last] + drafts, pos)  # verified, every row's features injected
            n_acc = n_accepted(rows, drafts)
            drop_after(self.target, pos + n_acc + 1)
            drop_after(self.ctx, pos + n_acc + 1)
            accepted.append(n_acc)
            out += drafts[:n_acc]
            last = int(np.argmax(rows[n_acc]))
            out.append(last)
            pos += n_acc + 1
        return out, accepted

    def close(self) -> None:
        self.tokens.free()
        self.features.free()
        ll.llama_free(self.ctx)
        ll.llama_free(self.target)
        ll.llama_model_free(self.model)
        ll.llama_model_free(self.target_model)


VARIANTS = {
    "dflash": ("dflash", {}),
    "dflash-causal": ("dflash", {"causal": True}),
    "dflash-own": ("dflash", {"own_embd": True, "own_output": True}),
    "dflash-d2t": ("dflash", {"d2t": True}),
    "dflash2": ("dflash", {"selector_top_k": 4}),
    "dspark": ("dspark", {}),
    "dspark-bonus-anchor": ("dspark", {"sample_from_anchor": False, "confidence": False}),
    "dspark-d2t-causal": ("dspark", {"d2t": True, "causal": True}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_dflash_loads_and_runs_a_block(tmp_path, variant):
    arch, kw = VARIANTS[variant]
    path, target = write_drafter(arch, tmp_path / f"{variant}.gguf", **kw)
    assert target == tmp_path / f"{variant}.target.gguf"
    reader = gguf.GGUFReader(path)
    fields, names = reader.fields, {t.name for t in reader.tensors}
    assert fields["general.architecture"].contents() == "dflash"
    assert fields["dflash.block_size"].contents() == DFLASH_BLOCK_SIZE
    assert fields["dflash.target_layers"].contents() == list(DFLASH_TARGET_LAYERS)
    assert fields["dflash.attention.causal"].contents() == kw.get("causal", False)
    assert fields["tokenizer.ggml.mask_token_id"].contents() == tokenizer_vocab()[0].index(DFLASH_MASK)
    assert {"fc.weight", "enc.output_norm.weight", "output_norm.weight", "blk.0.attn_q.weight"} <= names
    assert ("token_embd.weight" in names) == bool(kw.get("own_embd"))
    assert ("output.weight" in names) == bool(kw.get("own_output") or kw.get("d2t"))
    assert ("d2t" in names) == bool(kw.get("d2t"))
    dspark = arch == "dspark"
    assert ({"markov_w1.weight", "markov_w2.weight"} <= names) == dspark
    assert ("conf_proj.weight" in names) == (dspark and kw.get("confidence", True))
    if dspark:
        assert fields["dflash.has_confidence_head"].contents() == kw.get("confidence", True)
        assert fields["dflash.sample_from_anchor"].contents() == kw.get("sample_from_anchor", True)
    else:
        assert "dflash.has_confidence_head" not in fields and "dflash.sample_from_anchor" not in fields
    top_k = kw.get("selector_top_k", 0)
    assert ({"selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight",
             "blk.0.attn_conv_base", "blk.0.ffn_conv_proj.weight"} <= names) == bool(top_k)

    run = DFlash(path, ctx_other=not kw.get("own_embd"))
    try:
        assert ll.llama_model_has_encoder(run.model)
        assert run.layers == list(DFLASH_TARGET_LAYERS)
        assert run.top_k == top_k
        assert run.mask == tokenizer_vocab()[0].index(DFLASH_MASK)
        prompt = tokenize(run.target_model, PROMPT)
        rows = run.target_decode(prompt, 0)
        drafts, conf = run.draft(int(np.argmax(rows[-1])), len(prompt))
        assert len(drafts) == DFLASH_BLOCK_SIZE - (0 if run.anchor_first else 1)
        assert all(0 <= t < N_VOCAB - len(SPECIALS) for t in drafts)  # never a special token
        if run.confidence:
            assert conf is not None and ((0 < conf) & (conf < 1)).all()
    finally:
        run.close()


def test_a_draft_without_its_own_tensors_needs_the_target_context(tmp_path):
    path, _ = write_drafter("dflash", tmp_path / "d.gguf")
    model = load(path)
    try:
        assert not ll.llama_init_from_model(model, cparams())  # "dflash requires ctx_other to be set"
    finally:
        ll.llama_model_free(model)


@pytest.mark.parametrize("arch", ["dflash", "dspark"])
def test_dflash_drafts_follow_the_target_some_of_the_time(tmp_path, arch):
    """As the driver runs them: the text is the target's greedy text, and drafts are accepted at
    some steps and not at others. DFlash's masks all draft the anchor's successor (at most one
    accepted); DSpark's Markov head chains successors, so some steps accept two or more."""
    path, _ = write_drafter(arch, tmp_path / f"{arch}.gguf")
    run = DFlash(path)
    try:
        prompt = tokenize(run.target_model, PROMPT)
        out, accepted = run.speculate(prompt, 40)
        assert out == greedy(run.target, prompt, len(out))
    finally:
        run.close()
    assert 0 < sum(a > 0 for a in accepted) < len(accepted), accepted
    if arch == "dspark":
        assert max(accepted) >= 2, accepted


def test_dflash_drafts_read_the_target_features(tmp_path):
    """The masks' logits move with the injected features (the second head's average over
    them): features of another text, or none, give other logits for the same block."""
    path, _ = write_drafter("dflash", tmp_path / "d.gguf")
    run = DFlash(path)
    try:
        prompt = tokenize(run.target_model, PROMPT)
        other = tokenize(run.target_model, "def f(x): return the cat and the dog, print hello world")[: len(prompt)]
        assert len(other) == len(prompt)
        block = [prompt[-1]] + [run.mask] * (run.block - 1)
        seen = []
        for text in (prompt, other):
            ll.llama_memory_clear(ll.llama_get_memory(run.ctx), True)
            ll.llama_memory_clear(ll.llama_get_memory(run.target), True)
            run.target_decode(text[:-1], 0)
            decode(run.ctx, run.tokens.fill(list(range(len(prompt) - 1, len(prompt) - 1 + len(block))), block))
            seen.append(logits(run.ctx, 1))
        assert np.isfinite(seen[0]).all() and np.abs(seen[0] - seen[1]).max() > 1e-3
    finally:
        run.close()


# -- the Gemma-4 assistant, and hy_v3's chained NextN heads ------------------------------------


class Mtp:
    """An MTP draft context as common_speculative's draft-mtp driver makes it (ctx_type MTP,
    ctx_other the target's): a Gemma-4 assistant on its own file (shares the target's KV
    cache: no catch-up decodes, every draft step at the same position), or a model's NextN
    blocks (catch-up of (token, previous hidden state) pairs; several heads chained through
    llama_set_nextn_layer_offset, one a step)."""

    def __init__(self, target: Path, draft: Path | None = None):
        self.target_model = load(target, load_mtp=draft is None)
        self.model = load(draft) if draft else self.target_model
        self.target = ll.llama_init_from_model(self.target_model, cparams())
        assert self.target
        self.ctx = ll.llama_init_from_model(self.model, cparams(ctx_type=ll.LLAMA_CONTEXT_TYPE_MTP,
                                                                ctx_other=self.target))
        assert self.ctx, "llama.cpp could not create the MTP context"
        self.n_embd = ll.llama_model_n_embd_out(self.model)
        assert self.n_embd == ll.llama_model_n_embd_out(self.target_model)
        self.shared = ext.get_ctx_other(self.ctx) == self.target
        self.heads = max(1, ll.llama_model_n_layer_nextn(self.model))
        self.chain = self.heads > 1 and not self.shared
        ext.set_embeddings_nextn(self.target, True, False)
        ext.set_embeddings_nextn(self.ctx, True, True)
        self.tokens = Batch()
        self.pairs = Batch(self.n_embd)

    def hidden(self, ctx, n: int) -> np.ndarray:
        return np.array([np.ctypeslib.as_array(ext.get_embeddings_nextn_ith(ctx, i), shape=(self.n_embd,))
                         for i in range(n)])

    def target_decode(self, tokens: list[int], pos: int, pending: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        decode(self.target, self.tokens.fill(list(range(pos, pos + len(tokens))), tokens))
        rows = [logits(self.target, i) for i in range(len(tokens))]
        h = self.hidden(self.target, len(tokens))
        if not self.shared:  # the head's catch-up: token k with the hidden state of k - 1
            pairs = np.concatenate([pending[None], h[:-1]])
            for head in range(self.heads if self.chain else 1):
                if self.chain:
                    drop_after(self.ctx, pos)
                    ext.set_nextn_layer_offset(self.ctx, head)
                decode(self.ctx, self.pairs.fill(list(range(pos, pos + len(tokens))), tokens, pairs, logits=False))
            ext.set_nextn_layer_offset(self.ctx, 0)
        return rows, h

    def draft(self, last: int, h: np.ndarray, pos: int, n_max: int) -> list[int]:
        n_max = min(n_max, self.heads) if self.chain else n_max
        tokens, hs, drafts = [last], [h], []
        for i in range(n_max):
            if self.chain:  # head i over the whole prefix, its KV rebuilt from pos
                drop_after(self.ctx, pos)
                ext.set_nextn_layer_offset(self.ctx, i)
                decode(self.ctx, self.pairs.fill(list(range(pos, pos + len(tokens))), tokens, np.array(hs)))
                idx = len(tokens) - 1
            else:  # a shared-KV assistant drafts every token at pos; a single head at pos + i
                decode(self.ctx, self.pairs.fill([pos if self.shared else pos + i], tokens[-1:], np.array(hs[-1:])))
                idx = 0
            row = logits(self.ctx, idx)
            assert np.isfinite(row).all()
            drafts.append(int(np.argmax(row)))
            tokens.append(drafts[-1])
            hs.append(np.ctypeslib.as_array(ext.get_embeddings_nextn_ith(self.ctx, idx), shape=(self.n_embd,)).copy())
        ext.set_nextn_layer_offset(self.ctx, 0)
        if not self.shared:
            drop_after(self.ctx, pos)  # the catch-up of the verified tokens comes there
        return drafts

    def speculate(self, prompt: list[int], n: int, n_max: int = 3) -> tuple[list[int], list[int]]:
        rows, h = self.target_decode(prompt, 0, np.zeros(self.n_embd, dtype=np.float32))
        pos, last, pending = len(prompt), int(np.argmax(rows[-1])), h[-1]
        out, accepted = [last], []
        while len(out) < n:
            drafts = self.draft(last, pending, pos, n_max)
            rows, h = self.target_decode([last] + drafts, pos, pending)  # verified, with the head's catch-up
            n_acc = n_accepted(rows, drafts)
            drop_after(self.target, pos + n_acc + 1)
            if not self.shared:
                drop_after(self.ctx, pos + n_acc + 1)
            accepted.append(n_acc)
            out += drafts[:n_acc]
            last, pending = int(np.argmax(rows[n_acc])), h[n_acc]
            out.append(last)
            pos += n_acc + 1
        return out, accepted

    def close(self) -> None:
        self.tokens.free()
        self.pairs.free()
        ll.llama_free(self.ctx)
        ll.llama_free(self.target)
        if self.model != self.target_model:
            ll.llama_model_free(self.model)
        ll.llama_model_free(self.target_model)


def test_gemma4_assistant_shares_its_targets_kv_cache(tmp_path):
    path, target = write_drafter("gemma4-assistant", tmp_path / "a.gguf")
    reader = gguf.GGUFReader(path)
    fields, names = reader.fields, {t.name for t in reader.tensors}
    assert fields["general.architecture"].contents() == "gemma4-assistant"
    assert fields["gemma4-assistant.embedding_length"].contents() == 32
    assert fields["gemma4-assistant.embedding_length_out"].contents() == 64  # the target's width
    assert fields["gemma4-assistant.nextn_predict_layers"].contents() == 2 == fields["gemma4-assistant.block_count"].contents()
    assert fields["gemma4-assistant.attention.sliding_window_pattern"].contents() == [True, False]
    assert {"nextn.pre_projection.weight", "nextn.post_projection.weight", "blk.0.attn_q.weight",
            "blk.1.layer_output_scale.weight", "rope_freqs.weight"} <= names
    assert not any(".attn_k." in n or ".attn_v." in n for n in names)  # the keys and values are the target's
    assert gguf.GGUFReader(target).fields["general.architecture"].contents() == "gemma4"

    model = load(path)
    try:
        assert not ll.llama_init_from_model(model, cparams(ctx_type=ll.LLAMA_CONTEXT_TYPE_MTP))  # needs ctx_other
    finally:
        ll.llama_model_free(model)
    run = Mtp(target, path)
    try:
        assert run.shared and run.heads == 2 and not run.chain
        assert ll.llama_model_n_embd(run.model) == 32 and run.n_embd == 64
        prompt = tokenize(run.target_model, PROMPT)
        rows, h = run.target_decode(prompt, 0, np.zeros(64, dtype=np.float32))
        assert h.shape == (len(prompt), 64) and np.isfinite(h).all()
        drafts = run.draft(int(np.argmax(rows[-1])), h[-1], len(prompt), 3)
        assert all(0 <= t < N_VOCAB - len(SPECIALS) for t in drafts)
        assert ll.llama_memory_seq_pos_max(ll.llama_get_memory(run.target), 0) == len(prompt) - 1  # untouched
    finally:
        run.close()


@pytest.mark.parametrize("kind", ["gemma4-assistant", "hy_v3-2-heads"])
def test_mtp_drafts_follow_the_target_some_of_the_time(tmp_path, kind):
    if kind == "gemma4-assistant":
        path, target = write_drafter(kind, tmp_path / "a.gguf")
        run = Mtp(target, path)
    else:
        run = Mtp(write_model("hy_v3", tmp_path / "hy.gguf", mtp=2))
        assert run.chain and run.heads == 2
    try:
        prompt = tokenize(run.target_model, PROMPT)
        out, accepted = run.speculate(prompt, 40)
        assert out == greedy(run.target, prompt, len(out))
    finally:
        run.close()
    assert 0 < sum(a > 0 for a in accepted) < len(accepted), accepted
    assert max(accepted) >= 2, accepted


# -- files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", [a for a in DRAFTERS if a != "eagle3"])
def test_same_seed_same_files(tmp_path, arch):
    a = [p.read_bytes() for p in write_drafter(arch, tmp_path / "a.gguf", seed=2)]
    b = [p.read_bytes() for p in write_drafter(arch, tmp_path / "b.gguf", seed=2)]
    c = [p.read_bytes() for p in write_drafter(arch, tmp_path / "c.gguf", seed=3)]
    assert a == b and a[0] != c[0]
    expected = {"dflash": "dflash", "dspark": "dflash", "gemma4-assistant": "gemma4-assistant"}[arch]
    assert gguf.GGUFReader(tmp_path / "a.gguf").fields["general.architecture"].contents() == expected
    assert (DRAFTER_INFO[arch].gguf_arch or arch) == expected


def test_bad_drafter_arguments_are_refused(tmp_path):
    cases = [
        ("dflash", {"confidence": False}, "DSpark's"),
        ("dspark", {"selector_top_k": 4}, "no DFlash2 selector"),
        ("dflash", {"own_embd": True}, "pass own_output"),
        ("dflash", {"n_embd": 128}, "as wide as its target"),
        ("dflash", {"selector_top_k": 8}, "selector_top_k"),
        ("eagle3", {"causal": True}, "DFlash's and DSpark's"),
        ("gemma4-assistant", {"n_embd": 64}, "narrower or wider"),
        ("gemma4-assistant", {"d2t": True}, "own output projection"),
    ]
    for arch, kw, message in cases:
        with pytest.raises(ValueError, match=message):
            write_drafter(arch, tmp_path / "x.gguf", **kw)


@pytest.mark.parametrize("arch", ["dflash", "dspark", "gemma4-assistant"])
def test_command_line_writes_the_drafter_and_its_target(tmp_path, arch):
    out = tmp_path / f"{arch}.gguf"
    proc = subprocess.run([sys.executable, "-m", "tests.tiny_drafters", arch, str(out), "--seed", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout and str(target_path(out)) in proc.stdout
    api = write_drafter(arch, tmp_path / "api.gguf", seed=1)
    assert out.read_bytes() == api[0].read_bytes() and target_path(out).read_bytes() == api[1].read_bytes()
