"""`speculate doctor`: the llama.cpp build, and whether greedy speculation is exact on it."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import typer

from . import options, terminal
from .progress import StatusLine
from .render import quiet_pipe


@options.with_options(options.MODELS.only("model", "n_gpu_layers", "threads", "threads_batch", "flash_attn", "rpc",
                                          "device", "verbose", *options.TARGET_MEMORY_FLAGS),
                      options.SLOTS.only("parallel", "kv_unified"))
def doctor_command(
    models: options.ModelOptions,
    slots: options.SlotOptions,
    json_output: bool = typer.Option(False, "--json", help="One JSON object instead of the report."),
    reset_costs: bool = typer.Option(
        False, "--reset-costs",
        help="Forget what passes cost on this machine (auto's prices, learnt as runs go, in costs.json in "
             "speculate's home), of every model or only -m's, and exit: the next run calibrates again."),
) -> None:
    """Report the llama.cpp build and measure whether it scores a position the same alone and
    inside a batch (then greedy speculative output is token-identical to target-only output), and
    a request the same alone and among -np others (then serve's and batch's answers are)."""
    if reset_costs:
        _reset_costs(models)
        return
    n_ctx = 512 if slots.unified() else 512 * slots.n_slots  # 512 for each request either way
    target, _ = replace(models, ctx_size=n_ctx, batch_size=512).specs(use_draft=False)
    target = slots.apply(target)
    from speculative.llamacpp.doctor import batch_invariance, sequence_invariance
    from speculative.engine.engine import Engine  # loads llama.cpp: imported when a model runs (start-up time)
    from speculative.llamacpp.devices import bindings_version, gpu_offload, rpc_available, system_info

    steps = 2 + (slots.n_slots > 1)
    with StatusLine(enabled=not json_output) as status, \
            Engine(target, notify=status.say, progress=status.step(1, steps)) as engine:
        m = engine.target
        checks = batch_invariance(engine.caches["target"], progress=status.step(
            2, steps, "positions alone vs in batches"))
        among = sequence_invariance(m, progress=status.step(
            3, steps, f"a request alone vs among {_others(slots.n_slots - 1)}")) if slots.n_slots > 1 else None
        status.clear()
        report = {
            "llama_cpp_python": bindings_version(), "system_info": system_info(),
            "gpu_offload": gpu_offload(), "rpc": rpc_available(), "model": target.name, "placement": m.placement,
            "n_gpu_layers": m.n_gpu_layers, "threads": m.n_threads, "flash_attn": m.flash_attn,
            "flash_attn_on": m.flash_attn_on, "cache_type_k": m.cache_types[0], "cache_type_v": m.cache_types[1],
            "overrides": [list(o) for o in target.overrides],
            "batch_variant_kernels": m.kernels, "recurrent": m.recurrent, "architecture": m.arch,
            "checks": [c.to_dict() for c in checks],
            "batch_invariant": all(c.max_abs_diff == 0.0 for c in checks),
            "parallel": slots.n_slots, "kv_unified": slots.unified(),
            "sequences": among.to_dict() if among else None,
            "sequence_invariant": among is None or among.max_abs_diff == 0.0,
        }
    with quiet_pipe():
        _print(report, json_output)


def _reset_costs(models: options.ModelOptions) -> None:
    """--reset-costs: every model's costs, or with -m (or -hf) only those of that file."""
    from speculative.engine import costs
    from speculative.files import content_identity

    keep = lambda identity: False  # noqa: E731
    if models.model is not None or models.hf_repo is not None:
        target, _ = models.specs(use_draft=False)
        mine = content_identity(target.path)
        keep = lambda identity: {k: identity.get(k) for k in mine} != mine  # noqa: E731
    forgotten = costs.reset(keep=keep)
    print(f"forgot the costs of {forgotten} model{'s' * (forgotten != 1)} ({costs.book_path()}): the next run "
          "calibrates again", file=sys.stderr)


def _others(n: int) -> str:
    return f"{n} other{'s' * (n > 1)}"


def _print(report: dict, json_output: bool) -> None:
    if json_output:
        print(json.dumps(report))
        return
    columns = terminal.width(sys.stdout)
    for line in _report_lines(report, columns):
        print(line)


def _report_lines(report: dict, columns: int | None) -> list[str]:
    """The report as lines of at most `columns`, each item broken only between words, or between
    fields where a field has spaces of its own ("-ngl -1", "AVX2 = 1")."""
    out = terminal.wrap(
        f"llama-cpp-python {report['llama_cpp_python']}, GPU offload "
        f"{'supported' if report['gpu_offload'] else 'not available (no GPU this build can use)'}, RPC "
        f"{'built in (--rpc, speculate rpc-server)' if report['rpc'] else 'not built in'}", columns)
    system = [f.strip() for f in report["system_info"].strip().rstrip("|").split(" | ")]
    out += terminal.fields([f"llama.cpp: {system[0]}", *system[1:]], columns, " | ")
    out += terminal.fields([
        f"model: {report['model']} ({report['architecture']}"
        f"{', recurrent layers: probed at every position of a batch' if report['recurrent'] else ''})",
        f"{report['threads']} threads", f"-ngl {report['n_gpu_layers']}",
        f"-fa {report['flash_attn']} ({'on' if report['flash_attn_on'] else 'off'})",
        f"KV cache K {report['cache_type_k']} V {report['cache_type_v']}",
        f"layers on {'the CPU' if report['placement'] == 'cpu' else 'a GPU'}",
        *(f"{pattern} in {buft}" for pattern, buft in report["overrides"])], columns, ", ")
    out += terminal.wrap("kernels of this build and settings that may change with batch size: "
                         f"{', '.join(report['batch_variant_kernels']) or 'none'} (measured below)", columns)
    return out + [line for paragraph in _findings(report) for line in terminal.wrap(paragraph, columns)]


def _findings(report: dict) -> list[str]:
    """What was measured, and the verdict."""
    out = []
    checks = report["checks"]
    for cached in sorted({c["cached"] for c in checks}):
        row = [c for c in checks if c["cached"] == cached]
        differ = [c for c in row if c["max_abs_diff"] != 0.0]
        detail = ("bit-identical in every batch" if not differ else
                  f"differs in batches {', '.join(str(c['batch']) for c in differ)} "
                  f"(max |logit difference| {max(c['max_abs_diff'] for c in differ):.3g})")
        out.append(f"positions after {cached} cached tokens, one at a time vs in a batch of "
                   f"{row[0]['batch']}-{row[-1]['batch']}: {detail}")
    if report["sequences"] is not None:
        s = report["sequences"]
        cache = "one unified pool of cells" if report["kv_unified"] else "KV streams of their own (--no-kv-unified)"
        out.append(f"a request among {_others(s['others'])} ({cache}), {s['positions']} positions: "
                   + ("bit-identical to it alone" if report["sequence_invariant"] else
                      f"differs from it alone (max |logit difference| {s['max_abs_diff']:.3g}): with -np "
                      f"{report['parallel']} a near-tie may resolve otherwise than alone, as in llama-server"))
    if report["batch_invariant"]:
        out.append("verdict: batch-invariant. Greedy speculative output is token-identical to "
                   "target-only output.")
    else:
        out.append("verdict: not batch-invariant. Greedy speculative output can diverge from "
                   "target-only output where the target's top two logits nearly tie; both are valid "
                   "greedy decodings up to rounding. For exact identity build as scripts/test.sh does "
                   "and run with GGML_CPU_TILED_MM=0 and -fa off (see docs/exactness-and-builds.md).")
    return out
