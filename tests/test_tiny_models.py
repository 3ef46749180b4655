"""tests/tiny_model.py writes models the pinned llama.cpp really loads and runs.

Every architecture of ARCHS is written to a temporary directory and driven through
llama-cpp-python's low-level bindings (as speculative/llamacpp/ does): it loads, llama.cpp
classes it as the architecture should be (recurrent, hybrid, diffusion), and the generative
ones decode greedily into varied, reproducible text. Qwen3.5's NextN (MTP) layer loads and
runs in an MTP context; several NextN blocks load and count, and hy_v3's run one by one
(llama_set_nextn_layer_offset). Hybrids that support it roll their recurrent state back (n_rs_seq),
and the greedy text after a rollback is the text of a fresh decode; a batch scores each
position exactly as a lone token does.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gguf
import llama_cpp as ll
from llama_cpp import llama_cpp_ext as ll_ext

from speculative.llamacpp.devices import init_once
from tests.tiny_model import ARCH_INFO, ARCHS, SPECIALS, tokenizer_vocab, write_model

pytestmark = pytest.mark.real

os.environ.setdefault("GGML_CPU_TILED_MM", "0")  # as conftest: batch-invariant CPU matmuls

ROOT = Path(__file__).resolve().parents[1]
GENERATIVE = [a for a in ARCHS if ARCH_INFO[a].generative]
ROLLBACK = [a for a in ARCHS if ARCH_INFO[a].rollback]
PROMPT = "Once upon a time there was a tiny model"
N_RS_SEQ = 8


@pytest.fixture(scope="module", autouse=True)
def _backend():
    init_once()  # the backend, and llama.cpp's log quiet unless SPECULATE_LLAMA_LOG is set


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """(arch, mtp) -> the model's path, written once per module."""
    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[tuple[str, bool], Path] = {}

    def get(arch: str, mtp: bool = False) -> Path:
        if (arch, mtp) not in cache:
            cache[arch, mtp] = write_model(arch, root / f"{arch}{'-mtp' if mtp else ''}.gguf", mtp=mtp)
        return cache[arch, mtp]

    return get


