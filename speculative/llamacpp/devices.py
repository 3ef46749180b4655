"""llama.cpp in this process, and ggml's devices and RPC backend (ggml-rpc).

Process-wide: llama.cpp's backend is initialised once, its log kept quiet (unless -v or
SPECULATE_LLAMA_LOG asks for it), and what the build can do is read here (system_info, its
batch-variant kernels). The bindings leave out ggml's device registry and RPC backend: they
are reached in libggml, for the devices a model's layers go to (model_params, placement),
--rpc's servers (add_rpc_servers) and `speculate rpc-server` (serve_rpc).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import threading
from typing import Sequence

import llama_cpp as ll

from speculative.decoding.settings import LOAD_MODES, SPLIT_MODES
from speculative.errors import ModelError

_initialised = False


_errors: collections.deque[str] = collections.deque(maxlen=8)  # llama.cpp's latest error lines
GGML_LOG_LEVEL_ERROR = 4
_show_log = False  # -v: llama.cpp's log on stderr, as SPECULATE_LLAMA_LOG


@ll.llama_log_callback
def _quiet_log(level, text, user_data):  # pragma: no cover - called from C
    if level == GGML_LOG_LEVEL_ERROR:
        _errors.append(text.decode(errors="replace").strip())
    if _show_log or os.environ.get("SPECULATE_LLAMA_LOG"):
        os.write(2, text)


def show_llama_log() -> None:
    """llama.cpp's log on stderr from now on (-v, as llama.cpp's own -v; SPECULATE_LLAMA_LOG=1 too)."""
    global _show_log
    _show_log = True


def log_errors() -> str:
    """What llama.cpp logged as errors since the last call (why a context could not be made:
    '...: failed to allocate CPU buffer of size ...'), as one line; empty when nothing."""
    lines = [line for line in _errors if line]
    _errors.clear()
    return "; ".join(lines)


def init_once() -> None:
    """llama.cpp's backend, initialised once per process, with its log quiet."""
    global _initialised
    if not _initialised:
        ll.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _initialised = True


_SYSTEM_INFO = threading.Lock()


@functools.lru_cache(maxsize=1)
def system_info() -> str:
    """llama.cpp's build and CPU feature line (e.g. 'CPU : AVX2 = 1 | LLAMAFILE = 1 | ...'), read
    once: llama_print_system_info writes a static string, so two threads calling it at once (two
    requests' models' identities) garble it or corrupt the heap."""
    init_once()
    with _SYSTEM_INFO:
        return ll.llama_print_system_info().decode(errors="replace")


def bindings_version() -> str:
    """The llama-cpp-python version."""
    return ll.__version__


def llama_cpp_versions() -> str:
    """llama-cpp-python's version, and those of the llama.cpp it was built from as the libraries
    say (llama_version, ggml_version, ggml_commit: llama.cpp's commit when ggml is built inside it;
    the build number stays in llama.cpp's libcommon, which the bindings do not ship)."""
    from llama_cpp._ctypes_extensions import load_shared_library

    ggml = load_shared_library("ggml-base", ll.llama_cpp._base_path)
    said = {}
    for lib, name in ((ll.llama_cpp._lib, "llama_version"), (ggml, "ggml_version"), (ggml, "ggml_commit")):
        function = getattr(lib, name, None)
        if function is not None:
            function.restype, function.argtypes = ctypes.c_char_p, []
            said[name] = function().decode(errors="replace")
    parts = [f"{what} {said[name]}" for what, name in (("libllama", "llama_version"), ("ggml", "ggml_version"),
                                                       ("commit", "ggml_commit")) if name in said]
    return f"llama-cpp-python {bindings_version()}" + (f" ({', '.join(parts)})" if parts else "")


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


