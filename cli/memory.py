"""llama.cpp's model and memory flags: KV cache types (-ctk/-ctv, the draft's -ctkd/-ctvd), tensor
placement (-ot/-otd, -cmoe/-ncmoe/-ncffn and the draft's -cmoed/-ncmoed), -ub, -lm (and older
llama.cpp's --mlock/--mmap/--no-mmap), -sm/-ts/-mg
and --swa-full, checked as llama.cpp checks them, and earlier where it fails late: values before
anything loads, buffer types once the devices (--rpc's included) are known, head sizes and
tensor names from the GGUF files before llama.cpp reads them."""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from typing import Optional, Sequence

from speculative.decoding.settings import CACHE_TYPES, LOAD_MODES, SPLIT_MODES, ModelSpec
from speculative.errors import UsageError

# llama.cpp's patterns (common/common.h): the expert tensors of a MoE layer, and a dense FFN's
FFN_EXPS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
FFN_DENSE = r"\.ffn_(up|down|gate)\."
CPU = "CPU"  # the host's buffer type, as -cmoe places experts


def check_values(o) -> None:
    """What the flags of ModelOptions `o` say on their own (exit 2 before anything loads)."""
    for flag, value in (("-ctk/--cache-type-k", o.cache_type_k), ("-ctv/--cache-type-v", o.cache_type_v),
                        ("-ctkd/--spec-draft-type-k", o.cache_type_k_draft),
                        ("-ctvd/--spec-draft-type-v", o.cache_type_v_draft)):
        if value not in CACHE_TYPES:
            raise UsageError(f"{flag}: unsupported cache type {value!r} (valid: {', '.join(CACHE_TYPES)})")
    load_mode(o)
    for flag, value, valid in (("-lm/--load-mode", o.load_mode, LOAD_MODES),
                               ("-sm/--split-mode", o.split_mode, SPLIT_MODES)):
        if value not in valid:
            raise UsageError(f"{flag}: invalid value {value!r} (valid: {', '.join(valid)})")
    for flag, value, least in (("-ub/--ubatch-size", o.ubatch_size, 1), ("-ncmoe/--n-cpu-moe", o.n_cpu_moe, 0),
                               ("-ncffn/--n-cpu-ffn", o.n_cpu_ffn, 0),
                               ("-ncmoed/--spec-draft-n-cpu-moe", o.n_cpu_moe_draft, 0),
                               ("-mg/--main-gpu", o.main_gpu, 0)):
        if value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    for flag, v in (("-ctv/--cache-type-v", o.cache_type_v), ("-ctvd/--spec-draft-type-v", o.cache_type_v_draft)):
        if CACHE_TYPES[v] > 1 and o.flash_attn == "off":
            raise UsageError(f"{flag} {v}: a quantized V cache needs flash attention, which -fa off turns off "
                             "(give -fa auto or on, or an unquantized V cache type)")


def load_mode(o) -> str:
    """-lm, or what older llama.cpp's --mlock, --mmap and --no-mmap say of loading (the pinned
    llama.cpp has -lm only): the weights mapped or read in, and locked in RAM or not."""
    if not o.mlock and o.mmap is None:
        return o.load_mode
    if o.load_mode != ModelSpec.load_mode:
        raise UsageError(f"-lm/--load-mode {o.load_mode} and --mlock/--mmap/--no-mmap both say how the weights "
                         "load; give one of them")
    if o.mmap is False:
        return "mlock" if o.mlock else "none"
    return "mmap+mlock" if o.mlock else "mmap"


def tensor_split(value: Optional[str], max_devices: int) -> tuple[float, ...]:
    """-ts as llama.cpp reads it: proportions split by ',' or '/', fewer than its maximum devices."""
    if value is None:
        return ()
    try:
        shares = tuple(float(item) for item in re.split(r"[,/]+", value))
    except ValueError:
        raise UsageError(f"-ts/--tensor-split: expected numbers like 3,1, got {value!r}") from None
    if len(shares) >= max_devices:  # llama.cpp's own bound (common/arg.cpp): at most max - 1
        raise UsageError(f"-ts/--tensor-split: {len(shares)} values, but llama.cpp takes fewer than its "
                         f"{max_devices} devices")
    return shares


# What Python's `re` reads and std::regex's ECMAScript grammar does not (llama.cpp would throw on it)
_NOT_ECMASCRIPT = re.compile(r"\(\?(P[<=]|<[=!]|#|[aiLmsux-]+[:)]|>)|\\[AZz]|[*+?}][+]")


