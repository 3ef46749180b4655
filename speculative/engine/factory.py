"""The drafter a run asks for, built by its --spec-type names: one drafter, a chain of several
tried in order, or auto choosing among them each step.

BUILDERS says how each type is built; which types exist is settings.DRAFTER_TYPES, the one
list of their names (the settings layer checks --spec-type against it and cannot import this
one; tests/test_factory.py holds the two to each other). What drafters keep between runs lives
here too: ngram-mod's hash tables, and ngram-cache's -lcs/-lcd files (read once; -lcd written
back, with what the requests learned, when the engine closes).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Callable

from speculative.decoding.cache import Cache, MtpCache
from speculative.decoding.constraint import Constraint
from speculative.decoding.drafter import Drafter
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import HEAD_TYPES, NgramSettings, SpecSettings
from speculative.drafters import (Chain, ForcedDrafter, LookupFiles, ModelDrafter, ModTable, MtpDrafter, NgramCache, NgramMapK, NgramMapK4v,
                                  NgramMod, NgramSimple)
from speculative.drafters.auto import Auto, Rewind
from speculative.drafters.block import BlockDrafter
from speculative.drafters.pool import Pool, PoolDrafter
from speculative.engine import calibrate
from speculative.errors import UsageError

CATCHUP_BATCH = 16  # a draft model catching up decodes about this many tokens at once
BLOCK_TYPES = ("draft-dflash", "draft-dspark")  # drafters of a whole block per decode (drafters/block.py)

Costs = Callable[..., list[float]]  # (role, max_batch[, sequences]) -> measured decode costs (Engine.costs)


class DrafterFactory:
    """Builds the drafters of a loaded target (and draft model, MTP head, pool), keeping what
    they share between runs."""

    def __init__(self, caches: dict[str, Cache], mtp: MtpCache | None, pool: Pool | None, costs: Costs,
                 target_batch: int, notify: Callable[[str], None] | None = None, pool_asked: bool = False):
        """`target_batch`: the largest batch the target verifies in one step; `pool_asked`: a pool
        file was given (--spec-pool FILE)."""
        self.caches, self.mtp, self.pool, self.costs = caches, mtp, pool, costs
        # The pool drafts a request from earlier ones' output, which would shape its verify passes by
        # what ran before it: where those shapes change the logits' last bits (a batch-variant build,
        # or a GPU's, not known to be invariant), identical requests could then get other answers,
        # so auto takes it by default only where no such kernel runs, or when asked for
        target = caches["target"].model
        self.pool_in_auto = pool_asked or (getattr(target, "placement", "cpu") == "cpu"
                                           and not getattr(target, "kernels", ()))
        self.target = caches["target"].model
        self.draft = caches["draft"].model if "draft" in caches else None
        self.target_batch = target_batch
        self.notify = notify
        self._mod_tables: dict[int, ModTable] = {}  # ngram-mod's tables by n_match, shared by runs
        self._lookup_files: dict[tuple, LookupFiles] = {}  # ngram-cache's -lcs/-lcd, read once

    def make(self, spec: SpecSettings, draft_sampler: Sampler | None = None,
             constraint: Constraint | None = None, earlier: Drafter | None = None) -> Drafter | None:
        """The drafter --spec-type asks for: one, a chain, or auto over several.
        `draft_sampler`: the draft model samples with it (else it drafts greedily); `constraint`:
        the run's grammar, which every drafter drafts under (and auto's choices add `forced`);
        `earlier`: an earlier run's drafter whose auto this one's learns from."""
        names = spec.drafters or ("ngram-simple", *(("ngram-pool",) if self.pool and self.pool_in_auto else ()),
                                  *(("draft",) if self.draft else ()), *((self.mtp.head.kind,) if self.mtp else ()),
                                  *(("forced",) if constraint is not None else ()))
        if not spec.auto and not spec.drafters:
            return None
        drafters = [BUILDERS[name](self, spec, draft_sampler) for name in names]
        for d in drafters:
            d.constraint = constraint
        if spec.auto:
            auto = self._auto(names, drafters, spec.draft_max)
            if isinstance(earlier, Auto):
                auto.learn_from(earlier)
            return auto
        return drafters[0] if len(drafters) == 1 else Chain(drafters, [spec.draft_limit(n) for n in names])

    def _auto(self, names: tuple[str, ...], drafters: list[Drafter], draft_max: int) -> Auto:
        """auto over `drafters`, with what the models' steps cost as measured (calibrate.py)."""
        k_max = min(draft_max, self.target_batch - 1)
        slots = getattr(self.target, "n_slots", 1)
        verify = self.costs("target", k_max + 1)
        # requests at once: the pass carries every slot's step, and each plans for all of it, with
        # the others' steps as if plain (their passes calibrated as such): priced against their
        # drafts (or a prompt's chunk, gone by the next pass), a request's draft would make the
        # pass look cheaper per token to the next, and drafts would grow together
        shared = [self.costs("target", k_max + 1, n) for n in range(2, slots + 1)]
        drafting = {name: self.costs("draft" if name == "draft" else "mtp", CATCHUP_BATCH)
                    for name in ("draft", *HEAD_TYPES) if name in names}
        if not all([verify, *shared, *drafting.values()]):  # a request's own auto on a server without it
            raise UsageError("auto: the models' costs were not measured before the requests started: "
                             "start with --spec-type auto")
        # a draft token alone, and one within a batch of CATCHUP_BATCH; a block drafter's tokens
        # decode together, as a catch-up's do
        draft_costs = {name: costs[-1] / len(costs) if name in BLOCK_TYPES else costs[0]
                       for name, costs in drafting.items()}
        catchup_costs = {name: costs[-1] / len(costs) for name, costs in drafting.items()}
        target = self.target
        return Auto(drafters, verify, k_max, draft_costs, catchup_costs,
                    rewind(self.caches["target"], k_max), (lambda: target.load(plain=True)) if slots > 1 else None,
                    shared)

    def view(self, caches: dict[str, Cache], mtp: MtpCache | None) -> "DrafterFactory":
        """The factory of another request's caches on the same models (parallel.py), sharing
        ngram-mod's tables and ngram-cache's files with this one."""
        view = DrafterFactory(caches, mtp, self.pool, self.costs, self.target_batch, self.notify)
        view.pool_in_auto = self.pool_in_auto
        view._mod_tables, view._lookup_files = self._mod_tables, self._lookup_files
        return view

    def mod_table(self, n_match: int) -> ModTable:
        """ngram-mod's table for n-grams of n_match tokens, made the first time a run asks for it."""
        if n_match not in self._mod_tables:
            self._mod_tables[n_match] = ModTable(n_match)
        return self._mod_tables[n_match]

    def lookup_files(self, spec: SpecSettings) -> LookupFiles:
        """ngram-cache's files, read the first time a run asks for them (notices for what is unusable)."""
        key = (spec.lookup_cache.static, spec.lookup_cache.dynamic)
        if key not in self._lookup_files:
            self._lookup_files[key] = LookupFiles(*key, self.target.n_vocab, self.notify or (lambda _: None))
        return self._lookup_files[key]

    def close(self) -> None:
        for files in self._lookup_files.values():
            files.save()  # -lcd: llama-lookup saves its dynamic cache at the end too
        self._lookup_files.clear()


