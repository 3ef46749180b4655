"""Tiny random-weight GGUF models of several architectures that the pinned llama.cpp loads.

    python -m tests.tiny_model ARCH OUT.gguf [--mtp | --mtp-only] [--mtp-heads N] [--n-embd N] [--n-layer N] [--seed S] [--f16]

or, from Python, ``write_model(arch, path, mtp=False, mtp_only=False, n_embd=None, n_layer=None, seed=0)``.
``ARCHS`` lists the architectures and ``ARCH_INFO`` what llama.cpp says of each (recurrent,
hybrid, recurrent-state rollback, generative).

Every model shares one tokenizer (369 tokens): GPT-2 style byte-level BPE (the 256 byte
tokens, 109 merges of common English and code pieces, then <|bos|>, <|endoftext|> (EOS),
<|im_start|> and <|im_end|>) with a ChatML chat template. Any text tokenizes into varied
tokens, and the tokens' pieces join back into it exactly (llama_detokenize itself cleans up
spaces before punctuation, as Hugging Face's clean_up_tokenization_spaces). Since the
vocabulary is shared, any of these models can draft for any other.

Weights are random (numpy's default_rng(seed): the same arguments give the same file), scaled
by fan-in so the residual stream stays O(1) at any width, with the projections back into it
scaled by 1/sqrt(n_layer). Greedy text is varied: the output projection adds to the random
logits a bias towards a fixed successor of the last token (one cycle through the whole
vocabulary, the same for every seed and architecture), strong enough that about half the greedy
steps follow it and the rest depend on the context; so greedy text does not fall into a short
loop, and two different models (another seed or architecture) agree on roughly a third of
each other's greedy tokens, as a draft and its target do. The special tokens' output rows are
zero, so greedy decoding never picks EOS (and sampling almost never does). Recurrent decay
parameters are negative where llama.cpp needs it (Mamba's ssm_a, the delta-net's ssm_a).
Matrices are F32 (or F16 with --f16); norms, biases and recurrent parameters are always F32.
Nothing binary is committed: tests write the models.

qwen35 has an MTP (NextN) block with --mtp, and comes as llama.cpp's converter publishes a
model in two files: --mtp-only writes the head alone, as `convert_hf_to_gguf.py --mtp` does
(the same metadata as --mtp, block_count and nextn_predict_layers included, but of the tensors
only the NextN block, token_embd, output_norm and output), and the plain model is what
`--no-nextn` writes (no NextN block, no nextn_predict_layers). The weights are drawn in the
same order for all three, so with one seed the head file and the plain model hold exactly the
--mtp file's tensors: the pair drafts what the combined file drafts. --mtp-heads N (mtp=N)
writes N NextN blocks (block_count = n_layer + N, nextn_predict_layers = N, the first of them
the one block of --mtp); llama.cpp loads and counts them (llama_model_n_layer_nextn), but
its qwen35 MTP graph runs a single block only (GGML_ASSERT: an MTP context on such a file
aborts the process). hy_v3 (a dense Hunyuan-V3) takes --mtp and --mtp-heads as qwen35 does,
and its MTP graph runs block n_layer + llama_set_nextn_layer_offset, so llama.cpp's draft-mtp
driver chains its N heads, one a draft step (ArchInfo.mtp_chain).

gemma4 is Gemma 4's dense text model (sliding-window layers and a full one last, no per-layer
embeddings), the target of tests/tiny_drafters.py's Gemma-4 assistant.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

import gguf


@dataclass(frozen=True)
class ArchInfo:
    recurrent: bool = False  # llama_model_is_recurrent
    hybrid: bool = False  # llama_model_is_hybrid
    rollback: bool = False  # llm_arch_supports_rs_rollback: n_rs_seq > 0 lets seq_rm drop a suffix
    generative: bool = True  # False: llama.cpp cannot generate text with it (encoder, diffusion)
    diffusion: bool = False  # llama_model_is_diffusion
    n_layer: int = 2  # default block count
    n_embd: int = 64  # default width
    mtp: bool = False  # --mtp adds NextN layers
    mtp_chain: bool = False  # llama.cpp's MTP graph runs any of several NextN blocks (llama_set_nextn_layer_offset)


ARCH_INFO: dict[str, ArchInfo] = {
    "llama": ArchInfo(),
    "mamba": ArchInfo(recurrent=True),
    "mamba2": ArchInfo(recurrent=True),
    "rwkv7": ArchInfo(recurrent=True, n_embd=128),  # two wkv heads of 64
    "lfm2": ArchInfo(hybrid=True, rollback=True, n_layer=4),
    "qwen35": ArchInfo(hybrid=True, rollback=True, n_layer=4, mtp=True),
    "granitehybrid": ArchInfo(hybrid=True, n_layer=4),
    "gemma4": ArchInfo(),  # sliding-window attention, the last layer full (a Gemma-4 assistant shares both)
    "hy_v3": ArchInfo(mtp=True, mtp_chain=True),  # dense Hunyuan-V3: llama.cpp chains several NextN blocks of it
    "qwen3moe": ArchInfo(n_layer=3),  # Mixture of Experts: each layer's FFN is MOE_EXPERTS experts (-cmoe's tensors)
    "bert": ArchInfo(generative=False),  # encoder only: embeddings, no causal LM head
    "dream": ArchInfo(generative=False, diffusion=True),  # non-causal attention
    "llada": ArchInfo(generative=False, diffusion=True),
}
ARCHS: tuple[str, ...] = tuple(ARCH_INFO)

CONTEXT_LENGTH = 4096
LOGIT_STD = 3.0  # standard deviation of the (non-special) logits
CHAIN = 1.5  # strength of the successor bias (see _Weights.embeddings); 0: none
NEXTN_HIDDEN = 0.3  # how much of the trunk's hidden state the NextN projection mixes in
RESIDUAL_GAIN = 1.0  # the scale of what each layer adds to the residual stream, times 1/sqrt(n_layer)
MOE_EXPERTS, MOE_USED = 4, 2  # qwen3moe: experts per layer, and how many each token goes through
GEMMA4_FULL_EVERY = 6  # Gemma 4: five sliding-window layers, then a full one (counted from the last)
GEMMA4_SLIDING_WINDOW = 64
GEMMA4_ROPE_BASE, GEMMA4_ROPE_BASE_SWA = 1e6, 1e4
GEMMA4_SOFTCAP = 30.0  # final_logit_softcapping
GEMMA4_POST_GAIN = 0.6  # Gemma's post-norms make each layer add exactly their weight: about half the greedy steps follow the chain

# -- the tokenizer ---------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# Pieces whose merges the vocabulary gets ("Ġ" is GPT-2's space), in merge-rank order.
_PIECES = (
    "th the Ġt Ġa Ġth Ġthe in er an re on en at or es is it ou ed ing nd ar al Ġs Ġw Ġo Ġc Ġb Ġf "
    "Ġm Ġp Ġd Ġh Ġi Ġin Ġof Ġto Ġand Ġis Ġit Ġhe Ġwas Ġfor Ġthat Ġwith Ġyou Ġon Ġas Ġare Ġbe "
    "Ġhello Ġworld Ġcat Ġdog Ġtiny Ġmodel Ġtoken Ġonce Ġupon Ġtime Ġthere Ġwere Ġhi ll le ro "
    "ĊĊ ĠĠ ĠĠĠĠ () ); Ġ= Ġ{ Ġ} def Ġdef Ġreturn Ġprint Ġimport"
).split()
SPECIALS = ("<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): bytes, merged pieces, then the special tokens."""
    tokens = [_bytes_to_unicode()[b] for b in range(256)]
    ranks: dict[tuple[str, str], int] = {}
    for piece in _PIECES:
        # BPE applies merges lowest rank first, so the merges so far split the piece into
        # parts; new merges, ranked after them, join those parts left to right.
        parts = _bpe(piece, ranks)
        while len(parts) > 1:
            ranks[parts[0], parts[1]] = len(ranks)
            tokens.append(parts[0] + parts[1])
            parts = [parts[0] + parts[1]] + parts[2:]
    merges = [f"{a} {b}" for a, b in ranks]
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    return tokens + list(SPECIALS), merges, types


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    parts = list(word)
    while len(parts) > 1:
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(parts, parts[1:])))
        if rank == len(ranks):
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def add_tokenizer(w: gguf.GGUFWriter) -> int:
    """Write the BPE tokenizer and chat template; returns n_vocab."""
    tokens, merges, types = tokenizer_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|bos|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