class Model:
    """A loaded model; `context()` makes contexts on it."""

    def __init__(self, path: Path, *, load_mtp: bool = False):
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        params.load_mtp = load_mtp
        self.ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        assert self.ptr, f"llama.cpp could not load {path}"
        self.vocab = ll.llama_model_get_vocab(self.ptr)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        data = text.encode()
        buf = (ll.llama_token * (len(data) + 8))()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_special, True)
        assert n >= 0
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        assert n >= 0
        return buf.raw[:n]

    def detokenize(self, tokens: list[int]) -> str:
        """The tokens' pieces joined, as the CLI streams them. (llama_detokenize differs: it
        cleans up spaces, " !" -> "!", as Hugging Face's clean_up_tokenization_spaces.)"""
        return b"".join(self.piece(t) for t in tokens).decode("utf-8")

    def context(self, **cparams) -> "Context":
        return Context(self, **cparams)

    def close(self) -> None:
        if self.ptr:
            ll.llama_model_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Context:
    def __init__(self, model: Model, n_ctx: int = 256, **cparams):
        self.model = model
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = 64
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = 1
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        for key, value in cparams.items():
            setattr(params, key, value)
        self.ptr = ll.llama_init_from_model(model.ptr, params)
        assert self.ptr, "llama.cpp could not create a context"
        self.mem = ll.llama_get_memory(self.ptr)
        self.batch = ll.llama_batch_init(params.n_batch, 0, 1)

    def decode(self, tokens: list[int], pos: int, all_logits: bool = False) -> list[np.ndarray]:
        """Decode tokens at pos.. in sequence 0; the logits of every one, or of the last."""
        n = len(tokens)
        for i, token in enumerate(tokens):
            self.batch.token[i] = token
            self.batch.pos[i] = pos + i
            self.batch.n_seq_id[i] = 1
            self.batch.seq_id[i][0] = 0
            self.batch.logits[i] = all_logits or i == n - 1
        self.batch.n_tokens = n
        assert ll.llama_decode(self.ptr, self.batch) == 0
        rows = range(n) if all_logits else [n - 1]
        return [np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ptr, i), shape=(self.model.n_vocab,)).copy()
                for i in rows]

    def greedy(self, logits: np.ndarray, pos: int, n: int) -> list[int]:
        """n greedy tokens after `logits`, the first decoded at pos."""
        out = []
        for i in range(n):
            assert np.isfinite(logits).all()
            out.append(int(np.argmax(logits)))
            if i < n - 1:
                logits = self.decode([out[-1]], pos + i)[0]
        return out

    def generate(self, prompt: list[int], n: int) -> list[int]:
        ll.llama_memory_clear(self.mem, True)
        return self.greedy(self.decode(prompt, 0)[0], len(prompt), n)

    def seq_rm(self, p0: int) -> bool:
        return bool(ll.llama_memory_seq_rm(self.mem, 0, p0, -1))

    def close(self) -> None:
        if self.ptr:
            ll.llama_batch_free(self.batch)
            ll.llama_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- every architecture --------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_as_its_kind(model_file, arch):
    info = ARCH_INFO[arch]
    path = model_file(arch)
    assert path.stat().st_size < 4_000_000
    with Model(path) as model:
        assert ll.llama_model_is_recurrent(model.ptr) == info.recurrent
        assert ll.llama_model_is_hybrid(model.ptr) == info.hybrid
        assert ll.llama_model_is_diffusion(model.ptr) == info.diffusion
        assert ll.llama_model_n_layer(model.ptr) == info.n_layer
        assert model.n_vocab == len(tokenizer_vocab()[0])
        with model.context() as ctx:
            assert ctx.ptr


@pytest.mark.parametrize("arch", GENERATIVE)
def test_greedy_text_is_varied_and_reproducible(model_file, arch):
    with Model(model_file(arch)) as model:
        prompt = model.tokenize(PROMPT)
        with model.context() as ctx:
            tokens = ctx.generate(prompt, 16)
            assert ctx.generate(prompt, 16) == tokens  # the same context again
        with model.context() as ctx:  # and a fresh one (a kernel reading garbage would differ)
            assert ctx.generate(prompt, 16) == tokens
    assert len(set(tokens)) >= 4, tokens
    assert max(tokens) < model.n_vocab - len(SPECIALS)  # special tokens (EOS) are never greedy


def test_tokenizer_round_trips_ascii(model_file):
    with Model(model_file("llama")) as model:
        bos = ll.llama_vocab_bos(model.vocab)
        assert bos >= 0 and ll.llama_vocab_eos(model.vocab) >= 0
        assert ll.llama_vocab_is_eog(model.vocab, ll.llama_vocab_eos(model.vocab))
        im_end = model.tokenize("<|im_end|>", add_special=False)
        assert len(im_end) == 1 and ll.llama_vocab_is_eog(model.vocab, im_end[0])  # ChatML's end of turn
        assert ll.llama_model_chat_template(model.ptr, None).startswith(b"{% for message in messages %}")
        text = "".join(chr(c) for c in range(32, 127)) + "\n\tThe cat and the dog, once upon a time: def f(x): return x"
        tokens = model.tokenize(text)
        assert tokens[0] == bos
        assert model.detokenize(tokens[1:]) == text
        assert len(set(tokens)) > 60
        words = model.tokenize(" the hello world", add_special=False)
        assert len(words) == 3  # merged pieces, not bytes
        assert model.detokenize(model.tokenize("héllo ünïcode ✓", add_special=False)) == "héllo ünïcode ✓"