def rewind(target: Cache, k_max: int) -> Rewind | None:
    """What drafts of up to k_max tokens cost the target beyond its verify (auto.Rewind):
    nothing for an attention cache, or a recurrent state whose snapshots cover them."""
    limit = target.model.rollback_limit
    if limit is None or limit >= k_max:
        return None
    return Rewind(limit, *calibrate.checkpoint_costs(target))


def no_mtp_layers(name: str) -> str:
    return (f"--spec-type draft-mtp: {name} has no NextN (MTP) layers to draft with; "
            "give its MTP head file with -md")


DRAFTER_FILES = {"draft-eagle3": "an EAGLE-3 drafter", "draft-dflash": "a DFlash drafter",
                 "draft-dspark": "a DSpark drafter"}


def needs_drafter_file(kind: str) -> str:
    return f"--spec-type {kind} needs {DRAFTER_FILES[kind]} (a GGUF of its own): give it with -md"


Builder = Callable[[DrafterFactory, SpecSettings, "Sampler | None"], Drafter]


def _draft(factory: DrafterFactory, spec: SpecSettings, draft_sampler: Sampler | None) -> Drafter:
    draft, target = factory.draft, factory.target
    if draft is None:
        raise UsageError("--spec-type draft needs a draft model: give -md PATH|NAME")
    if spec.branches > min(draft.n_seq, target.n_seq):
        raise UsageError(f"{spec.branches} draft branches: the models were loaded for "
                         f"{min(draft.n_seq, target.n_seq)} branches")
    return ModelDrafter(factory.caches["draft"], p_min=spec.draft_p_min, sampler=draft_sampler,
                        branches=spec.branches, p_split=spec.p_split)


