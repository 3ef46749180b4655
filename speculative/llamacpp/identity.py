"""What a model's runs depend on, as saved results record it: calibrations (a model's speed
here) and the prompt cache (what its KV cache holds for given tokens) are used again only by
a model with the same identity."""

from __future__ import annotations

from pathlib import Path

import llama_cpp as ll

from speculative.decoding.settings import ModelSpec
from speculative.files import content_identity
from speculative.llamacpp.devices import rpc_endpoints, system_info


def file_identity(path: Path) -> dict:
    stat = path.stat()
    return {"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def speed_identity(model) -> dict:
    """Everything that changes how fast a LlamaModel runs here (for its costs: engine/costs.py): the
    file by its content, not by the name or path it was given."""
    # llama.cpp drops an adapter of scale 0; another scale costs the same as 1.
    loras = [content_identity(lora) for lora, scale in model.loras if scale != 0]
    return {**content_identity(model.path), "threads": model.n_threads,
            "n_gpu_layers": model.n_gpu_layers, "n_batch": model.n_batch, "build": system_info(),
            "kernels": model.kernels, "llama_cpp_python": ll.__version__,
            **({"loras": loras} if loras else {}),  # no key without: older calibrations stay valid
            **_device_identity(model.devices), **_memory_identity(model),
            **({"n_ubatch": model.n_ubatch} if model.n_ubatch != ModelSpec.n_ubatch else {}),
            **({"threads_batch": model.n_threads_batch} if model.n_threads_batch != model.n_threads else {})}


def cache_identity(model) -> dict:
    """Everything that decides what a LlamaModel's KV cache holds for given tokens (for the prompt
    cache): the model file, its LoRA adapters and their scales, where layers run, flash
    attention, the KV cache types and the tensor overrides, the build and its kernels. The batch
    size is left out: only batch-variant kernels (listed) make it matter."""
    loras = [{**file_identity(lora), "scale": scale} for lora, scale in model.loras if scale != 0]
    return {**file_identity(model.path), "loras": loras, "n_gpu_layers": model.n_gpu_layers,
            "flash_attn": model._flash_attn_type, "build": system_info(), "kernels": model.kernels,
            "llama_cpp_python": ll.__version__, **_device_identity(model.devices), **_memory_identity(model)}


def _memory_identity(model) -> dict:
    """The memory flags that change what a cache holds and how fast the model runs, where they
    are not the defaults (so that what was stored before them stays valid): the KV cache types,
    the tensor overrides (-ot, -cmoe, ...) and how layers split over devices (-sm, -ts, -mg)."""
    spec, default = model.spec, ModelSpec
    out = {}
    if model.cache_types != (default.cache_type_k, default.cache_type_v):
        out["cache_types"] = list(model.cache_types)
    if spec.overrides:
        out["overrides"] = [list(o) for o in spec.overrides]
    split = (spec.split_mode, list(spec.tensor_split), spec.main_gpu)
    if split != (default.split_mode, list(default.tensor_split), default.main_gpu):
        out["split"] = list(split)
    if not spec.repack:
        out["repack"] = False
    return out


def _device_identity(devices: tuple[str, ...] | None) -> dict:
    """The devices given for the layers, an RPC server's with its endpoint (none given: no key)."""
    if devices is None:
        return {}
    servers = rpc_endpoints()
    return {"devices": [f"{name} ({servers[name]})" if name in servers else name for name in devices]}
