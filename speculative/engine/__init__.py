"""Running prompts on loaded models: what every command builds on.

  engine.py        Engine: load a target (and draft), turn prompts into tokens, run the loop
  parallel.py      many requests at once on one engine's models (-np): a slot each
  factory.py       the drafter a run asks for, built by its --spec-type names
  persist.py       the prompt cache file and --cache-ram around each run
  stream.py        the loop's events as text pieces and statistics
  text.py          tokens to text, stop strings
  chat.py          chat templates
  conversation.py  a conversation with the target: its messages, each turn run on the engine
  prompt_cache.py  the --prompt-cache file
  ram_cache.py     --cache-ram: conversations kept in host memory
  costs.py         what a model's passes cost on this machine, learnt as runs go (auto's prices)
  calibrate.py     the short calibration of what the book of costs lacks
  bench.py         speculate bench: configurations over a prompt set
"""
