"""Counters and timings of one generation, built from its events (stream.py adds them up)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

from speculative.decoding.events import Done, Event, Prefilled, PromptCache, Step, Token


@dataclass
class Stats:
    n_prompt: int = 0
    n_cached: int = 0           # of n_prompt, tokens kept in the cache from the previous run
    n_restored: int = 0         # of n_cached, tokens restored from the prompt cache file
    n_predict: int = 0          # tokens generated (end-of-generation token excluded)
    n_drafted: int = 0          # tokens proposed by drafters and verified
    n_accept: int = 0           # drafted tokens the target accepted
    n_steps: int = 0            # target forward passes after the prompt
    n_draft_steps: int = 0      # steps that verified a draft
    n_from_draft: int = 0       # emitted tokens that were accepted drafted tokens
    drafted_at: list[int] = field(default_factory=list)   # per draft position: times drafted
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted
    accepted_lengths: Counter = field(default_factory=Counter)  # m -> number of drafting steps
    plans: Counter = field(default_factory=Counter)  # (drafter or "none", k) -> steps
    passes: Counter = field(default_factory=Counter)  # (requests, tokens) in the target's pass -> steps
    n_tree_steps: int = 0       # steps that verified a draft tree (more than one branch)
    max_branches: int = 1
    branch_steps: Counter = field(default_factory=Counter)     # branch -> tree steps accepted along it
    branch_accepted: Counter = field(default_factory=Counter)  # branch -> drafted tokens accepted on it
    t_load: float = 0.0
    t_encode: float = 0.0
    t_restore: float = 0.0      # reading and loading the prompt cache file (before t_encode)
    t_save: float = 0.0         # writing it (after t_encode, before t_decode)
    t_decode: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_llama: float = 0.0        # of t_decode, the time inside llama.cpp (both models)
    t_plan: float = 0.0         # of t_decode, auto's own planning and scoring (its drafters' calls not included)
    finish_reason: str | None = None
    incomplete: bool = False    # cut by -n or the context before its grammar was complete
    t_grammar: float = 0.0      # of t_decode, the grammar's own checks
    n_shifted: int = 0          # tokens context shifts dropped
    n_certain: int = 0          # tokens a grammar admitted alone (forced, kind a): no row sampled
    n_forced_drafted: int = 0   # forced text drafted as the model spells it (kind b) ...
    n_forced_accept: int = 0    # ... and accepted

    def add(self, event: Event) -> None:
        if isinstance(event, Token):
            self.n_predict += 1
            self.n_from_draft += event.from_draft
        elif isinstance(event, Step):
            self.n_steps += 1
            self.t_draft += event.t_draft
            self.t_verify += event.t_verify
            self.plans[(event.drafter or "none", event.n_drafted)] += 1
            self.passes[(event.n_seqs, event.n_pass or event.n_drafted + 1)] += 1
            if event.n_drafted:
                self._add_draft(event.n_drafted, event.n_accepted)
            self.n_certain += event.n_certain
            if event.drafter == "forced":
                self.n_forced_drafted += event.n_drafted - event.n_certain
                self.n_forced_accept += event.n_accepted - event.n_certain
            if event.n_branches > 1:
                self.n_tree_steps += 1
                self.max_branches = max(self.max_branches, event.n_branches)
                if event.n_accepted:
                    self.branch_steps[event.branch] += 1
                    self.branch_accepted[event.branch] += event.n_accepted
        elif isinstance(event, Prefilled):
            self.n_prompt = event.n_prompt
            self.n_cached = event.n_cached
            self.t_encode = event.seconds
        elif isinstance(event, PromptCache):
            self.n_restored = event.n_restored
            self.t_restore = event.t_restore
            self.t_save = event.t_save
        elif isinstance(event, Done):
            self.finish_reason = event.reason
            self.t_decode = event.t_decode
            self.incomplete = event.incomplete
            self.t_grammar = event.t_grammar
            self.n_shifted = event.n_shifted

    def merge(self, other: "Stats") -> None:
        """Add another run's statistics (a conversation's turns summed): counts, times and
        histograms add up; the load time is this one's, the finish the latest run's."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "t_load":
                continue
            if f.name == "max_branches":
                self.max_branches = max(mine, theirs)
            elif isinstance(mine, Counter):
                mine.update(theirs)
            elif isinstance(mine, list):
                grow = len(theirs) - len(mine)
                mine += [0] * max(grow, 0)
                for i, n in enumerate(theirs):
                    mine[i] += n
            elif isinstance(mine, (int, float)) and not isinstance(mine, bool):
                setattr(self, f.name, mine + theirs)
            else:  # the finish and whether the grammar was left incomplete: the latest run's
                setattr(self, f.name, theirs)

    def _add_draft(self, k: int, m: int) -> None:
        self.n_draft_steps += 1
        self.n_drafted += k
        self.n_accept += m
        self.accepted_lengths[m] += 1
        grow = k - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(k):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < m

    # -- derived ---------------------------------------------------------

    @property
    def accept_rate(self) -> float:
        return self.n_accept / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafted tokens per step that verified a draft."""
        return self.n_accept / self.n_draft_steps if self.n_draft_steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per target forward pass (1.0 without speculation)."""
        return self.n_predict / self.n_steps if self.n_steps else 0.0

    @property
    def accept_rate_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def python_seconds_per_token(self) -> float:
        """Generation time spent outside llama.cpp, per generated token."""
        return max(self.t_decode - self.t_llama, 0.0) / self.n_predict if self.n_predict else 0.0

    @property
    def python_share(self) -> float:
        return max(self.t_decode - self.t_llama, 0.0) / self.t_decode if self.t_decode > 0 else 0.0

    @property
    def encode_tps(self) -> float:
        """Prompt tokens processed per second (those kept from the cache are not counted). The
        prompt's last token is decoded by the first step, so with all others kept nothing was
        processed here and there is no rate."""
        processed = self.n_prompt - self.n_cached
        return processed / self.t_encode if self.t_encode > 0 and processed > 1 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.n_predict / self.t_decode if self.t_decode > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "finish_reason": self.finish_reason,
            **({"grammar_incomplete": True} if self.incomplete else {}),
            **({"t_grammar_s": self.t_grammar} if self.t_grammar else {}),
            **({"n_certain": self.n_certain, "n_forced_drafted": self.n_forced_drafted,
                "n_forced_accept": self.n_forced_accept} if self.n_certain or self.n_forced_drafted else {}),
            "n_prompt": self.n_prompt,
            "n_cached": self.n_cached,
            "n_restored": self.n_restored,
            "n_predict": self.n_predict,
            "n_drafted": self.n_drafted,
            "n_accept": self.n_accept,
            "n_steps": self.n_steps,
            "n_draft_steps": self.n_draft_steps,
            "accept_rate": self.accept_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_step": self.tokens_per_step,
            "accept_rate_by_position": self.accept_rate_by_position,
            "accepted_length_histogram": {str(m): n for m, n in sorted(self.accepted_lengths.items())},
            "plans": [{"drafter": d, "k": k, "steps": n} for (d, k), n in sorted(self.plans.items())],
            "passes": [{"sequences": s, "tokens": t, "steps": n} for (s, t), n in sorted(self.passes.items())],
            "tree_steps": self.n_tree_steps,
            "branches": [{"branch": b, "steps": self.branch_steps[b], "accepted": self.branch_accepted[b]}
                         for b in sorted(self.branch_steps)],
            "t_load_s": self.t_load,
            "t_encode_s": self.t_encode,
            "t_restore_s": self.t_restore,
            "t_save_s": self.t_save,
            "t_decode_s": self.t_decode,
            "t_draft_s": self.t_draft,
            "t_verify_s": self.t_verify,
            "t_llama_s": self.t_llama,
            "python_ms_per_token": 1000 * self.python_seconds_per_token,
            "python_share": self.python_share,
            "t_plan_s": self.t_plan,
            "plan_share": self.t_plan / self.t_decode if self.t_decode > 0 else 0.0,
            "encode_tps": self.encode_tps,
            "decode_tps": self.decode_tps,
        }
