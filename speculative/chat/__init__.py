"""Chat beyond plain text: tool calls and reasoning, read from what a model writes and held to
the request's tools by a grammar, as the pinned llama.cpp's common/chat.cpp does.

  message.py     the assistant's message (content, reasoning, tool calls) and its stream of deltas
  format.py      what one template family's format is: its parser, its tool grammar, its triggers
  formats/       the families, and which one a template uses (formats.detect)
  request.py     what a chat request asks of its answer's format: family, reading, call grammar
"""
