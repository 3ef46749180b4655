"""What flash attention's setting costs on the CPU: decode and prompt speed, -fa off against -fa on.

    python scripts/bench_flash_attn.py [-m MODEL] [--rounds 3] [-n 96] [--source FILE]
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

    {"meta": scripts/results.py's meta, with llama_cpp (system_info) and env
             ({"GGML_CPU_TILED_MM": the value the runs had}),
     "args": this script's arguments ("extra": the speculate flags after --),
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
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.results import meta  # noqa: E402
from speculative.decoding.settings import ModelSpec  # noqa: E402
from speculative.llamacpp.devices import system_info  # noqa: E402
from speculative.llamacpp.model import LlamaModel  # noqa: E402
from speculative.models.registry import Registry, resolve  # noqa: E402

DEFAULT_SOURCE = ROOT / "speculative" / "engine" / "engine.py"
MODES = ("off", "on")


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


def target_path(model: str | None) -> Path:
    registry = Registry.load()

    def not_pulled(entry, dest):
        sys.exit(f"{entry.name} is not pulled: run `speculate models pull {entry.name}`")

    return resolve(model or registry.default_target, registry, not_pulled)[0]


def cut_prompts(path: Path, source: Path, sizes: dict[str, int]) -> dict[str, dict]:
    lines = source.read_text().splitlines(keepends=True)
    with LlamaModel(ModelSpec(path, name=path.name, n_ctx=512, n_gpu_layers=0)) as model:
        def count(text: str) -> int:
            return len(model.tokenize(text, add_special=True))  # as the CLI tokenises -p

        prompts = {}
        for name, tokens in sizes.items():
            n = leading_lines(lines, count, tokens)
            text = "".join(lines[:n])
            prompts[name] = {"source": str(source.resolve().relative_to(ROOT)) if source.resolve().is_relative_to(ROOT)
                             else str(source), "lines": n, "chars": len(text), "n_tokens": count(text), "text": text}
    return prompts


def speculate_command() -> str:
    beside = Path(sys.executable).with_name("speculate")
    return str(beside) if beside.exists() else shutil.which("speculate") or sys.exit("speculate is not installed")


def run(path: Path, prompt: str, mode: str, args, extra: list[str], env: dict) -> dict:
    cmd = [speculate_command(), "-m", str(path), "-p", "-", "--spec-type", "none", "-n", str(args.n_predict),
           "--temp", "0", "--ignore-eos", "-fa", mode, "--json", *extra]
    proc = subprocess.run(cmd, input=prompt.encode(), capture_output=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"speculate -fa {mode} failed (exit {proc.returncode}): "
                 f"{proc.stderr.decode(errors='replace')[-2000:]}")
    return json.loads(proc.stdout)


def summarise(runs: list[dict], prompt: str) -> dict:
    of = {mode: [r for r in runs if r["prompt"] == prompt and r["flash_attn"] == mode] for mode in MODES}
    by_round = {r["round"]: r for r in of["off"]}
    decode_ratios = [r["decode_tps"] / by_round[r["round"]]["decode_tps"] for r in of["on"]]
    encode_ratios = [r["encode_tps"] / by_round[r["round"]]["encode_tps"] for r in of["on"]]
    summary = {"n_prompt": of["off"][0]["n_prompt"]}
    for mode in MODES:
        speeds = [r["decode_tps"] for r in of[mode]]
        summary[f"decode_tps_{mode}"] = statistics.median(speeds)
        summary[f"encode_tps_{mode}"] = statistics.median(r["encode_tps"] for r in of[mode])
        summary[f"decode_{mode}_range"] = [min(speeds), max(speeds)]
    return summary | {"decode_ratio": statistics.median(decode_ratios),
                      "encode_ratio": statistics.median(encode_ratios),
                      "decode_ratios": decode_ratios, "encode_ratios": encode_ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", help="target (a path or a registry name; default: the registry's default)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of off and on for each prompt (default 3)")
    parser.add_argument("-n", "--n-predict", type=int, default=96, help="tokens per run (default 96)")
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="the text the prompts are cut from "
                        "(default speculative/engine/engine.py)")
    parser.add_argument("--short", type=int, default=150, help="the short prompt's tokens, about (default 150)")
    parser.add_argument("--long", type=int, default=2100, help="the long prompt's tokens, about (default 2100)")
    parser.add_argument("-o", "--output", type=Path)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    path = target_path(args.model)
    prompts = cut_prompts(path, args.source, {"short": args.short, "long": args.long})
    env = {"GGML_CPU_TILED_MM": "0", **os.environ}
    print(f"{path.name}, --spec-type none -n {args.n_predict} --temp 0 --ignore-eos {' '.join(extra)}; "
          f"GGML_CPU_TILED_MM={env['GGML_CPU_TILED_MM']}; prompts from {prompts['short']['source']}: "
          + ", ".join(f"{name} {p['n_tokens']} tokens ({p['lines']} lines)" for name, p in prompts.items()), flush=True)
    runs = []
    for r in range(1, args.rounds + 1):
        for name, prompt in prompts.items():
            done = {}
            for mode in (MODES if r % 2 else MODES[::-1]):
                out = run(path, prompt["text"], mode, args, extra, env)
                done[mode] = out
                runs.append({"round": r, "prompt": name, "flash_attn": mode,
                             **{k: out[k] for k in ("n_prompt", "n_predict", "decode_tps", "encode_tps", "t_encode_s",
                                                    "t_decode_s", "t_load_s", "finish_reason")}})
                print(f"round {r}  {name:5s} ({out['n_prompt']:4d} tokens)  -fa {mode:3s}  "
                      f"decode {out['decode_tps']:6.2f} t/s  prompt {out['encode_tps']:7.1f} t/s", flush=True)
            same = done["on"]["tokens"] == done["off"]["tokens"]
            for entry in runs[-2:]:
                entry["same_as_off"] = None if entry["flash_attn"] == "off" else same
    summary = {name: summarise(runs, name) for name in prompts}
    print(f"\nmedians over {args.rounds} rounds; on/off ratios taken within each round:")
    for name, s in summary.items():
        print(f"  {name:5s} {s['n_prompt']:4d} tokens: decode off {s['decode_tps_off']:.2f} "
              f"({s['decode_off_range'][0]:.2f}-{s['decode_off_range'][1]:.2f}), on {s['decode_tps_on']:.2f} "
              f"({s['decode_on_range'][0]:.2f}-{s['decode_on_range'][1]:.2f}) t/s, on/off {s['decode_ratio']:.3f}; "
              f"prompt off {s['encode_tps_off']:.1f}, on {s['encode_tps_on']:.1f} t/s, on/off {s['encode_ratio']:.3f}")
    if args.output:
        for prompt in prompts.values():
            prompt.pop("text")
        saved = vars(args) | {"source": prompts["short"]["source"], "output": str(args.output), "extra": extra}
        args.output.write_text(json.dumps({"meta": meta(llama_cpp=system_info(),
                                                        env={"GGML_CPU_TILED_MM": env["GGML_CPU_TILED_MM"]}),
                                           "args": saved, "model": path.name, "prompts": prompts, "runs": runs,
                                           "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