# -- weights ---------------------------------------------------------------------

# Matrices (names ending so) that --f16 stores in F16; everything else stays F32.
_MATRICES = ("token_embd.weight", "output.weight", "position_embd.weight", "attn_q.weight", "attn_k.weight",
             "attn_v.weight", "attn_output.weight", "attn_qkv.weight", "attn_gate.weight", "ffn_gate.weight",
             "ffn_up.weight", "ffn_down.weight", "ssm_in.weight", "ssm_out.weight", "ssm_x.weight",
             "ssm_dt.weight", "ssm_alpha.weight", "ssm_beta.weight", "shortconv.in_proj.weight",
             "shortconv.out_proj.weight", "time_mix_key.weight", "time_mix_value.weight",
             "time_mix_receptance.weight", "time_mix_output.weight", "channel_mix_key.weight",
             "channel_mix_value.weight", "nextn.eh_proj.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
             "ffn_up_exps.weight", "ffn_down_exps.weight")


class _Weights:
    """Adds tensors to a writer; shapes are given as ggml's ne (numpy's shape reversed)."""

    def __init__(self, w: gguf.GGUFWriter, seed: int, f16: bool, n_layer: int,
                 keep: Callable[[str], bool] = lambda name: True):
        self.w = w
        self.keep = keep  # tensors left out are still drawn: the rest stay the same
        self.residual_gain = RESIDUAL_GAIN / np.sqrt(n_layer)
        self.rng = np.random.default_rng(seed)
        self.f16 = f16

    def add(self, name: str, data: np.ndarray) -> None:
        if not self.keep(name):
            return
        data = np.ascontiguousarray(data, dtype=np.float32)
        if self.f16 and name.endswith(_MATRICES):
            data = data.astype(np.float16)
        self.w.add_tensor(name, data)

    def normal(self, ne: tuple[int, ...], std: float) -> np.ndarray:
        return self.rng.standard_normal(ne[::-1], dtype=np.float32) * np.float32(std)

    def out(self, name: str, n_in: int, n_out: int) -> None:
        """A projection back into the residual stream, scaled down by depth (as GPT-2's init)."""
        self.linear(name, n_in, n_out, gain=self.residual_gain)

    def linear(self, name: str, n_in: int, n_out: int, gain: float = 1.0) -> None:
        """A matrix {n_in, n_out}: y = W x keeps the scale of x (times gain)."""
        self.add(name, self.normal((n_in, n_out), gain / np.sqrt(n_in)))

    def rand(self, name: str, ne: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        self.add(name, self.normal(ne, std) + np.float32(mean))

    def const(self, name: str, ne: tuple[int, ...], value: float) -> None:
        self.add(name, np.full(ne[::-1], value, dtype=np.float32))

    def norm(self, name: str, n: int) -> None:
        """A norm's weight: about 1."""
        self.rand(name, (n,), 0.1, 1.0)

    def embeddings(self, n_embd: int, n_vocab: int, n_special: int, embd_scale: float = 1.0) -> None:
        """token_embd (N(0, embd_scale^2): an architecture that scales its embeddings up, as
        Gemma's by sqrt(n_embd), takes them scaled down) and output (see below)."""
        embd = self.normal((n_embd, n_vocab), 1.0)
        self.add("token_embd.weight", embd if embd_scale == 1.0 else embd * np.float32(embd_scale))
        out = self.normal((n_embd, n_vocab), LOGIT_STD / np.sqrt(n_embd))
        if CHAIN:
            # a bias towards successor(token): one cycle through every normal token, the same
            # for every seed, so greedy text does not settle into a short loop (see the top)
            n_normal = n_vocab - n_special
            succ = successors(n_normal)
            unit = embd[:n_normal] / np.linalg.norm(embd[:n_normal], axis=1, keepdims=True)
            out[succ] += np.float32(CHAIN * 3 * LOGIT_STD / np.sqrt(n_embd)) * unit
        out[n_vocab - n_special:] = 0.0  # special tokens: logit 0, never the greedy choice
        self.add("output.weight", out)


def successors(n_normal: int) -> np.ndarray:
    """succ[t]: the successor of normal token t that every model's output projection favours
    (one cycle through all n_normal tokens, the same for every seed and architecture)."""
    order = np.random.default_rng(1234).permutation(n_normal)
    succ = np.empty(n_normal, dtype=np.int64)
    succ[order] = np.roll(order, -1)
    return succ


# -- architectures -----------------------------------------------------------------


@dataclass
class Dims:
    n_embd: int
    n_layer: int
    n_vocab: int
    head_dim: int
    n_head: int
    n_head_kv: int
    n_ff: int


def _dims(n_embd: int, n_layer: int, n_vocab: int) -> Dims:
    head_dim = 16 if n_embd <= 128 else 64
    if n_embd % head_dim:
        raise ValueError(f"n_embd {n_embd} must be a multiple of {head_dim}")
    n_head = n_embd // head_dim
    return Dims(n_embd, n_layer, n_vocab, head_dim, n_head, max(1, n_head // 2), 3 * n_embd)


def _attention_kv(w: gguf.GGUFWriter, d: Dims) -> None:
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(d.n_head)
    w.add_head_count_kv(d.n_head_kv)
    w.add_rope_dimension_count(d.head_dim)
    w.add_layer_norm_rms_eps(1e-6)


def _llama_block(t: _Weights, b: str, d: Dims, *, biases: bool = False) -> None:
    kv, q = d.head_dim * d.n_head_kv, d.head_dim * d.n_head
    t.norm(b + "attn_norm.weight", d.n_embd)
    t.linear(b + "attn_q.weight", d.n_embd, q)
    t.linear(b + "attn_k.weight", d.n_embd, kv)
    t.linear(b + "attn_v.weight", d.n_embd, kv)
    if biases:
        t.rand(b + "attn_q.bias", (q,), 0.1)
        t.rand(b + "attn_k.bias", (kv,), 0.1)
        t.rand(b + "attn_v.bias", (kv,), 0.1)
    t.out(b + "attn_output.weight", d.head_dim * d.n_head, d.n_embd)
    _ffn(t, b, d)


def _ffn(t: _Weights, b: str, d: Dims, norm: str | None = "ffn_norm") -> None:
    if norm:
        t.norm(b + norm + ".weight", d.n_embd)
    t.linear(b + "ffn_gate.weight", d.n_embd, d.n_ff)
    t.linear(b + "ffn_up.weight", d.n_embd, d.n_ff)
    t.out(b + "ffn_down.weight", d.n_ff, d.n_embd)


def _write_llama_like(arch: str):
    def write(w: gguf.GGUFWriter, t: _Weights, d: Dims, mtp: bool) -> None:
        _attention_kv(w, d)
        t.embeddings(d.n_embd, d.n_vocab, len(SPECIALS))
        t.norm("output_norm.weight", d.n_embd)
        for i in range(d.n_layer):
            _llama_block(t, f"blk.{i}.", d, biases=arch == "dream")
    return write


def _ssm_model(w: gguf.GGUFWriter, t: _Weights, d: Dims, d_inner: int, d_conv: int, d_state: int,
               dt_rank: int) -> None:
    """The keys and the outer tensors Mamba and Mamba-2 share."""
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-6)
    t.embeddings(d.n_embd, d.n_vocab, len(SPECIALS))
    t.norm("output_norm.weight", d.n_embd)


def _write_mamba(w: gguf.GGUFWriter, t: _Weights, d: Dims, mtp: bool) -> None:
    d_inner, d_conv, d_state = 2 * d.n_embd, 4, 16  # llama.cpp: d_inner == 2 * n_embd
    dt_rank = -(-d.n_embd // 16)
    _ssm_model(w, t, d, d_inner, d_conv, d_state, dt_rank)
    # S4D-real A = -(1..d_state) per channel; dt = softplus(dt_bias + W x) about 0.001..0.1
    a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))  # numpy (d_inner, d_state)
    for i in range(d.n_layer):
        b = f"blk.{i}."
        t.norm(b + "attn_norm.weight", d.n_embd)
        t.linear(b + "ssm_in.weight", d.n_embd, 2 * d_inner)
        t.rand(b + "ssm_conv1d.weight", (d_conv, d_inner), 1 / np.sqrt(d_conv))
        t.rand(b + "ssm_conv1d.bias", (d_inner,), 0.1)
        t.linear(b + "ssm_x.weight", d_inner, dt_rank + 2 * d_state)
        t.linear(b + "ssm_dt.weight", dt_rank, d_inner, gain=0.5)
        dt = np.exp(t.rng.uniform(np.log(1e-3), np.log(1e-1), d_inner)).astype(np.float32)
        t.add(b + "ssm_dt.bias", dt + np.log(-np.expm1(-dt)))  # inverse softplus
        t.add(b + "ssm_a", a)
        t.const(b + "ssm_d", (d_inner,), 1.0)
        t.out(b + "ssm_out.weight", d_inner, d.n_embd)


def _mamba2_layer(t: _Weights, b: str, n_embd: int, d_inner: int, d_state: int, n_group: int, n_head: int,
                  d_conv: int) -> None:
    conv_dim = d_inner + 2 * n_group * d_state
    t.linear(b + "ssm_in.weight", n_embd, 2 * d_inner + 2 * n_group * d_state + n_head)
    t.rand(b + "ssm_conv1d.weight", (d_conv, conv_dim), 1 / np.sqrt(d_conv))
    t.rand(b + "ssm_conv1d.bias", (conv_dim,), 0.1)
    dt = np.exp(t.rng.uniform(np.log(1e-3), np.log(1e-1), n_head)).astype(np.float32)
    t.add(b + "ssm_dt.bias", dt + np.log(-np.expm1(-dt)))
    t.add(b + "ssm_a", -t.rng.uniform(1, 16, (n_head, 1)).astype(np.float32))  # ne {1, n_head}, negative
    t.const(b + "ssm_d", (1, n_head), 1.0)
    t.rand(b + "ssm_norm.weight", (d_inner // n_group, n_group), 0.1, 1.0)
    t.out(b + "ssm_out.weight", d_inner, n_embd)


def _write_mamba2(w: gguf.GGUFWriter, t: _Weights, d: Dims, mtp: bool) -> None:
    d_inner, d_conv, d_state, n_group = 2 * d.n_embd, 4, 16, 1
    n_head = d_inner // 16  # head_dim 16
    w.add_ssm_group_count(n_group)
    _ssm_model(w, t, d, d_inner, d_conv, d_state, n_head)
    for i in range(d.n_layer):
        b = f"blk.{i}."
        t.norm(b + "attn_norm.weight", d.n_embd)
        _mamba2_layer(t, b, d.n_embd, d_inner, d_state, n_group, n_head, d_conv)


def _write_rwkv7(w: gguf.GGUFWriter, t: _Weights, d: Dims, mtp: bool) -> None:
    # ggml's CPU wkv7 kernel steps over a head GGML_F32_STEP floats at a time (32 with AVX2, 64
    # with AVX-512) with no tail loop: a smaller head reads and writes past it (garbage state,
    # non-deterministic output). Real RWKV-7 heads are 64.
    head_size = 64
    if d.n_embd % head_size:
        raise ValueError(f"rwkv7: n_embd must be a multiple of {head_size} (the wkv head size)")
    lora = {"decay": max(8, d.n_embd // 16), "iclr": max(8, d.n_embd // 16),
            "value_residual_mix": max(8, d.n_embd // 32), "gate": max(16, d.n_embd // 8)}
    n_ff = 4 * d.n_embd
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_layer_norm_eps(1e-5)
    w.add_rescale_every_n_layers(0)
    w.add_wkv_head_size(head_size)
    w.add_uint32("rwkv7.attention.decay_lora_rank", lora["decay"])
    w.add_uint32("rwkv7.attention.iclr_lora_rank", lora["iclr"])
    w.add_uint32("rwkv7.attention.value_residual_mix_lora_rank", lora["value_residual_mix"])
    w.add_uint32("rwkv7.attention.gate_lora_rank", lora["gate"])
    w.add_uint32("rwkv7.token_shift_count", 2)
    n = d.n_embd
    t.embeddings(n, d.n_vocab, len(SPECIALS))
    t.norm("token_embd_norm.weight", n)
    t.const("token_embd_norm.bias", (n,), 0.0)
    t.norm("output_norm.weight", n)
    t.const("output_norm.bias", (n,), 0.0)
    for i in range(d.n_layer):
        b = f"blk.{i}."
        for norm in ("attn_norm", "attn_norm_2", "time_mix_ln"):
            t.norm(b + norm + ".weight", n)
            t.const(b + norm + ".bias", (n,), 0.0)
        v_rank = lora["iclr"] if i == 0 else lora["value_residual_mix"]
        for x, rank in (("w", lora["decay"]), ("a", lora["iclr"]), ("v", v_rank)):
            t.rand(b + f"time_mix_{x}0.weight", (n,), 0.5)
            t.linear(b + f"time_mix_{x}1.weight", n, rank, gain=0.5)
            t.linear(b + f"time_mix_{x}2.weight", rank, n, gain=0.5)
        t.linear(b + "time_mix_g1.weight", n, lora["gate"], gain=0.5)
        t.linear(b + "time_mix_g2.weight", lora["gate"], n, gain=0.5)
        t.add(b + "time_mix_lerp_fused.weight", t.rng.uniform(0, 1, (6, 1, 1, n)))
        t.rand(b + "time_mix_k_k.weight", (n,), 0.5, 1.0)
        t.rand(b + "time_mix_k_a.weight", (n,), 0.5, 1.0)
        t.rand(b + "time_mix_r_k.weight", (n,), 0.5)
        for name in ("key", "value", "receptance"):
            t.linear(b + f"time_mix_{name}.weight", n, n)
        t.out(b + "time_mix_output.weight", n, n)
        t.add(b + "channel_mix_lerp_k.weight", t.rng.uniform(0, 1, (1, 1, n)))
        t.linear(b + "channel_mix_key.weight", n, n_ff)
        t.out(b + "channel_mix_value.weight", n_ff, n)


def _write_lfm2(w: gguf.GGUFWriter, t: _Weights, d: Dims, mtp: bool) -> None:
    l_cache = 3
    attention = [i % 3 == 2 for i in range(d.n_layer)]  # short-conv, short-conv, attention, ...
    if not any(attention):
        attention[-1] = True
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(d.n_head)
    w.add_head_count_kv([d.n_head_kv if a else 0 for a in attention])
    w.add_rope_dimension_count(d.head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_uint32("lfm2.shortconv.l_cache", l_cache)
    t.embeddings(d.n_embd, d.n_vocab, len(SPECIALS))
    t.norm("token_embd_norm.weight", d.n_embd)  # LFM2's output norm has this name
    for i in range(d.n_layer):
        b = f"blk.{i}."
        t.norm(b + "attn_norm.weight", d.n_embd)
        if attention[i]:
            kv = d.head_dim * d.n_head_kv
            t.linear(b + "attn_q.weight", d.n_embd, d.n_embd)
            t.linear(b + "attn_k.weight", d.n_embd, kv)
            t.linear(b + "attn_v.weight", d.n_embd, kv)
            t.out(b + "attn_output.weight", d.n_embd, d.n_embd)
            t.norm(b + "attn_q_norm.weight", d.head_dim)
            t.norm(b + "attn_k_norm.weight", d.head_dim)
        else:
            t.rand(b + "shortconv.conv.weight", (l_cache, d.n_embd), 1 / np.sqrt(l_cache))
            t.linear(b + "shortconv.in_proj.weight", d.n_embd, 3 * d.n_embd)
            t.out(b + "shortconv.out_proj.weight", d.n_embd, d.n_embd)
        _ffn(t, b, d)


def _write_qwen35(w: gguf.GGUFWriter, t: _Weights, d: Dims, mtp: int) -> None:
    """Gated delta-net layers with a full-attention layer every 4th (as Qwen3.5), and with
    mtp = N NextN blocks after them: block_count = n_layer + N, nextn_predict_layers = N.
    The blocks are drawn one after another, so the first of N is the one block of mtp = 1."""
    interval = 4 if d.n_layer >= 4 else 2
    n_nextn = int(mtp)
    d_state = d.head_dim  # linear attention head size (keys and values)
    n_v_heads = d.n_head
    n_k_heads = max(1, n_v_heads // 2)
    d_inner = d_state * n_v_heads
    d_conv = 4
    n_rot = d.head_dim // 2  # partial rotary, as Qwen3.5's 0.25 of 256
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer + n_nextn)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(d.n_head)
    w.add_head_count_kv(d.n_head_kv)
    w.add_key_length(d.head_dim)
    w.add_value_length(d.head_dim)
    w.add_rope_dimension_count(n_rot)
    w.add_rope_freq_base(1e7)
    # sections count rotary pairs (sum = n_rot / 2), as Qwen3.5's [11, 11, 10, 0]
    half = n_rot // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3, 0]
    w.add_array("qwen35.rope.dimension_sections", sections)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_state_size(d_state)
    w.add_ssm_group_count(n_k_heads)
    w.add_ssm_time_step_rank(n_v_heads)
    w.add_ssm_inner_size(d_inner)
    w.add_uint32("qwen35.full_attention_interval", interval)
    if n_nextn:
        w.add_uint32("qwen35.nextn_predict_layers", n_nextn)
    t.embeddings(d.n_embd, d.n_vocab, len(SPECIALS))
    t.norm("output_norm.weight", d.n_embd)
    key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
    for i in range(d.n_layer + n_nextn):
        b = f"blk.{i}."
        t.norm(b + "attn_norm.weight", d.n_embd)
        t.norm(b + "post_attention_norm.weight", d.n_embd)
        if i >= d.n_layer or (i + 1) % interval == 0:  # full attention (the NextN block too)
            _qwen35_attention(t, b, d)
        else:
            t.linear(b + "attn_qkv.weight", d.n_embd, 2 * key_dim + value_dim)
            t.linear(b + "attn_gate.weight", d.n_embd, value_dim)
            t.rand(b + "ssm_conv1d.weight", (d_conv, 2 * key_dim + value_dim), 1 / np.sqrt(d_conv))
            t.rand(b + "ssm_dt.bias", (n_v_heads,), 0.5)
            t.add(b + "ssm_a", -np.exp(t.rng.uniform(np.log(1), np.log(16), n_v_heads)))  # -exp(A_log)
            t.linear(b + "ssm_beta.weight", d.n_embd, n_v_heads)
            t.linear(b + "ssm_alpha.weight", d.n_embd, n_v_heads)
            t.norm(b + "ssm_norm.weight", d_state)
            t.out(b + "ssm_out.weight", value_dim, d.n_embd)
        _ffn(t, b, d, norm=None)
        if i >= d.n_layer:
            _nextn_projection(t, b, d)
            t.norm(b + "nextn.enorm.weight", d.n_embd)
            t.norm(b + "nextn.hnorm.weight", d.n_embd)
            t.norm(b + "nextn.shared_head_norm.weight", d.n_embd)


def _nextn_projection(t: _Weights, b: str, d: Dims) -> None:
    """The NextN block's input projection of [embedding of token p+1, trunk's hidden state at p]:
    the embedding passes straight through (plus a little of the hidden state), so the head,
    through the shared output projection, favours that token's successor as the trunk does
    (see _Weights.embeddings). Its drafts are then accepted about as often as the trunk
    follows the successor chain: some, not all."""
    hidden = t.normal((d.n_embd, d.n_embd), NEXTN_HIDDEN / np.sqrt(d.n_embd))
    t.add(b + "nextn.eh_proj.weight", np.concatenate([np.eye(d.n_embd, dtype=np.float32), hidden], axis=1))


def _qwen35_attention(t: _Weights, b: str, d: Dims) -> None:
    kv = d.head_dim * d.n_head_kv
    t.linear(b + "attn_q.weight", d.n_embd, 2 * d.head_dim * d.n_head)  # query and its gate
    t.linear(b + "attn_k.weight", d.n_embd, kv)
    t.linear(b + "attn_v.weight", d.n_embd, kv)
    t.out(b + "attn_output.weight", d.head_dim * d.n_head, d.n_embd)
    t.norm(b + "attn_q_norm.weight", d.head_dim)
    t.norm(b + "attn_k_norm.weight", d.head_dim)


def _gemma4_swa_pattern(n_layer: int) -> list[bool]:
    """Gemma 4's layer pattern, counted from the end: the last layer full attention, the five
    before it sliding-window, and so on (a Gemma-4 assistant shares the KV of the last full
    layer and of the sliding one before it)."""
    return [(n_layer - 1 - i) % GEMMA4_FULL_EVERY != 0 for i in range(n_layer)]


def _write_gemma4(w: gguf.GGUFWriter, t: _Weights, d: Dims, mtp: bool) -> None:
    """Gemma 4's dense text model with no per-layer embeddings (embedding_length_per_layer_input
    0), no shared-KV layers and no MoE: sliding-window and full attention layers (see
    _gemma4_swa_pattern) with q/k norms, post-attention and post-FFN norms, GELU FFNs and
    final-logit softcapping. Gemma scales its embeddings by sqrt(n_embd), so token_embd is
    drawn scaled down by as much; its attention does not scale q.k (scale 1), so the q/k norms
    are about 0.5; the post-norms' weights (about GEMMA4_POST_GAIN / sqrt(n_layer)) set what
    each layer adds to the residual stream, as the projections' scale does for llama."""
    if d.n_layer < 2:
        raise ValueError("gemma4 needs at least 2 layers (llama.cpp's sliding-window cache wants one of each kind)")
    pattern = _gemma4_swa_pattern(d.n_layer)
    _attention_kv(w, d)
    w.add_key_length(d.head_dim)
    w.add_value_length(d.head_dim)
    w.add_key_length_swa(d.head_dim)
    w.add_value_length_swa(d.head_dim)
    w.add_uint32("gemma4.rope.dimension_count_swa", d.head_dim)
    w.add_rope_freq_base(GEMMA4_ROPE_BASE)
    w.add_rope_freq_base_swa(GEMMA4_ROPE_BASE_SWA)
    w.add_sliding_window(GEMMA4_SLIDING_WINDOW)
    w.add_sliding_window_pattern(pattern)
    w.add_embedding_length_per_layer_input(0)
    w.add_final_logit_softcapping(GEMMA4_SOFTCAP)
    t.embeddings(d.n_embd, d.n_vocab, len(SPECIALS), embd_scale=1 / np.sqrt(d.n_embd))
    t.norm("output_norm.weight", d.n_embd)
    t.const("rope_freqs.weight", (d.head_dim // 2,), 1.0)  # the full layers' (proportional rope) frequency factors
    _gemma4_layers(t, d, pattern, kv=True)


def _gemma4_layers(t: _Weights, d: Dims, pattern: list[bool], *, kv: bool, prefix: int = 0) -> None:
    """Gemma 4's decoder layers (blk.prefix ...); without kv (a Gemma-4 assistant's) they have
    queries only: the keys and values are the target's."""
    gain = GEMMA4_POST_GAIN * t.residual_gain
    for i in range(len(pattern)):
        b = f"blk.{prefix + i}."
        q = d.head_dim * d.n_head
        t.norm(b + "attn_norm.weight", d.n_embd)
        t.linear(b + "attn_q.weight", d.n_embd, q)
        if kv:
            t.linear(b + "attn_k.weight", d.n_embd, d.head_dim * d.n_head_kv)
            t.linear(b + "attn_v.weight", d.n_embd, d.head_dim * d.n_head_kv)
        t.out(b + "attn_output.weight", q, d.n_embd)
        t.rand(b + "attn_q_norm.weight", (d.head_dim,), 0.05, 0.5)
        if kv:
            t.rand(b + "attn_k_norm.weight", (d.head_dim,), 0.05, 0.5)
        t.rand(b + "post_attention_norm.weight", (d.n_embd,), 0.1 * gain, gain)
        _ffn(t, b, d)
        t.rand(b + "post_ffw_norm.weight", (d.n_embd,), 0.1 * gain, gain)


def _write_hy_v3(w: gguf.GGUFWriter, t: _Weights, d: Dims, mtp: int) -> None:
    """Hunyuan-V3 with dense FFNs only (no experts): llama blocks with q/k norms, and with mtp = N
    NextN blocks after them (block_count = n_layer + N, nextn_predict_layers = N), each a full
    block behind an eh_proj as qwen35's. llama.cpp's MTP graph runs block n_layer + offset
    (llama_set_nextn_layer_offset), so its draft-mtp driver chains the N heads, one a step."""
    n_nextn = int(mtp)
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer + n_nextn)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(d.n_head)
    w.add_head_count_kv(d.n_head_kv)
    w.add_rope_dimension_count(d.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_feed_forward_length(d.n_ff)  # required by the loader; no experts use it
    if n_nextn:
        w.add_nextn_predict_layers(n_nextn)
    t.embeddings(d.n_embd, d.n_vocab, len(SPECIALS))
    t.norm("output_norm.weight", d.n_embd)
    for i in range(d.n_layer + n_nextn):
        b = f"blk.{i}."
        _llama_block(t, b, d)
        t.norm(b + "attn_q_norm.weight", d.head_dim)
        t.norm(b + "attn_k_norm.weight", d.head_dim)
        if i >= d.n_layer:
            _nextn_projection(t, b, d)
            t.norm(b + "nextn.enorm.weight", d.n_embd)
            t.norm(b + "nextn.hnorm.weight", d.n_embd)
            t.norm(b + "nextn.shared_head_norm.weight", d.n_embd)


def _write_qwen3moe(w: gguf.GGUFWriter, t: _Weights, d: Dims, mtp: bool) -> None:
    """Qwen3-MoE (Qwen3-30B-A3B's architecture): Qwen3's attention (q and k normed per head) and
    in every layer a router over MOE_EXPERTS experts, MOE_USED of them per token; the experts'
    matrices stacked in one tensor each (blk.N.ffn_{gate,up,down}_exps, which -cmoe keeps on the CPU)."""
    _attention_kv(w, d)
    w.add_key_length(d.head_dim)
    w.add_value_length(d.head_dim)
    w.add_expert_count(MOE_EXPERTS)
    w.add_expert_used_count(MOE_USED)
    n_ff_exp = d.n_ff // MOE_USED
    w.add_expert_feed_forward_length(n_ff_exp)
    t.embeddings(d.n_embd, d.n_vocab, len(SPECIALS))
    t.norm("output_norm.weight", d.n_embd)
    kv, q = d.head_dim * d.n_head_kv, d.head_dim * d.n_head
    for i in range(d.n_layer):
        b = f"blk.{i}."
        t.norm(b + "attn_norm.weight", d.n_embd)
        t.linear(b + "attn_q.weight", d.n_embd, q)
        t.linear(b + "attn_k.weight", d.n_embd, kv)
        t.linear(b + "attn_v.weight", d.n_embd, kv)
        t.norm(b + "attn_q_norm.weight", d.head_dim)
        t.norm(b + "attn_k_norm.weight", d.head_dim)
        t.out(b + "attn_output.weight", q, d.n_embd)
        t.norm(b + "ffn_norm.weight", d.n_embd)
        t.linear(b + "ffn_gate_inp.weight", d.n_embd, MOE_EXPERTS)
        t.add(b + "ffn_gate_exps.weight", t.normal((d.n_embd, n_ff_exp, MOE_EXPERTS), 1 / np.sqrt(d.n_embd)))
        t.add(b + "ffn_up_exps.weight", t.normal((d.n_embd, n_ff_exp, MOE_EXPERTS), 1 / np.sqrt(d.n_embd)))
        t.add(b + "ffn_down_exps.weight", t.normal((n_ff_exp, d.n_embd, MOE_EXPERTS),
                                                   t.residual_gain / np.sqrt(n_ff_exp)))


def _write_granitehybrid(w: gguf.GGUFWriter, t: _Weights, d: Dims, mtp: bool) -> None:
    """Mamba-2 layers with an attention layer every 4th (head_count_kv 0 marks Mamba-2)."""
    d_inner, d_conv, d_state, n_group = 2 * d.n_embd, 4, 16, 1  # llama.cpp: d_inner == 2 * n_embd
    n_ssm_head = d_inner // 16
    attention = [(i + 1) % 4 == 0 for i in range(d.n_layer)]
    if not any(attention):
        attention[-1] = True
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count([d.n_head] * d.n_layer)
    w.add_head_count_kv([d.n_head_kv if a else 0 for a in attention])
    w.add_rope_dimension_count(d.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(n_ssm_head)
    w.add_ssm_group_count(n_group)
    t.embeddings(d.n_embd, d.n_vocab, len(SPECIALS))
    t.norm("output_norm.weight", d.n_embd)
    for i in range(d.n_layer):
        b = f"blk.{i}."
        if attention[i]:
            _llama_block(t, b, d)
        else:
            t.norm(b + "attn_norm.weight", d.n_embd)
            _mamba2_layer(t, b, d.n_embd, d_inner, d_state, n_group, n_ssm_head, d_conv)
            _ffn(t, b, d)


def _write_bert(w: gguf.GGUFWriter, t: _Weights, d: Dims, mtp: bool) -> None:
    n = d.n_embd
    w.add_context_length(512)
    w.add_embedding_length(n)
    w.add_block_count(d.n_layer)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(d.n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_token_type_count(2)
    t.rand("token_embd.weight", (n, d.n_vocab), 1.0)
    t.rand("token_types.weight", (n, 2), 0.1)
    t.rand("position_embd.weight", (n, 512), 0.1)
    t.norm("token_embd_norm.weight", n)
    t.const("token_embd_norm.bias", (n,), 0.0)
    for i in range(d.n_layer):
        b = f"blk.{i}."
        for x in ("q", "k", "v"):
            t.linear(b + f"attn_{x}.weight", n, n)
            t.const(b + f"attn_{x}.bias", (n,), 0.0)
        t.out(b + "attn_output.weight", n, n)
        t.const(b + "attn_output.bias", (n,), 0.0)
        for norm in ("attn_output_norm", "layer_output_norm"):
            t.norm(b + norm + ".weight", n)
            t.const(b + norm + ".bias", (n,), 0.0)
        t.linear(b + "ffn_up.weight", n, d.n_ff)
        t.const(b + "ffn_up.bias", (d.n_ff,), 0.0)
        t.out(b + "ffn_down.weight", d.n_ff, n)
        t.const(b + "ffn_down.bias", (n,), 0.0)


_WRITERS = {
    "llama": _write_llama_like("llama"),
    "mamba": _write_mamba,
    "mamba2": _write_mamba2,
    "rwkv7": _write_rwkv7,
    "lfm2": _write_lfm2,
    "qwen35": _write_qwen35,
    "granitehybrid": _write_granitehybrid,
    "gemma4": _write_gemma4,
    "hy_v3": _write_hy_v3,
    "qwen3moe": _write_qwen3moe,
    "bert": _write_bert,
    "dream": _write_llama_like("dream"),
    "llada": _write_llama_like("llada"),
}
assert set(_WRITERS) == set(ARCHS)


def _in_mtp_file(n_layer: int) -> Callable[[str], bool]:
    """What `convert_hf_to_gguf.py --mtp` keeps: the blocks from n_layer on (NextN) and the
    tensors outside blocks (the embeddings, output norm and head the NextN block shares)."""
    return lambda name: not name.startswith("blk.") or int(name.split(".")[1]) >= n_layer


def write_model(arch: str, path: str | Path, *, mtp: bool | int = False, mtp_only: bool = False,
                n_embd: int | None = None, n_layer: int | None = None, seed: int = 0, f16: bool = False,
                split_max_tensors: int = 0) -> Path:
    """Write a tiny random-weight GGUF of architecture `arch` (one of ARCHS) to `path`.

    n_embd defaults to the architecture's ARCH_INFO default, 64 for most (a multiple of 16 up
    to 128, of 64 above; rwkv7's of 64) and n_layer to the
    architecture's ARCH_INFO default; mtp (qwen35, hy_v3) adds NextN blocks: True or 1 one, an
    int N that many (nextn_predict_layers = N); mtp_only writes them alone, as llama.cpp's
    converter publishes an MTP head (see the top), one block unless mtp says more.
    split_max_tensors > 0 writes a split model as gguf-split does, `STEM-00001-of-0000N.gguf`
    and so on beside `path`, and returns the first part's path."""
    if isinstance(mtp, bool) or mtp is None:
        mtp = 1 if mtp else 0
    if mtp < 0:
        raise ValueError(f"mtp must be a number of NextN blocks >= 0, not {mtp}")
    mtp = max(mtp, 1) if mtp_only else mtp
    if arch not in ARCH_INFO:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    info = ARCH_INFO[arch]
    if mtp and not info.mtp:
        raise ValueError(f"{arch} has no MTP (NextN) layers here; only {[a for a in ARCHS if ARCH_INFO[a].mtp]}")
    n_embd = info.n_embd if n_embd is None else n_embd
    n_layer = info.n_layer if n_layer is None else n_layer
    if n_layer < 1 or n_embd < 16:
        raise ValueError("n_layer must be >= 1 and n_embd >= 16")
    if info.hybrid and n_layer < 2:
        raise ValueError(f"{arch} is hybrid: it needs at least 2 layers")
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_name(f"tiny-{arch}{'-mtp' if mtp else ''}{mtp if mtp > 1 else ''}")
    n_vocab = add_tokenizer(w)
    d = _dims(n_embd, n_layer, n_vocab)
    keep = _in_mtp_file(n_layer) if mtp_only else (lambda name: True)
    _WRITERS[arch](w, _Weights(w, seed, f16, n_layer, keep), d, mtp)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("arch", choices=ARCHS, help="the architecture (a drafter's: python -m tests.tiny_drafters)")
    p.add_argument("out", type=Path)
    p.add_argument("--mtp", action="store_true", help="add NextN/MTP layer(s) (qwen35, hy_v3)")
    p.add_argument("--mtp-heads", type=int, default=None, metavar="N",
                   help="how many NextN blocks --mtp / --mtp-only write (default 1; implies --mtp; "
                        "nextn_predict_layers = N)")
    p.add_argument("--mtp-only", action="store_true",
                   help="only the MTP head, as convert_hf_to_gguf.py --mtp writes it (qwen35, hy_v3; its model: "
                        "the same arguments without --mtp-only, which is what --no-nextn writes)")
    p.add_argument("--n-embd", type=int, default=None)
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--f16", action="store_true", help="store matrices in F16 (norms etc. stay F32)")
    p.add_argument("--split-max-tensors", type=int, default=0, metavar="N",
                   help="write a split model, at most N tensors a part (OUT-00001-of-0000K.gguf, ...)")
    args = p.parse_args(argv)
    if args.mtp_heads is not None and args.mtp_heads < 1:
        p.error("--mtp-heads must be at least 1")
    mtp = args.mtp_heads if args.mtp_heads is not None else args.mtp
    try:
        path = write_model(args.arch, args.out, mtp=mtp, mtp_only=args.mtp_only, n_embd=args.n_embd, n_layer=args.n_layer,
                           seed=args.seed, f16=args.f16, split_max_tensors=args.split_max_tensors)
    except ValueError as e:
        p.error(str(e))
    print(f"{path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
