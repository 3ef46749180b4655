"""drafters/registry.py declares each drafter type once: every list elsewhere that names types
(the code's, --spec-type's help, README's table, auto's choices) is held to it here, and each
entry's parts (settings, flags, what it needs, auto's prior) hold together."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from speculative.decoding.settings import SpecSettings
from speculative.drafters.registry import ALIASES, DRAFT, GRAMMAR, HEAD, POOL, SPEC_TYPES, TYPES, canonical, check, heads
from speculative.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"""["'`]((?:draft|ngram)-[a-z0-9-]+|draft|forced)["'`]""")


def test_no_module_names_a_type_the_registry_does_not_declare():
    """A type's name in code elsewhere (a check, a message, a list) is one the registry declares:
    a type renamed or removed there cannot live on in another list."""
    stray = {}
    for path in [*(ROOT / "speculative").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        names = set(NAME.findall(path.read_text())) - set(TYPES) - set(ALIASES)
        names -= {"draft-max", "draft-min", "draft-p-min", "ngram-n", "ngram-m", "ngram-min-hits"}  # bench's --sweep keys
        if names:
            stray[path.relative_to(ROOT).as_posix()] = sorted(names)
    assert stray == {}


def test_readme_and_help_name_every_type():
    readme = (ROOT / "README.md").read_text()
    head = "| `--spec-type` | what drafts |\n|---|---|\n"
    table = readme[readme.index(head) + len(head):]
    table = table[:table.index("\n\n")]
    named = {name for cell in re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE)
             for name in re.findall(r"`([a-z0-9-]+)`", cell)}
    assert set(SPEC_TYPES) <= named <= set(SPEC_TYPES) | set(ALIASES)
    from speculative.cli.options import SPEC_TYPE

    for name in SPEC_TYPES:
        assert re.search(rf"\b{name}\b", SPEC_TYPE.help), name
    for alias in ALIASES:
        assert alias in SPEC_TYPE.help and alias in readme


def test_each_types_settings_are_the_field_of_its_name_and_its_flags_set_them():
    declared = {f.name: f for f in fields(SpecSettings)}
    for kind in TYPES.values():
        if kind.settings is None:
            assert kind.flags == () and kind.settings_field not in declared, kind.name
            continue
        assert isinstance(getattr(SpecSettings(), kind.settings_field), kind.settings), kind.name
        own = {f.name for f in fields(kind.settings)}
        assert {flag.field for flag in kind.flags} <= own, kind.name
        assert all(name.startswith("-") for flag in kind.flags for name in flag.names)


def test_what_each_type_needs_is_named_and_auto_has_a_prior_for_each_choice():
    for kind in TYPES.values():
        assert kind.needs in ("", DRAFT, HEAD, POOL, GRAMMAR), kind.name
        assert bool(kind.model) == (kind.needs in (DRAFT, HEAD)), kind.name
        assert kind.refusal("t.gguf").startswith("--spec-type " + kind.name) if kind.needs else True
        assert 0 < kind.prior < 1 and all(0 < p < 1 for p in kind.priors.values())
        assert not (kind.auto and kind.own_limit), kind.name  # auto plans every k: no own maximum


def test_types_with_their_own_maximum_draft_up_to_it_and_auto_refuses_them():
    spec = SpecSettings(types=("ngram-mod",))
    assert spec.draft_limit("ngram-mod") == spec.ngram_mod.n_max
    assert spec.draft_limit("ngram-simple") == spec.draft_max
    for kind in TYPES.values():
        if kind.own_limit:
            with pytest.raises(UsageError, match=f"auto chooses among .*not {kind.name}"):
                check(SpecSettings(types=("auto", kind.name)))


def test_names_are_checked_and_aliases_read_as_speculates_own():
    with pytest.raises(UsageError, match="unknown type sideways"):
        check(SpecSettings(types=("sideways",)))
    with pytest.raises(UsageError, match="none cannot be combined"):
        check(SpecSettings(types=("none", "draft")))
    assert canonical(["draft-simple", "ngram-mod"]) == ("draft", "ngram-mod")
    assert heads(SpecSettings(types=("auto",))) == ("auto", "auto")
    assert heads(SpecSettings(types=("draft-dflash",))) == (None, "draft-dflash")
    assert heads(SpecSettings(types=("draft-mtp", "ngram-simple"))) == ("named", None)


def test_docs_flags_names_each_types_flags():
    """docs/flags.md's speculation row names every type's own flags (the per-type n-gram sizes
    as `--spec-ngram-KIND-*`)."""
    doc = (ROOT / "docs" / "flags.md").read_text()
    for kind in TYPES.values():
        for flag in kind.flags:
            for name in flag.names:
                assert name in doc or re.sub(r"-(size-[nm]|min-hits)$", "-*", name) in doc, name
