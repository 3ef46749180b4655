"""Can this draft speculate for this target? llama.cpp's vocabulary rule,
checked from GGUF metadata before any weights are loaded.

The rule (llama.cpp common/speculative.cpp): same tokenizer type; same
add-BOS/add-EOS flags and the same BOS/EOS ids; vocabulary sizes within 128 of
each other; identical token text for every id from 5 up to the smaller size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from speculative.errors import ModelError
from speculative.models.gguf_meta import read_metadata

MAX_SIZE_DIFFERENCE = 128
CHECK_START_ID = 5

_KEYS = {
    "model": "tokenizer.ggml.model",
    "tokens": "tokenizer.ggml.tokens",
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "add_bos": "tokenizer.ggml.add_bos_token",
    "add_eos": "tokenizer.ggml.add_eos_token",
}
# llama.cpp's defaults when a file does not say whether BOS/EOS are added.
_ADD_BOS_DEFAULT = {"llama": True, "bert": True}


@dataclass(frozen=True)
class Vocab:
    path: Path
    type: str
    tokens: list[bytes]
    bos: int | None
    eos: int | None
    add_bos: bool
    add_eos: bool


def read_vocab(path: Path) -> Vocab:
    meta = read_metadata(path, _KEYS.values())
    kind = meta.get(_KEYS["model"])
    tokens = meta.get(_KEYS["tokens"])
    if kind is None or not tokens:
        raise ModelError(f"{path}: the file has no tokenizer (tokenizer.ggml.model/tokens missing)")
    return Vocab(
        path=Path(path),
        type=str(kind),
        tokens=tokens,
        bos=meta.get(_KEYS["bos"]),
        eos=meta.get(_KEYS["eos"]),
        add_bos=bool(meta.get(_KEYS["add_bos"], _ADD_BOS_DEFAULT.get(kind, False))),
        add_eos=bool(meta.get(_KEYS["add_eos"], False)),
    )


def check_compatible(target: Vocab, draft: Vocab) -> None:
    """Raise ModelError (one line) when the draft cannot speculate for the target."""
    where = f"draft {draft.path.name} cannot speculate for target {target.path.name}"
    first = first_differing_token(target, draft)
    at = f"; first differing token id {first}: {_show(target, first)} vs {_show(draft, first)}" \
        if first is not None else ""
    if target.type != draft.type:
        raise ModelError(f"{where}: tokenizer types differ ({target.type} vs {draft.type}){at}")
    for flag, a, b in (("add-BOS", target.add_bos, draft.add_bos), ("add-EOS", target.add_eos, draft.add_eos),
                       ("BOS id", target.bos, draft.bos), ("EOS id", target.eos, draft.eos)):
        if a != b:
            raise ModelError(f"{where}: {flag} differs ({a} vs {b}){at}")
    diff = abs(len(target.tokens) - len(draft.tokens))
    if diff > MAX_SIZE_DIFFERENCE:
        raise ModelError(
            f"{where}: vocabulary sizes {len(target.tokens)} vs {len(draft.tokens)} differ by {diff} "
            f"(at most {MAX_SIZE_DIFFERENCE}){at}"
        )
    if first is not None:
        raise ModelError(f"{where}: vocabularies differ{at}")


def first_differing_token(a: Vocab, b: Vocab) -> int | None:
    """The first id from CHECK_START_ID whose token text differs, up to the smaller size."""
    n = min(len(a.tokens), len(b.tokens))
    if a.tokens[CHECK_START_ID:n] == b.tokens[CHECK_START_ID:n]:
        return None
    return next(i for i in range(CHECK_START_ID, n) if a.tokens[i] != b.tokens[i])


def _show(v: Vocab, token: int) -> str:
    return repr(v.tokens[token].decode("utf-8", errors="replace")) if token < len(v.tokens) else "(none)"
