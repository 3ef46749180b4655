#!/usr/bin/env python3
"""What a saved sequence state costs per token, for each model: the size of the copy that
`--prompt-cache` writes and `serve --cache-ram` keeps in memory.

    python scripts/state_sizes.py [MODEL ...] [-o results.json]

For each model (registry names or paths; default: the registry's SmolLM2, Qwen2.5-Coder 0.5B
and 1.5B), llama.cpp's serialised state of sequence 0 (llama_state_seq_get_data, what
LlamaModel.save_state returns) after 128 and after 512 prompt tokens; the cost per token is the
difference over the 384 tokens between (a state also has a fixed header). f16 keys and values,
the default.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.results import meta  # noqa: E402
from speculative.decoding.cache import Cache  # noqa: E402
from speculative.decoding.scheduler import run  # noqa: E402
from speculative.decoding.settings import ModelSpec  # noqa: E402
from speculative.llamacpp.devices import system_info  # noqa: E402
from speculative.llamacpp.model import LlamaModel  # noqa: E402
from speculative.models.registry import Registry  # noqa: E402

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
SHORT, LONG = 128, 512


def locate(name: str) -> Path:
    if Path(name).is_file():
        return Path(name)
    registry = Registry.load()
    entry = registry.get(name)
    if not registry.is_pulled(entry):
        sys.exit(f"{name} is not pulled: speculate models pull {name}")
    return registry.locate(entry)


def sizes(path: Path) -> dict:
    with LlamaModel(ModelSpec(path, name=path.name, n_ctx=1024)) as model:
        cache = Cache(model)
        tokens = [(7 * i + 11) % model.n_vocab for i in range(LONG)]
        run(cache.extend(tokens[:SHORT]))
        short = len(model.save_state())
        run(cache.extend(tokens[SHORT:]))
        long = len(model.save_state())
    return {"model": path.name, f"bytes_at_{SHORT}": short, f"bytes_at_{LONG}": long,
            "kib_per_token": (long - short) / (LONG - SHORT) / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    rows = []
    for name in args.models:
        rows.append({"name": name, **sizes(locate(name))})
        print(f"{name}: {rows[-1]['kib_per_token']:.1f} KiB per token", flush=True)
    if args.output:
        args.output.write_text(json.dumps({"meta": meta(llama_cpp=system_info()), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
