"""The llama.cpp backend: a position scores the same alone and inside a verify batch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from speculative.decoding.settings import ModelSpec
from speculative.llamacpp.model import LlamaModel
from tests.conftest import SMOL, speculate, speculate_json

pytestmark = pytest.mark.real


# 700 cached cells: past 512, where the CPU flash-attention kernel splits a lone query's cache
# over the threads (why -fa auto is off on the CPU). 17 rows: past the 8-row matmul switch.
@pytest.mark.parametrize("cached", [100, 700])
@pytest.mark.parametrize("batch", [2, 9, 17])
def test_a_position_scores_the_same_alone_and_inside_a_batch(model_path, batch_invariant, cached, batch):
    with LlamaModel(ModelSpec(model_path(SMOL), name=SMOL, n_ctx=1024)) as model:
        assert model.kernels == []
        tokens = np.random.default_rng(cached + batch).integers(100, model.n_vocab - 100, cached + batch).tolist()
        model.decode(tokens[:cached], 0, "none")
        alone = [model.decode([t], cached + i, "last")[0].copy() for i, t in enumerate(tokens[cached:])]
        model.trim(cached)
        together = model.decode(tokens[cached:], cached, "all")
        for i, (a, b) in enumerate(zip(alone, together)):
            assert np.array_equal(a, b), f"row {i}: largest difference {np.abs(a - b).max()}"


def test_every_branch_of_a_tree_scores_as_its_own_sequence_would(model_path, batch_invariant):
    """A draft tree in one batch, each branch a sequence: every token's logits equal those of
    its root-to-node path decoded alone, bit for bit; keep_branch then leaves exactly that
    path as the cache, and the next decode continues from it."""
    from speculative.decoding.tree import Tree

    tree = Tree((-1, -1, -1, 0, 0, 1, 3, 5, 2))  # three root children; forks below 0
    with LlamaModel(ModelSpec(model_path(SMOL), name=SMOL, n_ctx=512, n_seq=tree.n_branches)) as model:
        rng = np.random.default_rng(5)
        prompt = rng.integers(100, model.n_vocab - 100, 150).tolist()
        drafted = rng.integers(100, model.n_vocab - 100, len(tree.parents)).tolist()
        n = len(prompt)
        model.decode(prompt[:-1], 0, "none")
        for b in range(1, tree.n_branches):
            model.copy_branch(0, b)
        rows = model.decode_branches([prompt[-1], *drafted], [n - 1, *(n - 1 + d for d in tree.depth)],
                                     [tuple(range(tree.n_branches)), *tree.seqs])
        rows = [r.copy() for r in rows]

        def alone(path: list[int]) -> np.ndarray:
            model.trim(n - 1)
            return model.decode([prompt[-1], *(drafted[i] for i in path)], n - 1, "all")[-1].copy()

        for node in range(-1, len(drafted)):
            expected = alone(tree.path(node))
            assert np.array_equal(rows[node + 1], expected), f"node {node}: {np.abs(rows[node + 1] - expected).max()}"

        # Decode the tree again, keep the path to node 7 (branch 1), continue after it.
        model.trim(n - 1)
        for b in range(1, tree.n_branches):
            model.copy_branch(0, b)
        model.decode_branches([prompt[-1], *drafted], [n - 1, *(n - 1 + d for d in tree.depth)],
                              [tuple(range(tree.n_branches)), *tree.seqs])
        path = tree.path(7)
        model.keep_branch(tree.branch[7], n + len(path))
        after = model.decode([drafted[0]], n + len(path), "last")[0].copy()
        model.trim(n - 1)
        model.decode([prompt[-1], *(drafted[i] for i in path)], n - 1, "none")
        assert np.array_equal(after, model.decode([drafted[0]], n + len(path), "last")[0])


def test_flash_attention_on_the_cpu_is_reported_as_batch_variant(model_path):
    with LlamaModel(ModelSpec(model_path(SMOL), name=SMOL, n_ctx=256, n_gpu_layers=0, flash_attn="on")) as model:
        assert "FLASH_ATTN" in model.kernels
        assert "FLASH_ATTN" in model.identity()["kernels"]  # calibrations are kept apart


def test_doctor_measures_batch_invariance(model_path, batch_invariant):
    smol = str(model_path(SMOL))
    exact = speculate_json("doctor", "-m", smol)
    assert exact["batch_invariant"] is True and exact["batch_variant_kernels"] == []
    assert {c["cached"] for c in exact["checks"]} == {16, 300} and len(exact["checks"]) == 30
    # requests at once (-np 4 by default): measured in one pool of cells, and identical in streams of their own
    assert exact["parallel"] == 4 and exact["kv_unified"] is True and exact["sequences"]["others"] == 3
    streams = speculate_json("doctor", "-m", smol, "--no-kv-unified")
    assert streams["sequence_invariant"] is True and streams["sequences"]["max_abs_diff"] == 0.0
    assert speculate_json("doctor", "-m", smol, "-np", "1")["sequences"] is None
    flash = speculate("doctor", "-m", smol, "-fa", "on")
    assert flash.returncode == 0, flash.stderr
    lines = flash.stdout.decode().splitlines()
    assert any("FLASH_ATTN" in line for line in lines)
    assert any(line.startswith("positions after 300 cached tokens") and "differs in batches" in line
               for line in lines)
    assert lines[-1].startswith("verdict: not batch-invariant")


def test_every_decode_runs_on_one_thread_whichever_thread_asks(model_path, monkeypatch):
    """OpenMP keeps a team of worker threads per thread that runs a graph, and more of them than
    cores makes every barrier sleep: so every llama_decode of a server runs on its model thread,
    the warm-up of the models' loading included, whichever threads hand requests over."""
    import threading

    import llama_cpp

    from speculative.decoding.settings import SamplerSettings, SpecSettings
    from speculative.engine.engine import Engine
    from speculative.engine.parallel import ModelThread, Parallel
    from speculative.engine.stream import completing

    ran_on, decode = set(), llama_cpp.llama_decode

    def recorded(ctx, batch):
        ran_on.add(threading.get_ident())
        return decode(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", recorded)
    models = ModelThread()
    spec = ModelSpec(model_path(SMOL), name=SMOL, n_ctx=512, n_threads=1, n_slots=2)
    parallel = models.call(lambda: Parallel(Engine(spec), 2))
    models.attach(parallel)
    finals, greedy, none = [], SamplerSettings(temp=0.0), SpecSettings(types=("none",), n_predict=4)

    def ask(prompt: list[int]) -> None:
        finals.append(parallel.submit(prompt, lambda engine: completing(engine, prompt, greedy, none, 1)).wait())

    asked = [threading.Thread(target=ask, args=([1, 2 + i, 3],)) for i in range(2)]
    for thread in asked:
        thread.start()
    for thread in asked:
        thread.join()
    models.attach(None)
    models.call(parallel.engine.close)
    models.close()
    assert [len(final.tokens) for final in finals] == [4, 4]
    assert ran_on == {models._thread.ident}


def test_the_build_line_is_read_safely_from_many_threads():
    """llama_print_system_info writes a static string: read from two requests' threads at once (their
    models' identities, in auto's costs) it came back garbled, a costs entry of nothing (a 400), or
    corrupted the heap. In a process of its own, so that a crash fails this test only."""
    code = ("import threading\n"
            "from speculative.llamacpp.devices import system_info\n"
            "seen = set()\n"
            "def read():\n"
            "    for _ in range(500):\n"
            "        seen.add(system_info())\n"
            "threads = [threading.Thread(target=read) for _ in range(4)]\n"
            "[t.start() for t in threads]\n"
            "[t.join() for t in threads]\n"
            "print(len(seen), 'CPU' in next(iter(seen)))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["1", "True"], proc.stdout + proc.stderr
