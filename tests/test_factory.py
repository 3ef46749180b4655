"""The drafter factory (speculative/engine/factory.py), against the fake backend: it builds each
type drafters/registry.py declares, a drafter of that name, refuses one whose model is not
loaded, and what drafters keep between runs is shared by the runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speculative.decoding.cache import Cache
from speculative.decoding.settings import SpecSettings
from speculative.drafters import Chain
from speculative.drafters.auto import Auto
from speculative.drafters.pool import Pool
from speculative.drafters.registry import HEAD, TYPES
from speculative.engine.factory import DrafterFactory
from speculative.errors import UsageError
from tests.fakes import FakeBackend, ToyModel


def factory(draft: bool = True, head_kind: str | None = "draft-mtp", pool: bool = True) -> DrafterFactory:
    """`head_kind`: the kind of head loaded (a type that needs registry.HEAD), or None."""
    caches = {"target": Cache(FakeBackend(ToyModel())), **({"draft": Cache(FakeBackend(ToyModel()))} if draft else {})}
    # enough of an HeadCache to build its drafter
    head = SimpleNamespace(n_ctx=256, head=SimpleNamespace(kind=head_kind)) if head_kind else None
    return DrafterFactory(caches, head, Pool(max_tokens=1000) if pool else None,
                          lambda role, max_batch: [1e-3 * (1 + b) for b in range(max_batch)], target_batch=64)


@pytest.mark.parametrize("name", TYPES)
def test_each_type_builds_a_drafter_of_its_name(name):
    made = factory(head_kind=name if TYPES[name].needs == HEAD else "draft-mtp")
    drafter = made.make(SpecSettings(types=(name,)), constraint=object() if name == "forced" else None)
    assert drafter.name == name


@pytest.mark.parametrize("name, missing, message", [
    ("draft", {"draft": False}, "needs a draft model"),
    ("draft-mtp", {"head_kind": None}, "no NextN"),
    ("draft-mtp", {"head_kind": "draft-eagle3"}, "no NextN"),
    ("draft-eagle3", {"head_kind": None}, "needs an EAGLE-3 drafter"),
    ("draft-eagle3", {"head_kind": "draft-mtp"}, "needs an EAGLE-3 drafter"),
    ("ngram-pool", {"pool": False}, "the pool is off"),
    ("forced", {}, "drafts what a grammar forces: give --grammar"),
])
def test_a_type_without_what_it_drafts_with_is_refused(name, missing, message):
    with pytest.raises(UsageError, match=message):
        factory(**missing).make(SpecSettings(types=(name,)))


def test_none_builds_nothing_several_build_a_chain_and_auto_takes_the_defaults():
    assert factory().make(SpecSettings(types=("none",))) is None
    chain = factory().make(SpecSettings(types=("ngram-mod", "ngram-simple")))
    assert isinstance(chain, Chain) and chain.name == "ngram-mod,ngram-simple"
    made = factory()
    auto = made.make(SpecSettings(types=("auto",)))
    assert isinstance(auto, Auto)
    assert [d.name for d in auto.drafters] == ["ngram-simple", "draft", "draft-mtp"]  # the pool is empty
    made.pool.add(list(range(64)))
    assert [d.name for d in made.make(SpecSettings(types=("auto",))).drafters] == [
        "ngram-simple", "ngram-pool", "draft", "draft-mtp"]


def test_ngram_mod_tables_and_lookup_files_are_shared_by_runs():
    made = factory()
    first, second = (made.make(SpecSettings(types=("ngram-mod", "ngram-cache"))) for _ in range(2))
    assert first.drafters[0].table is second.drafters[0].table
    assert first.drafters[1].files is second.drafters[1].files
