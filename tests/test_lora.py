"""LoRA adapters: --lora, --lora-scaled and --lora-draft apply them; what does not fit is refused.

Every adapter is built here (tests/gguf_builder.py): small random A/B matrices for a few
weights of the tiny llama or of SmolLM2-135M, whose shapes are read with gguf's reader.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from speculative.decoding.settings import ModelSpec
from speculative.errors import ModelError
from speculative.files import content_identity
from speculative.llamacpp.model import LlamaModel
from speculative.models.gguf_meta import preflight_adapter
from tests.conftest import SMOL, speculate, speculate_here, speculate_json
from tests.gguf_builder import KV, T, V, build, write_lora, write_tiny_llama

TINY_WEIGHTS = {"blk.0.attn_q.weight": (64, 64), "blk.1.ffn_up.weight": (64, 128)}  # [inputs, outputs]
ARCH = KV("general.architecture", V.STRING, "llama")
IS_ADAPTER = KV("general.type", V.STRING, "adapter")
IS_LORA = KV("adapter.type", V.STRING, "lora")
ALPHA = KV("adapter.lora.alpha", V.FLOAT32, 8.0)
Q_A, Q_B = "blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b"
Q_PAIR = [T(Q_A, (64, 4)), T(Q_B, (4, 64))]  # tiny llama's attn_q is [64, 64]: rank 4


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_tiny_llama(tmp_path / "tiny.gguf")


def adapter_file(tmp_path: Path, kvs: list[KV], tensors: list[T]) -> Path:
    path = tmp_path / "adapter.gguf"
    path.write_bytes(build(kvs, tensors)[0])
    return path


# -- the pre-flight check, against the tiny llama --------------------------------


@pytest.mark.parametrize("kvs, tensors", [
    ([ARCH, IS_ADAPTER, IS_LORA, ALPHA], Q_PAIR),
    ([ARCH, IS_ADAPTER, IS_LORA], [*Q_PAIR, T("blk.0.attn_norm.weight", (64,))]),  # norms: skipped
    ([ARCH, IS_ADAPTER, IS_LORA], [T("token_embd.weight.lora_a", (4, 8)), T("token_embd.weight.lora_b", (4, 64))]),
], ids=["attn_q", "with a norm", "token_embd"])
def test_adapters_that_fit_pass(tiny, tmp_path, kvs, tensors):
    preflight_adapter(adapter_file(tmp_path, kvs, tensors), tiny)


@pytest.mark.parametrize("kvs, tensors, message", [
    ([ARCH, KV("general.type", V.STRING, "model"), IS_LORA], Q_PAIR,
     "not a LoRA adapter (general.type is 'model', not 'adapter')"),
    ([ARCH, IS_LORA], Q_PAIR, "not a LoRA adapter (general.type is missing, not 'adapter')"),
    ([ARCH, IS_ADAPTER, KV("adapter.type", V.STRING, "control_vector")], Q_PAIR,
     "not a LoRA adapter (adapter.type is 'control_vector', not 'lora')"),
    ([KV("general.architecture", V.STRING, "qwen2"), IS_ADAPTER, IS_LORA], Q_PAIR,
     "a LoRA adapter for architecture 'qwen2', but tiny.gguf is 'llama'"),
    ([ARCH, IS_ADAPTER, IS_LORA], [T(Q_A, (64, 4))], "LoRA tensor 'blk.0.attn_q.weight' has no lora_b"),
    ([ARCH, IS_ADAPTER, IS_LORA], [T("blk.7.attn_q.weight.lora_a", (64, 4)), T("blk.7.attn_q.weight.lora_b", (4, 64))],
     "LoRA tensor 'blk.7.attn_q.weight' is not in tiny.gguf"),
    ([ARCH, IS_ADAPTER, IS_LORA], [T(Q_A, (32, 4)), T(Q_B, (4, 64))],
     "LoRA matrices for 'blk.0.attn_q.weight' of shapes [32, 4] and [4, 64] do not fit its shape [64, 64]"),
    ([ARCH, IS_ADAPTER, IS_LORA], [T(Q_A, (64, 4)), T(Q_B, (5, 64))], "do not fit its shape [64, 64]"),
    ([ARCH, IS_ADAPTER, IS_LORA], [*Q_PAIR, T("blk.0.attn_q.weight", (64, 64))],
     "invalid LoRA adapter: tensor 'blk.0.attn_q.weight': not a LoRA matrix"),
    ([ARCH, IS_ADAPTER, IS_LORA, KV("adapter.lora.alpha", V.FLOAT32, float("nan"))], Q_PAIR,
     "key 'adapter.lora.alpha': nan is not a finite number"),
    # What llama.cpp aborts on (checked by hand: GGML_ASSERT in gguf.cpp's get_val, or
    # ggml_can_mul_mat at the first decode) rather than refusing:
    ([ARCH, KV("general.type", V.UINT32, 7), IS_LORA], Q_PAIR, "key 'general.type': must be of type string, not uint32"),
    ([KV("general.architecture", V.ARRAY, ["llama"], etype=V.STRING), IS_ADAPTER, IS_LORA], Q_PAIR,
     "key 'general.architecture': must be of type string, not array"),
    ([ARCH, IS_ADAPTER, IS_LORA, KV("adapter.lora.alpha", V.FLOAT64, 8.0)], Q_PAIR,
     "key 'adapter.lora.alpha': must be of type float32, not float64"),
    ([ARCH, IS_ADAPTER, IS_LORA], [T(Q_A, (64, 4, 2)), T(Q_B, (4, 64, 2))],
     "of shapes [64, 4, 2] and [4, 64, 2] do not fit its shape [64, 64]"),
    ([ARCH, IS_ADAPTER, IS_LORA], [T("token_embd.weight.lora_a", (4, 8)), T("token_embd.weight.lora_b", (5, 64))],
     "LoRA matrices for 'token_embd.weight' of shapes [4, 8] and [5, 64] do not fit its shape [64, 8]"),
])
def test_adapters_that_do_not_fit_are_refused_with_one_line(tiny, tmp_path, kvs, tensors, message):
    path = adapter_file(tmp_path, kvs, tensors)
    with pytest.raises(ModelError) as err:
        preflight_adapter(path, tiny)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}: ") and message in text, text


def test_a_hostile_adapter_header_is_refused_as_a_model_is(tiny, tmp_path):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(build([ARCH, IS_ADAPTER, IS_LORA], Q_PAIR, n_tensors=1 << 20)[0])
    with pytest.raises(ModelError, match=r"invalid LoRA adapter: header: tensor count 1048576 is larger than 65536"):
        preflight_adapter(path, tiny)


# -- through llama.cpp, on the tiny llama ------------------------------------------


@pytest.mark.real
def test_an_adapter_changes_the_logits_and_scale_0_leaves_them(tiny, tmp_path):
    lora = write_lora(tmp_path / "lora.gguf", TINY_WEIGHTS, rank=4, std=1.0)

    def logits(loras) -> tuple[np.ndarray, dict]:
        with LlamaModel(ModelSpec(tiny, name="tiny", n_ctx=64, loras=loras)) as model:
            return model.decode([1, 4, 5, 6], 0, "last")[0].copy(), model.identity()

    base, base_id = logits(())
    scaled, scaled_id = logits([(lora, 1.0)])
    zero, zero_id = logits([(lora, 0.0)])
    assert not np.allclose(base, scaled)
    assert np.array_equal(base, zero)
    # calibrations: one with the adapter is its own; scale 0 runs (and costs) as none
    assert scaled_id["loras"] == [content_identity(lora)]
    assert zero_id == base_id and "loras" not in base_id


@pytest.mark.real
def test_an_adapter_llama_cpp_refuses_is_a_model_error(tiny, tmp_path):
    """The pre-flight does not repeat every check of llama.cpp's loader: an aLoRA's invocation
    tokens of the wrong element type are its clean refusal (NULL), named."""
    tokens = KV("adapter.alora.invocation_tokens", V.ARRAY, ["a"], etype=V.STRING)
    path = adapter_file(tmp_path, [ARCH, IS_ADAPTER, IS_LORA, tokens], Q_PAIR)
    preflight_adapter(path, tiny)
    with pytest.raises(ModelError, match=rf"^{path}: llama.cpp could not load this LoRA adapter for tiny.gguf$"):
        LlamaModel(ModelSpec(tiny, name="tiny", n_ctx=64, loras=[(path, 1.0)]))


# -- the command line ----------------------------------------------------------------


@pytest.mark.parametrize("args, code, message", [
    (("--lora", "/nonexistent/a.gguf"), 3, "LoRA adapter not found: /nonexistent/a.gguf"),
    (("--lora-scaled", "/nonexistent/a.gguf"), 2, "--lora-scaled: expected FNAME:SCALE with a finite SCALE, got"),
    (("--lora-scaled", "a.gguf:half"), 2, "--lora-scaled: expected FNAME:SCALE with a finite SCALE, got 'a.gguf:half'"),
    (("--lora-scaled", "a.gguf:nan"), 2, "--lora-scaled: expected FNAME:SCALE"),
    (("--lora", "a.gguf,"), 2, "--lora: empty file name in 'a.gguf,'"),
    (("--lora-draft", "a.gguf", "--spec-type", "none"), 2, "--lora-draft is for the draft model, which this run does not load"),
])
def test_bad_adapter_flags_exit_with_one_line(tiny, args, code, message):
    proc = speculate_here("-m", str(tiny), "-p", "hi", "-n", "1", *args)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculate: error: ") and message in lines[0], proc.stderr
    assert proc.stdout == b""


# -- SmolLM2-135M ----------------------------------------------------------------------

GREEDY = ("-p", "The three primary colours are", "-n", "32", "--temp", "0")


@pytest.fixture(scope="module")
def smol_weights(model_path) -> dict[str, tuple[int, int]]:
    """SmolLM2's weights as [inputs, outputs], from its own file."""
    return {t.name: tuple(int(d) for d in t.shape) for t in GGUFReader(model_path(SMOL)).tensors}


