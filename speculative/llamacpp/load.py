"""Loading a GGUF model into llama.cpp: what is refused before llama.cpp sees the file, its
weights, and its LoRA adapters (LlamaModel's first steps)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import llama_cpp as ll

from speculative.errors import ModelError
from speculative.models.gguf_meta import nextn_kind, preflight, preflight_adapter, read_metadata

# Architectures whose GGUF is a drafting sidecar for another model, not a model on its own.
SIDECARS = {"eagle3": "an EAGLE-3 drafter", "dflash": "a DFlash drafter", "gemma4-assistant": "a Gemma-4 MTP assistant"}


def check_file(path: Path, loras: Sequence[tuple[Path, float]]) -> tuple[str, str, bool]:
    """Refuse what is no model to generate with before llama.cpp sees it; its architecture,
    its NextN layers (gguf_meta.nextn_kind) and whether its attention is causal."""
    preflight(path)  # hostile or corrupt GGUF headers never reach llama.cpp's parser
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture") or "unknown"
    if arch in SIDECARS:
        raise ModelError(f"{path}: {SIDECARS[arch]} ({arch}): it drafts for another model and cannot "
                         "generate on its own")
    nextn = nextn_kind(path)
    if nextn == "head":
        raise ModelError(f"{path}: an MTP head without its model ({arch}): it drafts for that model, "
                         "given with -md and --spec-type draft-mtp, and cannot generate on its own")
    causal = read_metadata(path, [f"{arch}.attention.causal"]).get(f"{arch}.attention.causal", True)
    for lora, _ in loras:  # nor adapters, which are refused before the model loads
        preflight_adapter(lora, path)
    return arch, nextn, causal


def load_weights(path: Path, mparams, arch: str, causal: bool):
    """The model file's weights, as mparams say; refused (and freed) where the model cannot
    generate one token after another."""
    model = ll.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise ModelError(f"{path}: llama.cpp could not load this model file")
    cannot = ("a diffusion model (it denoises whole blocks)" if ll.llama_model_is_diffusion(model) else
              "an encoder-only model" if not ll.llama_model_has_decoder(model) else
              "an encoder-decoder model" if ll.llama_model_has_encoder(model) else
              "an embedding model (bidirectional attention)" if causal is False else None)
    if cannot:
        ll.llama_model_free(model)
        raise ModelError(f"{path}: {cannot} ({arch}); speculate needs a model that generates "
                         "one token after another")
    return model


class Adapters:
    """A model's LoRA adapters and their scales, as llama_set_adapters_lora takes them (none
    without any). llama.cpp frees them with the model."""

    def __init__(self, model, loras: Sequence[tuple[Path, float]], model_name: str):
        self.n = len(loras)
        self._adapters = (ll.llama_adapter_lora_p_ctypes * len(loras))()
        for i, (lora, _) in enumerate(loras):
            adapter = ll.llama_adapter_lora_init(model, str(lora).encode())
            if not adapter:
                raise ModelError(f"{lora}: llama.cpp could not load this LoRA adapter for {model_name}")
            self._adapters[i] = adapter
        self._scales = (ctypes.c_float * len(loras))(*(scale for _, scale in loras))

    def set_on(self, ctx) -> None:
        """Set them on a context of the model (its own, its MTP head's)."""
        if self.n:
            ll.llama_set_adapters_lora(ctx, self._adapters, self.n, self._scales)
