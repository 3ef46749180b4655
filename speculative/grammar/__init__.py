"""Grammars and JSON schemas, as text. Pure Python; no model is needed to check either.

  gbnf.py         GBNF checked ahead of llama.cpp's parser, which names no place when it refuses
  json_schema.py  JSON Schema turned into GBNF exactly as the pinned llama.cpp turns it
  given.py        the grammar a run or a request is constrained by, however it was given
"""
