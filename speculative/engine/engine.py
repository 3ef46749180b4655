"""A target and an optional draft, loaded once, ready to run prompts.

This is what the command line, `bench`, `batch` and `serve` build on: it checks
the pair's vocabularies before loading any weights, loads both models, turns a
prompt into tokens (optionally through the model's chat template), and runs the
loop. Between runs the caches (cache.py) keep what they hold: a prompt that starts
like the previous conversation (the same system prompt, document, or chat so far) only
processes what is new. With a prompt cache file (--prompt-cache), the first run
starts from the caches a previous process saved there, and every run saves its
prompt's caches for the next process. With a RAM cache (--cache-ram, ram_cache.py), a
prompt that would cut the caches saves them in host memory first, and one that an earlier
saved conversation continues better restores that. What llama.cpp's n-gram drafters keep between
requests is kept here too: ngram-mod's hash table, and ngram-cache's -lcs/-lcd files
(read once; -lcd written back, with what the requests learned, when the engine closes).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from speculative.engine import calibrate, chat, prompt_cache, ram_cache
from speculative.drafters.auto import Auto, Rewind
from speculative.decoding.cache import Cache, MtpCache
from speculative.drafters import (Chain, LookupFiles, ModelDrafter, ModTable, MtpDrafter, NgramCache, NgramMapK, NgramMapK4v, NgramMod, NgramSimple)
from speculative.decoding.drafter import Drafter
from speculative.errors import GenerationError, ModelError, UsageError
from speculative.decoding.events import Event, Prefilled, PromptCache, Token
from speculative.llamacpp.model import LlamaModel
from speculative.decoding.loop import generate
from speculative.drafters.pool import Pool, PoolDrafter, PoolFile, fingerprint
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import (POOL_TOKENS, ModelSpec, SamplerSettings, SpecSettings, acceptance, check_prompt)
from speculative.models.vocab import check_compatible, read_vocab


NEXTN_ROLE = "target-nextn"  # the prompt cache part of the target's NextN rows (draft-mtp)
CATCHUP_BATCH = 16  # a draft model catching up decodes about this many tokens at once
DRAFT_SEED_OFFSET = 0x9E3779B9  # the draft samples from its own random stream, derived from --seed


# A recurrent target keeps a snapshot of its state per draftable token (llama.cpp's n_rs_seq),
# each a whole unquantised copy of it (hundreds of MiB for a large hybrid): drafts longer than
# this roll back from a checkpoint instead (cache.py), which auto plans with (auto.Rewind).
MAX_SNAPSHOTS = 8


class Engine:
    def __init__(self, target: ModelSpec, draft: ModelSpec | None = None,
                 notify: Callable[[str], None] | None = None, prompt_cache_file: Path | None = None,
                 prompt_cache_ro: bool = False, pool_tokens: int = POOL_TOKENS, pool_file: Path | None = None,
                 cache_ram_mib: int = 0):
        target_vocab = functools.cache(lambda: read_vocab(target.path))  # read when needed, once
        for other in (draft.path if draft else None, target.mtp_sidecar):
            if other is not None and other.resolve() != target.path.resolve():
                check_compatible(target_vocab(), read_vocab(other))
        self.pool_file: PoolFile | None = None  # (close() may run before the pool is set up)
        self._lookup_files: dict[tuple, LookupFiles] = {}  # ngram-cache's -lcs/-lcd, read once
        t0 = time.perf_counter()
        self.target = _load(target)
        self.draft = None
        try:
            self.draft = _load(draft) if draft is not None else None
            # The target's MTP head (its own NextN layers, or an MTP head file's): its cache, kept
            # between runs too.
            has_head = target.mtp_sidecar or self.target.nextn_layers
            self.mtp = MtpCache(self.target.mtp_head(target.mtp_sidecar)) if has_head else None
        except BaseException:
            self.close()
            raise
        self.t_load = time.perf_counter() - t0
        # Each model's cache, kept between runs: a prompt that starts like the last one keeps that prefix.
        self.caches = {"target": Cache(self.target), **({"draft": Cache(self.draft)} if self.draft else {})}
        self.notify = notify
        self.drafter: Drafter | None = None  # the drafter of the latest run
        self._costs: dict[str, list[float]] = {}  # role -> v(1..)
        self.prompt_cache_file = prompt_cache_file
        self.prompt_cache_ro = prompt_cache_ro
        self._restore_pending = prompt_cache_file is not None  # the first run restores it
        self._file_holds: dict[str, tuple[int, ...]] = {}  # role -> tokens the cache file holds
        # --cache-ram: earlier conversations' caches in host memory (0: none; -1: no size limit)
        target_cache = self.caches["target"]
        self.ram_cache = ram_cache.RamCache(cache_ram_mib, lambda state, tokens, limit: (
            target_cache.keepable_after_restore(state.tokens, tokens, limit, state.checkpoint))
        ) if cache_ram_mib else None
        self._whole_prompt = False  # forget() was called: the next run keeps and restores nothing
        # What earlier runs wrote (pool.py): learnt after each run while `learn` is set (bench
        # clears it so no run drafts from its own configuration's earlier output).
        self.pool = Pool(max_tokens=pool_tokens) if pool_tokens > 0 else None
        self.learn = True
        if pool_file is not None and self.pool is not None:
            vocab = target_vocab()
            self.pool_file = PoolFile(pool_file, fingerprint(vocab.tokens, vocab.type, vocab.bos, vocab.eos),
                                      notify or (lambda message: None))
            self.pool_file.load(self.pool)
        self._mod_tables: dict[int, ModTable] = {}  # ngram-mod's tables by n_match, shared by runs

    def prompt_tokens(self, text: str, use_chat: bool = False, system: str | None = None) -> list[int]:
        if use_chat:
            return self.chat_tokens(chat.conversation(text, system))
        return self.target.tokenize(text, add_special=True)

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation through the target's own chat template, ready for the reply."""
        template = self.target.chat_template()
        if not template:
            raise ModelError(f"{self.target.name} has no chat template; run without --chat")
        bos = self.target.special_text("bos")
        rendered = chat.render(template, messages, bos_token=bos, eos_token=self.target.special_text("eos"))
        # A template that writes BOS itself must not get a second one from the tokenizer.
        has_bos = bool(bos) and self.target.add_bos and rendered.startswith(bos)
        return self.target.tokenize(rendered, add_special=not has_bos)

    def top2(self, context: list[int]) -> tuple[tuple[int, float], tuple[int, float]]:
        """The target's two best next tokens after `context`, with their logits."""
        (row,) = self.caches["target"].sync(context, "last")
        second, first = np.argpartition(row, -2)[-2:]
        if row[second] > row[first]:
            first, second = second, first
        return (int(first), float(row[first])), (int(second), float(row[second]))

    def run(self, prompt: list[int], sampling: SamplerSettings, spec: SpecSettings,
            seed: int) -> Iterator[Event]:
        """Generate from `prompt`: the loop's events, and PromptCache after Prefilled when a
        prompt cache file is used. The longest prefix of the prompt that the caches still
        hold from the previous run is not processed again (stream.py turns this into text
        and statistics)."""
        whole_prompt, self._whole_prompt = self._whole_prompt, False
        check_prompt(prompt, self.target.n_ctx, spec.n_predict)  # before any calibration
        rule = acceptance(sampling, spec)
        banned = self.target.eog_tokens() if spec.ignore_eos else None
        draft_sampler = None  # the draft model or MTP head samples its drafts for speculative sampling
        if (self.draft is not None or self.mtp is not None) and rule == "rejection":
            drafting = self.draft or self.target
            draft_sampler = Sampler(sampling, (seed + DRAFT_SEED_OFFSET) % 2**32,
                                    drafting.eog_tokens() if spec.ignore_eos else None, drafting)
        self.drafter = self.make_drafter(spec, draft_sampler)  # may calibrate, which uses the caches
        restored = self._restore_pending
        t_restore = self._restore_prompt_cache() if restored else 0.0
        t_swap = self._swap_ram_cache(prompt) if self.ram_cache is not None and not whole_prompt else 0.0
        context = list(prompt)
        try:
            for event in generate(self.caches["target"], prompt, Sampler(sampling, seed, banned, self.target), spec,
                                  self.drafter):
                if isinstance(event, Token):
                    context.append(event.id)
                elif isinstance(event, Prefilled) and t_swap:  # part of processing this prompt
                    event = dataclasses.replace(event, seconds=event.seconds + t_swap)
                yield event
                if isinstance(event, Prefilled) and self.prompt_cache_file is not None:
                    # restored: the caches held nothing else before
                    yield PromptCache(event.n_cached if restored else 0, t_restore, self._save_prompt_cache(prompt))
        finally:  # whatever ended the run (a stop string, a client gone): what it generated is text
            if self.drafter is not None:
                self.drafter.finish(context)
            if isinstance(self.drafter, Auto) and self.drafter.calibration_stale():
                calibrate.forget(self.caches["target"].model.identity())
                self._costs.pop("target", None)
            if self.pool is not None and self.learn:
                self.pool.add(context[len(prompt):])

    def forget(self) -> None:
        """Empty the caches: the next run processes its whole prompt, restoring nothing from
        the RAM cache either (llama-server's `cache_prompt: false`). As llama-server does, the
        conversation the caches held is saved in the RAM cache first, for a later request
        that continues it."""
        if self.ram_cache is not None and len(self.caches["target"]) >= ram_cache.MIN_TOKENS:
            self._save_to_ram_cache()
        self._whole_prompt = True
        for cache in self.caches.values():
            cache.forget()
        if self.mtp is not None:
            self.mtp.forget()

    def notes(self) -> list[str]:
        """What the latest run's drafter has to say about it (why auto declined a drafter)."""
        summary = getattr(self.drafter, "summary", None)
        return summary() if summary else []

    def plan_seconds(self) -> float:
        """What auto itself spent planning and scoring in the latest run (0 for fixed drafters)."""
        return getattr(self.drafter, "t_plan", 0.0)

    def make_drafter(self, spec: SpecSettings, draft_sampler: Sampler | None = None) -> Drafter | None:
        """The drafter --spec-type asks for: one, a chain, or auto over several.
        `draft_sampler`: the draft model samples with it (else it drafts greedily)."""
        names = spec.drafters or ("ngram-simple", *(("ngram-pool",) if self.pool else ()),
                                  *(("draft",) if self.draft else ()), *(("draft-mtp",) if self.mtp else ()))
        if not spec.auto and not spec.drafters:
            return None
        drafters = [self._drafter(name, spec, draft_sampler) for name in names]
        if spec.auto:
            draft_costs, catchup_costs = {}, {}
            for name, role in (("draft", "draft"), ("draft-mtp", "mtp")):
                if name in names:  # a token alone, and a token within a batch of CATCHUP_BATCH
                    costs = self.costs(role, CATCHUP_BATCH)
                    draft_costs[name], catchup_costs[name] = costs[0], costs[-1] / len(costs)
            k_max = min(spec.draft_max, _largest_batch(self.target) - 1)
            return Auto(drafters, self.costs("target", k_max + 1), k_max, draft_costs, catchup_costs,
                        self._rewind(k_max))
        return drafters[0] if len(drafters) == 1 else Chain(drafters, [spec.draft_limit(n) for n in names])

    def _drafter(self, name: str, spec: SpecSettings, draft_sampler: Sampler | None) -> Drafter:
        if name == "draft":
            if self.draft is None:
                raise UsageError("--spec-type draft needs a draft model: give -md PATH|NAME")
            if spec.branches > min(self.draft.n_seq, self.target.n_seq):
                raise UsageError(f"{spec.branches} draft branches: the models were loaded for "
                                 f"{min(self.draft.n_seq, self.target.n_seq)} branches")
            return ModelDrafter(self.caches["draft"], p_min=spec.draft_p_min, sampler=draft_sampler,
                                branches=spec.branches, p_split=spec.p_split)
        if name == "draft-mtp":
            if self.mtp is None:
                raise UsageError(no_mtp_layers(self.target.name))
            return MtpDrafter(self.mtp, self.target.is_eog, p_min=spec.draft_p_min, sampler=draft_sampler)
        if name == "ngram-pool":
            if self.pool is None:
                raise UsageError("--spec-type ngram-pool: the pool is off (--spec-pool-tokens 0)")
            return PoolDrafter(self.pool)
        if name == "ngram-mod":
            mod = spec.ngram_mod
            if mod.n_match not in self._mod_tables:
                self._mod_tables[mod.n_match] = ModTable(mod.n_match)
            return NgramMod(self._mod_tables[mod.n_match], mod.n_min, mod.n_max)
        if name == "ngram-cache":
            return NgramCache(self._lookup(spec))
        ngram = {"ngram-simple": spec.ngram_simple, "ngram-map-k": spec.ngram_map_k,
                 "ngram-map-k4v": spec.ngram_map_k4v}[name]
        kind = {"ngram-simple": NgramSimple, "ngram-map-k": NgramMapK, "ngram-map-k4v": NgramMapK4v}[name]
        return kind(ngram.size(spec.auto), ngram.m, ngram.min_hits)

    def _lookup(self, spec: SpecSettings) -> LookupFiles:
        """ngram-cache's files, read the first time a run asks for them (notices for what is unusable)."""
        key = (spec.lookup_cache.static, spec.lookup_cache.dynamic)
        if key not in self._lookup_files:
            self._lookup_files[key] = LookupFiles(*key, self.target.n_vocab, self.notify or (lambda _: None))
        return self._lookup_files[key]

    def costs(self, role: str, max_batch: int) -> list[float]:
        """The measured decode cost of a model ("target", "draft", or "mtp": the target's MTP
        head) for batches of 1..max_batch tokens."""
        if role == "mtp":
            cache, model, measure = self.mtp, self.mtp.head, calibrate.measure_mtp
            identity = {**self.target.identity(), "name": model.name, "mtp": model.file or True}
        else:
            cache, measure = self.caches[role], calibrate.measure
            model, identity = cache.model, cache.model.identity()
        max_batch = min(max_batch, _largest_batch(model))
        known = self._costs.get(role, [])
        if len(known) < max_batch:
            known = self._costs[role] = calibrate.batch_costs(cache, max_batch, identity, self.notify,
                                                              measured_by=measure)
        return known[:max_batch]

    def _rewind(self, k_max: int) -> Rewind | None:
        """What drafts of up to k_max tokens cost the target beyond its verify (auto.Rewind):
        nothing for an attention cache, or a recurrent state whose snapshots cover them."""
        limit = self.target.rollback_limit
        if limit is None or limit >= k_max:
            return None
        return Rewind(limit, *calibrate.checkpoint_costs(self.caches["target"]))

    def _swap_ram_cache(self, prompt: list[int]) -> float:
        """--cache-ram (ram_cache.py): keep the caches in host memory when this prompt would cut
        them, and restore the entry that keeps more of it; the seconds it took."""
        t0 = time.perf_counter()
        target = self.caches["target"]
        limit = len(prompt) - 1  # the prompt's last token is always decoded (loop.prefill)
        kept = target.keepable(prompt, limit)
        entry, reused = self.ram_cache.best(prompt, limit)
        swap = entry is not None and reused >= kept + ram_cache.MIN_TOKENS
        if swap:
            self.ram_cache.use(entry)  # first: making room for what the caches hold evicts others
        if len(target) and (swap or len(target) - kept >= ram_cache.MIN_TOKENS):
            self._save_to_ram_cache()
        if swap:  # (evicted by now if the budget holds only one entry: restored all the same)
            for role, state in entry.parts.items():
                if not self._load_state(role, state.tokens, state.data, state.checkpoint):
                    ram_cache.log.warning("cache-ram: could not restore the %s part of %d tokens", role,
                                          len(state.tokens))
            ram_cache.log.info("cache-ram: restored %d tokens, %d of them this prompt's", len(entry.tokens),
                               target.keepable(prompt, limit))
        return time.perf_counter() - t0

    def _save_to_ram_cache(self) -> None:
        """Keep what every cache holds now in the RAM cache (ram_cache.RamCache.add)."""
        try:
            self.ram_cache.add({role: ram_cache.State(tokens, copy(), self.caches[role].saved_checkpoint()
                                                      if role in self.caches else None)
                                for role, (tokens, copy) in self._cache_states().items()})
        except (GenerationError, MemoryError) as e:  # a cache problem never fails the request
            ram_cache.log.warning("cache-ram: could not save the caches: %s", e or "out of memory")

    def _restore_prompt_cache(self) -> float:
        """Load every part of the prompt cache file that these models can use; the seconds
        it took. What cannot be used is left out with a notice, never an error."""
        self._restore_pending = False
        t0 = time.perf_counter()
        try:
            parts, notices = prompt_cache.read(self.prompt_cache_file, self._cache_identities())
        except FileNotFoundError:
            if self.prompt_cache_ro:
                self._notice("does not exist; nothing restored")
            return 0.0
        except (prompt_cache.Unusable, OSError) as e:
            self._notice(f"ignored: {getattr(e, 'strerror', None) or e}")
            return 0.0
        for notice in notices:
            self._notice(notice)
        for part in parts:
            if self._load_state(part.role, part.tokens, part.state):
                self._file_holds[part.role] = part.tokens
            else:
                self._notice(f"could not load the {part.role} part (-c smaller than its {len(part.tokens)} "
                             "tokens?); ignored")
        return time.perf_counter() - t0

    def _cache_identities(self) -> dict[str, dict]:
        """What produced each part the prompt cache file may hold (LlamaModel.cache_identity)."""
        identities = {role: cache.model.cache_identity() for role, cache in self.caches.items()}
        if self.mtp is not None:
            identities[NEXTN_ROLE] = {**identities["target"], "nextn_rows": self.mtp.head.n_embd}
        return identities

    def _load_state(self, role: str, tokens: tuple[int, ...], state: bytes,
                    checkpoint: tuple[int, bytes] | None = None) -> bool:
        """Restore one part that _cache_states gave (the prompt cache file's or --cache-ram's);
        False (and that cache empty) when it cannot be loaded."""
        if role == NEXTN_ROLE:  # the rows of the tokens the target part restored
            return self.caches["target"].tokens() == tokens and self.target.load_nextn_state(state, len(tokens))
        return self.caches[role].restore(state, tokens, checkpoint)

    def _cache_states(self) -> dict[str, tuple[tuple[int, ...], Callable[[], bytes]]]:
        """What each cache holding anything holds, and how to copy its state: role -> (tokens,
        copy), the target first, then the target's NextN rows where all are known."""
        states = {role: (cache.tokens(), cache.save) for role, cache in self.caches.items() if len(cache)}
        rows = self.target.nextn_state(len(self.caches["target"])) if "target" in states else None
        if rows is not None:  # an MTP head follows a restored target from these
            states[NEXTN_ROLE] = (states["target"][0], lambda: rows)
        return states

    def _save_prompt_cache(self, prompt: list[int]) -> float:
        """Write the caches for the prompt just processed (the target holds all of it but its
        last token) to the prompt cache file, unless it holds them already; the seconds it took."""
        if self.prompt_cache_ro:
            return 0.0
        t0 = time.perf_counter()
        states = self._cache_states()
        holds = {role: tokens for role, (tokens, _) in states.items()}
        if holds == self._file_holds:
            return 0.0
        identities = self._cache_identities()
        try:
            prompt_cache.write(self.prompt_cache_file, [
                prompt_cache.Part(role, identities[role], tokens, state()) for role, (tokens, state) in states.items()])
        except (OSError, UsageError, GenerationError) as e:  # a cache problem never fails the run
            self._notice(f"not written: {getattr(e, 'strerror', None) or e}")
            return 0.0
        self._file_holds = holds
        return time.perf_counter() - t0

    def _notice(self, message: str) -> None:
        if self.notify:
            self.notify(f"prompt cache {self.prompt_cache_file}: {message}")

    def busy_seconds(self) -> float:
        """Seconds both models have spent inside llama.cpp so far."""
        heads = (self.mtp.head,) if self.mtp is not None else ()
        return sum(m.busy_seconds for m in (self.target, self.draft, *heads) if m is not None)

    def close(self) -> None:
        if self.pool_file is not None:
            try:
                self.pool_file.save(self.pool)
            except OSError as e:  # a full disk: the pool is a cache, the run's output is what matters
                self.pool_file.notice(f"--spec-pool {self.pool_file.path}: not written: {e.strerror or e}")
        for files in self._lookup_files.values():
            files.save()  # -lcd: llama-lookup saves its dynamic cache at the end too
        self._lookup_files.clear()
        for model in (self.draft, self.target):
            if model is not None:
                model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def no_mtp_layers(name: str) -> str:
    return (f"--spec-type draft-mtp: {name} has no NextN (MTP) layers to draft with; "
            "give its MTP head file with -md")


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
