"""The llama.cpp backend: a position scores the same alone and inside a verify batch."""

from __future__ import annotations

import numpy as np
import pytest

from speculative.llamacpp import LlamaModel
from tests.conftest import SMOL, speculate, speculate_json

pytestmark = pytest.mark.real


# 700 cached cells: past 512, where the CPU flash-attention kernel splits a lone query's cache
# over the threads (why -fa auto is off on the CPU). 17 rows: past the 8-row matmul switch.
@pytest.mark.parametrize("cached", [100, 700])
@pytest.mark.parametrize("batch", [2, 9, 17])
def test_a_position_scores_the_same_alone_and_inside_a_batch(model_path, batch_invariant, cached, batch):
    with LlamaModel(model_path(SMOL), name=SMOL, n_ctx=1024) as model:
        assert model.kernels == []
        tokens = np.random.default_rng(cached + batch).integers(100, model.n_vocab - 100, cached + batch).tolist()
        model.decode(tokens[:cached], 0, "none")
        alone = [model.decode([t], cached + i, "last")[0].copy() for i, t in enumerate(tokens[cached:])]
        model.trim(cached)
        together = model.decode(tokens[cached:], cached, "all")
        for i, (a, b) in enumerate(zip(alone, together)):
            assert np.array_equal(a, b), f"row {i}: largest difference {np.abs(a - b).max()}"


def test_flash_attention_on_the_cpu_is_reported_as_batch_variant(model_path):
    with LlamaModel(model_path(SMOL), name=SMOL, n_ctx=256, n_gpu_layers=0, flash_attn="on") as model:
        assert "FLASH_ATTN" in model.kernels
        assert "FLASH_ATTN" in model.identity()["kernels"]  # calibrations are kept apart


def test_doctor_measures_batch_invariance(model_path, batch_invariant):
    smol = str(model_path(SMOL))
    exact = speculate_json("doctor", "-m", smol)
    assert exact["batch_invariant"] is True and exact["batch_variant_kernels"] == []
    assert {c["cached"] for c in exact["checks"]} == {16, 300} and len(exact["checks"]) == 30
    flash = speculate("doctor", "-m", smol, "-fa", "on")
    assert flash.returncode == 0, flash.stderr
    lines = flash.stdout.decode().splitlines()
    assert any("FLASH_ATTN" in line for line in lines)
    assert any(line.startswith("a position after 300 cached tokens") and "differs in batches" in line
               for line in lines)
    assert lines[-1].startswith("verdict: not batch-invariant")