@pytest.mark.parametrize("arch", GENERATIVE)
def test_f16_models_run(tmp_path, arch):
    path = write_model(arch, tmp_path / f"{arch}-f16.gguf", f16=True)
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["output.weight"] == gguf.GGMLQuantizationType.F16
    assert all(types[n] == gguf.GGMLQuantizationType.F32 for n in types if "norm" in n or n.endswith(".bias"))
    with Model(path) as model, model.context() as ctx:
        assert len(set(ctx.generate(model.tokenize(PROMPT), 16))) >= 4


def test_same_seed_same_file_other_seed_other_weights(tmp_path):
    a = write_model("lfm2", tmp_path / "a.gguf", seed=3).read_bytes()
    b = write_model("lfm2", tmp_path / "b.gguf", seed=3).read_bytes()
    c = write_model("lfm2", tmp_path / "c.gguf", seed=4).read_bytes()
    assert a == b
    assert a != c and len(a) == len(c)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown architecture"):
        write_model("gpt5", tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="MTP"):
        write_model("llama", tmp_path / "x.gguf", mtp=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        write_model("rwkv7", tmp_path / "x.gguf", n_embd=96)


# -- Qwen3.5 with MTP ----------------------------------------------------------------


def test_qwen35_mtp_layer(model_file):
    path = model_file("qwen35", mtp=True)
    reader = gguf.GGUFReader(path)
    assert reader.fields["qwen35.nextn_predict_layers"].contents() == 1
    n_layer = ARCH_INFO["qwen35"].n_layer
    assert reader.fields["qwen35.block_count"].contents() == n_layer + 1
    names = {t.name for t in reader.tensors}
    assert {f"blk.{n_layer}.nextn.{x}.weight" for x in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= names
    with Model(path, load_mtp=True) as model:
        assert ll.llama_model_n_layer_nextn(model.ptr) == 1
        assert ll.llama_model_is_hybrid(model.ptr)
        with model.context() as ctx:
            with_mtp = ctx.generate(model.tokenize(PROMPT), 16)
    with Model(path) as model:  # without load_mtp the NextN tensors are skipped
        with model.context() as ctx:
            assert ctx.generate(model.tokenize(PROMPT), 16) == with_mtp
    # the NextN block is not part of the trunk: the same weights without it decode the same
    with Model(model_file("qwen35")) as model:
        assert ll.llama_model_n_layer_nextn(model.ptr) == 0
        with model.context() as ctx:
            assert ctx.generate(model.tokenize(PROMPT), 16) == with_mtp


def test_qwen35_mtp_head_runs(model_file):
    """The NextN tensors fit llama.cpp's MTP graph: an MTP context on the model (sharing the
    target's memory) decodes the target's NextN hidden states into finite logits."""
    with Model(model_file("qwen35", mtp=True), load_mtp=True) as model:
        n_embd = ll.llama_model_n_embd(model.ptr)
        prompt = model.tokenize(PROMPT)
        with model.context() as target:
            ll_ext.llama_set_embeddings_nextn(target.ptr, True, False)
            target.decode(prompt, 0, all_logits=True)
            hidden = np.ctypeslib.as_array(ll_ext.llama_get_embeddings_nextn(target.ptr),
                                           shape=(len(prompt), n_embd)).copy()
            assert np.isfinite(hidden).all() and hidden.std() > 0.1
            params = ll.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch = 256, 64, 64
            params.n_threads = params.n_threads_batch = 1
            params.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
            params.ctx_other = target.ptr
            mtp = ll.llama_init_from_model(model.ptr, params)
            assert mtp
            batch = ll.llama_batch_init(64, n_embd, 1)
            tokens = (ll.llama_token * 64)()
            batch.token = tokens  # an embeddings batch has no token array of its own
            try:
                embd = np.ctypeslib.as_array(batch.embd, shape=(64, n_embd))
                n = len(prompt) - 1
                for i in range(n):  # row i: the hidden state at i and the token after it
                    tokens[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = prompt[i + 1], i, 1, 1
                    batch.seq_id[i][0] = 0
                    embd[i] = hidden[i]
                batch.n_tokens = n
                assert ll.llama_decode(mtp, batch) == 0
                drafts = [np.ctypeslib.as_array(ll.llama_get_logits_ith(mtp, i), shape=(model.n_vocab,))
                          for i in range(n)]
                assert all(np.isfinite(row).all() for row in drafts)
                assert len({int(np.argmax(row)) for row in drafts}) >= 4
            finally:
                batch.token = ctypes.POINTER(ll.llama_token)()
                ll.llama_batch_free(batch)
                ll.llama_free(mtp)


def _mtp_decode(model: Model, target: Context, offset: int) -> list[np.ndarray]:
    """The target decodes the prompt (its NextN rows unmasked); an MTP context on the model
    (ctx_other: the target's) runs NextN block n_layer + offset over (token p+1, row p) pairs;
    each pair's logits."""
    n_embd = ll.llama_model_n_embd(model.ptr)
    prompt = model.tokenize(PROMPT)
    ll_ext.llama_set_embeddings_nextn(target.ptr, True, False)
    ll.llama_memory_clear(target.mem, True)
    target.decode(prompt, 0, all_logits=True)
    hidden = np.ctypeslib.as_array(ll_ext.llama_get_embeddings_nextn(target.ptr), shape=(len(prompt), n_embd)).copy()
    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 256, 64, 64
    params.n_threads = params.n_threads_batch = 1
    params.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
    params.ctx_other = target.ptr
    mtp = ll.llama_init_from_model(model.ptr, params)
    assert mtp
    batch = ll.llama_batch_init(64, n_embd, 1)
    tokens = (ll.llama_token * 64)()
    batch.token = tokens
    try:
        ll_ext.llama_set_nextn_layer_offset(mtp, offset)
        embd = np.ctypeslib.as_array(batch.embd, shape=(64, n_embd))
        n = len(prompt) - 1
        for i in range(n):
            tokens[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = prompt[i + 1], i, 1, 1
            batch.seq_id[i][0] = 0
            embd[i] = hidden[i]
        batch.n_tokens = n
        assert ll.llama_decode(mtp, batch) == 0
        return [np.ctypeslib.as_array(ll.llama_get_logits_ith(mtp, i), shape=(model.n_vocab,)).copy() for i in range(n)]
    finally:
        batch.token = ctypes.POINTER(ll.llama_token)()
        ll.llama_batch_free(batch)
        ll.llama_free(mtp)


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}


def test_several_nextn_blocks(tmp_path, model_file):
    """mtp = N writes N NextN blocks (block_count n_layer + N, nextn_predict_layers N), the
    first of them the one block of mtp = 1, the trunk the same; --mtp-only keeps all N.
    llama.cpp loads and counts them. (Its qwen35 MTP graph runs one block only: an MTP context
    on this file would abort the process, GGML_ASSERT(n_layer_nextn == 1); hy_v3's below runs.)"""
    n_layer = ARCH_INFO["qwen35"].n_layer
    path = write_model("qwen35", tmp_path / "q2.gguf", mtp=2)
    reader = gguf.GGUFReader(path)
    assert reader.fields["qwen35.nextn_predict_layers"].contents() == 2
    assert reader.fields["qwen35.block_count"].contents() == n_layer + 2
    two, one = _tensors(path), _tensors(model_file("qwen35", mtp=True))
    assert set(two) - set(one) == {n for n in two if n.startswith(f"blk.{n_layer + 1}.")}
    assert {f"blk.{n_layer + 1}.nextn.{x}.weight" for x in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= set(two)
    assert all(np.array_equal(one[n], two[n]) for n in one)  # the first block, the trunk, the embeddings
    assert any(not np.array_equal(two[f"blk.{n_layer}.{x}"], two[f"blk.{n_layer + 1}.{x}"])
               for x in ("attn_q.weight", "ffn_up.weight"))  # the second block drawn anew
    with Model(path, load_mtp=True) as model:
        assert ll.llama_model_n_layer_nextn(model.ptr) == 2
        assert ll.llama_model_n_layer(model.ptr) == n_layer
        with model.context() as ctx:
            trunk = ctx.generate(model.tokenize(PROMPT), 16)
    with Model(model_file("qwen35")) as model, model.context() as ctx:
        assert ctx.generate(model.tokenize(PROMPT), 16) == trunk
    head = write_model("qwen35", tmp_path / "q2-head.gguf", mtp=2, mtp_only=True)
    kept = _tensors(head)
    assert {n for n in two if n.startswith("blk.") and int(n.split(".")[1]) >= n_layer} <= set(kept)
    assert not any(n.startswith("blk.") and int(n.split(".")[1]) < n_layer for n in kept)
    with Model(head, load_mtp=True) as model:
        assert ll.llama_model_n_layer_nextn(model.ptr) == 2


def test_hy_v3_chains_its_nextn_heads(tmp_path):
    """hy_v3's MTP graph runs block n_layer + llama_set_nextn_layer_offset: each of its NextN
    heads runs in the one MTP context, and they differ; its head-only file runs as well."""
    assert ARCH_INFO["hy_v3"].mtp_chain and not ARCH_INFO["qwen35"].mtp_chain
    path = write_model("hy_v3", tmp_path / "hy.gguf", mtp=2)
    with Model(path, load_mtp=True) as model:
        assert ll.llama_model_n_layer_nextn(model.ptr) == 2
        assert ll.llama_model_n_layer(model.ptr) == ARCH_INFO["hy_v3"].n_layer
        with model.context() as target:
            heads = [_mtp_decode(model, target, offset) for offset in (0, 1)]
    for rows in heads:
        assert all(np.isfinite(row).all() for row in rows)
        assert len({int(np.argmax(row)) for row in rows}) >= 4
    assert max(float(np.abs(a - b).max()) for a, b in zip(*heads)) > 0.1
    head = write_model("hy_v3", tmp_path / "hy-head.gguf", mtp=2, mtp_only=True)
    with Model(path) as trunk, Model(head, load_mtp=True) as model, trunk.context() as target:
        alone = _mtp_decode(model, target, 1)  # the head file on the plain model: the same drafts
    assert max(float(np.abs(a - b).max()) for a, b in zip(alone, heads[1])) < 1e-3


# -- what the non-generative ones look like -------------------------------------------


def test_encoder_has_no_lm_head(model_file):
    """bert loads and decodes, but it is an embedding model: non-causal, pooled, and its
    logits are all zero. (llama_model_has_encoder is false for it: that is for T5.)"""
    with Model(model_file("bert")) as model:
        buf = ctypes.create_string_buffer(16)
        ll.llama_model_meta_val_str(model.ptr, b"bert.attention.causal", buf, len(buf))
        assert buf.value == b"false"
        assert not ll.llama_model_has_encoder(model.ptr)
        with model.context() as ctx:
            assert ll.llama_pooling_type(ctx.ptr) == ll.LLAMA_POOLING_TYPE_MEAN
            logits = ctx.decode(model.tokenize(PROMPT), 0)[0]
            assert not logits.any()


# -- batch invariance --------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen35", "lfm2", "llama"])
def test_batch_logits_equal_token_by_token(model_file, arch, batch_invariant):
    """A prompt decoded as one batch scores every position exactly as one token at a time
    (on the batch-invariant build scripts/test.sh makes; the delta-net too)."""
    with Model(model_file(arch)) as model:
        tokens = model.tokenize(PROMPT + ", and the tiny model was happy.")
        with model.context() as ctx:
            batched = ctx.decode(tokens, 0, all_logits=True)
            ll.llama_memory_clear(ctx.mem, True)
            single = [ctx.decode([t], i)[0] for i, t in enumerate(tokens)]
    assert max(float(np.abs(b - s).max()) for b, s in zip(batched, single)) == 0.0


# -- recurrent-state rollback --------------------------------------------------------


@pytest.mark.parametrize("arch", ROLLBACK)
def test_rollback_after_a_verify_batch(model_file, arch):
    """n_rs_seq = 8: right after a 9-token batch, seq_rm drops its last 1..8 tokens, and
    greedy decoding from there gives the tokens of a fresh decode of the kept ones."""
    with Model(model_file(arch)) as model:
        prompt = model.tokenize(PROMPT)
        drafts = model.tokenize(" abcdefgh", add_special=False)[:9]
        drafts += [7] * (9 - len(drafts))
        p = len(prompt)
        with model.context(n_rs_seq=N_RS_SEQ) as ctx:
            assert ll.llama_n_rs_seq(ctx.ptr) == N_RS_SEQ
            for dropped in range(1, N_RS_SEQ + 2):
                ll.llama_memory_clear(ctx.mem, True)
                ctx.decode(prompt, 0)
                rows = ctx.decode(drafts, p, all_logits=True)
                keep = p + 9 - dropped
                if dropped > N_RS_SEQ:
                    assert not ctx.seq_rm(keep)  # 9 back is more than the snapshots hold
                    continue
                assert ctx.seq_rm(keep), dropped
                assert ll.llama_memory_seq_pos_max(ctx.mem, 0) == keep - 1
                after = ctx.greedy(rows[8 - dropped], keep, 8)
                fresh = ctx.generate(prompt + drafts[: 9 - dropped], 8)
                assert after == fresh, dropped


@pytest.mark.parametrize("arch", ROLLBACK + ["granitehybrid"])
def test_rollback_refused_without_snapshots(model_file, arch):
    """Without n_rs_seq a hybrid refuses a partial rollback; granitehybrid does not support
    rollback at all (llama.cpp clamps its n_rs_seq to 0)."""
    with Model(model_file(arch)) as model:
        prompt = model.tokenize(PROMPT)
        n_rs_seq = N_RS_SEQ if arch == "granitehybrid" else 0
        with model.context(n_rs_seq=n_rs_seq) as ctx:
            assert ll.llama_n_rs_seq(ctx.ptr) == 0
            ctx.decode(prompt, 0)
            assert not ctx.seq_rm(len(prompt) - 1)


# -- the command line ------------------------------------------------------------------


def test_command_line(tmp_path):
    out = tmp_path / "cli.gguf"
    proc = subprocess.run([sys.executable, "-m", "tests.tiny_model", "qwen35", str(out), "--mtp",
                           "--n-embd", "128", "--n-layer", "3", "--seed", "5"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout
    assert out.read_bytes() == write_model("qwen35", tmp_path / "api.gguf", mtp=True, n_embd=128, n_layer=3,
                                           seed=5).read_bytes()
    with Model(out, load_mtp=True) as model:
        assert ll.llama_model_n_embd(model.ptr) == 128
        assert ll.llama_model_n_layer(model.ptr) == 3  # the trunk: the NextN block is not counted
        assert ll.llama_model_n_layer_nextn(model.ptr) == 1
    bad = subprocess.run([sys.executable, "-m", "tests.tiny_model", "llama", str(tmp_path / "x.gguf"),
                          "--mtp"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "MTP" in bad.stderr
    heads = tmp_path / "heads.gguf"
    proc = subprocess.run([sys.executable, "-m", "tests.tiny_model", "qwen35", str(heads),
                           "--mtp-heads", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert heads.read_bytes() == write_model("qwen35", tmp_path / "heads-api.gguf", mtp=2).read_bytes()
    bad = subprocess.run([sys.executable, "-m", "tests.tiny_model", "qwen35", str(tmp_path / "x.gguf"),
                          "--mtp-heads", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--mtp-heads" in bad.stderr
