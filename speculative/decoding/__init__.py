"""The algorithm: the draft/verify loop and what it is made of, with no llama.cpp in it.

  loop.py      generate(): prefill, then draft, verify and roll back, step by step, as events
  drafter.py   the drafter contract (Draft, Outcome, Drafter, DecodingDrafter)
  verify.py    the acceptance rules: greedy match and rejection sampling
  tree.py      draft trees: parents, attention masks, paths
  sampling.py  the target's sampler chain (llama.cpp's order), in numpy
  constraint.py  generation under a grammar: the tokens it admits, exactly
  cache.py     one model's KV cache: what it holds, and rollback
  scheduler.py  every running request's decodes of one model in one batch per tick
  backend.py   the small interface a model implements (the loop's only view of llama.cpp),
               and the decodes a step yields (Decode, HeadDecode)
  events.py    what the loop yields
  stats.py     the statistics those events add up to
  settings.py  the settings every layer reads (sampling, speculation, models)
"""
