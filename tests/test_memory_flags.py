"""llama.cpp's model and memory flags (cli/memory.py): KV cache types, tensor overrides and the
MoE placements, -ub, -lm, -sm/-ts/-mg, --swa-full. Refused values exit 2 with one line; what
they change is read back from llama.cpp itself (its load log, its KV cache size line) and from
greedy identity with target-only output at the same flags."""

from __future__ import annotations

import json
import re

import pytest

from cli import memory
from speculative.decoding.settings import CACHE_TYPES
from speculative.models.gguf_meta import kv_cache_bytes, tensor_names
from tests.conftest import SMOL, speculate, speculate_here, speculate_json
from tests.gguf_builder import write_tiny_llama
from tests.test_rpc import model_loads, rpc_server

real = pytest.mark.real
GREEDY = ("-p", "The three primary colours are red, yellow and blue. The three primary colours are", "-n", "32",
          "--temp", "0", "-t", "1", "-c", "1024")


@pytest.mark.parametrize("args, message", [
    (("-ctk", "q9"), "-ctk/--cache-type-k: unsupported cache type 'q9' (valid: f32, f16, bf16, q8_0, q4_0, q4_1, "
                     "iq4_nl, q5_0, q5_1)"),
    (("-ctvd", "f8"), "-ctvd/--spec-draft-type-v: unsupported cache type 'f8'"),
    (("-ctv", "q8_0", "-fa", "off"), "-ctv/--cache-type-v q8_0: a quantized V cache needs flash attention, which "
                                     "-fa off turns off"),
    (("-ctvd", "q4_0", "-fa", "off"), "-ctvd/--spec-draft-type-v q4_0: a quantized V cache needs flash attention"),
    (("-lm", "mmapp"), "-lm/--load-mode: invalid value 'mmapp' (valid: auto, none, mmap, mlock, mmap+mlock, dio)"),
    (("-sm", "rows"), "-sm/--split-mode: invalid value 'rows' (valid: none, layer, row, tensor)"),
    (("-ub", "0"), "-ub/--ubatch-size must be >= 1, got 0"),
    (("-ncmoe", "-1"), "-ncmoe/--n-cpu-moe must be >= 0, got -1"),
    (("-ncmoed", "-2"), "-ncmoed/--spec-draft-n-cpu-moe must be >= 0, got -2"),
    (("-mg", "-1"), "-mg/--main-gpu must be >= 0, got -1"),
    (("-ot", "blk[=CPU"), "-ot: invalid regular expression 'blk[': unterminated character set"),
    (("-ot", r"(?P<n>exps)=CPU"), "-ot: invalid regular expression '(?P<n>exps)': '(?P<' at 0 is not ECMAScript"),
    (("-otd", r"\Aexps=CPU"), "-otd: invalid regular expression '\\\\Aexps': '\\\\A' at 0 is not ECMAScript"),
    (("-ot", "exps"), "-ot: expected <tensor name pattern>=<buffer type>, got 'exps'"),
    (("-ot", "exps=CPU,ffn=CUDA9"), "-ot: unknown buffer type 'CUDA9' (available: CPU"),
    (("-ts", "3,x"), "-ts/--tensor-split: expected numbers like 3,1, got '3,x'"),
    (("-ts", ",".join(["1"] * 16)), "-ts/--tensor-split: 16 values, but llama.cpp takes fewer than its 16 devices"),
])
def test_bad_memory_flags_exit_2_with_one_line(args, message):
    proc = speculate_here("-p", "x", *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculate: error: ") and message in lines[0], proc.stderr
    assert proc.stdout == b""


def test_the_flags_read_llama_cpps_environment_variables():
    for variable, value, message in (("LLAMA_ARG_CACHE_TYPE_K", "q9", "-ctk/--cache-type-k: unsupported"),
                                     ("LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V", "q9", "-ctvd/--spec-draft-type-v"),
                                     ("LLAMA_ARG_LOAD_MODE", "x", "-lm/--load-mode"),
                                     ("LLAMA_ARG_SPLIT_MODE", "x", "-sm/--split-mode"),
                                     ("LLAMA_ARG_UBATCH", "0", "-ub/--ubatch-size"),
                                     ("LLAMA_ARG_N_CPU_MOE", "-1", "-ncmoe/--n-cpu-moe"),
                                     ("LLAMA_ARG_OVERRIDE_TENSOR", "a[=CPU", "-ot: invalid regular expression")):
        proc = speculate_here("-p", "x", env={variable: value})
        assert proc.returncode == 2 and message in proc.stderr, (variable, proc.stderr)


@pytest.mark.parametrize("command", ["batch", "bench", "serve", "doctor"])
def test_every_command_that_loads_a_model_takes_them(command):
    out = speculate_here(command, "--help-all", env={"COLUMNS": "200"}).stdout.decode()
    for flag in ("--cache-type-k", "--override-tensor", "--cpu-moe", "--n-cpu-moe", "--ubatch-size", "--load-mode",
                 "--split-mode", "--tensor-split", "--main-gpu", "--swa-full"):
        assert flag in out, (command, flag)
    draft_flags = ("--spec-draft-type-k", "--spec-draft-override-tensor", "--spec-draft-cpu-moe")
    assert all((flag in out) == (command != "doctor") for flag in draft_flags), command


def test_the_cache_types_block_sizes_are_ggmls():
    """settings.CACHE_TYPES (checked before anything loads, without the gguf package) holds the
    values per block that ggml's type traits give, which the KV bytes are computed from."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    assert {name: GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]][0] for name in CACHE_TYPES} == CACHE_TYPES


def test_overrides_come_as_llama_cpp_builds_them():
    placed = memory.overrides(["token_embd=CPU,output=CPU", r"blk\.0\.attn=CPU"], True, 2, 1, "-ot")
    assert placed == (("token_embd", "CPU"), ("output", "CPU"), (r"blk\.0\.attn", "CPU"), (memory.FFN_EXPS, "CPU"),
                      (r"blk\.0" + memory.FFN_EXPS, "CPU"), (r"blk\.1" + memory.FFN_EXPS, "CPU"),
                      (r"blk\.0" + memory.FFN_DENSE, "CPU"))
    first_blocks = [pattern for pattern, _ in placed[4:6]]
    for name, expected in (("blk.0.ffn_up_exps.weight", True), ("blk.1.ffn_gate_exps.weight", True),
                           ("blk.1.ffn_gate_up_exps.weight", True), ("blk.0.ffn_down_chexps.weight", True),
                           ("blk.10.ffn_up_exps.weight", False), ("blk.2.ffn_down_exps.weight", False),
                           ("blk.0.ffn_up.weight", False), ("blk.0.ffn_gate_inp.weight", False)):
        assert any(re.search(p, name) for p in first_blocks) == expected, name
    assert re.search(placed[-1][0], "blk.0.ffn_down.weight") and not re.search(placed[-1][0], "blk.0.ffn_down_exps.weight")


def test_weights_stay_out_of_the_amx_buffer_type_and_repacking_stays():
    """The pinned llama.cpp's AMX matmul crashes: AMX is taken out of the list llama.cpp places
    weights from, whatever else it lists (repacking) kept in order."""
    import ctypes

    from speculative.llamacpp import devices

    listed = devices.weight_buffer_types()  # this build on this CPU, after the change
    assert "AMX" not in listed and all(isinstance(name, str) and name for name in listed)
    assert devices.model_params(-1, None)[0].use_extra_bufts  # llama.cpp's default: repacking where built
    names = {1: "AMX", 2: "CPU_REPACK", 3: "KLEIDIAI"}
    for before, after in (([1, 2], [2]), ([2, 1, 3], [2, 3]), ([2], [2]), ([1], []), ([], [])):
        bufts = (ctypes.c_void_p * (len(before) + 1))(*before, None)
        assert devices.drop_buffer_type(bufts, names.get, "AMX") == [names[b] for b in after]
        assert list(bufts)[:len(after) + 1] == [*after, None], before


def test_no_repack_loads_weights_as_they_are_and_drops_repack_from_the_batch_variant_kernels(monkeypatch):
    """llama.cpp's -nr/--no-repack: no extra buffer types for the weights, so the repacked kernels
    do not run (a build's other batch-variant kernels still do)."""
    from speculative.llamacpp import decode, devices

    assert not devices.model_params(-1, None, repack=False)[0].use_extra_bufts
    monkeypatch.setattr(decode, "batch_variant_kernels", lambda: ["LLAMAFILE", "REPACK", "TILED_MM"])
    off = decode.ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert decode.context_kernels(False, off) == ["LLAMAFILE", "REPACK", "TILED_MM"]
    assert decode.context_kernels(False, off, repack=False) == ["LLAMAFILE", "TILED_MM"]


# -- with models ---------------------------------------------------------------------


def kv_log_bytes(log: str) -> list[float]:
    """llama.cpp's own 'llama_kv_cache: size = X MiB' lines, in load order, in bytes."""
    return [float(x) * 2**20 for x in re.findall(r"llama_kv_cache: size = +([\d.]+) MiB", log)]


@real
@pytest.mark.parametrize("types", [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"),
                                   ("bf16", "q5_1")])
def test_the_kv_bytes_reported_are_what_llama_cpp_allocated(model_path, types):
    smol = str(model_path(SMOL))
    proc = speculate("-m", smol, "-md", smol, "--spec-type", "draft", *GREEDY, "-n", "4", "-ctk", types[0],
                     "-ctv", types[1], "-ctkd", "q8_0", "--json", env={"SPECULATE_LLAMA_LOG": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    target, draft = out["target"], out["draft"]
    logged = kv_log_bytes(proc.stderr)
    assert len(logged) == 2
    assert target["kv_bytes"] == pytest.approx(logged[0], rel=5e-3, abs=0.005 * 2**20), (target, logged)
    assert draft["kv_bytes"] == pytest.approx(logged[1], rel=5e-3, abs=0.005 * 2**20), (draft, logged)
    assert (target["cache_type_k"], target["cache_type_v"]) == types
    assert (draft["cache_type_k"], draft["cache_type_v"]) == ("q8_0", "f16")  # -ctvd stays f16 whatever -ctv says
    assert target["flash_attn"] == (types[1] not in ("f16", "bf16", "f32"))  # a quantized V turns it on
    assert ("flash attention on" in proc.stderr) == target["flash_attn"]
    f16 = kv_cache_bytes(model_path(SMOL), 1024, "f16", "f16")
    if types == ("q8_0", "q8_0"):
        assert target["kv_bytes"] / f16 == pytest.approx(34 / 64)  # 8.5 bits a value against 16


@real
@pytest.mark.parametrize("spec", [("--spec-type", "ngram-simple", "--spec-ngram-size-n", "2"),
                                  ("-md", "{smol}", "--spec-type", "draft")])
def test_greedy_speculation_with_a_quantized_k_cache_equals_target_only_with_it(model_path, batch_invariant, spec):
    """-ctk q8_0 with flash attention off: what the quantized cache changes, it changes for both."""
    smol = str(model_path(SMOL))
    copy = ("-p", "Copy this list twice: red, green, blue, yellow, purple, orange. red, green,", "-n", "40",
            "--temp", "0", "-t", "1", "-c", "1024")
    flags = ("-m", smol, *copy, "-ctk", "q8_0", "-ctkd", "q8_0", "-fa", "off")
    alone = speculate_json(*flags, "--spec-type", "none")
    f16 = speculate_json("-m", smol, *copy, "-fa", "off", "--spec-type", "none")
    out = speculate_json(*flags, *(arg.format(smol=smol) for arg in spec))
    assert out["tokens"] == alone["tokens"] and out["n_drafted"] > 0
    assert alone["target"]["kv_bytes"] < f16["target"]["kv_bytes"]


@real
def test_a_cache_type_whose_blocks_do_not_divide_the_head_size_exits_2_before_loading(tmp_path):
    tiny = write_tiny_llama(tmp_path / "tiny.gguf")  # heads of 16 values: q8_0's blocks are 32
    proc = speculate("-m", str(tiny), "-p", "hi", "-n", "2", "-ctk", "q8_0", env={"SPECULATE_LLAMA_LOG": "1"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "speculate: error: -ctk q8_0: its blocks of 32 values do not divide tiny.gguf's K head size 16; give a "
        "type whose block does (f16, bf16, f32)")
    assert "llama_model_loader" not in proc.stderr  # refused before llama.cpp read the file
    assert speculate("-m", str(tiny), "-p", "hi", "-n", "2", "-ctk", "bf16", "-ctv", "f32").returncode == 0


@real
def test_an_override_pattern_that_matches_no_tensor_is_a_note(model_path):
    smol = model_path(SMOL)
    proc = speculate("-m", str(smol), *GREEDY, "-n", "2", "-ot", "token_embd=CPU", "-ot", r"ffn_up_exps\.=CPU",
                     "--swa-full", "-ub", "64", "-lm", "none", "--spec-type", "none", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"-ot ffn_up_exps\\.: matches none of {smol.name}'s tensors"]
    out = json.loads(proc.stdout)
    assert out["target"]["overrides"] == [["token_embd", "CPU"], [r"ffn_up_exps\.", "CPU"]]
    assert out["target"]["n_ubatch"] == 64


@real
def test_doctor_takes_the_memory_flags(model_path):
    out = json.loads(speculate("doctor", "-m", str(model_path(SMOL)), "-ctk", "q8_0", "-ctv", "q8_0", "--json").stdout)
    assert (out["cache_type_k"], out["cache_type_v"], out["flash_attn_on"]) == ("q8_0", "q8_0", True)
    assert "FLASH_ATTN" in out["batch_variant_kernels"]
    plain = json.loads(speculate("doctor", "-m", str(model_path(SMOL)), "-nr", "--json").stdout)
    assert "REPACK" not in plain["batch_variant_kernels"] and plain["checks"]


@real
def test_with_flash_attention_on_speculation_is_exact_where_doctor_finds_the_build_batch_invariant(model_path, tmp_path):
    """A quantized V cache turns flash attention on. Where doctor finds that configuration
    batch-invariant, greedy speculation gives target-only output; where it does not (a CPU's
    flash attention), an answer may part from it only on a near-tie, which bench reports."""
    smol = str(model_path(SMOL))
    quantized = ("-ctk", "q8_0", "-ctv", "q8_0", "-t", "1")
    doctor = speculate_json("doctor", "-m", smol, *quantized)
    prompts, out = tmp_path / "p.jsonl", tmp_path / "r.json"
    prompts.write_text("".join(json.dumps({"id": str(i), "category": "copy", "prompt": p}) + "\n" for i, p in enumerate((
        "Copy this list twice: red, green, blue, yellow, purple, orange. red, green,",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "The capital of France is"))))
    proc = speculate("bench", str(prompts), "-m", smol, "-md", smol, "-C", "draft", "-C", "ngram-simple", "-n", "32",
                     *quantized, "-o", str(out), env={"SPECULATE_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert doctor["flash_attn_on"] and len(runs) == 3 * 3
    mismatches = [r["mismatch"] for r in runs if r["mismatch"]]
    if doctor["batch_invariant"]:
        assert mismatches == []
    else:
        assert all(abs(m["margin"]) < 0.5 for m in mismatches), mismatches  # near-ties, never a bug


@real
def test_what_is_stored_is_keyed_by_the_cache_types(model_path, tmp_path):
    """A prompt cache saved with an f16 KV cache is not offered to a q8_0 one."""
    smol, cache = str(model_path(SMOL)), tmp_path / "prompt.cache"
    common = ("-m", smol, *GREEDY, "-n", "4", "--spec-type", "none", "--prompt-cache", str(cache),
              "--prompt-cache-ro", "--json")
    assert speculate("-m", smol, *GREEDY, "-n", "4", "--spec-type", "none", "--prompt-cache", str(cache)).returncode == 0
    again = speculate(*common)
    quantized = speculate(*common, "-ctk", "q8_0")
    assert json.loads(again.stdout)["n_restored"] > 0
    assert json.loads(quantized.stdout)["n_restored"] == 0
    assert "the target part was saved for another model or settings" in quantized.stderr, quantized.stderr


# -- placement, on loopback RPC servers as devices ------------------------------------


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from tests.tiny_model import write_model

    path = write_model("qwen3moe", tmp_path_factory.mktemp("moe") / "moe.gguf", n_layer=4)
    experts = sorted(name for name in tensor_names(path) if "_exps." in name)
    assert len(experts) == 12
    return path, experts


def overridden(log: str) -> dict[str, str]:
    """llama.cpp's debug lines: tensor -> the buffer type an override put it in."""
    return dict(re.findall(r"tensor (\S+) \([^)]*\) buffer type overridden to (\S+)", log))


def load(moe_path, servers: str, *flags: str) -> tuple[dict, str]:
    proc = speculate("-m", str(moe_path), "--rpc", servers, "-ngl", "99", "-p", "hello world", "-n", "4",
                     "--temp", "0", "-t", "1", "-c", "256", "--spec-type", "none", *flags,
                     env={"SPECULATE_LLAMA_LOG": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return model_loads(proc.stderr)[0], proc.stderr


@real
def test_cpu_moe_and_n_cpu_moe_keep_exactly_the_experts_in_host_memory(moe):
    path, experts = moe
    with rpc_server() as (_, first, _), rpc_server() as (_, second, _):
        servers = f"{first},{second}"
        _, plain = load(path, servers)
        every, log_all = load(path, servers, "--cpu-moe")
        _, log_two = load(path, servers, "-ncmoe", "2")
        _, log_ffn = load(path, servers, "-ot", r"blk\.3\.attn_q\.=RPC0[" + second + "]")  # each server names its own device 0
    assert overridden(plain) == {}
    assert overridden(log_all) == dict.fromkeys(experts, "CPU")
    assert overridden(log_two) == {name: "CPU" for name in experts if name.startswith(("blk.0.", "blk.1."))}
    assert overridden(log_ffn) == {"blk.3.attn_q.weight": f"RPC0[{second}]"}
    assert every["layers"] == {"RPC0", "RPC1"} and any(w.startswith("CPU") for w in every["weights"]), every


@real
def test_tensor_split_and_split_mode_none_put_the_layers_where_they_say(moe):
    path, _ = moe

    def layers(log: str) -> list[str]:
        return re.findall(r"load_tensors: layer +\d+ assigned to device ([^,\s]+)", log)

    with rpc_server() as (_, first, _), rpc_server() as (_, second, _):
        servers = f"{first},{second}"
        _, even = load(path, servers)
        _, three_one = load(path, servers, "-ts", "3,1")
        _, alone = load(path, servers, "-sm", "none", "-mg", "1")
    assert layers(three_one).count("RPC0") > layers(even).count("RPC0"), (layers(even), layers(three_one))
    assert set(layers(alone)) - {"CPU"} == {"RPC1"}, layers(alone)
