"""Drafters propose tokens for the target to verify.

Every drafter implements the contract in speculative/decoding/drafter.py (Draft, Outcome,
Drafter): propose up to k tokens, then hear how many the target kept.

  model.py        a small draft model (its greedy or sampled continuation)
  head.py         a head drafting from the target's hidden states, token by token (NextN
                  layers, an MTP head file, EAGLE-3)
  block.py        DFlash and DSpark: a block of tokens drafted in one decode
  ngram.py        n-gram lookup in the prompt and output: no model at all
  ngram_mod.py    llama.cpp's ngram-mod: a hash table of n-grams, shared by requests
  ngram_map.py    llama.cpp's ngram-map-k4v: up to four continuations per n-gram, counted
  ngram_cache.py  llama.cpp's ngram-cache (llama-lookup): context, dynamic and static
                  n-gram statistics
  lookup_cache.py its -lcs/-lcd files, read and written as llama.cpp's lookup tools do
  forced.py       what a grammar forces next (--spec-type forced)
  chain.py        several drafters tried in order
  auto.py         the cost-aware choice among them (`--spec-type auto`)
  pool.py         ngram-pool: n-gram lookup in what earlier runs wrote (--spec-pool)
  registry.py     the drafter types, each declared once: name, settings, flags, needs,
                  builder, auto's prior
"""

import importlib

# the drafters' classes, imported when first asked for: the registry (names, flags, help) is read
# by --help and the flags' checks, which answer without numpy
_EXPORTS = {"Chain": "chain", "ForcedDrafter": "forced", "ModelDrafter": "model", "top_probability": "model",
            "TokenHeadDrafter": "head", "NgramMapK": "ngram", "NgramSimple": "ngram", "LookupFiles": "ngram_cache",
            "NgramCache": "ngram_cache", "NgramMapK4v": "ngram_map", "ModTable": "ngram_mod", "NgramMod": "ngram_mod"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
