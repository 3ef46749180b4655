"""The llama.cpp backend: the only module that imports llama_cpp.

Built on the low-level C API, not on `llama_cpp.Llama`: one llama_batch reused
for every call, logits read as zero-copy numpy views of llama.cpp's own buffer,
and rollback with llama_memory_seq_rm. Sequence 0 is the cache; draft trees add
sequences 1..n_seq-1 for their other branches (see backend.Backend). Sequence 0's
cache can be saved and restored (llama_state_seq_*) for the prompt cache.

Recurrent and hybrid models (Mamba, RWKV, LFM2, Qwen3.5, ...) keep a state per
sequence instead of a token per cell. Where llama.cpp supports it (its
llm_arch_supports_rs_rollback) the context keeps n_rs_seq snapshots of that state,
so the latest decode can be undone by up to that many tokens; everything else goes
through checkpoints of the recurrent state (cache.py).

A model with NextN (MTP) layers, loaded with load_mtp, drafts for itself: `mtp_head()`
gives the MtpHead, a second context on the same weights that runs only those layers, and
from then on the model copies its NextN hidden rows after every decode (nextn.py). Those
layers may also come as a file of their own (an MTP head, `convert_hf_to_gguf.py --mtp`),
given with -md: `mtp_head(path)` loads it and runs the head on its weights instead.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path
from typing import Sequence

import llama_cpp as ll
import numpy as np
from llama_cpp import llama_cpp_ext as ll_ext

from speculative.llamacpp import interrupt
from speculative.decoding.backend import Outputs
from speculative.errors import GenerationError, ModelError
from speculative.models.gguf_meta import nextn_kind, preflight, preflight_adapter, read_metadata
from speculative.llamacpp.nextn import NextnRows

_initialised = False
_abort = ll.ggml_abort_callback(interrupt.poll)  # Ctrl-C and SIGTERM stop a decode within a graph node
_no_abort = ll.ggml_abort_callback()  # NULL
# llama.cpp calls the abort callback at every graph node, which costs ~2% of decoding speed;
# only batches this large (prompt chunks, seconds to minutes on a CPU) are made abortable.
# A draft step, at most a few hundred ms, finishes before the signal is handled.
ABORTABLE_FROM = 64
# Architectures whose GGUF is a drafting sidecar for another model, not a model on its own.
SIDECARS = {"eagle3": "an EAGLE-3 drafter", "dflash": "a DFlash drafter"}


@ll.llama_log_callback
def _quiet_log(level, text, user_data):  # pragma: no cover - called from C
    if os.environ.get("SPECULATE_LLAMA_LOG"):
        os.write(2, text)


def _init_once() -> None:
    global _initialised
    if not _initialised:
        ll.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _initialised = True


def system_info() -> str:
    """llama.cpp's build and CPU feature line (e.g. 'CPU : AVX2 = 1 | LLAMAFILE = 1 | ...')."""
    _init_once()
    return ll.llama_print_system_info().decode(errors="replace")


def bindings_version() -> str:
    """The llama-cpp-python version."""
    return ll.__version__


def gpu_offload() -> bool:
    """Whether this machine has a GPU this build can offload layers to (Metal, CUDA, ...). Not
    llama_supports_gpu_offload(), which is true in every build with RPC compiled in."""
    return bool(offload_devices(remote=False))


# -- devices, and ggml's RPC backend (ggml-rpc) --------------------------------
# The bindings leave out ggml's device registry and RPC backend: they are reached in libggml.

DEV_CPU, DEV_GPU, DEV_IGPU = 0, 1, 2  # enum ggml_backend_dev_type
_ggml = None
_rpc_servers: dict[str, list[str]] = {}  # endpoint -> names of its devices, registered once
_abort_hook = None  # the ggml_set_abort_callback function, kept alive
_ABORT_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)


def _lib():
    global _ggml
    if _ggml is None:
        from llama_cpp._ctypes_extensions import load_shared_library

        _init_once()
        lib = load_shared_library("ggml", ll.llama_cpp._base_path)
        p, s, n = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        for name, restype, argtypes in (
                ("ggml_backend_dev_count", n, []), ("ggml_backend_dev_get", p, [n]),
                ("ggml_backend_dev_by_name", p, [s]), ("ggml_backend_dev_name", s, [p]),
                ("ggml_backend_dev_type", ctypes.c_int, [p]),
                ("ggml_backend_dev_backend_reg", p, [p]), ("ggml_backend_reg_name", s, [p]),
                ("ggml_backend_reg_by_name", p, [s]), ("ggml_backend_reg_get_proc_address", p, [p, s]),
                ("ggml_backend_reg_dev_count", n, [p]), ("ggml_backend_reg_dev_get", p, [p, n]),
                ("ggml_backend_register", None, [p]), ("ggml_set_abort_callback", p, [p])):
            getattr(lib, name).restype = restype
            getattr(lib, name).argtypes = argtypes
        _ggml = lib
    return _ggml


