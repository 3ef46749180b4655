"""The llama.cpp binding: the only package that imports llama_cpp.

  model.py      LlamaModel: one model and its context, the backend the loop talks to
  memory.py     the KV cache's sequences, a SlotSequences per slot: rolled back, forked into
                branches, saved and restored
  slots.py      one model shared by requests at once (-np): a slot's sequences, one batch for all
  load.py       a model file's checks before llama.cpp sees it, its weights, its LoRA adapters
  tokenizer.py  Tokenizer: a model's vocabulary (tokens, their text, the special tokens)
  templates.py  llama.cpp's built-in chat formats (--no-jinja, --chat-template NAME)
  grammar.py    llama.cpp's grammar sampler, asked which tokens a grammar admits
  decode.py     the decode path LlamaModel and the heads share: context parameters, Batch, Context,
                and the one thread every llama_decode runs on
  head.py       HeadContext: what every drafting head's context shares (a token and a row an entry)
  mtp.py        MtpHead: a model's NextN (MTP) layers in a context of their own
  heads.py      Tap: the target's hidden rows kept per slot for the head it makes (NextN layers, an
                MTP head file, EAGLE-3, DFlash, DSpark)
  eagle3.py     the EAGLE-3 drafter of its own file, run as common/speculative.cpp runs it
  dflash.py     DFlash and DSpark drafters: a block of tokens drafted in one decode
  features.py   what the drafters reading the target's layer inputs need of it, checked first
  ext.py        llama.cpp's src/llama-ext.h functions (hidden states), bound once
  identity.py   what calibrations and the prompt cache recognise a model by
  devices.py    llama.cpp in this process (init, system info) and ggml's devices and RPC backend
  nextn.py      the target's NextN rows, kept for the MTP head
  rpc.py        --rpc endpoints checked before ggml sees them; ggml's aborts as one line
  interrupt.py  Ctrl-C and SIGTERM, also inside a long llama_decode (decode.py's abort callback polls it)
  doctor.py     the doctor's probe: is this build exact (batch-invariant)?
"""
