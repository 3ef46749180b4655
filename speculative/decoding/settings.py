"""What a run is asked to do, and the checks on it: how tokens are sampled
(SamplerSettings, the sampling flags), how speculation drafts and verifies
(SpecSettings, the speculation flags), which acceptance rule follows from both, and
which model files load and how (ModelSpec, the model flags).
The command line, batch request lines and HTTP requests all build these; the loop
and the drafters only read them."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from speculative.errors import GenerationError, UsageError

DEFAULT_SEQUENCE = "edskypmxt"
ACTIVE_SAMPLERS = {"e": "penalties", "k": "top-k", "y": "typical", "p": "top-p", "m": "min-p",
                   "t": "temperature", "i": "infill"}
NEUTRAL_SAMPLERS = {"d": "dry", "s": "top-n-sigma", "x": "xtc"}


@dataclass(frozen=True)
class SamplerSettings:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64     # -1: the whole context; 0: no penalties
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    sequence: str = DEFAULT_SEQUENCE
    seed: int = -1  # -1: a random seed, reported so the run can be repeated
    grammar: str = ""  # GBNF the output must follow ('' none): --grammar, or a JSON schema's
    # where a lazy grammar starts (regular expressions over the generated text, llama.cpp's
    # trigger patterns: a tool call's opening); () : the grammar holds from the first token
    grammar_triggers: tuple[str, ...] = ()
    # llama.cpp's logit bias, the chain's first sampler: (token, bias) pairs added to the logits
    # (-inf: the token is never picked); a token named twice gets both
    logit_bias: tuple[tuple[int, float], ...] = ()
    # what the answer reports of each generated token (llama-server's n_probs): its probability
    # and the n_probs likeliest tokens' (0: nothing), from the target's logits as they are, or
    # from what the sampler chain leaves (post_sampling_probs)
    n_probs: int = 0
    post_sampling_probs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0

    @property
    def penalties(self) -> bool:
        """Whether the penalties sampler changes anything (then tokens need their history)."""
        return ("e" in self.sequence and self.repeat_last_n != 0 and
                (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0))

    def validate(self) -> None:
        for letter in self.sequence:
            if letter not in ACTIVE_SAMPLERS and letter not in NEUTRAL_SAMPLERS:
                known = "".join([*NEUTRAL_SAMPLERS, *ACTIVE_SAMPLERS])
                raise UsageError(
                    f"--sampling-seq: unknown sampler letter {letter!r} (known letters: {known})"
                )
        if not self.temp >= 0.0:
            raise UsageError(f"--temp must be >= 0 (0: greedy), got {self.temp}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 (0: off), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise UsageError(f"--top-p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise UsageError(f"--min-p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise UsageError(f"--typical must be in (0, 1], got {self.typical_p}")
        if not self.repeat_penalty > 0.0:
            raise UsageError(f"--repeat-penalty must be > 0 (1.0: off), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise UsageError(f"--repeat-last-n must be -1 (the whole context) or >= 0, got {self.repeat_last_n}")
        for flag, v in (("--presence-penalty", self.presence_penalty), ("--frequency-penalty", self.frequency_penalty)):
            if not math.isfinite(v):
                raise UsageError(f"{flag} must be a number, got {v}")
        if self.seed < -1 or self.seed >= 2**32:
            raise UsageError(f"--seed must be -1 (random) or in [0, 2^32), got {self.seed}")
        if self.n_probs < 0:
            raise UsageError(f"n_probs must be >= 0, got {self.n_probs}")
        for token, bias in self.logit_bias:
            if token < 0 or math.isnan(bias) or bias == math.inf:
                raise UsageError(f"logit bias: token {token} with bias {bias} (a token id >= 0 and a number, "
                                 "or -inf to ban it)")

    def resolved_seed(self) -> int:
        """The seed actually used: the given one, or a fresh random one for -1."""
        if self.seed >= 0:
            return self.seed
        return int.from_bytes(os.urandom(4), "little")


SPEC_ACCEPT = ("rejection", "match")  # speculative sampling, or the target samples and drafts must match
DRAFT_MAX_FIXED = 3    # llama.cpp's default --draft-max
DRAFT_MAX_AUTO = 16    # auto's cap: it picks k <= this each step
# n-gram length: llama.cpp's default when every match is drafted blindly; auto weighs
# each proposal by how long its context matches, and re-finds a copied passage
# sooner after an edit with short n-grams.
NGRAM_N_FIXED = 12
NGRAM_N_AUTO = 3
MAX_BRANCHES = 16  # -np: more branches than this make verify batches that never pay
POOL_TOKENS = 200_000  # --spec-pool-tokens: most tokens the pool keeps (about 1 MB on disk)
FLASH_ATTN_MODES = ("auto", "on", "off")  # -fa
# -ctk/-ctv: llama.cpp's KV cache types (common/arg.cpp kv_cache_types), and their ggml block
# sizes: a quantized type packs this many values of a head's row together
CACHE_TYPES = {"f32": 1, "f16": 1, "bf16": 1, "q8_0": 32, "q4_0": 32, "q4_1": 32, "iq4_nl": 32, "q5_0": 32, "q5_1": 32}
LOAD_MODES = ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")  # -lm (llama_load_mode, from -1)
SPLIT_MODES = ("none", "layer", "row", "tensor")  # -sm (llama_split_mode)


@dataclass(frozen=True)
class NgramSettings:
    n: int | None = None   # length of the n-gram looked up; None: NGRAM_N_FIXED or NGRAM_N_AUTO
    m: int = 48            # most tokens proposed after a match
    min_hits: int = 1      # earlier occurrences needed before proposing

    def size(self, auto: bool) -> int:
        return self.n if self.n is not None else NGRAM_N_AUTO if auto else NGRAM_N_FIXED

    def validate(self, flag: str) -> None:
        if not 1 <= self.size(False) <= 1024 or not 1 <= self.m <= 1024:
            raise UsageError(f"{flag}: n-gram sizes must be in [1, 1024], got n={self.n} m={self.m}")
        if self.min_hits < 1:
            raise UsageError(f"{flag}: min-hits must be >= 1, got {self.min_hits}")


@dataclass(frozen=True)
class NgramMapK4vSettings(NgramSettings):
    """ngram-map-k4v (llama.cpp's common_ngram_map with values): as the other n-gram lookups,
    but llama.cpp bounds its drafts by its own m, not by --draft-max."""

    def own_limit(self, draft_max: int | None) -> int:
        """The most it drafts: its m, and the given --draft-max (None: not given) below that."""
        return self.m if draft_max is None else min(self.m, draft_max)


@dataclass(frozen=True)
class NgramModSettings:
    """ngram-mod (llama.cpp's common_ngram_mod): a draft continues while the hash table knows
    what follows the last n_match tokens, up to n_max tokens, and is dropped when shorter than
    n_min. llama.cpp's defaults, which are also what its --spec-default sets."""
    n_match: int = 24
    n_min: int = 48
    n_max: int = 64

    def own_limit(self, draft_max: int | None) -> int:
        """The most it drafts: its n_max, and the given --draft-max (None: not given) below that."""
        return self.n_max if draft_max is None else min(self.n_max, draft_max)

    def validate(self, flag: str = "") -> None:
        """llama.cpp's range checks (common/arg.cpp)."""
        for flag, value, least in (("--spec-ngram-mod-n-match", self.n_match, 1),
                                   ("--spec-ngram-mod-n-min", self.n_min, 0),
                                   ("--spec-ngram-mod-n-max", self.n_max, 0)):
            if not least <= value <= 1024:
                raise UsageError(f"{flag} must be between {least} and 1024 inclusive, got {value}")


NGRAM_CACHE_DRAFT = 8  # llama.cpp's ngram-cache type drafts 8 tokens (common/speculative.cpp)


@dataclass(frozen=True)
class NgramCacheSettings:
    """ngram-cache's files, as llama.cpp's -lcs and -lcd: a static cache only read (written by
    llama-lookup-create), a dynamic one read at start and replaced by what it learned."""
    static: Path | None = None
    dynamic: Path | None = None

    def own_limit(self, draft_max: int | None) -> int:
        """The most it drafts: llama.cpp's 8, or the given --draft-max (llama-lookup's length)."""
        return NGRAM_CACHE_DRAFT if draft_max is None else draft_max

    def validate(self, flag: str = "") -> None:
        """Nothing to check in the settings themselves: the files are checked where they are
        named (the flags, before any model loads) and read (drafters/ngram_cache.py)."""


@dataclass(frozen=True)
class SpecSettings:
    types: tuple[str, ...] = ("auto",)  # --spec-type: drafters, tried in order, or auto over them
    draft_max: int = DRAFT_MAX_FIXED    # most tokens drafted per step
    draft_min: int = 0      # drafts shorter than this are not verified
    draft_p_min: float = 0.0  # the draft stops when its top candidate is less likely than this
    n_predict: int = -1     # hard cap on generated tokens; -1: until EOS or context full
    ignore_eos: bool = False
    # llama.cpp's context shift: at a full context, the first n_keep tokens stay (-1: the prompt),
    # n_discard after them (0: half of the rest) are dropped, and generation goes on (loop.shift)
    context_shift: bool = False
    n_keep: int = 0
    n_discard: int = 0
    accept: str = "match"  # --spec-accept: how sampled drafts are verified (SPEC_ACCEPT)
    branches: int = 1       # -np: the draft model's most branches per step (1: a chain)
    p_split: float = 0.1    # --draft-p-split: a candidate this likely to the draft starts a branch
    ngram_simple: NgramSettings = NgramSettings()
    ngram_map_k: NgramSettings = NgramSettings()
    ngram_map_k4v: NgramMapK4vSettings = NgramMapK4vSettings()
    ngram_mod: NgramModSettings = NgramModSettings()
    ngram_cache: NgramCacheSettings = NgramCacheSettings()
    draft_max_given: bool = False  # --draft-max was given: it caps llama.cpp's n-gram types too,
                                   # which otherwise draft up to their own maximum (own_limit)
    synth_len: float | None = None  # --spec-synth-len: synthetic acceptance's mean length (synthetic_probs)
    synth_rates: tuple[float, ...] = ()  # --spec-synth-rates: its chance per drafted position

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafter types named, without 'auto' and 'none'."""
        return tuple(t for t in self.types if t not in ("auto", "none"))

    @property
    def auto(self) -> bool:
        return "auto" in self.types

    def own(self, name: str) -> object | None:
        """Drafter type `name`'s own settings: the field named after it (ngram-mod: ngram_mod), or
        None for a type without any (drafters/registry.py declares which types have them)."""
        return getattr(self, name.replace("-", "_"), None)

    def draft_limit(self, name: str) -> int:
        """The most tokens drafter `name` drafts in a step. llama.cpp bounds its own n-gram
        types by their own settings (own_limit), not by the draft model's --spec-draft-n-max
        (our --draft-max), which caps them too only when given; every other drafter drafts up
        to --draft-max."""
        own = getattr(self.own(name), "own_limit", None)
        return self.draft_max if own is None else own(self.draft_max if self.draft_max_given else None)

    @property
    def step_max(self) -> int:
        """The most drafted tokens one step may verify: the largest of the drafters' limits."""
        return max((self.draft_limit(t) for t in self.drafters), default=self.draft_max)

    @property
    def longest_draft(self) -> int:
        """The most drafted tokens one step may verify (and roll back)."""
        return 0 if self.types == ("none",) else self.step_max

    def synthetic_probs(self) -> tuple[float, ...]:
        """llama.cpp's synthetic acceptance (benchmarking only: --spec-synth-len, --spec-synth-rates,
        common_speculative_synth_rates_resolve): drafted token i is kept with chance probs[i] once
        the ones before it were, whatever the target picks; () without it. Given a mean length L
        (the target's token included), rates p, p^2, ... with 1 + p + ... + p^n_max = L; the
        probabilities are each rate over the one before it. UsageError for what llama.cpp refuses."""
        if self.synth_len is None and not self.synth_rates:
            return ()
        n_max = self.step_max
        if self.synth_len is not None and self.synth_rates:
            raise UsageError("--spec-synth-len and --spec-synth-rates are mutually exclusive")
        if self.synth_rates:
            rates = self.synth_rates
            if len(rates) != n_max:
                raise UsageError(f"--spec-synth-rates must have {n_max} values (--draft-max), got {len(rates)}")
            if not all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in rates):
                raise UsageError("--spec-synth-rates must be finite and within [0, 1]")
            if any(b > a for a, b in zip(rates, rates[1:])):
                raise UsageError("--spec-synth-rates must be monotonically non-increasing")
        else:
            if not (math.isfinite(self.synth_len) and 1.0 <= self.synth_len <= n_max + 1):
                raise UsageError(f"--spec-synth-len must be finite and within [1, {n_max + 1}], got {self.synth_len}")
            p = 1.0 if self.synth_len == n_max + 1 else 0.0
            if 1.0 < self.synth_len < n_max + 1:  # llama.cpp's bisection, 32 rounds
                lo, hi = 0.0, 1.0
                for _ in range(32):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if sum(mid ** (j + 1) for j in range(n_max)) < self.synth_len - 1 else (lo, mid)
                p = (lo + hi) / 2
            rates = tuple(p ** (i + 1) for i in range(n_max))
        return tuple(r / before if before > 0 else 0.0 for r, before in zip(rates, (1.0, *rates)))

    def validate(self) -> None:
        """The checks that hold whatever the types: drafters/registry.py's check() runs these after
        its own of the types and their settings."""
        if self.accept not in SPEC_ACCEPT:
            raise UsageError(f"--spec-accept: expected one of {', '.join(SPEC_ACCEPT)}, got {self.accept!r}")
        if self.draft_max < 1 and self.types != ("none",):
            raise UsageError(f"--draft-max must be >= 1, got {self.draft_max} (--spec-type none: no drafting)")
        if self.draft_min < 0:
            raise UsageError(f"--draft-min must be >= 0, got {self.draft_min}")
        if self.draft_min > self.step_max:
            raise UsageError(f"--draft-min ({self.draft_min}) is larger than --draft-max ({self.step_max})")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise UsageError(f"--draft-p-min must be in [0, 1], got {self.draft_p_min}")
        if not 1 <= self.branches <= MAX_BRANCHES:
            raise UsageError(f"draft branches (-np, --draft-branches) must be in [1, {MAX_BRANCHES}], "
                             f"got {self.branches}")
        if not 0.0 <= self.p_split <= 1.0:
            raise UsageError(f"--draft-p-split must be in [0, 1], got {self.p_split}")
        if self.n_predict < -1:
            raise UsageError(f"-n/--n-predict must be -1 (no limit) or >= 0, got {self.n_predict}")
        if self.synthetic_probs() and self.branches > 1:
            raise UsageError("--spec-synth-*: synthetic acceptance verifies draft chains only (no -np branches)")


@dataclass(frozen=True)
class ModelSpec:
    """A model file and how it loads: the model flags (-m/-md, -c, -ngl, -t, -fa, --lora, -dev, and
    llama.cpp's memory flags: -ctk/-ctv, -ub, -lm, -sm/-ts/-mg, -ot and the MoE placements)."""
    path: Path
    name: str
    n_ctx: int = 4096
    n_batch: int = 2048
    n_gpu_layers: int = -1
    n_threads: int | None = None
    n_threads_batch: int | None = None  # -tb: threads for batches of more than one token (None: n_threads)
    flash_attn: str = "auto"
    n_seq: int = 1  # KV-cache sequences per request: the most draft-tree branches
    n_slots: int = 1  # requests decoded together (serve's and batch's -np), each with n_seq sequences
    kv_unified: bool = True  # one pool of cells for every sequence (else -c / n_slots each: --no-kv-unified)
    n_rs_seq: int = 0  # a recurrent state's snapshots: the longest draft it can undo directly (cache.py)
    loras: tuple[tuple[Path, float], ...] = ()  # LoRA adapters and their scales
    mtp: bool = False  # load its NextN (MTP) layers, where it has them, to draft with (draft-mtp)
    mtp_sidecar: Path | None = None  # an MTP head file (-md) that drafts for it instead (draft-mtp)
    feature_drafter: Path | None = None  # an EAGLE-3, DFlash or DSpark drafter (-md) reading its layer inputs
    devices: tuple[str, ...] | None = None  # devices for its offloaded layers (None: llama.cpp's choice)
    cache_type_k: str = "f16"  # -ctk/-ctv (the draft's: -ctkd/-ctvd), CACHE_TYPES
    cache_type_v: str = "f16"
    n_ubatch: int = 512  # -ub: most tokens in one physical batch (at most n_batch)
    load_mode: str = "auto"  # -lm, LOAD_MODES
    repack: bool = True  # weights repacked for the CPU's kernels (llama.cpp's extra buffer types; -nr: not)
    split_mode: str = "layer"  # -sm, SPLIT_MODES
    tensor_split: tuple[float, ...] = ()  # -ts: each device's share of the layers (empty: by free memory)
    main_gpu: int = 0  # -mg
    overrides: tuple[tuple[str, str], ...] = ()  # -ot, -cmoe, -ncmoe, -ncffn: (regex, buffer type), first match wins
    # a head drafting beside it (MTP head, EAGLE-3, DFlash) takes the draft's -ctkd/-ctvd and -otd/-cmoed
    head_cache_types: tuple[str, str] = ("f16", "f16")
    head_overrides: tuple[tuple[str, str], ...] = ()
    chat_template: str | None = None  # --chat-template: its own (a Jinja template, or a llama.cpp format's name)
    jinja: bool = True  # chats through the Jinja template; False (--no-jinja): llama.cpp's built-in formats

    def lora_info(self) -> list[dict]:
        """The adapters, for JSON output."""
        return [{"path": str(path), "scale": scale} for path, scale in self.loras]


def acceptance(sampling: SamplerSettings, spec: SpecSettings) -> str:
    """How drafted tokens are verified, decided once for the engine, the drafter and the loop:
    "greedy" (the target's argmax must match), "match" (the target samples and a drafted token
    is kept when it is the one drawn), "rejection" (speculative sampling: the draft model
    samples too, and a token is kept with probability min(1, p/q)), or "synthetic" (kept at
    random, benchmarking only: SpecSettings.synthetic_probs)."""
    if spec.synthetic_probs():
        return "synthetic"
    if sampling.greedy:
        return "greedy"
    return spec.accept


def check_prompt(prompt: Sequence[int], n_ctx: int, n_predict: int) -> None:
    """A prompt must leave room in the context for at least one generated token."""
    if not prompt:
        raise GenerationError("the prompt is empty (no tokens)")
    if len(prompt) >= n_ctx:
        raise GenerationError(
            f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}, "
            f"leaving no room to generate; raise -c/--ctx-size (to at least {len(prompt) + max(n_predict, 1)})"
        )
