"""What drafters that read the target's layer inputs (EAGLE-3, DFlash, DSpark) need of it, checked
before either model decodes anything.

Such a drafter's GGUF names layers of its target (`ARCH.target_layers`); the target hands out
the inputs of those layers for every token it decodes (llama_set_embeddings_layer_inp) where
its llama.cpp graph records them. Where llama.cpp would abort the process (GGML_ABORT,
GGML_ASSERT) or fail late on a drafter that does not fit its target, target_layers says so
first, in one line (ModelError, exit 3).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from speculative.errors import ModelError
from speculative.models.gguf_meta import preflight, read_metadata

# The target architectures whose llama.cpp graphs hand out layer inputs (res->t_layer_inp in
# src/models/*.cpp); with any other, llama.cpp aborts the process at the first decode.
LAYER_INPUTS = frozenset({"bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2",
                          "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35",
                          "qwen35moe", "qwen3moe", "qwen3next", "qwen4exp"})
NAMES = {"eagle3": "an EAGLE-3 drafter", "dflash": "a DFlash drafter"}


def target_layers(path: Path, arch: str, target_name: str, target_arch: str, n_layer: int, n_embd: int,
                  n_vocab: int) -> tuple[int, ...]:
    """The target layers the drafter of architecture `arch` ("eagle3", "dflash") at `path` reads,
    checked against its target (a ModelError where they do not fit). EAGLE-3 reads three, one
    of which may be n_layer (the target's last hidden state, its NextN row), of the width its
    `target_hidden_size` says; DFlash reads layer inputs only, its fc taking them at its own
    width."""
    preflight(path)
    name = NAMES[arch]
    keys = [f"{arch}.target_layers", f"{arch}.target_hidden_size", f"{arch}.embedding_length",
            f"{arch}.hyper_connection_count", "general.architecture"]
    meta = read_metadata(path, keys)
    if meta.get("general.architecture") != arch:
        raise ModelError(f"{path}: not {name} (architecture {meta.get('general.architecture')!r})")
    layers = meta.get(keys[0])
    count = 3 if arch == "eagle3" else None
    if (not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers)
            or (count is not None and len(layers) != count)):
        raise ModelError(f"{path}: {name} names {'three' if count else 'its'} target layers in {keys[0]}; "
                         f"it has {layers!r}")
    last = n_layer if arch == "eagle3" else n_layer - 1
    bad = [i for i in layers if not 0 <= i <= last]
    if bad:
        extra = f", and {n_layer} for its last hidden state" if arch == "eagle3" else ""
        raise ModelError(f"{path}: drafts from layer {bad[0]} of its target, but {target_name} has {n_layer} layers "
                         f"(0-{n_layer - 1}{extra})")
    if target_arch not in LAYER_INPUTS:
        raise ModelError(f"{path}: {name} reads its target's layer inputs, which llama.cpp hands out "
                         f"for {', '.join(sorted(LAYER_INPUTS))}, not for {target_name} ({target_arch})")
    width_key = keys[1] if arch == "eagle3" else keys[2]
    width = meta.get(width_key)
    if width != n_embd:
        raise ModelError(f"{path}: drafts from hidden states of width {width} ({width_key}), but {target_name}'s "
                         f"have {n_embd}")
    if meta.get(keys[3]):
        raise ModelError(f"{path}: a DFlash drafter with hyper-connections (DeepSeek-V4's graph), which speculate "
                         "does not drive")
    _check_d2t(path, target_name, n_vocab)
    return tuple(layers)


def _check_d2t(path: Path, target_name: str, n_vocab: int) -> None:
    """A reduced vocabulary's map (tensor d2t: each draft row's target token id) must name
    tokens of the target: llama.cpp writes the logits there unchecked."""
    reader = gguf.GGUFReader(str(path))  # preflight has checked the file's layout
    d2t = next((t for t in reader.tensors if t.name == "d2t"), None)
    if d2t is None:
        return
    ids = np.asarray(d2t.data).reshape(-1)
    if d2t.tensor_type != gguf.GGMLQuantizationType.I64:
        raise ModelError(f"{path}: its d2t map is {d2t.tensor_type.name}, not I64 as llama.cpp reads it")
    outside = ids[(ids < 0) | (ids >= n_vocab)]
    if outside.size:
        raise ModelError(f"{path}: its d2t map names token {int(outside[0])}, outside {target_name}'s vocabulary "
                         f"of {n_vocab}")