@pytest.fixture(scope="module")
def smol_lora(smol_weights, tmp_path_factory) -> str:
    """Rank 8 on the query and value projections of all 30 layers, strong enough that SmolLM2
    without it disagrees with the adapted greedy continuation at most positions (25 of 32 on
    one CPU). A gentle adapter (4 layers, std 0.1) changed the text but left it so predictable
    that on another CPU the base model, as a draft, had every drafted token accepted."""
    names = {f"blk.{i}.{w}.weight" for i in range(30) for w in ("attn_q", "attn_v")}
    lora = write_lora(tmp_path_factory.mktemp("lora") / "smol-lora.gguf",
                      {name: smol_weights[name] for name in names}, rank=8, std=0.5)
    return str(lora)


@pytest.fixture(scope="module")
def adapted(model_path, smol_lora) -> dict:
    """Target-only greedy output with the adapter."""
    return speculate_json("-m", str(model_path(SMOL)), *GREEDY, "--spec-type", "none", "--lora", smol_lora)


@pytest.mark.real
def test_an_adapter_changes_the_output_and_at_scale_0_it_is_the_base(model_path, smol_lora, adapted):
    smol = str(model_path(SMOL))
    base = speculate_json("-m", smol, *GREEDY, "--spec-type", "none")
    zero = speculate_json("-m", smol, *GREEDY, "--spec-type", "none", "--lora-scaled", f"{smol_lora}:0")
    zero_old_form = speculate_json("-m", smol, *GREEDY, "--spec-type", "none", "--lora-scaled", smol_lora, "0")
    assert zero_old_form["tokens"] == zero["tokens"]
    assert adapted["tokens"] != base["tokens"] and adapted["text"].strip()
    assert zero["tokens"] == base["tokens"]
    assert adapted["target"]["loras"] == [{"path": smol_lora, "scale": 1.0}]
    assert zero["target"]["loras"] == [{"path": smol_lora, "scale": 0.0}] and base["target"]["loras"] == []


