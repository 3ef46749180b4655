"""Grammars and JSON schemas, as text: GBNF checked ahead of llama.cpp's parser (gbnf.py) and JSON
Schema turned into GBNF (json_schema.py). Pure Python; no model is needed to check either."""
