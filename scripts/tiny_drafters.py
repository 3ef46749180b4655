"""Tiny random-weight drafter GGUFs (EAGLE-3, ...) with the target each drafts for.

    python scripts/tiny_model.py eagle3 OUT.gguf      # also writes OUT.target.gguf

or, from Python, ``write_drafter(arch, path, ...)``, which returns (draft, target). A drafter of
these architectures reads the target's hidden states, so it comes with its target: a tiny
model of scripts/tiny_model.py written first, whose tensors the drafter then reuses where the
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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

import gguf

from scripts.tiny_model import SPECIALS, _dims, add_tokenizer, write_model

EAGLE3_TARGET_LAYERS = (0, 2, 3)  # of the 4-layer target; llama.cpp reads them as layer inputs
_CONST = 3.0  # the draft embeddings' constant dimension (see the top)
_FOCUS = 6.0  # how strongly the attention looks at its own position
FC_GAIN = 0.5  # the scale of fc's rows g (normed before the decoder uses them)
G_SCALE = 0.4  # how much of g (normed) the decoder's residual stream takes beside the token's embedding


@dataclass(frozen=True)
class DrafterInfo:
    target_arch: str
    target_layers: int  # the target's block count


DRAFTER_INFO: dict[str, DrafterInfo] = {
    "eagle3": DrafterInfo("llama", 4),
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


def write_drafter(arch: str, path: str | Path, *, seed: int = 0, n_embd: int = 64, target_n_embd: int = 64,
                  own_embd: bool = True, own_output: bool = False, d2t: bool = False,
                  target_layers: tuple[int, ...] | None = None) -> tuple[Path, Path]:
    """Write a tiny drafter of architecture `arch` (one of DRAFTERS) to `path` and its target to
    target_path(path); returns both paths. own_embd / own_output: whether the draft carries its
    own token embeddings / output projection (llama.cpp takes the target's otherwise); d2t: a
    reduced draft vocabulary mapped to the target's ids (own output rows)."""
    if arch not in DRAFTER_INFO:
        raise ValueError(f"unknown drafter {arch!r}; known: {', '.join(DRAFTERS)}")
    info = DRAFTER_INFO[arch]
    path = Path(path)
    target = write_model(info.target_arch, target_path(path), n_embd=target_n_embd, n_layer=info.target_layers,
                         seed=seed)
    reader = gguf.GGUFReader(str(target))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    add_tokenizer(w)
    rng = np.random.default_rng(seed + 1)
    _write_eagle3(w, reader, rng, n_embd, own_embd, own_output, d2t,
                  EAGLE3_TARGET_LAYERS if target_layers is None else target_layers)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, target