@pytest.mark.real
@pytest.mark.parametrize("spec, draft_has_it", [
    (("--spec-type", "ngram-simple"), None),
    (("-md", SMOL, "--spec-type", "draft"), False),
    (("-md", SMOL, "--spec-type", "draft", "--lora-draft", "{lora}"), True),
], ids=["ngram-simple", "draft without the adapter", "draft with --lora-draft"])
def test_greedy_speculation_with_an_adapter_equals_target_only_with_it(model_path, batch_invariant, smol_lora,
                                                                       adapted, spec, draft_has_it):
    spec = [arg.format(lora=smol_lora) for arg in spec]
    out = speculate_json("-m", str(model_path(SMOL)), *GREEDY, "--lora", smol_lora, *spec)
    assert out["tokens"] == adapted["tokens"] and out["text"] == adapted["text"]
    if draft_has_it is not None:  # the draft is SmolLM2 itself: exact with the adapter, not without
        assert out["n_drafted"] > 0 and (out["accept_rate"] == 1.0) == draft_has_it
        assert out["draft"]["loras"] == ([{"path": smol_lora, "scale": 1.0}] if draft_has_it else [])


@pytest.mark.real
@pytest.mark.parametrize("arch, weights, message", [
    ("qwen2", {"blk.0.attn_q.weight": (576, 576)}, "a LoRA adapter for architecture 'qwen2', but "),
    ("llama", {"blk.0.attn_q.weight": (512, 512)}, "LoRA matrices for 'blk.0.attn_q.weight' of shapes "
                                                   "[512, 8] and [8, 512] do not fit its shape [576, 576]"),
], ids=["another architecture", "another shape"])
def test_an_adapter_for_another_model_exits_3(model_path, tmp_path, arch, weights, message):
    lora = write_lora(tmp_path / "other.gguf", weights, arch=arch)
    proc = speculate("-m", str(model_path(SMOL)), "--lora", str(lora), *GREEDY)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"speculate: error: {lora}: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == b""