def _devices() -> dict[str, tuple[int, bool]]:
    """Every registered device: name -> (ggml device type, whether it is an RPC server's)."""
    lib = _lib()
    out = {}
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        reg = lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev))
        out[lib.ggml_backend_dev_name(dev).decode()] = (lib.ggml_backend_dev_type(dev), reg == b"RPC")
    return out


def offload_devices(remote: bool | None = None) -> list[str]:
    """Devices layers can be offloaded to (GPUs, integrated GPUs, RPC servers' devices);
    remote False: this machine's only, True: RPC servers' only."""
    return [name for name, (kind, rpc) in _devices().items()
            if kind in (DEV_GPU, DEV_IGPU) and (remote is None or rpc == remote)]


def cpu_devices() -> list[str]:
    return [name for name, (kind, _) in _devices().items() if kind == DEV_CPU]


def require_rpc():
    """The RPC backend's registry entry; ModelError where this build has none."""
    reg = _lib().ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise ModelError("this llama.cpp build has no RPC support: reinstall llama-cpp-python built with "
                         'CMAKE_ARGS="-DGGML_RPC=on" (see README, "Beyond one machine")')
    return reg


def _rpc_function(name: str, *signature):
    return ctypes.CFUNCTYPE(*signature)(_lib().ggml_backend_reg_get_proc_address(require_rpc(), name.encode()))


def rpc_available() -> bool:
    return bool(_lib().ggml_backend_reg_by_name(b"RPC"))