def flush_c_stdio() -> None:
    """Flush what llama.cpp printed with printf (before os._exit, which would lose it)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # pragma: no cover - Windows
        pass


# -- devices -------------------------------------------------------------------

DEV_CPU, DEV_GPU, DEV_IGPU = 0, 1, 2  # enum ggml_backend_dev_type
_ggml = None
_rpc_servers: dict[str, list[str]] = {}  # endpoint -> names of its devices, registered once
_abort_hook = None  # the ggml_set_abort_callback function, kept alive
_weight_bufts: list[str] | None = None  # weight_buffer_types(), once AMX is out
_ABORT_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)


def _lib():
    global _ggml
    if _ggml is None:
        from llama_cpp._ctypes_extensions import load_shared_library

        init_once()
        lib = load_shared_library("ggml", ll.llama_cpp._base_path)
        p, s, n = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        for name, restype, argtypes in (
                ("ggml_backend_dev_count", n, []), ("ggml_backend_dev_get", p, [n]),
                ("ggml_backend_dev_by_name", p, [s]), ("ggml_backend_dev_name", s, [p]),
                ("ggml_backend_dev_type", ctypes.c_int, [p]),
                ("ggml_backend_dev_backend_reg", p, [p]), ("ggml_backend_reg_name", s, [p]),
                ("ggml_backend_reg_by_name", p, [s]), ("ggml_backend_reg_get_proc_address", p, [p, s]),
                ("ggml_backend_reg_dev_count", n, [p]), ("ggml_backend_reg_dev_get", p, [p, n]),
                ("ggml_backend_register", None, [p]), ("ggml_set_abort_callback", p, [p]),
                ("ggml_backend_dev_buffer_type", p, [p]), ("ggml_backend_buft_name", s, [p])):
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


def max_devices() -> int:
    """llama.cpp's most devices a model splits over (-ts takes fewer values)."""
    return ll.llama_max_devices()


def cpu_devices() -> list[str]:
    return [name for name, (kind, _) in _devices().items() if kind == DEV_CPU]


def gpu_offload() -> bool:
    """Whether this machine has a GPU this build can offload layers to (Metal, CUDA, ...). Not
    llama_supports_gpu_offload(), which is true in every build with RPC compiled in."""
    return bool(offload_devices(remote=False))


def weight_buffer_types() -> list[str]:
    """The CPU backend's extra buffer types that llama.cpp may put weights in, before plain host
    memory ("CPU_REPACK", ...), read once. AMX is taken out of that list (llama.cpp's own,
    NULL-terminated, which only the weight loader reads): the pinned llama.cpp's AMX matmul
    crashes (SIGSEGV in ggml_backend_amx_mul_mat, loading an invalid tile configuration: llama.cpp
    issue 20824, pull request 26954) on the CPUs that have AMX (Intel Xeon since Sapphire Rapids)
    in any build compiled for them (-march=native). Repacking stays; no weight reaches AMX, so its
    kernels never run."""
    global _weight_bufts
    if _weight_bufts is None:
        lib, _weight_bufts = _lib(), []
        cpu = next((dev for dev in map(lib.ggml_backend_dev_get, range(lib.ggml_backend_dev_count()))
                    if lib.ggml_backend_dev_type(dev) == DEV_CPU), None)
        fn = cpu and lib.ggml_backend_reg_get_proc_address(lib.ggml_backend_dev_backend_reg(cpu),
                                                           b"ggml_backend_dev_get_extra_bufts")
        if fn:
            bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(cpu)
            _weight_bufts = drop_buffer_type(bufts, lambda buft: lib.ggml_backend_buft_name(buft).decode(), "AMX")
    return _weight_bufts


def drop_buffer_type(bufts, name_of, unwanted: str) -> list[str]:
    """Take the buffer type named `unwanted` out of the NULL-terminated array `bufts`, in place;
    the names of those left, in order."""
    items = []
    while bufts[len(items)]:
        items.append(bufts[len(items)])
    kept = [buft for buft in items if name_of(buft) != unwanted]
    for i, buft in enumerate([*kept, None]):
        bufts[i] = buft
    return [name_of(buft) for buft in kept]


def _device(name: str) -> int:
    dev = _lib().ggml_backend_dev_by_name(name.encode())
    if dev:
        return dev
    raise ModelError(f"no device {name!r} (available: {', '.join(_devices())})")


