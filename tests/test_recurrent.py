"""Recurrent models are refused: their cache cannot be rolled back token by token.

The model is a tiny Mamba GGUF (about 11 KB, all-zero F32 weights) written here by
the `gguf` package, so the test needs no download and no committed binary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gguf
from speculative.gguf_meta import read_metadata

from tests.conftest import speculate
from tests.gguf_builder import TOKENS, add_tiny_tokenizer, write_out

pytestmark = pytest.mark.real


def write_tiny_mamba(path: Path) -> Path:
    """The smallest Mamba that llama.cpp loads: 1 layer, n_embd 16, 8 SPM tokens."""
    n_embd, n_layer = 16, 1
    d_inner, d_conv, d_state, dt_rank = 2 * n_embd, 4, 4, 1  # llama.cpp: d_inner == 2*n_embd

    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_context_length(64)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    add_tiny_tokenizer(w)

    def tensor(name: str, *shape: int) -> None:  # numpy shape = ggml's ne reversed
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))

    tensor("token_embd.weight", len(TOKENS), n_embd)  # output.weight falls back to this
    tensor("output_norm.weight", n_embd)
    for i in range(n_layer):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", n_embd)
        tensor(b + "ssm_in.weight", 2 * d_inner, n_embd)
        tensor(b + "ssm_conv1d.weight", d_inner, d_conv)
        tensor(b + "ssm_conv1d.bias", d_inner)
        tensor(b + "ssm_x.weight", dt_rank + 2 * d_state, d_inner)
        tensor(b + "ssm_dt.weight", d_inner, dt_rank)
        tensor(b + "ssm_dt.bias", d_inner)
        tensor(b + "ssm_a", d_inner, d_state)
        tensor(b + "ssm_d", d_inner)
        tensor(b + "ssm_out.weight", n_embd, d_inner)
    return write_out(w, path)


@pytest.fixture
def mamba(tmp_path) -> Path:
    return write_tiny_mamba(tmp_path / "tiny-mamba.gguf")


def test_recurrent_model_is_refused(mamba):
    assert read_metadata(mamba, ["general.architecture"]) == {"general.architecture": "mamba"}
    proc = speculate("-m", str(mamba), "-p", "hi", "-n", "4", "--temp", "0",
                     env={"SPECULATE_LLAMA_LOG": ""}, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("speculate: error: "), proc.stderr
    assert "recurrent/hybrid" in lines[0]
    # llama.cpp loaded the file (a load failure says "could not load"); the refusal came after
    assert "could not load" not in lines[0]
    assert proc.stdout == b""
