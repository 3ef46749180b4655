"""The llama.cpp binding: the only package that imports llama_cpp.

  model.py      LlamaModel: one model and its context, the backend the loop talks to
  load.py       a model file's checks before llama.cpp sees it, its weights, its LoRA adapters
  tokenizer.py  Tokenizer: a model's vocabulary (tokens, their text, the special tokens)
  decode.py     the decode path LlamaModel and MtpHead share: context parameters, Batch, Context,
                and the one thread every llama_decode runs on
  mtp.py        MtpHead: a model's NextN (MTP) layers in a context of their own
  identity.py   what calibrations and the prompt cache recognise a model by
  devices.py    llama.cpp in this process (init, system info) and ggml's devices and RPC backend
  nextn.py      the target's NextN rows, kept for the MTP head
  rpc.py        --rpc endpoints checked before ggml sees them; ggml's aborts as one line
  interrupt.py  Ctrl-C and SIGTERM, also inside a long llama_decode (decode.py's abort callback polls it)
  doctor.py     the doctor's probe: is this build exact (batch-invariant)?
"""