def overrides(values: Optional[Sequence[str]], cpu_moe: bool, n_cpu_moe: int, n_cpu_ffn: int,
              flag: str) -> tuple[tuple[str, str], ...]:
    """(pattern, buffer type) in the order llama.cpp tries them: -ot's items as given, then -cmoe's
    and -ncmoe's expert patterns and -ncffn's dense ones (llama.cpp keeps the command line's order;
    here -ot comes first). Each pattern is checked as a regular expression."""
    out = []
    for value in values or ():
        for item in value.split(","):
            pattern, eq, buft = item.partition("=")
            if not eq or not pattern or not buft:
                raise UsageError(f"{flag}: expected <tensor name pattern>=<buffer type>, got {item!r}")
            out.append((_checked_regex(pattern, flag), buft))
    if cpu_moe:
        out.append((FFN_EXPS, CPU))
    out += [(f"blk\\.{i}{FFN_EXPS}", CPU) for i in range(n_cpu_moe)]
    out += [(f"blk\\.{i}{FFN_DENSE}", CPU) for i in range(n_cpu_ffn)]
    return tuple(out)


def _checked_regex(pattern: str, flag: str) -> str:
    bad = _NOT_ECMASCRIPT.search(pattern)
    if bad:
        raise UsageError(f"{flag}: invalid regular expression {pattern!r}: {bad.group(0)!r} at {bad.start()} is "
                         "not ECMAScript (std::regex, which llama.cpp reads it with)")
    try:
        re.compile(pattern)
    except re.error as e:
        raise UsageError(f"{flag}: invalid regular expression {pattern!r}: {e}") from None
    return pattern


def check_buffer_types(placed: Sequence[tuple[str, str]], flag: str) -> None:
    """Every buffer type named is one of the devices' (llama.cpp's "unknown buffer type")."""
    from speculative.llamacpp.devices import buffer_types

    known = buffer_types()
    for _, buft in placed:
        if buft not in known:
            raise UsageError(f"{flag}: unknown buffer type {buft!r} (available: {', '.join(known)})")


def check_model(spec: ModelSpec, flags: tuple[str, str], ot_flag: str) -> None:
    """Before llama.cpp reads the file: a quantized cache type whose block does not divide the
    model's head size exits 2 (llama.cpp refuses the context later); an -ot pattern that matches
    none of its tensors is a note (llama.cpp says nothing)."""
    from speculative.models.gguf_meta import head_sizes, tensor_names

    blocked = CACHE_TYPES[spec.cache_type_k] > 1 or CACHE_TYPES[spec.cache_type_v] > 1
    sizes = head_sizes(spec.path) if blocked else None
    for flag, kind, sizes_of, value in ((flags[0], "K", 0, spec.cache_type_k), (flags[1], "V", 1, spec.cache_type_v)):
        block = CACHE_TYPES[value]
        odd = sorted(n for n in (sizes[sizes_of] if sizes else ()) if n % block)
        if odd:
            raise UsageError(f"{flag} {value}: its blocks of {block} values do not divide {spec.name}'s {kind} "
                             f"head size {odd[0]}; give a type whose block does (f16, bf16, f32)")
    wanted = [pattern for pattern, _ in spec.overrides if pattern not in _BUILT_IN]
    if wanted:
        names = tensor_names(spec.path)
        for pattern in dict.fromkeys(wanted):
            if not any(re.search(pattern, name) for name in names):
                print(f"{ot_flag} {pattern}: matches none of {spec.name}'s tensors", file=sys.stderr)


_BUILT_IN = (FFN_EXPS,)  # -cmoe on a dense model: llama.cpp's pattern, said nothing of


def apply(target: ModelSpec, draft: Optional[ModelSpec], o, placed: tuple, placed_draft: tuple,
          split: tuple[float, ...]) -> tuple[ModelSpec, Optional[ModelSpec]]:
    """The flags on the models' specs, as llama.cpp gives them (common_base_params_to_speculative):
    the draft (or a head drafting beside the target) takes -ctkd/-ctvd and -otd/-cmoed/-ncmoed;
    -ub, -fa, -lm, -nr, -sm, -ts and -mg follow the target."""
    shared = dict(n_ubatch=o.ubatch_size, load_mode=load_mode(o), split_mode=o.split_mode,
                  tensor_split=split, main_gpu=o.main_gpu, repack=o.repack)
    drafts = dict(cache_type_k=o.cache_type_k_draft, cache_type_v=o.cache_type_v_draft)
    target = replace(target, **shared, cache_type_k=o.cache_type_k, cache_type_v=o.cache_type_v, overrides=placed,
                     head_cache_types=(o.cache_type_k_draft, o.cache_type_v_draft), head_overrides=placed_draft)
    check_model(target, ("-ctk", "-ctv"), "-ot")
    if draft is not None:
        draft = replace(draft, **shared, **drafts, overrides=placed_draft)
        check_model(draft, ("-ctkd", "-ctvd"), "-otd")
    for spec, flag in ((target, "-ctv"), (draft, "-ctvd")):
        if spec is not None and CACHE_TYPES[spec.cache_type_v] > 1 and o.flash_attn == "auto":
            print(f"{flag} {spec.cache_type_v}: flash attention on for {spec.name}, which a quantized V cache "
                  "needs (llama.cpp turns it on too)", file=sys.stderr)
    return target, draft
