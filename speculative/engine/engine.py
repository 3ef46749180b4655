"""A target and an optional draft, loaded once, ready to run prompts.

This is what the command line, `bench`, `batch` and `serve` build on: it checks
the pair's vocabularies before loading any weights, loads both models, turns a
prompt into tokens (optionally through the model's chat template), and runs the
loop. Between runs the caches (cache.py) keep what they hold: a prompt that starts
like the previous conversation (the same system prompt, document, or chat so far) only
processes what is new. The drafter each run asks for is built by factory.py, which keeps
what llama.cpp's n-gram drafters keep between requests; the prompt cache file and the RAM
cache (--prompt-cache, --cache-ram) are persist.py's, called around each run.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Callable, Iterator

from speculative.decoding import scheduler
from speculative.decoding.backend import NEEDS
from speculative.decoding.cache import Cache, HeadCache
from speculative.decoding.constraint import Constraint
from speculative.decoding.drafter import Drafter
from speculative.decoding.events import Event, Prefilled, PromptCache, Token
from speculative.decoding.loop import generate
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import (POOL_TOKENS, ModelSpec, SamplerSettings, SpecSettings, acceptance,
                                           check_prompt)
from speculative.drafters.pool import Pool, PoolFile, fingerprint
from speculative.engine import calibrate, chat
from speculative.engine.costs import CostBook, ModelCosts
from speculative.engine.factory import DrafterFactory
from speculative.engine.persist import CachePersistence
from speculative.errors import ModelError, UsageError
from speculative.llamacpp.model import LlamaModel
from speculative.models.vocab import Vocab, check_compatible, read_vocab


DRAFT_SEED_OFFSET = 0x9E3779B9  # the draft samples from its own random stream, derived from --seed
SAVE_COSTS_EVERY = 60.0  # seconds: what passes cost is saved after a run at most this often (and at close)


# A recurrent target keeps a snapshot of its state per draftable token (llama.cpp's n_rs_seq),
# each a whole unquantised copy of it (hundreds of MiB for a large hybrid): drafts longer than
# this roll back from a checkpoint instead (cache.py), which auto plans with (auto.Rewind).
MAX_SNAPSHOTS = 8

class Engine:
    def __init__(self, target: ModelSpec, draft: ModelSpec | None = None,
                 notify: Callable[[str], None] | None = None, prompt_cache_file: Path | None = None,
                 prompt_cache_ro: bool = False, pool_tokens: int = POOL_TOKENS, pool_file: Path | None = None,
                 cache_ram_mib: int = 0, progress: Callable[[str], None] | None = None):
        """`notify` hears lasting notices (a calibration measured, a cache file ignored);
        `progress` what a long step does now (loading a model, measuring costs), each call
        replacing the last: the command line draws it as a status line (cli/progress.py)."""
        self.progress = progress or (lambda text: None)
        target_vocab = functools.cache(lambda: read_vocab(target.path))  # read when needed, once
        for other in (draft.path if draft else None, target.mtp_sidecar, target.feature_drafter):
            if other is not None and other.resolve() != target.path.resolve():
                check_compatible(target_vocab(), read_vocab(other))
        t0 = time.perf_counter()
        self.progress(f"loading {target.name}")
        self.target = _load(target)
        self.draft = None
        try:
            if draft is not None:
                self.progress(f"loading the draft model {draft.name}")
                self.draft = _load(draft)
            # The head that drafts from the target's hidden states (its own NextN layers, an MTP head
            # file's, or an EAGLE-3, DFlash or DSpark drafter): its cache, kept between runs too.
            head = (self.target.tap.feature_head(target.feature_drafter) if target.feature_drafter else
                    self.target.tap.mtp_head(target.mtp_sidecar) if target.mtp_sidecar or self.target.nextn_layers
                    else None)
            self.head_cache = HeadCache(head) if head is not None else None
        except BaseException:
            self._close_models()
            raise
        self.t_load = time.perf_counter() - t0
        self.jinja = target.jinja  # chats through the Jinja template, else llama.cpp's formats (--no-jinja)
        # Each model's cache, kept between runs: a prompt that starts like the last one keeps that prefix.
        self.caches = {"target": Cache(self.target), **({"draft": Cache(self.draft)} if self.draft else {})}
        self.notify = notify
        self.drafter: Drafter | None = None  # the drafter of the latest run
        # what every pass costs here, learnt as they run (costs.py), and saved now and then
        self.book = CostBook()
        for model in (self.target, self.draft):
            if model is not None:
                model.on_pass = functools.partial(self.book.model(model.identity()).record, unified=model.kv_unified)
        self._saved_at = time.monotonic()
        self.persist = CachePersistence(self.caches, self.head_cache, notify, prompt_cache_file, prompt_cache_ro,
                                        cache_ram_mib)
        self._whole_prompt = False  # forget() was called: the next run keeps and restores nothing
        # What earlier runs wrote (pool.py): learnt after each run while `learn` is set (bench
        # clears it so no run drafts from its own configuration's earlier output).
        self.pool = Pool(max_tokens=pool_tokens) if pool_tokens > 0 else None
        self.learn = True
        self.pool_file = self._open_pool_file(pool_file, target_vocab) if self.pool is not None else None
        self.factory = DrafterFactory(self.caches, self.head_cache, self.pool, self.costs, _largest_batch(self.target),
                                      notify, pool_asked=pool_file is not None)
        self._owner = True  # it loaded the models (a slot's engine does not: parallel.SlotEngine)
        # False once its models serve requests at once (share, parallel.py): measuring costs would
        # decode into the sequences of requests running, so what was measured before is what there is
        self.may_measure = True

    def _open_pool_file(self, path: Path | None, target_vocab: Callable[[], Vocab]) -> PoolFile | None:
        """--spec-pool FILE, read into the pool now (None without one)."""
        if path is None:
            return None
        vocab = target_vocab()
        pool_file = PoolFile(path, fingerprint(vocab.tokens, vocab.type, vocab.bos, vocab.eos),
                             self.notify or (lambda message: None))
        pool_file.load(self.pool)
        return pool_file

    def prompt_tokens(self, text: str, use_chat: bool = False, system: str | None = None) -> list[int]:
        if use_chat:
            return self.chat_tokens(chat.conversation(text, system))
        return self.target.tokenize(text, add_special=True)

    def chat_tokens(self, messages: list[dict], tools: list[dict] | None = None,
                    extra: dict | None = None) -> list[int]:
        """A conversation through the target's chat template (its own, or --chat-template's), ready for
        the reply; `tools` and `extra` variables for the template (chat.render's)."""
        rendered, bos = self.chat_text(messages, tools, extra), self.target.special_text("bos")
        has_bos = bool(bos) and self.target.add_bos and rendered.startswith(bos)  # the template wrote it: not twice
        return self.target.tokenize(rendered, add_special=not has_bos)

    def chat_text(self, messages: list[dict], tools: list[dict] | None = None, extra: dict | None = None) -> str:
        if not (template := self.target.chat_template()):
            raise ModelError(f"{self.target.name} has no chat template, which --chat and -sys need "
                             "(give one with --chat-template)")
        return chat.format_chat(template, messages, self.jinja, *map(self.target.special_text, ("bos", "eos")),
                                tools, extra)

    def run(self, prompt: list[int], sampling: SamplerSettings, spec: SpecSettings,
            seed: int, carry: bool = False) -> Iterator[Event]:
        """Generate from `prompt`: the loop's events, and PromptCache after Prefilled when a
        prompt cache file is used. The longest prefix of the prompt that the caches still
        hold from the previous run is not processed again (stream.py turns this into text
        and statistics). `carry`: the run continues the previous one (a conversation's next
        turn), whose auto's estimates it starts from instead of the priors. Its decodes run
        alone, through a scheduler of its own (scheduler.run_alone)."""
        return scheduler.run_alone(self.running(prompt, sampling, spec, seed, carry))

    def running(self, prompt: list[int], sampling: SamplerSettings, spec: SpecSettings,
                seed: int, carry: bool = False) -> Iterator[Event]:
        """`run` as work: its events, and the decodes it needs, for the scheduler to run."""
        whole_prompt, self._whole_prompt = self._whole_prompt, False
        check_prompt(prompt, self.target.n_ctx, spec.n_predict)  # before any calibration
        rule = acceptance(sampling, spec)
        banned = self.target.eog_tokens() if spec.ignore_eos else None
        constraint = (Constraint(self.target.grammar(sampling.grammar, sampling.grammar_triggers))
                      if sampling.grammar else None)
        make = functools.partial(self.factory.make, spec, self._draft_sampler(sampling, spec, seed, rule), constraint)
        self.drafter = make(self.drafter if carry else None)  # may calibrate; make(old) after a context shift
        restored = self.persist.restore_pending
        t_restore = self.persist.restore_file() if restored else 0.0
        t_swap = self.persist.swap_ram(prompt) if not whole_prompt else 0.0
        context = list(prompt)
        try:
            for event in generate(self.caches["target"], prompt, Sampler(sampling, seed, banned, self.target), spec,
                                  self.drafter, constraint, make):
                if isinstance(event, NEEDS):  # the scheduler's to run
                    yield event
                    continue
                if isinstance(event, Token):
                    context.append(event.id)
                elif isinstance(event, Prefilled) and t_swap:  # part of processing this prompt
                    event = dataclasses.replace(event, seconds=event.seconds + t_swap)
                yield event
                if isinstance(event, Prefilled) and self.persist.file is not None:
                    # restored: the caches held nothing else before
                    yield PromptCache(event.n_cached if restored else 0, t_restore, self.persist.save_file())
        finally:  # whatever ended the run (a stop string, a client gone): what it generated is text
            self._after_run(context, len(prompt))

    def _draft_sampler(self, sampling: SamplerSettings, spec: SpecSettings, seed: int, rule: str) -> Sampler | None:
        """What the draft model or MTP head samples its drafts with for speculative sampling
        (None: it drafts greedily)."""
        if (self.draft is None and self.head_cache is None) or rule != "rejection":
            return None
        drafting = self.draft or self.target
        return Sampler(sampling, (seed + DRAFT_SEED_OFFSET) % 2**32, drafting.eog_tokens() if spec.ignore_eos else None,
                       drafting)

    def _after_run(self, context: list[int], n_prompt: int) -> None:
        """The drafter and the pool learn what the run generated; what its passes cost is saved now
        and then."""
        if self.drafter is not None:
            self.drafter.finish(context)
        if self.pool is not None and self.learn:
            self.pool.add(context[n_prompt:])
        if time.monotonic() - self._saved_at > SAVE_COSTS_EVERY:
            self._saved_at = time.monotonic()
            self.book.save()

    def forget(self) -> None:
        """Empty the caches: the next run processes its whole prompt, restoring nothing from
        the RAM cache either (llama-server's `cache_prompt: false`). As llama-server does, the
        conversation the caches held is saved in the RAM cache first, for a later request
        that continues it."""
        self.persist.keep()
        self._whole_prompt = True
        for cache in self.caches.values():
            cache.forget()
        if self.head_cache is not None:
            self.head_cache.forget()

    def share(self) -> None:
        """Its models serve requests at once from now on (engine/parallel.py): its caches, slot 0's
        sequences, are emptied for the slots, and it measures no more costs (that would decode
        into the sequences of requests running)."""
        self.forget()
        self.may_measure = False
        for model in (self.target, self.draft):
            if model is not None:
                model.clear()

    def notes(self) -> list[str]:
        """What the latest run's drafter has to say about it (why auto declined a drafter)."""
        summary = getattr(self.drafter, "summary", None)
        return summary() if summary else []

    def plan_seconds(self) -> float:
        """What auto itself spent planning and scoring in the latest run (0 for fixed drafters)."""
        return getattr(self.drafter, "t_plan", 0.0)

    def costs(self, role: str, max_batch: int, sequences: int = 1) -> list[float]:
        """What auto prices a pass of a model ("target", "draft", or "mtp": the head drafting from the
        target's hidden states) at, in seconds, for b = 1..max_batch tokens of one request, and one of
        each of sequences - 1 others. From the book of costs (costs.py), calibrated first where it
        lacks sizes, unless requests run on the model (may_measure): then [] if nothing was timed."""
        model = self.head_cache.head if role == "mtp" else self.caches[role].model
        costs = self._model_costs(role)
        max_batch = min(max_batch, _largest_batch(model) - (sequences - 1))
        sizes = calibrate.target_sizes(max_batch) if role == "target" else sorted({1, max_batch})
        missing = sorted(set(sizes) - set(costs.measured()))
        if missing and self.may_measure:
            self._calibrate(role, model, costs, sorted({1, *missing}))
        if costs.seconds() is None:
            return []
        unified = getattr(model, "kv_unified", True) and not getattr(model, "recurrent", False)
        return [costs.price(b + sequences - 1, sequences, unified) for b in range(1, max_batch + 1)]

    def _model_costs(self, role: str) -> ModelCosts:
        """The book's entry of a role's model (a head's: its file, or the target's NextN layers,
        beside the target it reads)."""
        if role != "mtp":
            return self.book.model(self.caches[role].model.identity())
        head = self.head_cache.head
        own = head.file or {"nextn": True}  # its file, by content; or the target's NextN layers
        return self.book.model({**self.target.identity(), "head": own})

    def _calibrate(self, role: str, model, costs: ModelCosts, sizes: list[int]) -> None:
        """Time a model's passes of these sizes into the book (calibrate.into), its own passes
        meanwhile not recorded as live ones."""
        measure = calibrate.measure_mtp if role == "mtp" else calibrate.measure
        cache = self.head_cache if role == "mtp" else self.caches[role]
        hook, model.on_pass = getattr(model, "on_pass", None), None
        try:
            calibrate.into(costs, model.name, lambda sizes, report: measure(cache, sizes, report), sizes,
                           self.notify, self.progress)
        finally:
            model.on_pass = hook
        self.book.save()

    def busy_seconds(self) -> float:
        """Seconds both models have spent inside llama.cpp so far."""
        heads = (self.head_cache.head,) if self.head_cache is not None else ()
        return sum(m.busy_seconds for m in (self.target, self.draft, *heads) if m is not None)

    def close(self) -> None:
        if not self._owner:
            return
        self.book.save()
        if self.pool_file is not None:
            try:
                self.pool_file.save(self.pool)
            except OSError as e:  # a full disk: the pool is a cache, the run's output is what matters
                self.pool_file.notice(f"--spec-pool {self.pool_file.path}: not written: {e.strerror or e}")
        self.factory.close()
        self._close_models()

    def _close_models(self) -> None:
        for model in (self.draft, self.target):
            if model is not None:
                model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _largest_batch(model: LlamaModel) -> int:
    """The largest batch a step can send: -b, and the context less the prompt's first token."""
    return max(1, min(model.n_batch, model.n_ctx - 1))


def _load(spec: ModelSpec) -> LlamaModel:
    model = LlamaModel(spec)
    if model.recurrent and spec.n_seq > 1:
        model.close()
        raise UsageError(f"{spec.n_seq} draft branches (-np): {spec.name} ({model.arch}) keeps a recurrent "
                         "state, which cannot be forked into branches; draft chains only (-np 1)")
    return model
