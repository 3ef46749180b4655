"""The llama.cpp binding: the only package that imports llama_cpp.

  model.py      LlamaModel: one model and its context, the backend the loop talks to
  nextn.py      the NextN (MTP) helpers llama-cpp-python binds from llama-ext.h
  rpc.py        llama.cpp's RPC servers as devices
  interrupt.py  Ctrl-C inside llama_decode: llama.cpp's abort callback
  doctor.py     the doctor's probe: is this build exact (batch-invariant)?
"""
