"""Whether a long prompt stalls a running stream: --prefill-budget measured on `speculate serve -np 2`.

    python -m scripts.bench prefill-gap [--speculate PATH] [-m MODEL] [--budgets 500,0] [--prompt-tokens 2000]
                                        [--max-tokens 1500] [--warmup 20] [-o results.json] [-- extra serve flags]

For each budget (milliseconds; default 500, then 0: whole -b chunks, as llama-server), a fresh
`speculate serve -np 2 --spec-type none -m MODEL -c 4096 --prefill-budget B` (default MODEL the
registry's qwen2.5-coder-1.5b-instruct, default executable .venv/bin/speculate) and two streamed
POST /v1/completions, greedy:

  A  a short prompt, --max-tokens (default 1500) with ignore_eos, so it outlasts the rest; the
     arrival (time.monotonic) of each of its server-sent events is recorded on a thread. Once it
     has --warmup pieces (default 20), its normal step is the median gap between consecutive
     pieces, the first gap left out.
  B  then a prompt of about --prompt-tokens tokens (text of scripts/prompts.jsonl, repeated, cut
     by /tokenize and /detokenize), max_tokens 8. Its response begins when its prompt has passed
     the checks (the headers arrive); its first piece arrives when its prefill is done.

A's gaps that overlap [B began, B's first piece] are taken (from A's last piece before B began to
its first piece after B's first), their largest is A's max gap; the bound is 2 x normal step +
budget. With budget 0 there is no bound to meet: the row shows the stall. Then both streams are
closed and the server stopped. GGML_CPU_TILED_MM=0, as every scenario's server (servers.py).

The table: per budget the normal step (ms), B's prefill (s), A's pieces during it, A's max gap
(ms), the bound (ms) and whether the max gap is within it. -o writes it with meta() and the raw
arrival times (seconds from A's request). It exits 0 whatever the figures (a measurement).

Time: with the defaults on the 2-core development machine, about 5 minutes (an estimate: a
512-token chunk of the 1.5B model takes 15-20 s there, so B's prefill is a minute or two per
budget). A trial with `-m smollm2-135m-instruct --prompt-tokens 600` takes 20 seconds.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from scripts.bench import harness
from scripts.bench.servers import Server

STREAM_PROMPT = "Tell a long story about a lighthouse keeper and the ships she saw, year after year.\n\n"
B_TOKENS = 8  # B's max_tokens
PATIENCE = 3600  # seconds to wait for any one event


class Stream(threading.Thread):
    """A streamed POST /v1/completions read on its own thread: when its response began
    (headers in) and each data event's arrival with its text."""

    def __init__(self, port: int, body: dict):
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PATIENCE)
        self.body = {**body, "stream": True, "temperature": 0}
        self.sent = self.began = None
        self.pieces: list[tuple[float, str]] = []
        self.ended = False  # [DONE], the end of the response, or an error
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        try:
            self.sent = time.monotonic()
            self.conn.request("POST", "/v1/completions", body=json.dumps(self.body),
                              headers={"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            self.began = time.monotonic()
            if resp.status != 200:
                self.error = f"HTTP {resp.status}: {resp.read()[:500]!r}"
                return
            while line := resp.readline():
                now = time.monotonic()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    self.error = str(event["error"])
                    return
                choice = (event.get("choices") or [{}])[0]
                if choice.get("text"):
                    self.pieces.append((now, choice["text"]))
        except (OSError, http.client.HTTPException, ValueError) as e:
            if not self.ended:  # not closed by us
                self.error = f"{type(e).__name__}: {e}"
        finally:
            self.ended = True

    def close(self) -> None:
        self.ended = True
        if self.conn.sock is not None:
            try:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.join(timeout=30)
        self.conn.close()


def wait_for(what: str, done, *streams: Stream) -> None:
    """Poll until done(); exit if a stream failed or ended first, or after PATIENCE seconds."""
    deadline = time.monotonic() + PATIENCE
    while not done():
        for s in streams:
            if s.error or s.ended:
                sys.exit(f"waiting for {what}: a stream {'failed: ' + s.error if s.error else 'ended first'}"
                         + ("" if s.error else " (raise --max-tokens)"))
        if time.monotonic() > deadline:
            sys.exit(f"waiting for {what}: nothing in {PATIENCE} s")
        time.sleep(0.01)


def long_prompt(server: Server, n_tokens: int) -> tuple[str, int]:
    """Text of scripts/prompts.jsonl, repeated and cut to about `n_tokens` tokens; its token count."""
    texts = []
    for row in harness.jsonl(harness.PROMPTS):
        texts += [row["prompt"]] if row.get("prompt") else [m["content"] for m in row.get("messages", [])]
    text, tokens = "", []
    while len(tokens) <= n_tokens:
        text += "\n\n".join(texts) + "\n\n"
        tokens = server.post("/tokenize", {"content": text})[1]["tokens"]
    text = server.post("/detokenize", {"tokens": tokens[:n_tokens]})[1]["content"]
    return text, len(server.post("/tokenize", {"content": text})[1]["tokens"])


def measure(server: Server, prompt: str, max_tokens: int, warmup: int) -> dict:
    """A streaming, then B's long prompt arriving: the raw times (from A's request on)."""
    a = Stream(server.port, {"prompt": STREAM_PROMPT, "max_tokens": max_tokens, "ignore_eos": True})
    try:
        wait_for(f"A's first {warmup} pieces", lambda: len(a.pieces) >= warmup, a)
        times = [t for t, _ in a.pieces]
        step = harness.median(t2 - t1 for t1, t2 in zip(times[1:], times[2:]))
        b = Stream(server.port, {"prompt": prompt, "max_tokens": B_TOKENS})
        try:
            wait_for("B's first piece", lambda: bool(b.pieces) or b.ended, a)
            if not b.pieces:
                sys.exit(f"B ended without a piece: {b.error or 'no text'}")
            first = b.pieces[0][0]
            wait_for("A's piece after B's first", lambda: a.pieces[-1][0] > first, a)
            wait_for("B's end", lambda: b.ended, a)
        finally:
            b.close()
    finally:
        a.close()
    t0 = a.sent
    return {"normal_step_s": step, "a_sent": 0.0, "a_began": a.began - t0,
            "a_pieces": [t - t0 for t, _ in a.pieces], "b_sent": b.sent - t0, "b_began": b.began - t0,
            "b_pieces": [t - t0 for t, _ in b.pieces], "b_text": "".join(text for _, text in b.pieces)}


def summarise(run: dict, budget_ms: float) -> dict:
    """B's prefill, A's pieces within it, A's largest gap overlapping it, and the bound."""
    began, first, times = run["b_began"], run["b_pieces"][0], run["a_pieces"]
    gaps = [t - s for s, t in zip(times, times[1:]) if t > began and s < first]
    bound = 2 * run["normal_step_s"] + budget_ms / 1000 if budget_ms > 0 else None
    max_gap = max(gaps) if gaps else None
    return {"budget_ms": budget_ms, "normal_step_ms": run["normal_step_s"] * 1000,
            "prefill_s": first - began, "a_pieces_during": sum(began < t < first for t in times),
            "max_gap_ms": max_gap * 1000 if max_gap is not None else None,
            "bound_ms": bound * 1000 if bound is not None else None,
            "within": None if bound is None or max_gap is None else max_gap <= bound}


def table(rows: list[dict], header: str) -> None:
    print(header + "\n")
    print("| budget (ms) | normal step (ms) | B's prefill (s) | A's pieces during it | A's max gap (ms) "
          "| bound 2 x step + budget (ms) | within |")
    print("|---:|---:|---:|---:|---:|---:|:---|")
    for r in rows:
        bound = f"{r['bound_ms']:.0f}" if r["bound_ms"] is not None else "-"
        within = {True: "yes", False: "**no**", None: "- (the stall)"}[r["within"]]
        gap = f"{r['max_gap_ms']:.0f}" if r["max_gap_ms"] is not None else "-"
        print(f"| {r['budget_ms']:g} | {r['normal_step_ms']:.0f} | {r['prefill_s']:.2f} | {r['a_pieces_during']} "
              f"| {gap} | {bound} | {within} |")


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    harness.add_speculate(parser, default=str(harness.ROOT / ".venv" / "bin" / "speculate"))
    parser.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct", help="target (path or registry name)")
    parser.add_argument("--budgets", default="500,0", help="--prefill-budget values in ms, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="B's prompt (default 2000 tokens)")
    parser.add_argument("--max-tokens", type=int, default=1500, help="A's max_tokens (default 1500)")
    parser.add_argument("--warmup", type=int, default=20, help="A's pieces before B is sent (default 20)")
    harness.add_output(parser, "the figures and raw times")
    args, extra = harness.parse(parser, argv, known=True)
    if args.warmup < 3:  # the normal step is the median gap between the pieces after the first
        parser.error("--warmup takes 3 pieces or more")
    try:
        budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        parser.error(f"--budgets {args.budgets}: milliseconds, comma-separated")
    args.speculate = harness.speculate(args.speculate)
    flags = ["-np", "2", "--spec-type", "none", "-m", args.model, "-c", "4096", *extra]
    runs, rows, n_prompt = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        for budget in budgets:
            server = Server([*flags, "--prefill-budget", f"{budget:g}"], Path(tmp) / f"serve-{budget:g}.log",
                            command=[args.speculate, "serve"])
            try:
                prompt, n_prompt = long_prompt(server, args.prompt_tokens)
                run = measure(server, prompt, args.max_tokens, args.warmup)
            finally:
                server.close()
            rows.append(summarise(run, budget))
            runs.append({**rows[-1], **run})
    table(rows, f"{args.speculate} serve {' '.join(flags)} --prefill-budget B: stream A ({args.max_tokens} tokens, "
                f"ignore_eos) running while B's prompt of {n_prompt} tokens arrives; greedy")
    if args.output:
        harness.write(args.output, {
            "meta": harness.meta(serve_flags=flags, speculate=args.speculate, budgets_ms=budgets,
                                 prompt_tokens=n_prompt, a_prompt=STREAM_PROMPT, a_max_tokens=args.max_tokens,
                                 b_max_tokens=B_TOKENS, warmup=args.warmup),
            "runs": runs})
    return 0
