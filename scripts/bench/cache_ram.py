"""What --cache-ram saves: two chat clients taking turns on one `speculate serve`.

    python -m scripts.bench cache-ram [-m MODEL] [--turns N] [--max-tokens N] [--cache-ram MiB]
                                      [--conversations ID,ID] [-o results.json] [-- extra serve flags]

Two conversations alternate, A1 B1 A2 B2 ..., each turn sending the conversation so far with
the next question (greedy), against a server started with --cache-ram 0 and then one with
--cache-ram MiB (default 8192, llama-server's). Each conversation opens with a prompt of
scripts/prompts.jsonl (by id; default two `rag` prompts: a module's documentation and a
question about it) and goes on with the follow-up questions below. The table gives each turn's
prompt tokens, `timings.cache_n` (prompt tokens not processed again) and `timings.prompt_ms`
(prompt processing, saving and restoring included) for both servers; the scenario exits 1 if any
answer differs between them. Without -m the server loads the registry's default pair (README);
-m MODEL (a path or a registry name) runs that model alone, quickly for a small one.
GGML_CPU_TILED_MM=0 keeps the CPU build batch-invariant (docs/exactness-and-builds.md).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from scripts.bench import harness
from scripts.bench.servers import Server

FOLLOW_UPS = ("Show a short example of that.", "What happens with invalid input?",
              "Summarise your answers so far in two sentences.", "Which mistake do beginners make most often here?",
              "Give one more example, different from the first.")
SAVED = re.compile(r"cache-ram: saved (\d+) tokens \(([\d.]+) MiB\)")


def first_turns(ids: list[str]) -> list[list[dict]]:
    """The opening messages of each conversation, from scripts/prompts.jsonl."""
    chats = [row for row in harness.jsonl(harness.PROMPTS) if row.get("messages")]
    try:
        return [row["messages"] for row in harness.by_ids(chats, ids, "chat prompt", harness.PROMPTS)]
    except ValueError as e:
        sys.exit(str(e))


def take_turns(server: Server, openings: list[list[dict]], turns: int, max_tokens: int) -> list[dict]:
    """Conversations alternating, `turns` each: per request its conversation, turn, answer and timings."""
    history = [list(messages) for messages in openings]
    results = []
    for turn in range(turns):
        for c, messages in enumerate(history):
            if turn > 0:
                messages.append({"role": "user", "content": FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]})
            status, answer = server.post("/v1/chat/completions", {
                "messages": messages, "max_tokens": max_tokens, "temperature": 0})
            if status != 200:
                sys.exit(f"request failed ({status}): {answer}")
            text = answer["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": text})
            results.append({"conversation": "AB"[c] if len(history) == 2 else str(c), "turn": turn + 1,
                            "text": text, "prompt_tokens": answer["usage"]["prompt_tokens"], **answer["timings"]})
    return results


def run_both(flags: list[str], openings: list[list[dict]], args: argparse.Namespace
             ) -> tuple[list[dict], list[dict], list[tuple[str, str]]]:
    """The turns against --cache-ram 0, then against --cache-ram MiB; the states the second saved."""
    runs, saved = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for mib in (0, args.cache_ram):
            server = Server([*flags, "--cache-ram", str(mib)], Path(tmp) / f"serve-{mib}.log")
            try:
                runs[mib] = take_turns(server, openings, args.turns, args.max_tokens)
            finally:
                server.close()
            if mib:
                saved = SAVED.findall(server.log.read_text())
    return runs[0], runs[args.cache_ram], saved


def print_table(plain: list[dict], cached: list[dict], saved: list[tuple[str, str]], budget: int) -> bool:
    """Each turn on both servers, the totals and the states saved; whether every answer is the same."""
    print(f"{'turn':>5} {'prompt':>7} | {'--cache-ram 0':^23} | {f'--cache-ram {budget}':^23} | "
          f"{'speed-up':>8} {'answer':>9}")
    print(f"{'':>5} {'tokens':>7} | {'cache_n':>9} {'prompt_ms':>13} | {'cache_n':>9} {'prompt_ms':>13} |")
    for p, c in zip(plain, cached):
        same = "same" if p["text"] == c["text"] else "DIFFERENT"
        print(f"{c['conversation'] + str(c['turn']):>5} {c['prompt_tokens']:7d} | {p['cache_n']:9d} "
              f"{p['prompt_ms']:13.1f} | {c['cache_n']:9d} {c['prompt_ms']:13.1f} | "
              f"{harness.ratio(p['prompt_ms'], c['prompt_ms']):7.1f}x {same:>9}")
    total = [sum(r["prompt_ms"] for r in run) for run in (plain, cached)]
    print(f"total prompt_ms: {total[0]:.1f} without, {total[1]:.1f} with ({harness.ratio(total[0], total[1]):.1f}x); "
          f"prompt tokens processed: {sum(r['prompt_n'] for r in plain)} without, "
          f"{sum(r['prompt_n'] for r in cached)} with")
    if saved:
        per_token = sum(float(mib) for _, mib in saved) / sum(int(n) for n, _ in saved) * 1024
        print(f"states saved: {len(saved)}, {per_token:.1f} KiB per token (all models' caches together)")
    identical = all(p["text"] == c["text"] for p, c in zip(plain, cached))
    print("answers with --cache-ram: " + ("identical to those without it" if identical else "DIFFERENT"))
    return identical


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("-m", "--model", help="target model (default: the registry's default pair)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per answer (default 96)")
    parser.add_argument("--cache-ram", type=int, default=8192, help="MiB for the cached run (default 8192)")
    parser.add_argument("--conversations", default="rag-textwrap,rag-functools",
                        help="ids of scripts/prompts.jsonl, comma-separated")
    harness.add_output(parser, "every turn of both runs")
    return harness.parse(parser, argv, known=True)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    openings = first_turns(args.conversations.split(","))
    flags = [*(["-m", args.model] if args.model else []), "-c", "8192", *extra]
    plain, cached, saved = run_both(flags, openings, args)
    print(f"speculate serve {' '.join(flags)}: {len(openings)} conversations ({args.conversations}) taking "
          f"turns, {args.turns} turns each, {args.max_tokens} tokens per answer, greedy")
    identical = print_table(plain, cached, saved, args.cache_ram)
    if args.output:
        harness.write(args.output, {
            "meta": harness.meta(serve_flags=flags, conversations=args.conversations.split(","), turns=args.turns,
                                 max_tokens=args.max_tokens, cache_ram=args.cache_ram),
            "plain": plain, "cached": cached,
            "saved": [{"tokens": int(n), "mib": float(mib)} for n, mib in saved]})
    return 0 if identical else 1
