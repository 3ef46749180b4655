"""Model files: which model a name means, getting it, and checking it before llama.cpp loads it.

  registry.py   models.toml: names, aliases, defaults
  pull.py       fetching a registry model (verified by sha256)
  hub.py        -hf: files from Hugging Face repositories
  gguf_meta.py  reading GGUF metadata and the preflight checks on a file
  vocab.py      a target and draft share a vocabulary (llama.cpp's rule)
"""