def buffer_types() -> dict[str, int]:
    """The buffer types -ot may name: each device's own, by name (as llama.cpp's
    parse_tensor_buffer_overrides lists them: "CPU", "CUDA0", "RPC0[127.0.0.1:50052]", ...)."""
    lib = _lib()
    out = {}
    for i in range(lib.ggml_backend_dev_count()):
        buft = lib.ggml_backend_dev_buffer_type(lib.ggml_backend_dev_get(i))
        if buft:
            out[lib.ggml_backend_buft_name(buft).decode()] = buft
    return out


class _Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def model_params(n_gpu_layers: int, devices: Sequence[str] | None, split_mode: str = "layer", main_gpu: int = 0,
                 tensor_split: Sequence[float] = (), load_mode: str = "auto",
                 overrides: Sequence[tuple[str, str]] = (), repack: bool = True):
    """Model parameters: n_gpu_layers (-1: llama.cpp's default); unless None, the devices for the
    offloaded layers (empty: none, the CPU keeps them); -sm, -mg, -ts, -lm, -nr; and the -ot overrides,
    (pattern, buffer type name) in order. What llama.cpp reads through pointers (the device list,
    the split, the overrides and their strings) is returned too, to be kept until the model has
    loaded."""
    mparams = ll.llama_model_default_params()
    weight_buffer_types()  # AMX out of the CPU's extra buffer types before any weight is placed
    if n_gpu_layers >= 0:
        mparams.n_gpu_layers = n_gpu_layers
    mparams.split_mode = SPLIT_MODES.index(split_mode)
    mparams.main_gpu = main_gpu
    mparams.load_mode = LOAD_MODES.index(load_mode) - 1  # llama_load_mode: auto is -1
    mparams.use_extra_bufts = repack  # llama.cpp's --no-repack: weights in plain host memory
    keep: list = []
    if devices is not None:  # NULL-terminated; llama.cpp's default selection may skip RPC devices
        devs = (ctypes.c_void_p * (len(devices) + 1))(*(_device(name) for name in devices), None)
        mparams.devices = ctypes.addressof(devs)
        keep.append(devs)
    if tensor_split:
        split = (ctypes.c_float * max_devices())(*tensor_split)
        mparams.tensor_split = split
        keep.append(split)
    if overrides:
        known = buffer_types()
        patterns = [pattern.encode() for pattern, _ in overrides]
        array = (_Override * (len(overrides) + 1))(  # NULL-terminated: a {NULL, NULL} entry
            *(_Override(pattern, known[buft]) for pattern, (_, buft) in zip(patterns, overrides)), _Override())
        mparams.tensor_buft_overrides = ctypes.addressof(array)
        keep += [array, patterns]
    return mparams, keep


def head_model_params(target):
    """Model parameters for a head that drafts beside `target` (a LlamaModel; an MTP head file,
    EAGLE-3, DFlash): its layers, devices, split and load mode, and the draft's -otd (llama.cpp
    gives its draft contexts the target's parameters but the draft's overrides); with what to
    keep alive."""
    spec = target.spec
    return model_params(target.n_gpu_layers, target.devices, spec.split_mode, spec.main_gpu, spec.tensor_split,
                        spec.load_mode, spec.head_overrides)


def placement(n_gpu_layers: int, devices: Sequence[str] | None) -> str:
    """Where a model's offloaded layers run: "cpu" (none offloaded), "rpc" (on RPC servers,
    whose hardware speculate cannot see: possibly a CPU) or "gpu" (this machine's GPUs).
    By the devices themselves, as llama.cpp picks them (devices None: every GPU and RPC device)."""
    used = offload_devices() if devices is None else devices
    if n_gpu_layers == 0 or not used:
        return "cpu"
    return "rpc" if any(_devices()[name][1] for name in used) else "gpu"


# -- ggml's RPC backend ---------------------------------------------------------

def require_rpc():
    """The RPC backend's registry entry; ModelError where this build has none."""
    reg = _lib().ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise ModelError("this llama.cpp build has no RPC support: reinstall llama-cpp-python built with "
                         'CMAKE_ARGS="-DGGML_RPC=on" (see docs/rpc.md)')
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


def rpc_endpoints() -> dict[str, str]:
    """The devices of the RPC servers registered so far: device name -> its server's endpoint."""
    return {name: endpoint for endpoint, names in _rpc_servers.items() for name in names}


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