def _draft_mtp(factory: DrafterFactory, spec: SpecSettings, draft_sampler: Sampler | None) -> Drafter:
    if factory.mtp is None or factory.mtp.head.kind != "draft-mtp":
        raise UsageError(no_mtp_layers(factory.target.name))
    return MtpDrafter(factory.mtp, factory.target.is_eog, p_min=spec.draft_p_min, sampler=draft_sampler)


def _features(kind: str) -> Builder:
    """A drafter of its own file reading the target's layer inputs: EAGLE-3 drafts as an MTP
    head does, token by token; DFlash and DSpark a block at a time."""
    def build(factory: DrafterFactory, spec: SpecSettings, draft_sampler: Sampler | None) -> Drafter:
        if factory.mtp is None or factory.mtp.head.kind != kind:
            raise UsageError(needs_drafter_file(kind))
        if kind == "draft-eagle3":
            return MtpDrafter(factory.mtp, factory.target.is_eog, p_min=spec.draft_p_min, sampler=draft_sampler)
        if kind == "draft-dspark" and spec.draft_p_min > 0 and not factory.mtp.head.confidence:
            raise UsageError("--draft-p-min: this DSpark drafter has no confidence head to cut its drafts with; "
                             "give --draft-p-min 0")
        return BlockDrafter(factory.mtp, p_min=spec.draft_p_min, sampler=draft_sampler)
    return build


def _ngram(kind: type, settings_of: Callable[[SpecSettings], NgramSettings]) -> Builder:
    """An n-gram lookup type built from its own --spec-ngram-KIND-* values."""
    def build(factory: DrafterFactory, spec: SpecSettings, draft_sampler: Sampler | None) -> Drafter:
        ngram = settings_of(spec)
        return kind(ngram.size(spec.auto), ngram.m, ngram.min_hits)
    return build


def _ngram_mod(factory: DrafterFactory, spec: SpecSettings, draft_sampler: Sampler | None) -> Drafter:
    mod = spec.ngram_mod
    return NgramMod(factory.mod_table(mod.n_match), mod.n_min, mod.n_max)


def _ngram_cache(factory: DrafterFactory, spec: SpecSettings, draft_sampler: Sampler | None) -> Drafter:
    return NgramCache(factory.lookup_files(spec))


def _ngram_pool(factory: DrafterFactory, spec: SpecSettings, draft_sampler: Sampler | None) -> Drafter:
    if factory.pool is None:
        raise UsageError("--spec-type ngram-pool: the pool is off (--spec-pool-tokens 0)")
    return PoolDrafter(factory.pool)


# How each drafter type is built, by its --spec-type name (in settings.DRAFTER_TYPES' order).
BUILDERS: dict[str, Builder] = {
    "draft": _draft,
    "draft-mtp": _draft_mtp,
    "draft-eagle3": _features("draft-eagle3"),
    "draft-dflash": _features("draft-dflash"),
    "draft-dspark": _features("draft-dspark"),
    "ngram-simple": _ngram(NgramSimple, attrgetter("ngram_simple")),
    "ngram-map-k": _ngram(NgramMapK, attrgetter("ngram_map_k")),
    "ngram-map-k4v": _ngram(NgramMapK4v, attrgetter("ngram_map_k4v")),
    "ngram-mod": _ngram_mod,
    "ngram-cache": _ngram_cache,
    "ngram-pool": _ngram_pool,
    "forced": lambda factory, spec, draft_sampler: ForcedDrafter(),
}
