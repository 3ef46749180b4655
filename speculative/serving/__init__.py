"""Many requests: `speculate serve` (HTTP) and `speculate batch` (a JSONL file).

  app.py         the HTTP app: routes, request checks, streaming
  worker.py      the engine behind a bounded queue
  generation.py  the neutral request both APIs read into, its errors, the refusal of unsupported fields
  openai_api.py  OpenAI-compatible /v1 endpoints
  llama_api.py   llama-server's own endpoints (/completion, /infill, ...)
  batch.py       speculate batch: requests in, results out, resumable
"""
