"""Drafters propose tokens for the target to verify.

Every drafter implements the contract in speculative/decoding/drafter.py (Draft, Outcome,
Drafter): propose up to k tokens, then hear how many the target kept.

  model.py        a small draft model (its greedy or sampled continuation)
  mtp.py          the target's own NextN (MTP) layers
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
  replay.py       auto's plans replayed over recorded runs (scripts/replay_auto.py)
"""

from speculative.drafters.chain import Chain
from speculative.drafters.forced import ForcedDrafter
from speculative.drafters.model import ModelDrafter, top_probability
from speculative.drafters.mtp import MtpDrafter
from speculative.drafters.ngram import NgramMapK, NgramSimple
from speculative.drafters.ngram_cache import LookupFiles, NgramCache
from speculative.drafters.ngram_map import NgramMapK4v
from speculative.drafters.ngram_mod import ModTable, NgramMod

__all__ = ["ModelDrafter", "MtpDrafter", "NgramSimple", "NgramMapK", "NgramMapK4v",
           "NgramMod", "ModTable", "NgramCache", "LookupFiles", "Chain", "ForcedDrafter", "top_probability"]
