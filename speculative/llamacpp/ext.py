"""The functions of llama.cpp's `src/llama-ext.h` that the hidden-state drafters use (the MTP
head, EAGLE-3), bound here once.

`libllama` exports them with C++ linkage: each is looked up by its plain name, then its
Itanium name (Linux, macOS: what a build here exports, checked by tests/test_llamacpp.py),
then its MSVC name (Windows; derived by MSVC's mangling rules, not tried on a Windows build).
A symbol is looked up when first called, never at import: a build that lacks one fails only
the drafter that needs it, in one line (ModelError, exit 3).
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as ll

from speculative.errors import ModelError

_ctx = ll.llama_context_p_ctypes
_model = ll.llama_model_p_ctypes
_floats = ctypes.POINTER(ctypes.c_float)


class _Function:
    """A llama-ext.h function: its names (plain, Itanium, MSVC), argument and result types."""

    def __init__(self, name: str, itanium: str, msvc: str, argtypes: list[Any], restype: Any):
        self.name, self.names = name, (name, itanium, msvc)
        self.argtypes, self.restype = argtypes, restype
        self._func = None

    def resolve(self):
        """The bound function; ModelError when this build of llama.cpp exports none of its names."""
        if self._func is None:
            lib = ll.llama_cpp._lib
            func = next((getattr(lib, n) for n in self.names if hasattr(lib, n)), None)
            if func is None:
                raise ModelError(f"this build of llama.cpp (llama-cpp-python {ll.__version__}) lacks {self.name} "
                                 f"(none of {', '.join(self.names)} is exported by libllama)")
            func.argtypes, func.restype = self.argtypes, self.restype
            self._func = func
        return self._func

    def __call__(self, *args):
        return self.resolve()(*args)


# void llama_set_embeddings_nextn(llama_context *, bool value, bool masked)
set_embeddings_nextn = _Function("llama_set_embeddings_nextn", "_Z26llama_set_embeddings_nextnP13llama_contextbb",
                           "?llama_set_embeddings_nextn@@YAXPEAUllama_context@@_N1@Z",
                           [_ctx, ctypes.c_bool, ctypes.c_bool], None)
# float * llama_get_embeddings_nextn(llama_context *)
get_embeddings_nextn = _Function("llama_get_embeddings_nextn", "_Z26llama_get_embeddings_nextnP13llama_context",
                           "?llama_get_embeddings_nextn@@YAPEAMPEAUllama_context@@@Z", [_ctx], _floats)
# float * llama_get_embeddings_nextn_ith(llama_context *, int32_t i)
get_embeddings_nextn_ith = _Function("llama_get_embeddings_nextn_ith", "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                               "?llama_get_embeddings_nextn_ith@@YAPEAMPEAUllama_context@@H@Z",
                               [_ctx, ctypes.c_int32], _floats)
# void llama_set_nextn_layer_offset(llama_context *, int32_t offset)
set_nextn_layer_offset = _Function("llama_set_nextn_layer_offset", "_Z28llama_set_nextn_layer_offsetP13llama_contexti",
                             "?llama_set_nextn_layer_offset@@YAXPEAUllama_context@@H@Z", [_ctx, ctypes.c_int32], None)
# void llama_set_embeddings_layer_inp(llama_context *, uint32_t lid, bool value)
set_embeddings_layer_inp = _Function("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                               "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z",
                               [_ctx, ctypes.c_uint32, ctypes.c_bool], None)
# float * llama_get_embeddings_layer_inp(llama_context *, uint32_t lid)
get_embeddings_layer_inp = _Function("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                               "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z",
                               [_ctx, ctypes.c_uint32], _floats)
# llama_context * llama_get_ctx_other(llama_context *)
get_ctx_other = _Function("llama_get_ctx_other", "_Z19llama_get_ctx_otherP13llama_context",
                    "?llama_get_ctx_other@@YAPEAUllama_context@@PEAU1@@Z", [_ctx], _ctx)
# const int32_t * llama_model_target_layer_ids(const llama_model *)
model_target_layer_ids = _Function("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model",
                             "?llama_model_target_layer_ids@@YAPEBHPEBUllama_model@@@Z", [_model],
                             ctypes.POINTER(ctypes.c_int32))
# uint32_t llama_model_target_layer_ids_n(const llama_model *)
model_target_layer_ids_n = _Function("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model",
                               "?llama_model_target_layer_ids_n@@YAIPEBUllama_model@@@Z", [_model], ctypes.c_uint32)
# int32_t llama_model_dflash_selector_top_k(const llama_model *)
model_dflash_selector_top_k = _Function("llama_model_dflash_selector_top_k",
                                  "_Z33llama_model_dflash_selector_top_kPK11llama_model",
                                  "?llama_model_dflash_selector_top_k@@YAHPEBUllama_model@@@Z", [_model], ctypes.c_int32)
# uint32_t llama_model_get_tok_embd(const llama_model *, float * out)
model_get_tok_embd = _Function("llama_model_get_tok_embd", "_Z24llama_model_get_tok_embdPK11llama_modelPf",
                         "?llama_model_get_tok_embd@@YAIPEBUllama_model@@PEAM@Z", [_model, _floats], ctypes.c_uint32)

FUNCTIONS = (set_embeddings_nextn, get_embeddings_nextn, get_embeddings_nextn_ith, set_nextn_layer_offset,
             set_embeddings_layer_inp, get_embeddings_layer_inp, get_ctx_other, model_target_layer_ids,
             model_target_layer_ids_n, model_dflash_selector_top_k, model_get_tok_embd)
# What each drafter needs: resolved before it loads anything, so a build without one says so first.
NEEDS = {
    "draft-mtp": (set_embeddings_nextn, get_embeddings_nextn, get_embeddings_nextn_ith),
    **{kind: (set_embeddings_nextn, get_embeddings_nextn, set_embeddings_layer_inp, get_embeddings_layer_inp,
              model_target_layer_ids, model_target_layer_ids_n, model_dflash_selector_top_k)
       for kind in ("draft-dflash", "draft-dspark")},
    "draft-eagle3": (set_embeddings_nextn, get_embeddings_nextn, get_embeddings_nextn_ith, set_embeddings_layer_inp,
                     get_embeddings_layer_inp, model_target_layer_ids, model_target_layer_ids_n),
}


def require(spec_type: str) -> None:
    """ModelError (exit 3) unless this build exports every function drafter `spec_type` needs."""
    for function in NEEDS.get(spec_type, ()):
        try:
            function.resolve()
        except ModelError as e:
            raise ModelError(f"--spec-type {spec_type}: {e}") from None
