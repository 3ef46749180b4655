"""What flash attention's setting costs on the CPU: decode and prompt speed, -fa off against -fa on.

    python -m scripts.bench flash-attn [-m MODEL] [--rounds 3] [-n 96] [--source FILE]
                                       [--short 150] [--long 2100] [-o FILE] [-- extra speculate flags]

The figures of docs/exactness-and-builds.md's "Exactness and the CPU build" (what turning flash attention off
costs). Two prompts cut from one source file of this repository (default
speculative/engine/engine.py): its first whole lines, as many as come nearest --short tokens (150)
and --long tokens (2,100) of the target's tokenizer (the target is loaded once for that).
Every round runs, for each prompt, `speculate --json -m MODEL -p - --spec-type none -n N
--temp 0 --ignore-eos -fa off` and the same with `-fa on` (which first alternates from one
round to the next), each a fresh process of the `speculate` beside this Python, so that the
build measured is the one whose system_info the result records; GGML_CPU_TILED_MM=0 unless the
environment sets it (the test build with it is batch-invariant: docs/exactness-and-builds.md).
Decode speed is at the prompt's length of cached tokens (it grows by N during the run);
prompt speed is the prompt's processing. Printed: every run, then per prompt the medians and
the on/off ratios, each ratio taken within one round. Without -m: the registry's default
target (qwen2.5-coder-1.5b-instruct).

-o writes JSON:

    {"meta": the harness's meta, with llama_cpp (system_info) and env
             ({"GGML_CPU_TILED_MM": the value the runs had}),
     "args": the scenario's arguments ("extra": the speculate flags after --),
     "model": the target's file name,
     "prompts": {"short": P, "long": P}, each P {"source" (the file, from the repository root),
         "lines" (how many of its first lines), "chars", "n_tokens" (as tokenised here)},
     "runs": [per run: "round", "prompt" ("short"/"long"), "flash_attn" ("off"/"on"),
         "n_prompt", "n_predict", "decode_tps", "encode_tps" (prompt t/s), "t_encode_s",
         "t_decode_s", "t_load_s", "finish_reason", "same_as_off" (on runs: the tokens are
         the same round's off run's; null for off runs)],
     "summary": {"short": S, "long": S}, each S {"n_prompt", "decode_tps_off", "decode_tps_on"
         and "encode_tps_off", "encode_tps_on" (medians over the rounds), "decode_off_range",
         "decode_on_range" ([min, max]), "decode_ratio" and "encode_ratio" (medians of each
         round's on / off), "decode_ratios", "encode_ratios" (each round's)}}
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable, Sequence

from scripts.bench import harness
from scripts.bench.harness import ROOT

DEFAULT_SOURCE = ROOT / "speculative" / "engine" / "engine.py"
MODES = ("off", "on")
KEPT = ("n_prompt", "n_predict", "decode_tps", "encode_tps", "t_encode_s", "t_decode_s", "t_load_s", "finish_reason")


def leading_lines(lines: Sequence[str], count: Callable[[str], int], tokens: int) -> int:
    """How many leading lines (at least one) make the text whose token count (`count`, growing
    with the lines) is nearest `tokens`; the shorter on a tie; all of them if even the whole is
    shorter."""
    def of(n: int) -> int:
        return count("".join(lines[:n]))

    low, high = 1, len(lines)
    while low < high:  # the fewest lines that reach `tokens`
        middle = (low + high) // 2
        if of(middle) >= tokens:
            high = middle
        else:
            low = middle + 1
    if low > 1 and tokens - of(low - 1) <= of(low) - tokens:
        return low - 1
    return low


def cut_prompts(path: Path, source: Path, sizes: dict[str, int]) -> dict[str, dict]:
    lines = source.read_text().splitlines(keepends=True)
    with harness.load(path, name=path.name, n_ctx=512, n_gpu_layers=0) as model:
        def count(text: str) -> int:
            return len(model.tokenize(text, add_special=True))  # as the CLI tokenises -p

        prompts = {}
        for name, tokens in sizes.items():
            n = leading_lines(lines, count, tokens)
            text = "".join(lines[:n])
            prompts[name] = {"source": str(source.resolve().relative_to(ROOT)) if source.resolve().is_relative_to(ROOT)
                             else str(source), "lines": n, "chars": len(text), "n_tokens": count(text), "text": text}
    return prompts


def run(speculate: str, path: Path, prompt: str, mode: str, args: argparse.Namespace, extra: list[str],
        env: dict) -> dict:
    return harness.run_json([speculate, "-m", str(path), "-p", "-", "--spec-type", "none", "-n", str(args.n_predict),
                             "--temp", "0", "--ignore-eos", "-fa", mode, "--json", *extra], input=prompt, env=env)


def measure(path: Path, prompts: dict[str, dict], args: argparse.Namespace, extra: list[str], env: dict) -> list[dict]:
    """Every round: each prompt with -fa off and on, which first alternating from round to round."""
    speculate = harness.speculate()
    runs = []
    for r in range(1, args.rounds + 1):
        for name, prompt in prompts.items():
            done = {}
            for mode in (MODES if r % 2 else MODES[::-1]):
                out = done[mode] = run(speculate, path, prompt["text"], mode, args, extra, env)
                runs.append({"round": r, "prompt": name, "flash_attn": mode, **{k: out[k] for k in KEPT}})
                print(f"round {r}  {name:5s} ({out['n_prompt']:4d} tokens)  -fa {mode:3s}  "
                      f"decode {out['decode_tps']:6.2f} t/s  prompt {out['encode_tps']:7.1f} t/s", flush=True)
            same = done["on"]["tokens"] == done["off"]["tokens"]
            for entry in runs[-2:]:
                entry["same_as_off"] = None if entry["flash_attn"] == "off" else same
    return runs


def summarise(runs: list[dict], prompt: str) -> dict:
    of = {mode: [r for r in runs if r["prompt"] == prompt and r["flash_attn"] == mode] for mode in MODES}
    by_round = {r["round"]: r for r in of["off"]}
    decode_ratios = [harness.ratio(r["decode_tps"], by_round[r["round"]]["decode_tps"]) for r in of["on"]]
    encode_ratios = [harness.ratio(r["encode_tps"], by_round[r["round"]]["encode_tps"]) for r in of["on"]]
    summary = {"n_prompt": of["off"][0]["n_prompt"]}
    for mode in MODES:
        speeds = [r["decode_tps"] for r in of[mode]]
        summary[f"decode_tps_{mode}"] = harness.median(speeds)
        summary[f"encode_tps_{mode}"] = harness.median(r["encode_tps"] for r in of[mode])
        summary[f"decode_{mode}_range"] = [min(speeds), max(speeds)]
    return summary | {"decode_ratio": harness.median(decode_ratios),
                      "encode_ratio": harness.median(encode_ratios),
                      "decode_ratios": decode_ratios, "encode_ratios": encode_ratios}


def print_summary(summary: dict[str, dict], rounds: int) -> None:
    print(f"\nmedians over {rounds} rounds; on/off ratios taken within each round:")
    for name, s in summary.items():
        print(f"  {name:5s} {s['n_prompt']:4d} tokens: decode off {s['decode_tps_off']:.2f} "
              f"({s['decode_off_range'][0]:.2f}-{s['decode_off_range'][1]:.2f}), on {s['decode_tps_on']:.2f} "
              f"({s['decode_on_range'][0]:.2f}-{s['decode_on_range'][1]:.2f}) t/s, on/off {s['decode_ratio']:.3f}; "
              f"prompt off {s['encode_tps_off']:.1f}, on {s['encode_tps_on']:.1f} t/s, on/off {s['encode_ratio']:.3f}")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("-m", "--model", help="target (a path or a registry name; default: the registry's default)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of off and on for each prompt (default 3)")
    parser.add_argument("-n", "--n-predict", type=int, default=96, help="tokens per run (default 96)")
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="the text the prompts are cut from "
                        "(default speculative/engine/engine.py)")
    parser.add_argument("--short", type=int, default=150, help="the short prompt's tokens, about (default 150)")
    parser.add_argument("--long", type=int, default=2100, help="the long prompt's tokens, about (default 2100)")
    harness.add_output(parser, "every run, the prompts and the summary")
    return harness.parse(parser, argv, known=True)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    path = harness.model_file(args.model)
    prompts = cut_prompts(path, args.source, {"short": args.short, "long": args.long})
    env = {"GGML_CPU_TILED_MM": "0", **os.environ}
    print(f"{path.name}, --spec-type none -n {args.n_predict} --temp 0 --ignore-eos {' '.join(extra)}; "
          f"GGML_CPU_TILED_MM={env['GGML_CPU_TILED_MM']}; prompts from {prompts['short']['source']}: "
          + ", ".join(f"{name} {p['n_tokens']} tokens ({p['lines']} lines)" for name, p in prompts.items()), flush=True)
    runs = measure(path, prompts, args, extra, env)
    summary = {name: summarise(runs, name) for name in prompts}
    print_summary(summary, args.rounds)
    if args.output:
        from speculative.llamacpp.devices import system_info  # llama.cpp's: here, so that --help needs none

        for prompt in prompts.values():
            prompt.pop("text")
        saved = vars(args) | {"source": prompts["short"]["source"], "output": str(args.output), "extra": extra}
        harness.write(args.output, {"meta": harness.meta(llama_cpp=system_info(),
                                                         env={"GGML_CPU_TILED_MM": env["GGML_CPU_TILED_MM"]}),
                                    "args": saved, "model": path.name, "prompts": prompts, "runs": runs,
                                    "summary": summary})
    return 0
