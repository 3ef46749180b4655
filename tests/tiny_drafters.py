"""Tiny random-weight drafter GGUFs (EAGLE-3, DFlash, DSpark, Gemma-4 assistant) with the target each drafts for.

    python -m tests.tiny_drafters eagle3 OUT.gguf   # also writes OUT.target.gguf (so dflash, dspark, gemma4-assistant)

or, from Python, ``write_drafter(arch, path, ...)``, which returns (draft, target). A drafter of
these architectures reads the target's hidden states, so it comes with its target: a tiny
model of tests/tiny_model.py written first, whose tensors the drafter then reuses where the
pinned llama.cpp's drafter shares them (token embeddings, the output projection).

EAGLE-3 (`eagle3`, src/models/eagle3.cpp): an encoder `fc` fuses the target's inputs of three
layers (`eagle3.target_layers`) into one row g per position; a one-layer decoder takes the
pair (token at p+1, g at p) and predicts the token at p+2. The weights are made so that its
drafts follow the target some of the time, as a trained drafter's do: its attention looks at
the entry's own position (its queries and keys are a constant, which RoPE makes largest at
distance 0: a constant first embedding dimension of the draft's own token embeddings), its
values pass that token's embedding through, and the output projection (the target's, or its
rows for a reduced vocabulary) favours that token's successor as the target does
(tiny_model's successor chain). `fc` mixes the target's features in, so a draft read from
stale or misplaced features differs.

DFlash (`dflash`, src/models/dflash.cpp) drafts a block at once: its KV cache holds, at every
position the target decoded, K/V made from `fc` of the target's inputs of two layers
(`dflash.target_layers`); a decode of [last token, mask x (block_size - 1)] reads its drafts
from the masks' rows, attending over that cache and the whole block (non-causally unless
`dflash.attention.causal`). The mask is the control token <|im_start|>
(`tokenizer.ggml.mask_token_id`). By default the draft takes the target's token embeddings
and output projection through ctx_other, as published DFlash drafters do. The weights make a
mask look at the block's anchor (the last token): the queries of a mask, and the keys of a
token, sit in each head's slowest rotary pair, so a score hardly depends on distance; a
mask's query is +/- the masks' direction (two query heads a KV head, one of each sign), and
a token's key is the sign of its embedding along a direction that has nothing of the mask's
nor of `fc`'s rows, so the anchor's key is large and the masks' and the target features'
keys are nothing: one of the two heads looks at the anchor alone, and the values (a token's
embedding less its mask part) bring its embedding to the masks, whose logits (through the
target's output projection) then favour the anchor's successor as the target does. Every mask
drafts that one token, so the first draft is accepted about as often as the target follows
its successor chain and the later ones hardly ever; the other head's average over the
target features mixes them in. DFlash2 (`selector_top_k`) adds per-layer convolutions
(here passing the rows through) and the candidate selector, whose pairwise scores favour a
candidate that succeeds its predecessor.

DSpark (`dspark`: a DFlash GGUF with `markov_w1`/`markov_w2`, and `conf_proj` with a
confidence head) adds a Markov head: each block position's logits get
markov_w2 . markov_w1[previous token], which favours the previous token's successor (the
target's output projection applied to that token's unit embedding), the previous token being
the anchor, then each position's argmax: so its drafts follow the successor chain, accepted
as long as the target does.

The Gemma-4 assistant (`gemma4-assistant`) is an MTP drafter for a tiny `gemma4` target whose
KV cache it shares (its context's ctx_other): see _write_gemma4_assistant.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import gguf

from tests.tiny_model import (CHAIN, CONTEXT_LENGTH, GEMMA4_ROPE_BASE, GEMMA4_ROPE_BASE_SWA, GEMMA4_SLIDING_WINDOW,
                                 LOGIT_STD, SPECIALS, Dims, _dims, add_tokenizer, successors, tokenizer_vocab,
                                 write_model)

EAGLE3_TARGET_LAYERS = (0, 2, 3)  # of the 4-layer target; llama.cpp reads them as layer inputs
_CONST = 3.0  # the draft embeddings' constant dimension (see the top)
_FOCUS = 6.0  # how strongly the attention looks at its own position
FC_GAIN = 0.5  # the scale of fc's rows g (normed before the decoder uses them)
G_SCALE = 0.4  # how much of g (normed) the decoder's residual stream takes beside the token's embedding


@dataclass(frozen=True)
class DrafterInfo:
    target_arch: str
    target_layers: int  # the target's block count
    gguf_arch: str = ""  # general.architecture, where not the drafter's name (DSpark is a DFlash GGUF)


DRAFTER_INFO: dict[str, DrafterInfo] = {
    "eagle3": DrafterInfo("llama", 4),
    "dflash": DrafterInfo("llama", 4),
    "dspark": DrafterInfo("llama", 4, "dflash"),
    "gemma4-assistant": DrafterInfo("gemma4", 2),
}
DRAFTERS: tuple[str, ...] = tuple(DRAFTER_INFO)


def target_path(path: str | Path) -> Path:
    """Where write_drafter writes the target of the drafter at `path`: OUT.target.gguf."""
    path = Path(path)
    return path.with_name(path.stem + ".target.gguf")


def _tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    """A tensor of a model as numpy's shape (ggml's ne reversed), F32."""
    for t in reader.tensors:
        if t.name == name:
            return np.array(t.data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
    raise KeyError(name)


def _write_eagle3(w: gguf.GGUFWriter, target: gguf.GGUFReader, rng: np.random.Generator, n_embd: int,
                  own_embd: bool, own_output: bool, d2t: bool, target_layers: tuple[int, ...]) -> None:
    embd = _tensor(target, "token_embd.weight")  # (n_vocab, n_embd_tgt)
    out = _tensor(target, "output.weight")
    n_vocab, n_embd_tgt = embd.shape
    if n_embd != n_embd_tgt and (not own_embd or not own_output):
        raise ValueError("an EAGLE-3 draft wider or narrower than its target needs its own embeddings and output")
    d = _dims(n_embd, 1, n_vocab)
    n_head = n_head_kv = d.n_head  # values carry the whole embedding
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(d.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_array("eagle3.target_layers", list(target_layers))
    w.add_uint32("eagle3.target_hidden_size", n_embd_tgt)
    w.add_bool("eagle3.norm_before_residual", True)  # the residual stream takes g normed, scaled by attn_norm_2

    def add(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    n_in = len(target_layers) * n_embd_tgt
    add("fc.weight", normal((n_embd, n_in), FC_GAIN / np.sqrt(n_in)))
    add("output_norm.weight", np.ones(n_embd))
    if own_embd:
        mine = embd if n_embd == n_embd_tgt else normal((n_vocab, n_embd), 1.0)
        mine = mine.copy()
        mine[:, 0] = _CONST
        add("token_embd.weight", mine)
    if d2t:  # a reduced vocabulary: the target ids of the draft's rows, every special token left out
        ids = np.sort(rng.choice(n_vocab - len(SPECIALS), size=(n_vocab - len(SPECIALS)) * 3 // 4, replace=False))
        add("output.weight", out[ids] if n_embd == n_embd_tgt else normal((len(ids), n_embd), 3.0 / np.sqrt(n_embd)))
        w.add_tensor("d2t", ids.astype(np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
    elif own_output:
        add("output.weight", out if n_embd == n_embd_tgt else normal((n_vocab, n_embd), 3.0 / np.sqrt(n_embd)))
    b = "blk.0."
    add(b + "attn_norm.weight", np.ones(n_embd))
    add(b + "attn_norm_2.weight", np.full(n_embd, G_SCALE))
    # queries and keys: the constant dimension into each head's first eight rotary dimensions
    qk = np.zeros((n_head * d.head_dim, 2 * n_embd), dtype=np.float32)
    for h in range(n_head):
        qk[h * d.head_dim : h * d.head_dim + 8, 0] = _FOCUS
    add(b + "attn_q.weight", qk)
    add(b + "attn_k.weight", qk)
    v = np.zeros((n_head_kv * d.head_dim, 2 * n_embd), dtype=np.float32)
    v[:, :n_embd] = np.eye(n_embd, dtype=np.float32)  # the token's normed embedding
    add(b + "attn_v.weight", v)
    add(b + "attn_output.weight", np.eye(n_embd, dtype=np.float32))
    add(b + "ffn_norm.weight", np.ones(n_embd))
    add(b + "ffn_gate.weight", normal((d.n_ff, n_embd), 1 / np.sqrt(n_embd)))
    add(b + "ffn_up.weight", normal((d.n_ff, n_embd), 1 / np.sqrt(n_embd)))
    add(b + "ffn_down.weight", normal((n_embd, d.n_ff), 0.3 / np.sqrt(d.n_ff)))


# -- DFlash, DSpark -------------------------------------------------------------------

DFLASH_TARGET_LAYERS = (1, 3)  # of the 4-layer llama target: the inputs of layers 1 and 3
DFLASH_BLOCK_SIZE = 8  # dflash.block_size: a block is the anchor and 7 masks
DFLASH_MASK = "<|im_start|>"  # tokenizer.ggml.mask_token_id: a control token no model generates
DFLASH_FOCUS = 3.0  # the q/k norms' weight on the slowest rotary pair: a mask's score for the anchor is
                    # sqrt(hd) * 3 * sqrt(hd) * 3 / sqrt(hd) = 36 with heads of 16
DFLASH_ANCHOR = 3.0  # how much of the anchor's (normed) embedding a mask row takes from it
MARKOV_GAIN = 5.0  # DSpark's Markov bias: this times the target's logits of the previous token's unit embedding
DSPARK_BASE = 0.3  # DSpark's output norm: its own logits weak beside the Markov bias
SELECTOR_GAIN = 5.0  # DFlash2's pairwise scores: the same, times the gate
DFLASH2_CONV = (4, 16)  # DFlash2's conv kernel size and group size


def _unit_rows(a: np.ndarray) -> np.ndarray:
    return a / np.linalg.norm(a, axis=1, keepdims=True)


def _write_dflash(w: gguf.GGUFWriter, target: gguf.GGUFReader, rng: np.random.Generator, *, dspark: bool,
                  own_embd: bool, own_output: bool, d2t: bool, target_layers: tuple[int, ...], block_size: int,
                  causal: bool, selector_top_k: int, confidence: bool, sample_from_anchor: bool) -> None:
    """A one-layer DFlash drafter (src/models/dflash.cpp, not its DeepSeek-V4 graph) of its
    target's width; with dspark its Markov head (and confidence head), with selector_top_k its
    DFlash2 convolutions and candidate selector. See the top for how its drafts follow the
    target."""
    embd = _tensor(target, "token_embd.weight")  # (n_vocab, n)
    out = _tensor(target, "output.weight")
    n_vocab, n = embd.shape
    d = _dims(n, 1, n_vocab)
    hd = d.head_dim
    n_head_kv = n // hd  # the values carry the whole embedding
    n_head = 2 * n_head_kv  # two query heads a KV head: one for each sign of the anchor's key
    rot = hd // 2 - 1  # NeoX pairs dimension i with i + hd/2; pair hd/2 - 1 turns slowest with distance
    tokens = tokenizer_vocab()[0]
    mask = tokens.index(DFLASH_MASK)
    n_special = len(SPECIALS)
    ids = None
    if d2t:  # a reduced vocabulary: the target ids of the draft's rows, every special token left out
        ids = np.sort(rng.choice(n_vocab - n_special, size=(n_vocab - n_special) * 3 // 4, replace=False))

    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(n)
    w.add_block_count(1)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_mask_token_id(mask)
    w.add_uint32("dflash.block_size", block_size)
    w.add_array("dflash.target_layers", list(target_layers))
    w.add_bool("dflash.attention.causal", causal)
    if dspark:
        w.add_bool("dflash.sample_from_anchor", sample_from_anchor)
        w.add_bool("dflash.has_confidence_head", confidence)
    if selector_top_k:
        kernel, group = DFLASH2_CONV
        w.add_uint32("dflash.conv_kernel_size", kernel)
        w.add_uint32("dflash.conv_group_size", group)
        w.add_uint32("dflash.selector_rank", n)
        w.add_uint32("dflash.selector_top_k", selector_top_k)

    def add(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    m_hat = embd[mask] / np.linalg.norm(embd[mask])  # the masks' direction (attn_norm is 1)
    u = rng.standard_normal(n).astype(np.float32)
    u -= (u @ m_hat) * m_hat
    u /= np.linalg.norm(u)  # the keys' direction: nothing of a mask
    eye = np.eye(n, dtype=np.float32)

    n_in = len(target_layers) * n
    add("fc.weight", (eye - np.outer(u, u)) @ normal((n, n_in), 1 / np.sqrt(n_in)))  # g: no key
    add("enc.output_norm.weight", np.ones(n))
    add("output_norm.weight", np.full(n, DSPARK_BASE if dspark else 1.0))
    if own_embd:
        add("token_embd.weight", embd)
    if ids is not None:
        add("output.weight", out[ids])
        w.add_tensor("d2t", ids.astype(np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
    elif own_output:
        add("output.weight", out)
    b = "blk.0."
    add(b + "attn_norm.weight", np.ones(n))
    q = np.zeros((n_head * hd, n), dtype=np.float32)
    for j in range(n_head):
        q[j * hd + rot] = m_hat if j % 2 == 0 else -m_hat
    k = np.zeros((n_head_kv * hd, n), dtype=np.float32)
    k[np.arange(n_head_kv) * hd + rot] = u
    add(b + "attn_q.weight", q)
    add(b + "attn_k.weight", k)
    add(b + "attn_v.weight", eye - np.outer(m_hat, m_hat))  # a mask's value is nothing
    o = np.zeros((n, n_head * hd), dtype=np.float32)
    for j in range(n_head):
        h = j // 2
        o[h * hd:(h + 1) * hd, j * hd:(j + 1) * hd] = DFLASH_ANCHOR * np.eye(hd)
    add(b + "attn_output.weight", o)
    norm = np.ones(hd, dtype=np.float32)
    norm[rot] = DFLASH_FOCUS
    add(b + "attn_q_norm.weight", norm)
    add(b + "attn_k_norm.weight", norm)
    add(b + "ffn_norm.weight", np.ones(n))
    if selector_top_k:  # DFlash2's convolutions: tap 0 passes the row through, the dynamic part is small
        kernel, group = DFLASH2_CONV
        base = np.zeros((2, kernel, n), dtype=np.float32)
        base[:, 0] = 1.0
        for name in ("attn", "ffn"):
            add(b + f"{name}_conv_base", base)
            add(b + f"{name}_conv_proj.weight", normal((2 * kernel * (n // group), n), 0.02 / np.sqrt(n)))
    add(b + "ffn_gate.weight", normal((d.n_ff, n), 1 / np.sqrt(n)))
    add(b + "ffn_up.weight", normal((d.n_ff, n), 1 / np.sqrt(n)))
    add(b + "ffn_down.weight", normal((n, d.n_ff), 0.3 / np.sqrt(d.n_ff)))
    # transition scores: the target's logits of the previous token's unit embedding, which favour
    # its successor as the target does, and follow the target's other preferences too
    if dspark:  # the Markov head: markov_w2 . markov_w1[prev]
        add("markov_w1.weight", _unit_rows(embd))
        add("markov_w2.weight", MARKOV_GAIN * (out if ids is None else out[ids]))
        if confidence:
            add("conf_proj.weight", normal((1, 2 * n), 1 / np.sqrt(2 * n)))
            add("conf_proj.bias", np.ones(1))
    if selector_top_k:  # DFlash2: predecessor . successor (times the gate) favours the predecessor's successor
        add("selector_predecessor.weight", _unit_rows(embd))
        add("selector_successor.weight", SELECTOR_GAIN * out)
        add("selector_hidden.weight", np.tile(m_hat / np.sqrt(n), (n, 1)))  # gate ~ the masks' share, > 0


# -- Gemma-4 assistant -------------------------------------------------------------------

ASSISTANT_H_MIX = 0.15  # how much of the target's hidden state the pre-projection mixes in
ASSISTANT_GAIN = 0.15  # what each of its layers adds (its post-norms' weight): the token's embedding stays ahead


def _write_gemma4_assistant(w: gguf.GGUFWriter, target: gguf.GGUFReader, rng: np.random.Generator,
                            n_embd: int) -> None:
    """A Gemma-4 assistant (src/models/gemma4-assistant.cpp): an MTP drafter of its own width
    whose layers have queries only and attend over its Gemma-4 target's KV cache (its
    sliding-window layer over the target's last sliding one, its full layer over the target's
    last layer). It takes [the target's embedding of a token (times sqrt(n_embd)), the target's
    hidden state] through nextn.pre_projection; its output projection is its token_embd. The
    pre-projection passes the token's embedding (projected to n_embd) through, and token_embd
    favours that token's successor as the target does (see the top)."""
    embd = _tensor(target, "token_embd.weight")  # (n_vocab, n_t), scaled down by sqrt(n_t)
    n_vocab, n_t = embd.shape
    if n_embd == n_t:
        raise ValueError("a Gemma-4 assistant is narrower or wider than its target (llama.cpp tells them apart so)")
    dt = _dims(n_t, 2, n_vocab)
    d = Dims(n_embd, 2, n_vocab, dt.head_dim, dt.n_head, dt.n_head_kv, 3 * n_embd)  # the target's heads
    pattern = [True, False]  # sliding-window, then full: the target's last two layers
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(n_embd)
    w.add_embedding_length_out(n_t)
    w.add_block_count(2)
    w.add_nextn_predict_layers(2)  # every layer is an MTP layer: llama.cpp makes an MTP context of it
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(d.n_head)
    w.add_head_count_kv(d.n_head_kv)
    w.add_key_length(d.head_dim)
    w.add_value_length(d.head_dim)
    w.add_key_length_swa(d.head_dim)
    w.add_value_length_swa(d.head_dim)
    w.add_rope_dimension_count(d.head_dim)
    w.add_uint32(f"{w.arch}.rope.dimension_count_swa", d.head_dim)
    w.add_rope_freq_base(GEMMA4_ROPE_BASE)
    w.add_rope_freq_base_swa(GEMMA4_ROPE_BASE_SWA)
    w.add_sliding_window(GEMMA4_SLIDING_WINDOW)
    w.add_sliding_window_pattern(pattern)
    w.add_layer_norm_rms_eps(1e-6)

    def add(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    x = embd * np.float32(np.sqrt(n_t))  # what the assistant reads: rows of about unit scale
    basis = np.linalg.qr(rng.standard_normal((n_t, n_t)))[0].astype(np.float32)
    proj = basis[: min(n_embd, n_t)] * np.float32(np.sqrt(max(1.0, n_t / n_embd)))  # (n_embd, n_t) at most
    if n_embd > n_t:
        proj = np.concatenate([proj, np.zeros((n_embd - n_t, n_t), dtype=np.float32)])
    n_special = len(SPECIALS)
    n_normal = n_vocab - n_special
    out = normal((n_vocab, n_embd), LOGIT_STD / np.sqrt(n_embd))
    out[successors(n_normal)] += np.float32(CHAIN * 3 * LOGIT_STD / np.sqrt(n_embd)) * _unit_rows(x[:n_normal] @ proj.T)
    out[n_normal:] = 0.0  # special tokens: never drafted
    add("token_embd.weight", out)
    add("output_norm.weight", np.ones(n_embd))
    add("nextn.pre_projection.weight",
        np.concatenate([proj, normal((n_embd, n_t), ASSISTANT_H_MIX / np.sqrt(n_t))], axis=1))
    add("nextn.post_projection.weight", normal((n_t, n_embd), 1 / np.sqrt(n_embd)))
    add("rope_freqs.weight", np.ones(d.head_dim // 2))
    for i in range(2):
        b = f"blk.{i}."
        q = d.head_dim * d.n_head
        add(b + "attn_norm.weight", np.ones(n_embd))
        add(b + "attn_q.weight", normal((q, n_embd), 1 / np.sqrt(n_embd)))
        add(b + "attn_output.weight", normal((n_embd, q), 1 / np.sqrt(q)))
        add(b + "attn_q_norm.weight", np.full(d.head_dim, 0.5))
        add(b + "post_attention_norm.weight", np.full(n_embd, ASSISTANT_GAIN))
        add(b + "layer_output_scale.weight", np.ones(1))
        add(b + "ffn_norm.weight", np.ones(n_embd))
        add(b + "ffn_gate.weight", normal((d.n_ff, n_embd), 1 / np.sqrt(n_embd)))
        add(b + "ffn_up.weight", normal((d.n_ff, n_embd), 1 / np.sqrt(n_embd)))
        add(b + "ffn_down.weight", normal((n_embd, d.n_ff), 1 / np.sqrt(d.n_ff)))
        add(b + "post_ffw_norm.weight", np.full(n_embd, ASSISTANT_GAIN))


def write_drafter(arch: str, path: str | Path, *, seed: int = 0, n_embd: int | None = None, target_n_embd: int = 64,
                  own_embd: bool | None = None, own_output: bool = False, d2t: bool = False,
                  target_layers: tuple[int, ...] | None = None, block_size: int = DFLASH_BLOCK_SIZE,
                  causal: bool = False, selector_top_k: int = 0, confidence: bool | None = None,
                  sample_from_anchor: bool | None = None, target_arch: str | None = None,
                  target_n_layer: int | None = None) -> tuple[Path, Path]:
    """Write a tiny drafter of architecture `arch` (one of DRAFTERS) to `path` and its target to
    target_path(path); returns both paths. n_embd: the draft's width (EAGLE-3: 64; DFlash and
    DSpark: the target's, as llama.cpp needs; a Gemma-4 assistant: half the target's).
    own_embd / own_output: whether the draft carries its own token embeddings / output
    projection (llama.cpp takes the target's otherwise; EAGLE-3's own_embd defaults to True,
    DFlash's to False, and DFlash ties its output to its own embeddings unless own_output);
    d2t: a reduced draft vocabulary mapped to the target's ids (own output rows).

    DFlash and DSpark only: block_size (dflash.block_size); causal (dflash.attention.causal:
    the block's attention causal, not bidirectional); selector_top_k > 0 (DFlash only) makes it
    a DFlash2 drafter (its convolutions and candidate selector, dflash.selector_top_k).
    DSpark only: confidence (default True: a confidence head, dflash.has_confidence_head) and
    sample_from_anchor (default True: the anchor's row drafts the first token;
    dflash.sample_from_anchor).

    target_arch: another target of tests/tiny_model.py than the drafter's own (DRAFTER_INFO),
    with as many layers (EAGLE-3, DFlash, DSpark: a recurrent or hybrid one, say); target_n_layer:
    a deeper target than DRAFTER_INFO's (for benchmarks at realistic sizes)."""
    if arch not in DRAFTER_INFO:
        raise ValueError(f"unknown drafter {arch!r}; known: {', '.join(DRAFTERS)}")
    dflash = arch in ("dflash", "dspark")
    if not dflash and (causal or selector_top_k or block_size != DFLASH_BLOCK_SIZE):
        raise ValueError("block_size, causal and selector_top_k are DFlash's and DSpark's")
    if arch != "dspark" and (confidence is not None or sample_from_anchor is not None):
        raise ValueError("confidence and sample_from_anchor are DSpark's")
    if arch == "dspark" and selector_top_k:
        raise ValueError("a DSpark drafter has no DFlash2 selector")
    if dflash and own_embd and not own_output and not d2t:
        raise ValueError("a DFlash drafter with its own token embeddings ties its output to them: pass own_output too")
    if arch == "gemma4-assistant" and (own_embd or own_output or d2t or target_layers is not None):
        raise ValueError("a Gemma-4 assistant has its own output projection and no target layers")
    if selector_top_k and not 0 < selector_top_k * (selector_top_k + 1) <= target_n_embd:
        raise ValueError(f"DFlash2's selector_top_k k needs k * (k + 1) <= n_embd ({target_n_embd})")
    if dflash and block_size < 2:
        raise ValueError("a DFlash block holds the anchor and at least one mask")
    info = DRAFTER_INFO[arch]
    path = Path(path)
    if target_arch not in (None, info.target_arch) and arch == "gemma4-assistant":
        raise ValueError("a Gemma-4 assistant reads a gemma4 target's cache")
    target = write_model(target_arch or info.target_arch, target_path(path), n_embd=target_n_embd,
                         n_layer=target_n_layer or info.target_layers, seed=seed)
    reader = gguf.GGUFReader(str(target))
    w = gguf.GGUFWriter(str(path), info.gguf_arch or arch)
    w.add_name(f"tiny-{arch}")
    add_tokenizer(w)
    rng = np.random.default_rng(seed + 1)
    if dflash:
        if n_embd not in (None, target_n_embd):
            raise ValueError("a DFlash drafter is as wide as its target (llama.cpp's fc takes n_embd-wide layers)")
        _write_dflash(w, reader, rng, dspark=arch == "dspark", own_embd=bool(own_embd), own_output=own_output,
                      d2t=d2t, target_layers=DFLASH_TARGET_LAYERS if target_layers is None else target_layers,
                      block_size=block_size, causal=causal, selector_top_k=selector_top_k,
                      confidence=True if confidence is None else confidence,
                      sample_from_anchor=True if sample_from_anchor is None else sample_from_anchor)
    elif arch == "gemma4-assistant":
        _write_gemma4_assistant(w, reader, rng, target_n_embd // 2 if n_embd is None else n_embd)
    else:
        _write_eagle3(w, reader, rng, 64 if n_embd is None else n_embd, True if own_embd is None else own_embd,
                      own_output, d2t, EAGLE3_TARGET_LAYERS if target_layers is None else target_layers)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("arch", choices=DRAFTERS, help="the drafter; its target is written beside it as OUT.target.gguf")
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        paths = write_drafter(args.arch, args.out, seed=args.seed)
    except ValueError as e:
        p.error(str(e))
    for path in paths:
        print(f"{path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