def add_rpc_servers(endpoints: Sequence[str]) -> list[str]:
    """Register the devices of each RPC server (once per endpoint; ggml aborts when one is not
    there: check them first, rpc.check) and return their names, in order."""
    lib = _lib()
    for endpoint in endpoints:
        if endpoint not in _rpc_servers:
            reg = _rpc_function("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)(endpoint.encode())
            if not reg:
                raise ModelError(f"RPC server {endpoint} offers no devices")
            lib.ggml_backend_register(reg)
            _rpc_servers[endpoint] = [lib.ggml_backend_dev_name(lib.ggml_backend_reg_dev_get(reg, i)).decode()
                                      for i in range(lib.ggml_backend_reg_dev_count(reg))]
    return [name for endpoint in endpoints for name in _rpc_servers[endpoint]]


def on_ggml_abort(report) -> None:
    """Call report(message) where ggml would abort the process (GGML_ABORT, GGML_ASSERT, on any
    thread): abort() follows its return, so report must end the process itself."""
    global _abort_hook
    _abort_hook = _ABORT_HOOK(lambda message: report(message.decode(errors="replace")))
    _lib().ggml_set_abort_callback(ctypes.cast(_abort_hook, ctypes.c_void_p))


def serve_rpc(endpoint: str, devices: Sequence[str], threads: int, cache_dir: str | None):
    """ggml's own RPC server for `devices` on endpoint, in a daemon thread (its call never
    returns unless it cannot start): the caller waits for it or for a signal."""
    start = _rpc_function("ggml_backend_rpc_start_server", None, ctypes.c_char_p, ctypes.c_char_p,
                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p)
    devs = (ctypes.c_void_p * len(devices))(*(_device(name) for name in devices))
    thread = threading.Thread(target=start, daemon=True, name="rpc-server", args=(
        endpoint.encode(), cache_dir.encode() if cache_dir else None, threads, len(devices), devs))
    thread.start()
    return thread


def flush_c_stdio() -> None:
    """Flush what llama.cpp printed with printf (before os._exit, which would lose it)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # pragma: no cover - Windows
        pass


def _device(name: str) -> int:
    dev = _lib().ggml_backend_dev_by_name(name.encode())
    if dev:
        return dev
    raise ModelError(f"no device {name!r} (available: {', '.join(_devices())})")


def _model_params(n_gpu_layers: int, devices: Sequence[str] | None):
    """Model parameters with n_gpu_layers (-1: llama.cpp's default) and, unless None,
    the devices for the offloaded layers (empty: none, the CPU keeps them); the array llama.cpp
    reads them from is returned too, to be kept until the model has loaded."""
    mparams = ll.llama_model_default_params()
    if n_gpu_layers >= 0:
        mparams.n_gpu_layers = n_gpu_layers
    devs = None
    if devices is not None:  # NULL-terminated; llama.cpp's default selection may skip RPC devices
        devs = (ctypes.c_void_p * (len(devices) + 1))(*(_device(name) for name in devices), None)
        mparams.devices = ctypes.addressof(devs)
    return mparams, devs


def placement(n_gpu_layers: int, devices: Sequence[str] | None) -> str:
    """Where a model's offloaded layers run: "cpu" (none offloaded), "rpc" (on RPC servers,
    whose hardware speculate cannot see: possibly a CPU) or "gpu" (this machine's GPUs).
    By the devices themselves, as llama.cpp picks them (devices None: every GPU and RPC device)."""
    used = offload_devices() if devices is None else devices
    if n_gpu_layers == 0 or not used:
        return "cpu"
    return "rpc" if any(_devices()[name][1] for name in used) else "gpu"


def batch_variant_kernels() -> list[str]:
    """CPU kernels in this build that pick a different matmul path by batch size.

    With them, scoring a position inside a batch of k tokens can differ in the last
    bits from scoring it alone, which can flip a near-tie in greedy decoding:
    LLAMAFILE (sgemm) and REPACK are build options (-DGGML_LLAMAFILE=OFF
    -DGGML_CPU_REPACK=OFF); TILED_MM, the x86 tiled K-quant matmul that takes over
    from 8 rows, is switched off at run time with GGML_CPU_TILED_MM=0.
    """
    info = system_info()
    kernels = [name for name in ("LLAMAFILE", "REPACK") if f"{name} = 1" in info]
    x86 = any(f"{flag} = 1" in info for flag in ("AVX", "AVX2", "AVX512_VNNI"))
    if x86 and os.environ.get("GGML_CPU_TILED_MM", "1").strip() not in ("0", ""):
        kernels.append("TILED_MM")
    return kernels


def flash_attn_type(mode: str, on_gpu: bool) -> int:
    """llama.cpp's flash-attention setting for -fa MODE. `auto` is llama.cpp's auto on this
    machine's GPUs and off elsewhere: on the CPU the flash-attention kernel is batch-variant (see
    LlamaModel.kernels) and decodes no faster, and an RPC server's device may be a CPU."""
    if mode == "on":
        return ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
    if mode == "off" or not on_gpu:
        return ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return ll.LLAMA_FLASH_ATTN_TYPE_AUTO


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def _context_params(n_ctx: int, n_batch: int, threads: int, fa_type: int, n_seq: int = 1):
    """llama.cpp's context parameters as speculate sets them for every context."""
    cparams = ll.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = n_batch
    cparams.n_ubatch = min(n_batch, 512)
    cparams.n_seq_max = n_seq
    cparams.kv_unified = True  # branches share the prompt's cells: one cache, not n_seq slices
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.swa_full = True  # sliding-window caches keep everything, so rollback is exact
    cparams.no_perf = True
    cparams.flash_attn_type = fa_type
    return cparams


def _file_identity(path: Path) -> dict:
    stat = path.stat()
    return {"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class LlamaModel:
    """A GGUF model with one context: sequence 0 is its cache, and n_seq - 1 more hold draft-tree
    branches within a step (see backend.Backend)."""

    rollback_limit: int | None = None  # an attention cache drops any suffix; see __init__ for recurrent ones

    def __init__(
        self,
        path: Path,
        *,
        name: str,
        n_ctx: int = 4096,
        n_batch: int = 2048,
        n_gpu_layers: int = -1,
        n_threads: int | None = None,
        flash_attn: str = "auto",
        n_seq: int = 1,
        n_rs_seq: int = 0,
        loras: Sequence[tuple[Path, float]] = (),
        load_mtp: bool = False,
        devices: Sequence[str] | None = None,
    ):
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
        _init_once()
        self.name = name
        self.path = Path(path)
        self.loras = tuple((Path(lora), float(scale)) for lora, scale in loras)
        self._model = self._ctx = None
        self._batch = None
        self._mtp: MtpHead | None = None
        self._adapters = None  # the LoRA adapters and their scales, as llama.cpp takes them

        self.devices = None if devices is None else tuple(devices)  # None: llama.cpp's choice
        mparams, _devs = _model_params(n_gpu_layers, self.devices)
        # NextN (MTP) layers cost memory and load time: loaded only where they may draft
        mparams.load_mtp = load_mtp and nextn != "none"
        model = ll.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not model:
            raise ModelError(f"{self.path}: llama.cpp could not load this model file")
        self._model = model
        self.arch = arch
        cannot = ("a diffusion model (it denoises whole blocks)" if ll.llama_model_is_diffusion(model) else
                  "an encoder-only model" if not ll.llama_model_has_decoder(model) else
                  "an encoder-decoder model" if ll.llama_model_has_encoder(model) else
                  "an embedding model (bidirectional attention)" if causal is False else None)
        if cannot:
            self.close()
            raise ModelError(f"{self.path}: {cannot} ({arch}); speculate needs a model that generates "
                             "one token after another")
        # A recurrent state (Mamba, RWKV; the hybrids' recurrent layers) is one per sequence:
        # it cannot be copied into draft-tree branches, and it rolls back only through snapshots.
        self.recurrent = bool(ll.llama_model_is_recurrent(model) or ll.llama_model_is_hybrid(model))

        self.nextn_layers = ll.llama_model_n_layer_nextn(model) if mparams.load_mtp else 0
        threads = n_threads or default_threads()
        # by the devices the layers are on: llama_supports_gpu_offload() is true in any RPC build
        self.placement = placement(n_gpu_layers, self.devices)
        cparams = _context_params(n_ctx, n_batch, threads, flash_attn_type(flash_attn, self.placement == "gpu"),
                                  n_seq)
        cparams.n_rs_seq = n_rs_seq if self.recurrent else 0  # llama.cpp clamps it to 0 where unsupported
        ctx = ll.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise ModelError(f"{self.path}: llama.cpp could not create a context (n_ctx={n_ctx})")
        self._ctx = ctx
        self._apply_loras()
        self._abortable = False
        self._mem = ll.llama_get_memory(ctx)
        # llama.cpp pads the context (to 256); the limit is still what was asked for.
        allocated = ll.llama_n_ctx(ctx)
        self.n_ctx = min(n_ctx, allocated) if n_ctx > 0 else allocated
        self.n_batch = ll.llama_n_batch(ctx)
        self.n_seq = n_seq
        if self.recurrent:  # the latest decode's last n_rs_seq tokens can be undone, once
            self.rollback_limit = ll.llama_n_rs_seq(ctx)
        self._vocab = ll.llama_model_get_vocab(model)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        self.n_threads = threads
        self.n_gpu_layers = n_gpu_layers
        self.flash_attn = flash_attn
        self._flash_attn_type = cparams.flash_attn_type
        # Flash attention on the CPU splits a lone query's cache over the threads (from 512
        # cells) and tiles many queries: the same position then scores differently alone
        # and inside a batch.
        fa_on_cpu = self.placement != "gpu" and cparams.flash_attn_type != ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.kernels = batch_variant_kernels() + (["FLASH_ATTN"] if fa_on_cpu else [])
        self.busy_seconds = 0.0  # time spent inside llama_decode: the rest is Python
        self._pieces: dict[int, bytes] = {}
        self._eog_cache: dict[int, bool] = {}
        self._eog_tokens: np.ndarray | None = None
        self._nextn = NextnRows(ll.llama_model_n_embd(model))  # filled once an MTP head drafts

        self._batch = ll.llama_batch_init(self.n_batch, 0, n_seq)
        for i in range(self.n_batch):
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = 0
        self._n_branched = 0  # leading batch entries whose sequence ids decode_branches changed
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        self._warm_up()

    def _apply_loras(self) -> None:
        """Load the adapters and set them, with their scales, on the context before the
        warm-up decode sizes the compute buffers. llama.cpp frees them with the model."""
        if not self.loras:
            return
        adapters = (ll.llama_adapter_lora_p_ctypes * len(self.loras))()
        for i, (lora, _) in enumerate(self.loras):
            adapter = ll.llama_adapter_lora_init(self._model, str(lora).encode())
            if not adapter:
                self.close()
                raise ModelError(f"{lora}: llama.cpp could not load this LoRA adapter for {self.path.name}")
            adapters[i] = adapter
        scales = (ctypes.c_float * len(self.loras))(*(scale for _, scale in self.loras))
        self._adapters = (adapters, scales)
        self._set_loras(self._ctx)

    def _set_loras(self, ctx) -> None:
        """Set the adapters on a context of this model (the target's, its MTP head's)."""
        if self._adapters is not None:
            ll.llama_set_adapters_lora(ctx, self._adapters[0], len(self.loras), self._adapters[1])

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
        raw = ll.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8", errors="replace") if raw else None

    def special_text(self, which: str) -> str:
        """Text of the BOS or EOS token ('' when the model has none)."""
        token = {"bos": ll.llama_vocab_bos, "eos": ll.llama_vocab_eos}[which](self._vocab)
        return self.token_bytes(token).decode("utf-8", errors="replace") if token >= 0 else ""

    def identity(self) -> dict:
        """Everything that changes how fast this model runs here (for calibration)."""
        # llama.cpp drops an adapter of scale 0; another scale costs the same as 1.
        loras = [_file_identity(lora) for lora, scale in self.loras if scale != 0]
        return {"name": self.name, **_file_identity(self.path), "threads": self.n_threads,
                "n_gpu_layers": self.n_gpu_layers, "n_batch": self.n_batch, "build": system_info(),
                "kernels": self.kernels, "llama_cpp_python": ll.__version__,
                **({"loras": loras} if loras else {}),  # no key without: older calibrations stay valid
                **self._device_identity()}

    def _device_identity(self) -> dict:
        """The devices given for the layers, an RPC server's with its endpoint (none given: no key)."""
        if self.devices is None:
            return {}
        servers = {name: endpoint for endpoint, names in _rpc_servers.items() for name in names}
        return {"devices": [f"{name} ({servers[name]})" if name in servers else name for name in self.devices]}

    def cache_identity(self) -> dict:
        """Everything that decides what the KV cache holds for given tokens (for the prompt
        cache): the model file, its LoRA adapters and their scales, where layers run, flash
        attention, the build and its kernels. The batch size is left out: only batch-variant
        kernels (listed) make it matter."""
        loras = [{**_file_identity(lora), "scale": scale} for lora, scale in self.loras if scale != 0]
        return {**_file_identity(self.path), "loras": loras, "n_gpu_layers": self.n_gpu_layers,
                "flash_attn": self._flash_attn_type, "build": system_info(), "kernels": self.kernels,
                "llama_cpp_python": ll.__version__, **self._device_identity()}

    @property
    def add_bos(self) -> bool:
        return bool(ll.llama_vocab_get_add_bos(self._vocab))

    # -- tokens ----------------------------------------------------------

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        """`parse_special`: text such as "<|fim_prefix|>" becomes that special token (else plain text)."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (ll.llama_token * capacity)()
        n = ll.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:  # the buffer was too small: -n is the size needed
            capacity = -n
            buf = (ll.llama_token * capacity)()
            n = ll.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            raise GenerationError("tokenization failed")
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = True) -> bytes:
        """A token's text; `special` False: special tokens (<|endoftext|>, ...) have none."""
        piece = self._pieces.get(token) if special else None
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            piece = buf.raw[: max(n, 0)]
            if special:
                self._pieces[token] = piece
        return piece

    def fim_tokens(self) -> dict[str, int | None]:
        """The model's fill-in-the-middle tokens (GGUF tokenizer.ggml.fim_*_token_id, or what
        llama.cpp recognises by their text): pre, suf, mid, rep, sep; None where it has none."""
        found = {name: int(get(self._vocab)) for name, get in (
            ("pre", ll.llama_vocab_fim_pre), ("suf", ll.llama_vocab_fim_suf), ("mid", ll.llama_vocab_fim_mid),
            ("rep", ll.llama_vocab_fim_rep), ("sep", ll.llama_vocab_fim_sep))}
        return {name: token if token >= 0 else None for name, token in found.items()}

    def bos_token(self) -> int | None:
        token = int(ll.llama_vocab_bos(self._vocab))
        return token if token >= 0 else None

    def end_token(self) -> int:
        """End of turn, or end of sequence where the model has none (llama.cpp's infill sampler's choice)."""
        token = int(ll.llama_vocab_eot(self._vocab))
        return token if token >= 0 else int(ll.llama_vocab_eos(self._vocab))

    def is_eog(self, token: int) -> bool:
        eog = self._eog_cache.get(token)
        if eog is None:
            eog = self._eog_cache[token] = bool(ll.llama_vocab_is_eog(self._vocab, token))
        return eog

    def eog_tokens(self) -> np.ndarray:
        if self._eog_tokens is None:
            self._eog_tokens = np.array(
                [t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(self._vocab, t)], dtype=np.int64)
        return self._eog_tokens

    # -- the cache -------------------------------------------------------

    def decode(self, tokens: Sequence[int], pos: int, outputs: Outputs) -> list[np.ndarray]:
        if outputs == "all" and len(tokens) > self.n_batch:
            raise GenerationError(f"batch of {len(tokens)} tokens exceeds -b/--batch-size {self.n_batch}")
        self._set_seqs([(0,)] * self._n_branched)
        self._n_branched = 0
        rows: list[np.ndarray] = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            n = len(chunk)
            self._tok[:n] = chunk
            self._pos[:n] = np.arange(pos + start, pos + start + n)
            self._out[:n] = 0
            if outputs == "all":
                self._out[:n] = 1
            elif (outputs == "last" or self.placement == "rpc") and start + n == len(tokens):
                # on RPC servers, reading an output is what waits for the compute: ggml's RPC
                # synchronize only waits for the commands to be sent, so without one a prompt's
                # processing would end in the first generated token's time
                self._out[n - 1] = 1
            self._run(n, pos + start)
            self._keep_nextn(pos + start, n)
        if outputs == "all":
            rows = [self._logits(i) for i in range(len(tokens))]
        elif outputs == "last" and tokens:
            rows = [self._logits(-1)]  # -1: the last output of the last chunk
        return rows

    def decode_branches(self, tokens: Sequence[int], positions: Sequence[int],
                        seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        n = len(tokens)
        if n > self.n_batch:
            raise GenerationError(f"batch of {n} tokens exceeds -b/--batch-size {self.n_batch}")
        self._tok[:n] = tokens
        self._pos[:n] = positions
        self._out[:n] = 1
        self._set_seqs(seqs)
        self._n_branched = max(self._n_branched, n)
        self._run(n, min(positions, default=0))
        if all(len(ids) == 1 and ids[0] == 0 for ids in seqs):  # a chain: positions follow each other
            self._keep_nextn(positions[0], n)
        else:  # rows of other branches would sit at the same positions
            self._nextn.cut(min(positions))
        return [self._logits(i) for i in range(n)]

    def _set_seqs(self, seqs: Sequence[Sequence[int]]) -> None:
        for i, ids in enumerate(seqs):
            self._batch.n_seq_id[i] = len(ids)
            for j, s in enumerate(ids):
                self._batch.seq_id[i][j] = s

    def _run(self, n: int, pos: int) -> None:
        """llama_decode over the batch's first n entries."""
        self._batch.n_tokens = n
        if (n >= ABORTABLE_FROM) != self._abortable:
            self._abortable = n >= ABORTABLE_FROM
            ll.llama_set_abort_callback(self._ctx, _abort if self._abortable else _no_abort, None)
        t0 = time.perf_counter()
        ret = ll.llama_decode(self._ctx, self._batch)
        if ret == 2 or interrupt.poll():  # aborted, or the signal came at the last node
            interrupt.stop()
        ll.llama_synchronize(self._ctx)  # GPU backends return early; count the real work
        self.busy_seconds += time.perf_counter() - t0
        if ret != 0:
            raise GenerationError(f"llama_decode failed on {self.name} (code {ret}) at position {pos}")

    def _logits(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, i), shape=(self.n_vocab,))

    def _keep_nextn(self, pos: int, n: int) -> None:
        """Copy the latest decode's NextN rows while an MTP head drafts from them (llama.cpp
        keeps them only until the next decode)."""
        if self._mtp is not None:
            rows = ll_ext.llama_get_embeddings_nextn(self._ctx)
            self._nextn.put(pos, np.ctypeslib.as_array(rows, shape=(n, self._nextn.n_embd)))

    def trim(self, n_keep: int) -> None:
        # -1: every sequence (a recurrent state refuses -1 for anything but everything)
        self._nextn.cut(n_keep)
        if not ll.llama_memory_seq_rm(self._mem, -1 if self.n_seq > 1 else 0, n_keep, -1):
            raise GenerationError(f"{self.name}: the KV cache refused to roll back to position {n_keep}")

    def copy_branch(self, src: int, dst: int) -> None:
        ll.llama_memory_seq_rm(self._mem, dst, -1, -1)
        ll.llama_memory_seq_cp(self._mem, src, dst, -1, -1)  # shares the cells, copies nothing

    def keep_branch(self, seq: int, n_keep: int) -> None:
        self._nextn.cut(n_keep)
        ll.llama_memory_seq_keep(self._mem, seq)  # cells of other branches are freed
        if not ll.llama_memory_seq_rm(self._mem, seq, n_keep, -1):
            raise GenerationError(f"{self.name}: the KV cache refused to roll back to position {n_keep}")
        if seq != 0:
            ll.llama_memory_seq_cp(self._mem, seq, 0, -1, -1)
            ll.llama_memory_seq_keep(self._mem, 0)

    def save_state(self, partial: bool = False) -> bytes:
        """Sequence 0's cache (its cells and their keys and values) as llama.cpp serialises it;
        `partial`: a recurrent model's state alone, without the attention cells (a checkpoint)."""
        flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else ll.LLAMA_STATE_SEQ_FLAGS_NONE
        size = ll.llama_state_seq_get_size_ext(self._ctx, 0, flags)
        buf = (ctypes.c_uint8 * size)()
        n = ll.llama_state_seq_get_data_ext(self._ctx, buf, size, 0, flags)
        if n == 0:
            raise GenerationError(f"{self.name}: llama.cpp could not copy the KV cache")
        return ctypes.string_at(buf, n)

    def load_state(self, data: bytes, n_tokens: int, partial: bool = False) -> bool:
        """Make sequence 0 hold exactly positions 0..n_tokens-1 from `data` (save_state's); on
        any failure the cache is left empty and False returned. `partial`: the recurrent state
        of a checkpoint, over the attention cells kept up to n_tokens."""
        flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else ll.LLAMA_STATE_SEQ_FLAGS_NONE
        self._nextn.cut(n_tokens if partial else 0)  # a restored cache comes without its NextN rows
        if not partial:
            self.trim(0)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        loaded = ll.llama_state_seq_set_data_ext(self._ctx, buf, len(data), 0, flags) == len(data)
        if loaded and partial:
            loaded = bool(ll.llama_memory_seq_rm(self._mem, 0, n_tokens, -1))  # the attention cells after it
        # a recurrent state is one cell at the last position: only attention caches start at 0
        if loaded and n_tokens and (ll.llama_memory_seq_pos_max(self._mem, 0) != n_tokens - 1 or
                                    not self.recurrent and ll.llama_memory_seq_pos_min(self._mem, 0) != 0):
            loaded = False
        if not loaded or not n_tokens:
            self.trim(0)
        return loaded

    # -- drafting with its own NextN layers -------------------------------

    def mtp_head(self, sidecar: Path | None = None) -> "MtpHead":
        """The MTP head on this model's NextN layers, or on those of the MTP head file
        `sidecar` (made on the first call; this model then keeps its NextN rows for it)."""
        if self._mtp is None:
            if sidecar is None and not self.nextn_layers:
                raise ModelError(f"{self.path}: no NextN (MTP) layers loaded")
            self._mtp = MtpHead(self, self._nextn, sidecar)
            ll_ext.llama_set_embeddings_nextn(self._ctx, True, False)  # unmasked: a row per token
        return self._mtp

    def nextn_state(self, n_tokens: int) -> bytes | None:
        """The NextN rows of positions 0..n_tokens-1, for the prompt cache file; None when not
        all are known."""
        rows = self._nextn.get(0, n_tokens) if self._mtp is not None else None
        return None if rows is None else rows.tobytes()

    def load_nextn_state(self, data: bytes, n_tokens: int) -> bool:
        """Rows that nextn_state gave, for a cache that holds those n_tokens again (restored)."""
        rows = np.frombuffer(data, dtype=np.float32)
        if self._mtp is None or rows.size != n_tokens * self._nextn.n_embd:
            return False
        self._nextn.cut(0)
        self._nextn.put(0, rows.reshape(n_tokens, self._nextn.n_embd))
        return True

    # -- lifetime --------------------------------------------------------

    def close(self) -> None:
        if self._mtp is not None:
            self._mtp.close()
            self._mtp = None
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "LlamaModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MtpHead:
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

    def __init__(self, target: LlamaModel, rows: NextnRows, sidecar: Path | None = None):
        """The head that follows `target` (its rows), on the target's weights or the file `sidecar`'s."""
        self.n_embd = rows.n_embd
        self._rows = rows
        self.n_batch = target.n_batch
        self._ctx = self._batch = self._own = None
        self.file = None if sidecar is None else _file_identity(sidecar)  # what it runs, for calibration
        self.name = f"{target.name if sidecar is None else sidecar.name} (MTP)"
        model = target._model if sidecar is None else self._load(sidecar, target)
        cparams = _context_params(ll.llama_n_ctx(target._ctx), target.n_batch, target.n_threads,
                                  target._flash_attn_type)
        cparams.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
        cparams.ctx_other = target._ctx  # llama.cpp shares the target's memory where the architecture does
        self._ctx = ll.llama_init_from_model(model, cparams)
        if not self._ctx:
            self.close()
            raise ModelError(f"{sidecar or target.path}: llama.cpp could not create an MTP context")
        ll_ext.llama_set_embeddings_nextn(self._ctx, True, False)  # unmasked: rows by batch index
        if sidecar is None:
            target._set_loras(self._ctx)  # the target's adapters change its NextN layers too
        self._mem = ll.llama_get_memory(self._ctx)
        self.n_ctx = target.n_ctx
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        self.busy_seconds = 0.0
        self._batch = ll.llama_batch_init(self.n_batch, self.n_embd, 1)
        self._tokens = (ll.llama_token * self.n_batch)()
        self._batch.token = self._tokens  # an embeddings batch has no token array; the graph needs both
        for i in range(self.n_batch):
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = 0
        self._tok = np.ctypeslib.as_array(self._tokens, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        self._embd = np.ctypeslib.as_array(self._batch.embd, shape=(self.n_batch, self.n_embd))
        self.decode([0], 0, np.zeros((1, self.n_embd), dtype=np.float32))  # allocates the compute buffers
        self.trim(0)

    def _load(self, path: Path, target: LlamaModel):
        """An MTP head file's weights, its NextN layers loaded (its trunk is not in it)."""
        preflight(path)
        mparams, _devs = _model_params(target.n_gpu_layers, target.devices)
        mparams.load_mtp = True
        self._own = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._own:
            raise ModelError(f"{path}: llama.cpp could not load this MTP head")
        width = ll.llama_model_n_embd(self._own)
        if width != self.n_embd:  # llama.cpp asserts they match
            self.close()
            raise ModelError(f"{path}: an MTP head of width {width} cannot draft for {target.name}, whose "
                             f"hidden states have {self.n_embd}")
        return self._own

    def target_rows(self, start: int, end: int) -> np.ndarray | None:
        """The target's NextN rows for positions start..end-1 (-1: zeros), None where unknown."""
        return self._rows.get(start, end)

    def decode(self, tokens: Sequence[int], pos: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Entries for tokens[i] with rows[i] at positions pos, pos+1, ... after the pos the
        cache holds: the last entry's logits and NextN row (views, valid until the next
        decode), or None when llama.cpp fails (the cache may then hold some of them)."""
        for start in range(0, len(tokens), self.n_batch):
            n = min(self.n_batch, len(tokens) - start)
            self._tok[:n] = tokens[start : start + n]
            self._pos[:n] = np.arange(pos + start, pos + start + n)
            self._embd[:n] = rows[start : start + n]
            self._out[:n] = 0
            self._out[n - 1] = start + n == len(tokens)
            self._batch.n_tokens = n
            t0 = time.perf_counter()
            ret = ll.llama_decode(self._ctx, self._batch)
            ll.llama_synchronize(self._ctx)
            self.busy_seconds += time.perf_counter() - t0
            if ret != 0:
                return None
        logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, -1), shape=(self.n_vocab,))
        hidden = np.ctypeslib.as_array(ll_ext.llama_get_embeddings_nextn_ith(self._ctx, n - 1), shape=(self.n_embd,))
        return logits, hidden

    def trim(self, n_keep: int) -> None:
        if not ll.llama_memory_seq_rm(self._mem, 0, n_keep, -1):
            raise GenerationError(f"{self.name}: the KV cache refused to roll back to position {n_keep}")

    def close(self) -> None:
        if self._batch is not None:
            self._batch.token = ctypes.POINTER(ll.llama_token)()  # ours: llama_batch_free must not free it
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._own:  # an MTP head file's weights: freed after the context on them
            ll.llama_model_free(self._own)
            self._own = None
