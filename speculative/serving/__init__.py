"""Many requests: `speculate serve` (HTTP) and `speculate batch` (a JSONL file).

  app.py         the HTTP app: routes, request checks, streaming
  worker.py      the engine behind a bounded queue
  generation.py  the neutral request both APIs read into, its errors, the refusal of unsupported fields
  openai_api.py  OpenAI-compatible /v1 endpoints
  llama_api.py   llama-server's own endpoints (/completion, /infill, ...)
  anthropic_api.py  Anthropic's /v1/messages and count_tokens, translated to and from chat
  responses_api.py  OpenAI's /v1/responses and input_tokens, translated to and from chat
  access.py      who may use the server: API keys, Host and CORS checks, before anything runs
  gcp.py         Google Cloud's Vertex AI prediction contract (AIP_MODE=PREDICTION)
  batch.py       speculate batch: requests in, results out, resumable
"""
