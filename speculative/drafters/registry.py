"""The drafter types, each declared once: its --spec-type name (and llama.cpp's, where that
differs), its own settings and flags, what must be loaded for it, how it is built, and what
auto believes of its proposals before any evidence.

Everything that names types reads this table: the settings' checks (check), the flags and
--spec-type's help (cli/options.py), which -md file a type drafts with (cli), the factory
(engine/factory.py) and auto's choices and priors. A new drafter is a module of drafters/ and
an entry here; tests/test_registry.py holds the lists elsewhere (help, README, docs) to it.

A type's own settings are SpecSettings' field named after it (ngram-mod: `ngram_mod`); those
with an `own_limit` draft up to their own maximum, as llama.cpp's n-gram types do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from speculative.decoding.drafter import AGREED, FORCED, LONG, MEDIUM, RESUMED, SHORT, Drafter
from speculative.decoding.settings import (NgramCacheSettings, NgramMapK4vSettings, NgramModSettings, NgramSettings,
                                           SpecSettings)
from speculative.errors import UsageError

if TYPE_CHECKING:  # the drafters' modules are imported by the builders that need them: the flags
    # and --help read this table without numpy
    from speculative.decoding.cache import Cache, HeadCache
    from speculative.decoding.sampling import Sampler
    from speculative.drafters.ngram_cache import LookupFiles
    from speculative.drafters.ngram_mod import ModTable
    from speculative.drafters.pool import Pool

OTHER_PRIOR = 0.5  # auto's prior of a proposal of no declared kind (a free drafter the registry lacks too)
MODEL_PRIOR = 0.7  # a drafting model's first token

# what a type needs loaded besides the target
DRAFT, HEAD, POOL, GRAMMAR = "a draft model", "a head", "the pool", "a grammar"


class Resources(Protocol):
    """What a builder draws on: the loaded models' caches, the head drafting beside the target,
    the pool, and what drafters share between runs (engine/factory.py's DrafterFactory)."""
    caches: dict[str, Cache]
    head_cache: HeadCache | None
    pool: Pool | None

    def mod_table(self, n_match: int) -> ModTable: ...

    def lookup_files(self, spec: SpecSettings) -> LookupFiles: ...


Builder = Callable[[Resources, SpecSettings, "Sampler | None"], Drafter]


@dataclass(frozen=True)
class Flag:
    """One of a type's own flags: llama.cpp's names for it, the field of the type's settings it
    sets, and its help. `common`: the flag of every n-gram lookup type it falls back to."""
    names: tuple[str, ...]
    field: str
    help: str
    kind: type = int
    metavar: str | None = None
    common: str | None = None


@dataclass(frozen=True)
class DrafterType:
    name: str
    build: Builder
    needs: str = ""               # DRAFT, HEAD, POOL, GRAMMAR or nothing
    model: str = ""               # DRAFT, HEAD: the model it drafts with (-md), as the errors name it
    settings: type | None = None  # its own settings' class: SpecSettings' field of its name
    flags: tuple[Flag, ...] = ()
    # auto's belief in its first drafted token, by the kind of proposal (Draft.kind), and of any other
    priors: Mapping[int, float] = field(default_factory=dict)
    prior: float = OTHER_PRIOR
    aliases: tuple[str, ...] = ()  # llama.cpp's other names for it
    auto: bool = False            # auto's default choices take it where what it needs is loaded
    trees: bool = False           # drafts trees (-np branches)
    block: bool = False           # drafts a block in one decode (its tokens cost as a catch-up's)

    @property
    def settings_field(self) -> str:
        """SpecSettings' field of its own settings."""
        return self.name.replace("-", "_")

    @property
    def own_limit(self) -> bool:
        """It drafts up to its own maximum, not --draft-max (llama.cpp's n-gram types)."""
        return hasattr(self.settings, "own_limit")

    def prior_of(self, kind: int) -> float:
        return self.priors.get(kind, self.prior)

    def refusal(self, target: str = "the target") -> str:
        """Why it cannot draft here: what it needs is not loaded (`target`: the target's name)."""
        if self.needs == HEAD and self.name == "draft-mtp":
            return (f"--spec-type draft-mtp: {target} has no NextN (MTP) layers to draft with; "
                    "give its MTP head file with -md")
        return {DRAFT: f"--spec-type {self.name} needs {self.model}: give -md PATH|NAME",
                HEAD: f"--spec-type {self.name} needs {self.model} (a GGUF of its own): give it with -md",
                POOL: f"--spec-type {self.name}: the pool is off (--spec-pool-tokens 0)",
                GRAMMAR: f"--spec-type {self.name} drafts what a grammar forces: give --grammar or --json-schema",
                }[self.needs]


# -- the builders ---------------------------------------------------------------------------


def _draft(res: Resources, spec: SpecSettings, sampler: Sampler | None) -> Drafter:
    from speculative.drafters.model import ModelDrafter

    draft, target = res.caches["draft"].model, res.caches["target"].model
    if spec.branches > min(draft.n_seq, target.n_seq):
        raise UsageError(f"{spec.branches} draft branches: the models were loaded for "
                         f"{min(draft.n_seq, target.n_seq)} branches")
    return ModelDrafter(res.caches["draft"], p_min=spec.draft_p_min, sampler=sampler,
                        branches=spec.branches, p_split=spec.p_split)


def _token_head(res: Resources, spec: SpecSettings, sampler: Sampler | None) -> Drafter:
    """A head drafting token by token: the target's NextN layers, an MTP head file, EAGLE-3."""
    from speculative.drafters.head import TokenHeadDrafter

    return TokenHeadDrafter(res.head_cache, res.caches["target"].model.is_eog, p_min=spec.draft_p_min, sampler=sampler)


def _block_head(res: Resources, spec: SpecSettings, sampler: Sampler | None) -> Drafter:
    """A head drafting a block in one decode: DFlash, DSpark."""
    from speculative.drafters.block import BlockDrafter

    if res.head_cache.head.kind == "draft-dspark" and spec.draft_p_min > 0 and not res.head_cache.head.confidence:
        raise UsageError("--draft-p-min: this DSpark drafter has no confidence head to cut its drafts with; "
                         "give --draft-p-min 0")
    return BlockDrafter(res.head_cache, p_min=spec.draft_p_min, sampler=sampler)


def _lookup(cls: str) -> Builder:
    """An n-gram lookup type (the drafters' class `cls`), built from its own settings."""
    def build(res: Resources, spec: SpecSettings, sampler: Sampler | None) -> Drafter:
        import speculative.drafters

        kind = getattr(speculative.drafters, cls)
        own = spec.own(kind.name)
        return kind(own.size(spec.auto), own.m, own.min_hits)
    return build


def _ngram_mod(res: Resources, spec: SpecSettings, sampler: Sampler | None) -> Drafter:
    from speculative.drafters.ngram_mod import NgramMod

    mod = spec.ngram_mod
    return NgramMod(res.mod_table(mod.n_match), mod.n_min, mod.n_max)


def _ngram_cache(res: Resources, spec: SpecSettings, sampler: Sampler | None) -> Drafter:
    from speculative.drafters.ngram_cache import NgramCache

    return NgramCache(res.lookup_files(spec))


def _ngram_pool(res: Resources, spec: SpecSettings, sampler: Sampler | None) -> Drafter:
    from speculative.drafters.pool import PoolDrafter

    return PoolDrafter(res.pool)


def _forced(res: Resources, spec: SpecSettings, sampler: Sampler | None) -> Drafter:
    from speculative.drafters.forced import ForcedDrafter

    return ForcedDrafter()


def _lookup_flags(kind: str) -> tuple[Flag, ...]:
    """--spec-ngram-KIND-size-n, -size-m and -min-hits: one n-gram lookup type's own values."""
    return tuple(Flag((f"--spec-ngram-{kind}-{flag}",), name, f"ngram-{kind} only: as --spec-ngram-{flag}.",
                      common=f"--spec-ngram-{flag}")
                 for flag, name in (("size-n", "n"), ("size-m", "m"), ("min-hits", "min_hits")))


# auto's prior of an n-gram match's first token: the longer the context matched, the likelier
# (ngram.match_class)
MATCHES = {SHORT: 0.4, MEDIUM: 0.7, LONG: 0.9, RESUMED: 0.6}

_TYPES = (
    DrafterType("ngram-simple", _lookup("NgramSimple"), settings=NgramSettings, flags=_lookup_flags("simple"),
                priors=MATCHES, auto=True),
    DrafterType("ngram-map-k", _lookup("NgramMapK"), settings=NgramSettings, flags=_lookup_flags("map-k"),
                priors=MATCHES),
    DrafterType("ngram-map-k4v", _lookup("NgramMapK4v"), settings=NgramMapK4vSettings, flags=_lookup_flags("map-k4v")),
    DrafterType("ngram-mod", _ngram_mod, settings=NgramModSettings, flags=(
                    Flag(("--spec-ngram-mod-n-match",), "n_match",
                         f"ngram-mod: length of the n-gram looked up, 1-1024 (default {NgramModSettings.n_match})."),
                    Flag(("--spec-ngram-mod-n-min",), "n_min", "ngram-mod: a draft shorter than this is dropped, "
                         f"0-1024 (default {NgramModSettings.n_min})."),
                    Flag(("--spec-ngram-mod-n-max",), "n_max",
                         f"ngram-mod: most tokens drafted, 0-1024 (default {NgramModSettings.n_max})."))),
    DrafterType("ngram-cache", _ngram_cache, settings=NgramCacheSettings, flags=(
                    Flag(("-lcs", "--lookup-cache-static"), "static",
                         "ngram-cache: a static n-gram cache in llama.cpp's format (llama-lookup-create), read only. "
                         "It carries no tokenizer identity: one from another model's tokenizer drafts tokens that "
                         "are rejected.", Path, "FNAME"),
                    Flag(("-lcd", "--lookup-cache-dynamic"), "dynamic",
                         "ngram-cache: a dynamic n-gram cache in llama.cpp's format (llama-lookup's), read at start "
                         "if it exists and replaced at the end with what the run generated added. A file that is "
                         "not an n-gram cache is never overwritten.", Path, "FNAME"))),
    DrafterType("ngram-pool", _ngram_pool, needs=POOL, priors={**MATCHES, AGREED: 0.8}, auto=True),
    DrafterType("draft", _draft, needs=DRAFT, model="a draft model", aliases=("draft-simple",),
                prior=MODEL_PRIOR, auto=True, trees=True),
    DrafterType("draft-mtp", _token_head, needs=HEAD, model="an MTP head", prior=MODEL_PRIOR, auto=True),
    DrafterType("draft-eagle3", _token_head, needs=HEAD, model="an EAGLE-3 drafter", prior=MODEL_PRIOR, auto=True),
    DrafterType("draft-dflash", _block_head, needs=HEAD, model="a DFlash drafter", prior=MODEL_PRIOR, auto=True,
                block=True),
    DrafterType("draft-dspark", _block_head, needs=HEAD, model="a DSpark drafter", prior=MODEL_PRIOR, auto=True,
                block=True),
    # 311 of 311 forced tokens accepted over six extraction answers (docs/grammars.md); it is
    # proposed a few times an answer, too seldom for its evidence to outlast auto's decay, so
    # the prior is most of what auto knows of it
    DrafterType("forced", _forced, needs=GRAMMAR, priors={FORCED: 0.95}, auto=True),
)
TYPES: dict[str, DrafterType] = {t.name: t for t in _TYPES}  # in the order auto's choices take them
SPEC_TYPES = ("none", *TYPES, "auto")  # none: no drafting; auto: chooses among drafters
ALIASES = {alias: t.name for t in _TYPES for alias in t.aliases}


def canonical(types) -> tuple[str, ...]:
    """--spec-type's names as speculate's own (llama.cpp's draft-simple is draft), wherever they
    come from: the flag, a request's speculative.type, bench's -C."""
    return tuple(ALIASES.get(t, t) for t in types)


def heads(spec: SpecSettings) -> tuple[str | None, str | None]:
    """Which heads beside the target may draft: the target's NextN (MTP) layers ("named":
    draft-mtp named; "auto": auto's default choices take them where the target has them; or
    None), and a drafter file reading its layer inputs (the type named, "auto", or None)."""
    default = "auto" if spec.auto and not spec.drafters else None
    named = [t for t in spec.drafters if TYPES[t].needs == HEAD and t != "draft-mtp"]
    return ("named" if "draft-mtp" in spec.drafters else default), (named[0] if named else default)


def check(spec: SpecSettings) -> None:
    """UsageError for speculation that makes no sense: the types' names and combinations, each
    type's own settings, then SpecSettings' own checks."""
    unknown = [t for t in spec.types if t not in SPEC_TYPES]
    if unknown or not spec.types:
        aliases = ", ".join(f"llama.cpp's {alias} for {name}" for alias, name in ALIASES.items())
        raise UsageError(f"--spec-type: unknown type {', '.join(unknown) or '(empty)'} "
                         f"(known: {', '.join(SPEC_TYPES)}; {aliases})")
    if "none" in spec.types and len(spec.types) > 1:
        raise UsageError("--spec-type none cannot be combined with other types")
    if len(set(spec.types)) != len(spec.types):
        raise UsageError(f"--spec-type names a type twice: {','.join(spec.types)}")
    if spec.branches > 1 and (spec.auto or not any(TYPES[t].trees for t in spec.drafters)
                              or any(TYPES[t].needs == HEAD for t in spec.drafters)):
        trees = ", ".join(t.name for t in _TYPES if t.trees)
        chains = ", ".join(t.name for t in _TYPES if t.needs == HEAD)
        raise UsageError(f"{spec.branches} draft branches: draft trees come from a draft model; "
                         f"use --spec-type {trees} (auto, {chains} draft chains only)")
    for t in _TYPES:
        if t.settings is not None:
            getattr(spec, t.settings_field).validate(f"--spec-{t.name}-*")
    own = [t for t in spec.drafters if TYPES[t].own_limit]
    if spec.auto and own:
        choices = ", ".join(t.name for t in _TYPES if t.auto and t.needs != GRAMMAR)
        raise UsageError(f"--spec-type auto chooses among {choices}, not {own[0]}: name the types to try "
                         "in order instead of auto")
    cache = spec.ngram_cache
    if (cache.static or cache.dynamic) and "ngram-cache" not in spec.drafters:
        flag = "-lcs/--lookup-cache-static" if cache.static else "-lcd/--lookup-cache-dynamic"
        raise UsageError(f"{flag} is for --spec-type ngram-cache, which this run does not use")
    spec.validate()

