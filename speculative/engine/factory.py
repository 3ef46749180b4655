"""The drafter a run asks for, built by its --spec-type names: one drafter, a chain of several
tried in order, or auto choosing among them each step.

How each type is built, and what it needs, is drafters/registry.py's; what drafters keep between
runs lives here: ngram-mod's hash tables, and ngram-cache's -lcs/-lcd files (read once; -lcd
written back, with what the requests learned, when the engine closes).
"""

from __future__ import annotations

from typing import Callable

from speculative.decoding.cache import Cache, HeadCache
from speculative.decoding.constraint import Constraint
from speculative.decoding.drafter import Drafter
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import SpecSettings
from speculative.drafters import Chain, LookupFiles, ModTable
from speculative.drafters.auto import Auto, Rewind
from speculative.drafters.pool import Pool
from speculative.drafters.registry import DRAFT, GRAMMAR, HEAD, POOL, TYPES, DrafterType
from speculative.engine import calibrate
from speculative.errors import UsageError

CATCHUP_BATCH = 16  # a draft model catching up decodes about this many tokens at once

Costs = Callable[..., list[float]]  # (role, max_batch[, sequences]) -> measured decode costs (Engine.costs)


class DrafterFactory:
    """Builds the drafters of a loaded target (and draft model, MTP head, pool), keeping what
    they share between runs."""

    def __init__(self, caches: dict[str, Cache], head_cache: HeadCache | None, pool: Pool | None, costs: Costs,
                 target_batch: int, notify: Callable[[str], None] | None = None, pool_asked: bool = False):
        """`target_batch`: the largest batch the target verifies in one step; `pool_asked`: a pool
        file was given (--spec-pool FILE)."""
        self.caches, self.head_cache, self.pool, self.costs = caches, head_cache, pool, costs
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
        if not spec.auto and not spec.drafters:
            return None
        names = spec.drafters or tuple(t.name for t in TYPES.values() if t.auto and self.has(t, constraint, auto=True))
        for name in names:
            if not self.has(TYPES[name], constraint):
                raise UsageError(TYPES[name].refusal(self.target.name))
        drafters = [TYPES[name].build(self, spec, draft_sampler) for name in names]
        for d in drafters:
            d.constraint = constraint
        if spec.auto:
            auto = self._auto(names, drafters, spec.draft_max)
            if isinstance(earlier, Auto):
                auto.learn_from(earlier)
            return auto
        return drafters[0] if len(drafters) == 1 else Chain(drafters, [spec.draft_limit(n) for n in names])

    def has(self, kind: DrafterType, constraint: Constraint | None, auto: bool = False) -> bool:
        """Whether what `kind` needs is loaded (`auto`: and auto's default choices may take it)."""
        head = self.head_cache.head.kind if self.head_cache is not None else None
        return {DRAFT: self.draft is not None, HEAD: head == kind.name,
                POOL: self.pool is not None and (not auto or bool(self.pool) and self.pool_in_auto),
                GRAMMAR: constraint is not None}.get(kind.needs, True)

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
        drafting = {name: self.costs("draft" if TYPES[name].needs == DRAFT else "mtp", CATCHUP_BATCH)
                    for name in names if TYPES[name].needs in (DRAFT, HEAD)}
        if not all([verify, *shared, *drafting.values()]):  # a request's own auto on a server without it
            raise UsageError("auto: the models' costs were not measured before the requests started: "
                             "start with --spec-type auto")
        # a draft token alone, and one within a batch of CATCHUP_BATCH; a block drafter's tokens
        # decode together, as a catch-up's do
        draft_costs = {name: costs[-1] / len(costs) if TYPES[name].block else costs[0]
                       for name, costs in drafting.items()}
        catchup_costs = {name: costs[-1] / len(costs) for name, costs in drafting.items()}
        cache = self.caches["target"]
        plain = lambda: (cache.load[1], cache.load[1])  # noqa: E731  as if each other request took a plain step
        return Auto(drafters, verify, k_max, draft_costs, catchup_costs, rewind(cache, k_max),
                    plain if slots > 1 else None, shared)

    def view(self, caches: dict[str, Cache], head_cache: HeadCache | None, costs) -> "DrafterFactory":
        """The factory of another request's caches on the same models (parallel.py), priced by
        `costs` (its engine's), sharing ngram-mod's tables and ngram-cache's files with this one."""
        view = DrafterFactory(caches, head_cache, self.pool, costs, self.target_batch, self.notify)
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
        key = (spec.ngram_cache.static, spec.ngram_cache.dynamic)
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
