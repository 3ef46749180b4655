"""A target and an optional draft, loaded once, ready to run prompts.

This is what the command line (and later bench/serve/batch) builds on: it checks
the pair's vocabularies before loading any weights, loads both models, turns a
prompt into tokens (optionally through the model's chat template), and runs the
loop with fresh caches each time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from . import chat
from .drafters import ModelDrafter
from .errors import ModelError
from .llamacpp import LlamaModel
from .loop import Event, SpecSettings, generate
from .sampling import Sampler, SamplerSettings
from .vocab import check_compatible, read_vocab


@dataclass(frozen=True)
class ModelSpec:
    path: Path
    name: str
    n_ctx: int = 4096
    n_batch: int = 2048
    n_gpu_layers: int = -1
    n_threads: int | None = None


class Engine:
    def __init__(self, target: ModelSpec, draft: ModelSpec | None = None):
        if draft is not None and draft.path.resolve() != target.path.resolve():
            check_compatible(read_vocab(target.path), read_vocab(draft.path))
        t0 = time.perf_counter()
        self.target = _load(target)
        self.draft = None
        try:
            self.draft = _load(draft) if draft is not None else None
        except BaseException:
            self.target.close()
            raise
        self.t_load = time.perf_counter() - t0

    def prompt_tokens(self, text: str, use_chat: bool = False, system: str | None = None) -> list[int]:
        if not use_chat:
            return self.target.tokenize(text, add_special=True)
        template = self.target.chat_template()
        if not template:
            raise ModelError(f"{self.target.name} has no chat template; run without --chat")
        bos = self.target.special_text("bos")
        rendered = chat.render(template, chat.conversation(text, system),
                               bos_token=bos, eos_token=self.target.special_text("eos"))
        # A template that writes BOS itself must not get a second one from the tokenizer.
        has_bos = bool(bos) and self.target.add_bos and rendered.startswith(bos)
        return self.target.tokenize(rendered, add_special=not has_bos)

    def run(self, prompt: list[int], sampling: SamplerSettings, spec: SpecSettings, seed: int,
            use_draft: bool = True) -> Iterator[Event]:
        """Generate from `prompt` with empty caches; yields the loop's events."""
        self.target.trim(0)
        drafter = None
        if use_draft and self.draft is not None:
            self.draft.trim(0)
            drafter = ModelDrafter(self.draft, p_min=spec.draft_p_min)
        banned = self.target.eog_tokens() if spec.ignore_eos else None
        return generate(self.target, prompt, Sampler(sampling, seed, banned), spec, drafter)

    def close(self) -> None:
        for model in (self.draft, self.target):
            if model is not None:
                model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _load(spec: ModelSpec) -> LlamaModel:
    return LlamaModel(spec.path, name=spec.name, n_ctx=spec.n_ctx, n_batch=spec.n_batch,
                      n_gpu_layers=spec.n_gpu_layers, n_threads=spec.n_threads)
