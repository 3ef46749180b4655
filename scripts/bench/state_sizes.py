"""What a saved sequence state costs per token, for each model: the size of the copy that
`--prompt-cache` writes and `serve --cache-ram` keeps in memory.

    python -m scripts.bench state-sizes [MODEL ...] [-o results.json]

For each model (registry names or paths; default: the registry's SmolLM2, Qwen2.5-Coder 0.5B
and 1.5B), llama.cpp's serialised state of sequence 0 (llama_state_seq_get_data, what
LlamaModel.save_state returns) after 128 and after 512 prompt tokens; the cost per token is the
difference over the 384 tokens between (a state also has a fixed header). f16 keys and values,
the default.
"""

from __future__ import annotations

from pathlib import Path

from scripts.bench import harness
from speculative.decoding.cache import Cache
from speculative.decoding.scheduler import run

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
SHORT, LONG = 128, 512


def sizes(path: Path) -> dict:
    with harness.load(path, name=path.name, n_ctx=1024) as model:
        cache = Cache(model)
        tokens = [(7 * i + 11) % model.n_vocab for i in range(LONG)]
        run(cache.extend(tokens[:SHORT]))
        short = len(model.save_state())
        run(cache.extend(tokens[SHORT:]))
        long = len(model.save_state())
    return {"model": path.name, f"bytes_at_{SHORT}": short, f"bytes_at_{LONG}": long,
            "kib_per_token": (long - short) / (LONG - SHORT) / 1024}


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("models", nargs="*", default=list(MODELS))
    harness.add_output(parser, "each model's sizes")
    args = harness.parse(parser, argv)
    rows = []
    for name in args.models:
        rows.append({"name": name, **sizes(harness.model_file(name))})
        print(f"{name}: {rows[-1]['kib_per_token']:.1f} KiB per token", flush=True)
    if args.output:
        from speculative.llamacpp.devices import system_info

        harness.write(args.output, {"meta": harness.meta(llama_cpp=system_info()), "rows": rows})
    return 0
