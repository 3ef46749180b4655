"""Options shared by `speculate`, `speculate serve`, `speculate batch` and `speculate bench`: the
models, how they run, how speculation drafts, and how tokens are sampled."""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, List, Optional

import typer

from speculative.decoding.settings import (CACHE_TYPES, DRAFT_MAX_AUTO, DRAFT_MAX_FIXED, FLASH_ATTN_MODES, LOAD_MODES,
                                           NGRAM_CACHE_DRAFT, NGRAM_N_AUTO, NGRAM_N_FIXED, POOL_TOKENS, SPLIT_MODES,
                                           ModelSpec, NgramSettings, SamplerSettings, SpecSettings)
from speculative.drafters import registry
from speculative.errors import UsageError
from speculative.models.registry import Registry, check_gguf_file

from . import memory
from .models import resolve_models

M, D, S, R = "Models", "Speculation", "Sampling", "Requests at once"

MODEL = typer.Option(
    None, "-m", "--model", rich_help_panel=M, metavar="PATH|NAME",
    help="Target model: a GGUF file or a registry name (default: the registry's default target).")
MODEL_DRAFT = typer.Option(
    None, "-md", "--model-draft", "--spec-draft-model", rich_help_panel=M, metavar="PATH|NAME",
    help="Draft model: a GGUF file or a registry name (default with no -m: the default draft).")
HF_REPO = typer.Option(
    None, "-hf", "-hfr", "--hf-repo", rich_help_panel=M, metavar="<user>/<model>[:quant]",
    envvar="LLAMA_ARG_HF_REPO", show_envvar=False,
    help="Target model from a Hugging Face repository, as llama.cpp's -hf: quant optional, case-insensitive "
         "(default Q4_K_M, else Q8_0, else the first GGUF). Found in llama.cpp's and huggingface_hub's caches, "
         "else downloaded (resumable, sha256-checked) into the shared cache.")
HF_REPO_DRAFT = typer.Option(
    None, "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf", rich_help_panel=M,
    metavar="<user>/<model>[:quant]", envvar="LLAMA_ARG_SPEC_DRAFT_HF_REPO", show_envvar=False,
    help="Draft model from a Hugging Face repository (as -hf).")
HF_FILE = typer.Option(
    None, "-hff", "--hf-file", rich_help_panel=M, metavar="FILE", envvar="LLAMA_ARG_HF_FILE", show_envvar=False,
    help="The file in the -hf repository (overrides :quant).")
HF_TOKEN = typer.Option(
    None, "-hft", "--hf-token", rich_help_panel=M, metavar="TOKEN",
    help="Hugging Face access token, for gated or private repositories (default: HF_TOKEN, or the stored "
         "`hf auth login`).")
CTX_SIZE = typer.Option(
    ModelSpec.n_ctx, "-c", "--ctx-size", rich_help_panel=M,
    help="Target context size in tokens (0: the model's own).")
CTX_SIZE_DRAFT = typer.Option(
    None, "-cd", "--ctx-size-draft", rich_help_panel=M, help="Draft context size (default: -c).")
N_GPU_LAYERS = typer.Option(
    ModelSpec.n_gpu_layers, "-ngl", "--n-gpu-layers", "--gpu-layers", rich_help_panel=M,
    help="Target layers to offload to the GPU (-1: all that the build can).")
N_GPU_LAYERS_DRAFT = typer.Option(
    None, "-ngld", "--n-gpu-layers-draft", "--spec-draft-ngl", "--gpu-layers-draft", rich_help_panel=M,
    help="Draft layers to offload to the GPU (default: -ngl).")
THREADS = typer.Option(
    None, "-t", "--threads", rich_help_panel=M, help="CPU threads for the target (default: all available).")
THREADS_DRAFT = typer.Option(
    None, "-td", "--threads-draft", "--spec-draft-threads", rich_help_panel=M,
    help="CPU threads for the draft (default: -t).")
THREADS_BATCH = typer.Option(
    None, "-tb", "--threads-batch", rich_help_panel=M, metavar="N",
    help="CPU threads for the target's batches: prompts and drafts verified (default: -t).")
THREADS_BATCH_DRAFT = typer.Option(
    None, "-tbd", "--threads-batch-draft", "--spec-draft-threads-batch", rich_help_panel=M, metavar="N",
    help="CPU threads for the draft's batches (default: -tb if given, else -td).")
FLASH_ATTN = typer.Option(
    ModelSpec.flash_attn, "-fa", "--flash-attn", rich_help_panel=M, metavar="on|off|auto",
    help="Flash attention (both models). auto: llama.cpp's choice on this machine's GPUs, off on the CPU, "
         "where it scores a position differently alone and inside a batch (greedy speculation would "
         "then drift from target-only output on near-ties), and on RPC servers, which may be CPUs.")
BATCH_SIZE = typer.Option(
    ModelSpec.n_batch, "-b", "--batch-size", rich_help_panel=M, help="Most tokens in one forward pass.")
RPC = typer.Option(
    None, "--rpc", rich_help_panel=M, metavar="SERVERS",
    help="Comma-separated RPC servers, HOST:PORT (llama.cpp's rpc-server or `speculate rpc-server`): the "
         "target's -ngl layers go to their devices, the draft model stays here. Each is checked before "
         "the models load.")
DEVICE = typer.Option(
    None, "-dev", "--device", rich_help_panel=M, metavar="<dev1,dev2,..>",
    help="Devices for the target's offloaded layers (none: keep them on the CPU; default: the --rpc "
         "servers' devices, else llama.cpp's choice).")
DEVICE_DRAFT = typer.Option(
    None, "-devd", "--device-draft", "--spec-draft-device", rich_help_panel=M, metavar="<dev1,dev2,..>",
    help="Devices for the draft model's offloaded layers (none: the CPU; default with --rpc: this "
         "machine's GPUs, else -dev).")
_KV_TYPES = ", ".join(CACHE_TYPES)
CACHE_TYPE_K = typer.Option(
    ModelSpec.cache_type_k, "-ctk", "--cache-type-k", rich_help_panel=M, metavar="TYPE",
    envvar="LLAMA_ARG_CACHE_TYPE_K", show_envvar=False, help=f"KV cache type for K: {_KV_TYPES}.")
CACHE_TYPE_V = typer.Option(
    ModelSpec.cache_type_v, "-ctv", "--cache-type-v", rich_help_panel=M, metavar="TYPE",
    envvar="LLAMA_ARG_CACHE_TYPE_V", show_envvar=False,
    help="KV cache type for V (a quantized one needs flash attention: -fa auto turns it on).")
CACHE_TYPE_K_DRAFT = typer.Option(
    ModelSpec.cache_type_k, "-ctkd", "--spec-draft-type-k", "--cache-type-k-draft", rich_help_panel=M,
    metavar="TYPE", envvar="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K", show_envvar=False,
    help="KV cache type for K of the draft model or head (f16 whatever -ctk says, as llama.cpp).")
CACHE_TYPE_V_DRAFT = typer.Option(
    ModelSpec.cache_type_v, "-ctvd", "--spec-draft-type-v", "--cache-type-v-draft", rich_help_panel=M,
    metavar="TYPE", envvar="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V", show_envvar=False,
    help="KV cache type for V of the draft model or head (f16 whatever -ctv says).")
OVERRIDE_TENSOR = typer.Option(
    None, "-ot", "--override-tensor", rich_help_panel=M, metavar="<tensor name pattern>=<buffer type>,...",
    envvar="LLAMA_ARG_OVERRIDE_TENSOR", show_envvar=False,
    help="Keep the target's tensors whose names match a pattern (an ECMAScript regular expression, "
         "searched) in that buffer type (CPU, or a device's: CUDA0, RPC0[host:port], ...); the first "
         "match wins. Repeatable.")
OVERRIDE_TENSOR_DRAFT = typer.Option(
    None, "-otd", "--spec-draft-override-tensor", "--override-tensor-draft", rich_help_panel=M,
    metavar="<tensor name pattern>=<buffer type>,...", help="As -ot, for the draft model or head.")
CPU_MOE = typer.Option(
    False, "-cmoe", "--cpu-moe", rich_help_panel=M, envvar="LLAMA_ARG_CPU_MOE", show_envvar=False,
    help="Keep every Mixture-of-Experts expert tensor of the target in host memory.")
N_CPU_MOE = typer.Option(
    0, "-ncmoe", "--n-cpu-moe", rich_help_panel=M, metavar="N", envvar="LLAMA_ARG_N_CPU_MOE", show_envvar=False,
    help="Keep the expert tensors of the target's first N layers in host memory.")
N_CPU_FFN = typer.Option(
    0, "-ncffn", "--n-cpu-ffn", rich_help_panel=M, metavar="N", envvar="LLAMA_ARG_N_CPU_FFN", show_envvar=False,
    help="Keep the dense FFN tensors of the target's first N layers in host memory.")
CPU_MOE_DRAFT = typer.Option(
    False, "-cmoed", "--spec-draft-cpu-moe", "--cpu-moe-draft", rich_help_panel=M,
    envvar="LLAMA_ARG_SPEC_DRAFT_CPU_MOE", show_envvar=False, help="As -cmoe, for the draft model.")
N_CPU_MOE_DRAFT = typer.Option(
    0, "-ncmoed", "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe", "--n-cpu-moe-draft", rich_help_panel=M,
    metavar="N", envvar="LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE", show_envvar=False, help="As -ncmoe, for the draft model.")
UBATCH_SIZE = typer.Option(
    ModelSpec.n_ubatch, "-ub", "--ubatch-size", rich_help_panel=M, metavar="N", envvar="LLAMA_ARG_UBATCH",
    show_envvar=False, help="Most tokens in one physical batch (both models; at most -b).")
LOAD_MODE = typer.Option(
    ModelSpec.load_mode, "-lm", "--load-mode", rich_help_panel=M, metavar="MODE", envvar="LLAMA_ARG_LOAD_MODE",
    show_envvar=False, help=f"How the weights load (both models): {', '.join(LOAD_MODES)}.")
MLOCK = typer.Option(
    False, "--mlock", rich_help_panel=M,
    help="Older llama.cpp's: keep the weights in RAM, -lm mmap+mlock (with --no-mmap: -lm mlock).")
MMAP = typer.Option(
    None, "--mmap/--no-mmap", rich_help_panel=M,
    help="Older llama.cpp's: memory-map the weights (-lm mmap), or read them in (-lm none).")
REPACK = typer.Option(
    True, "--repack/--no-repack", " /-nr", rich_help_panel=M, envvar="LLAMA_ARG_REPACK", show_envvar=False,
    help="Weight repacking for the CPU's faster kernels (both models), as llama.cpp's; -nr: weights as they are "
         "(slower on most CPUs; one batch-variant kernel fewer: docs/exactness-and-builds.md).")
OFFLINE = typer.Option(
    False, "--offline", rich_help_panel=M, envvar="LLAMA_ARG_OFFLINE", show_envvar=False,
    help="Offline mode, as llama.cpp's: models from the caches only, no network access (-hf as with "
         "HF_HUB_OFFLINE=1; a registry model not pulled yet is an error).")
VERBOSE = typer.Option(
    False, "-v", "--verbose", "--log-verbose", rich_help_panel=M,
    help="Show llama.cpp's log (loading, contexts, devices) on stderr, as SPECULATE_LLAMA_LOG=1 does; serve's "
         "OpenAI answers also carry llama-server's __verbose object (a request's `verbose` decides).")
JINJA = typer.Option(
    True, "--jinja/--no-jinja", rich_help_panel=M,
    help="Chats through the model's Jinja template, rendered in a sandbox (the default); --no-jinja: through "
         "llama.cpp's built-in chat formats, which it recognises in the template, as llama-server --no-jinja.")
CHAT_TEMPLATE = typer.Option(
    None, "--chat-template", rich_help_panel=M, metavar="JINJA_TEMPLATE",
    help="Chats through this Jinja template instead of the model's, or through one of llama.cpp's built-in "
         "formats by its name (chatml, llama3, gemma, mistral-v7, ...: a wrong name lists them).")
CHAT_TEMPLATE_FILE = typer.Option(
    None, "--chat-template-file", rich_help_panel=M, metavar="JINJA_TEMPLATE_FILE",
    help="As --chat-template, the template read from a file.")
SPLIT_MODE = typer.Option(
    ModelSpec.split_mode, "-sm", "--split-mode", rich_help_panel=M, metavar="{" + ",".join(SPLIT_MODES) + "}",
    envvar="LLAMA_ARG_SPLIT_MODE", show_envvar=False,
    help="How the offloaded layers split over several devices: none (the -mg device alone), layer, row, tensor.")
TENSOR_SPLIT = typer.Option(
    None, "-ts", "--tensor-split", rich_help_panel=M, metavar="N0,N1,N2,...", envvar="LLAMA_ARG_TENSOR_SPLIT",
    show_envvar=False, help="Each device's share of the offloaded layers, e.g. 3,1.")
MAIN_GPU = typer.Option(
    ModelSpec.main_gpu, "-mg", "--main-gpu", rich_help_panel=M, metavar="INDEX", envvar="LLAMA_ARG_MAIN_GPU",
    show_envvar=False, help="The device of -sm none (and of -sm row's intermediate results).")
SWA_FULL = typer.Option(
    False, "--swa-full", rich_help_panel=M, envvar="LLAMA_ARG_SWA_FULL", show_envvar=False,
    help="Accepted, changes nothing: speculate always keeps the full sliding-window cache, which exact "
         "rollback needs.")
LORA = typer.Option(
    None, "--lora", rich_help_panel=M, metavar="FNAME",
    help="LoRA adapter (GGUF) for the target, at scale 1; repeat or comma-separate for several.")
LORA_SCALED = typer.Option(
    None, "--lora-scaled", rich_help_panel=M, metavar="FNAME:SCALE",
    help="LoRA adapter for the target at scale SCALE; repeat or comma-separate for several.")
LORA_DRAFT = typer.Option(
    None, "--lora-draft", rich_help_panel=M, metavar="FNAME",
    help="LoRA adapter for the draft model, at scale 1; repeat or comma-separate for several.")


SPEC_TYPE = typer.Option(
    None, "--spec-type", rich_help_panel=D, metavar="TYPES",
    help="Comma-separated (or repeated), tried in order: "
         + ", ".join(t.name + "".join(f" ({a})" for a in t.aliases) for t in registry.TYPES.values())
         + "; auto (the default): choose among those loaded and k each step by measured cost, k = 0 included; "
           "none: target only, same code path.")
SPEC_DEFAULT = typer.Option(
    False, "--spec-default", rich_help_panel=D,
    help="llama.cpp's default speculation: adds ngram-mod (n-match 24, n-min 48, n-max 64) to --spec-type, "
         "before ngram-cache and the model drafters, as llama.cpp's order of types puts it.")
DRAFT_MAX = typer.Option(
    None, "--draft-max", "--draft", "--draft-n", "--spec-draft-n-max", rich_help_panel=D,
    help=f"Most tokens drafted per step (default {DRAFT_MAX_FIXED}; auto: up to {DRAFT_MAX_AUTO}; llama.cpp's "
         f"ngram-mod, ngram-map-k4v: their own n-max, size-m; ngram-cache: {NGRAM_CACHE_DRAFT}).")
DRAFT_MIN = typer.Option(
    SpecSettings.draft_min, "--draft-min", "--draft-n-min", "--spec-draft-n-min", rich_help_panel=D,
    help="Drafts shorter than this are not verified.")
DRAFT_P_MIN = typer.Option(
    SpecSettings.draft_p_min, "--draft-p-min", "--spec-draft-p-min", rich_help_panel=D,
    help="Stop drafting when the draft's top candidate is less likely than P.")
_BRANCHES_HELP = ("Draft trees: the draft model's most branches per step, all verified in one target batch "
                  "(1: a chain; needs --spec-type draft).")
PARALLEL = typer.Option(SpecSettings.branches, "-np", "--parallel", "--draft-branches", rich_help_panel=D,
                        metavar="N", help=_BRANCHES_HELP)
DRAFT_BRANCHES = typer.Option(SpecSettings.branches, "--draft-branches", rich_help_panel=D,  # serve's and batch's
                              metavar="N", help=_BRANCHES_HELP)                         # -np: their slots
DRAFT_P_SPLIT = typer.Option(
    SpecSettings.p_split, "--draft-p-split", "--spec-draft-p-split", rich_help_panel=D, metavar="P",
    help="Draft trees: a candidate the draft gives more than P starts a new branch (with more than one).")
SPEC_ACCEPT = typer.Option(
    SpecSettings.accept, "--spec-accept", rich_help_panel=D, metavar="match|rejection",
    help="How sampled drafts are verified: match (the default, llama.cpp's: the target samples, a drafted "
         "token is kept when it is the one drawn; with a seed, the tokens target-only decoding gives) or "
         "rejection (speculative sampling: the draft model samples, tokens are kept with probability "
         "min(1, p/q); keeps more of a sampling draft's tokens). Both follow the target's distribution "
         "exactly; with --temp 0 both are greedy.")
NGRAM_N = typer.Option(
    None, "--spec-ngram-size-n", rich_help_panel=D,
    help=f"N-gram drafters: length of the n-gram looked up [default: {NGRAM_N_FIXED}; auto: {NGRAM_N_AUTO}].")
NGRAM_M = typer.Option(
    None, "--spec-ngram-size-m", rich_help_panel=D,
    help=f"N-gram drafters: most tokens proposed after a match [default: {NgramSettings.m}].")
NGRAM_MIN_HITS = typer.Option(
    None, "--spec-ngram-min-hits", rich_help_panel=D,
    help=f"N-gram drafters: earlier occurrences needed [default: {NgramSettings.min_hits}].")


# each drafter type's own flags (drafters/registry.py), as parameters named TYPE__FIELD
TYPE_FLAGS = tuple((f"{t.settings_field}__{flag.field}", Optional[flag.kind],
                    typer.Option(None, *flag.names, rich_help_panel=D, metavar=flag.metavar, help=flag.help))
                   for t in registry.TYPES.values() for flag in t.flags)
SYNTH_LEN = typer.Option(
    None, "--spec-synth-len", rich_help_panel=D, metavar="L", envvar="LLAMA_ARG_SPEC_SYNTH_LEN", show_envvar=False,
    help="Benchmarking only, as llama.cpp's: keep drafted tokens at random, for a mean of L tokens a step (the "
         "target's included), whatever the target picks: the output is not the target's.")
SYNTH_RATES = typer.Option(
    None, "--spec-synth-rates", rich_help_panel=D, metavar="P0,P1,...", envvar="LLAMA_ARG_SPEC_SYNTH_RATES",
    show_envvar=False,
    help="Benchmarking only, as --spec-synth-len: the chance each drafted position is kept, one per --draft-max, "
         "non-increasing.")
CV = "Conversation"
CONVERSATION = typer.Option(
    False, "-cnv", "--conversation", rich_help_panel="Prompt",
    help="Chat as llama-cli (the default on a terminal without -p/-f; docs/conversation.md): /exit /regen /clear "
         "/read /glob /stats.")
NO_CONVERSATION = typer.Option(
    False, "-no-cnv", "--no-conversation", rich_help_panel=CV,
    help="No conversation: one generation from -p/-f.")
SINGLE_TURN = typer.Option(
    False, "-st", "--single-turn", rich_help_panel=CV,
    help="A conversation of one answer, then exit (130 when Ctrl-C stopped it).")
MULTILINE = typer.Option(
    False, "-mli", "--multiline-input", rich_help_panel=CV,
    help="A message goes on over lines until one that ends in / or \\ (without it, a line ending in \\ "
         "goes on).")
CONTEXT_SHIFT = typer.Option(
    False, "--context-shift/--no-context-shift", rich_help_panel=CV,
    help="When the conversation outgrows the context (-c), drop its oldest exchanges, leaving the answer a "
         "quarter of the context (or -n); without it, say so and keep the conversation for /clear.")
SHOW_TIMINGS = typer.Option(
    True, "--show-timings/--no-show-timings", rich_help_panel=CV,
    help="After each answer, one line: tokens, tokens/s, drafted and accepted, tokens per pass, new prompt tokens.")
SPEC_POOL = typer.Option(
    None, "--spec-pool", rich_help_panel=D, metavar="FILE",
    help="Keep what runs generate in FILE, and draft from it in later runs (auto; or --spec-type ngram-pool): "
         "for scripts that run speculate over many similar inputs. Saved atomically at the end, merged with "
         "what other processes saved; a file of another tokenizer is left alone, a damaged one ignored.")
SPEC_POOL_TOKENS = typer.Option(
    POOL_TOKENS, "--spec-pool-tokens", rich_help_panel=D, metavar="N",
    help="Most tokens of earlier output kept to draft from, in memory and in --spec-pool FILE "
         "(0: no pool; batch and serve otherwise draft from their earlier requests' output).")
N_PREDICT = typer.Option(
    SpecSettings.n_predict, "-n", "--n-predict", "--predict", rich_help_panel=S,
    help="Most tokens to generate (-1: until end of generation or a full context).")
TEMP = typer.Option(SamplerSettings.temp, "--temp", "--temperature", rich_help_panel=S,
                    help="Temperature; 0 is greedy.")
TOP_K = typer.Option(SamplerSettings.top_k, "--top-k", rich_help_panel=S, help="Top-k sampling (0: off).")
TOP_P = typer.Option(SamplerSettings.top_p, "--top-p", rich_help_panel=S, help="Top-p sampling (1.0: off).")
MIN_P = typer.Option(SamplerSettings.min_p, "--min-p", rich_help_panel=S, help="Min-p sampling (0.0: off).")
TYPICAL = typer.Option(SamplerSettings.typical_p, "--typical", "--typical-p", rich_help_panel=S,
                       help="Locally typical sampling, p (1.0: off).")
REPEAT_PENALTY = typer.Option(SamplerSettings.repeat_penalty, "--repeat-penalty", rich_help_panel=S,
                              help="Penalise repeated tokens (1.0: off).")
REPEAT_LAST_N = typer.Option(SamplerSettings.repeat_last_n, "--repeat-last-n", rich_help_panel=S,
                             help="Last N tokens the penalties look at (0: off, -1: all).")
PRESENCE_PENALTY = typer.Option(SamplerSettings.presence_penalty, "--presence-penalty", rich_help_panel=S,
                                help="Lower a seen token's logit by this (0.0: off).")
FREQUENCY_PENALTY = typer.Option(SamplerSettings.frequency_penalty, "--frequency-penalty", rich_help_panel=S,
                                 help="Lower a token's logit by this per time seen (0.0: off).")
SEED = typer.Option(SamplerSettings.seed, "-s", "--seed", rich_help_panel=S, help="Random seed (-1: random, reported).")
SAMPLING_SEQ = typer.Option(
    SamplerSettings.sequence, "--sampling-seq", "--sampler-seq", rich_help_panel=S,
    help="Sampler order, llama.cpp letters: e penalties, k top-k, y typical, p top-p, m min-p, "
         "t temperature (d s x accepted, inactive).")
GRAMMAR = typer.Option(
    None, "--grammar", rich_help_panel=S, metavar="GBNF",
    help="Constrain the output to this GBNF grammar (llama.cpp's syntax, root rule `root`).")
GRAMMAR_FILE = typer.Option(None, "--grammar-file", rich_help_panel=S, metavar="FILE",
                            help="Constrain the output to the GBNF grammar in FILE.")
JSON_SCHEMA = typer.Option(
    None, "-j", "--json-schema", rich_help_panel=S, metavar="SCHEMA",
    help="Constrain the output to JSON that follows this JSON Schema (converted as llama.cpp does); "
         "{} is any JSON value.")
JSON_SCHEMA_FILE = typer.Option(None, "-jf", "--json-schema-file", rich_help_panel=S, metavar="FILE",
                                help="Constrain the output to the JSON Schema in FILE.")
IGNORE_EOS = typer.Option(SpecSettings.ignore_eos, "--ignore-eos", rich_help_panel=S,
                          help="Never stop at end-of-generation tokens.")


def sampler_settings(*, temp: float, top_k: int, top_p: float, min_p: float, typical_p: float,
                     repeat_penalty: float, repeat_last_n: int, presence_penalty: float, frequency_penalty: float,
                     sampling_seq: str, seed: int, grammar: Optional[str] = None, grammar_file: Optional[Path] = None,
                     json_schema: Optional[str] = None, json_schema_file: Optional[Path] = None) -> SamplerSettings:
    """The sampling flags as validated settings; a grammar or schema checked (and converted) here,
    before any model loads."""
    sampling = SamplerSettings(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                               repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                               presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                               sequence=sampling_seq, seed=seed,
                               grammar=grammar_text(grammar, grammar_file, json_schema, json_schema_file))
    sampling.validate()
    return sampling


def spec_settings(*, spec_type: Optional[List[str]], draft_max: Optional[int], draft_min: int, draft_p_min: float,
                  spec_accept: str, branches: int, draft_p_split: float, ngram_n: Optional[int] = None,
                  ngram_m: Optional[int] = None, ngram_min_hits: Optional[int] = None,
                  n_predict: int = SpecSettings.n_predict, ignore_eos: bool = SpecSettings.ignore_eos,
                  spec_default: bool = False, synth_len: Optional[float] = None, synth_rates: Optional[str] = None,
                  **own) -> SpecSettings:
    """The speculation flags as validated settings. A type's own flag (`own`: TYPE_FLAGS') wins
    over the common --spec-ngram-* one, which wins over its settings' default. The -lcs/-lcd files
    are checked here, before any model loads."""
    named = registry.canonical([t.strip() for value in spec_type for t in value.split(",")]) if spec_type else None
    types = with_spec_default(named, spec_default)
    # the n-gram lookup types' common flags, each a fallback for the types' own (registry.Flag.common)
    common = {"--spec-ngram-size-n": ngram_n, "--spec-ngram-size-m": ngram_m, "--spec-ngram-min-hits": ngram_min_hits}
    settings = {}
    for kind in (t for t in registry.TYPES.values() if t.settings is not None):
        given = {flag.field: _first(own.get(f"{kind.settings_field}__{flag.field}"), common.get(flag.common))
                 for flag in kind.flags}  # what is not given: the settings' default
        settings[kind.settings_field] = kind.settings(**{k: v for k, v in given.items() if v is not None})
    spec = SpecSettings(
        types=types, draft_min=draft_min, draft_p_min=draft_p_min, n_predict=n_predict,
        draft_max=draft_max if draft_max is not None else DRAFT_MAX_AUTO if "auto" in types else DRAFT_MAX_FIXED,
        draft_max_given=draft_max is not None, ignore_eos=ignore_eos, accept=spec_accept, branches=branches,
        p_split=draft_p_split, synth_len=synth_len, synth_rates=_rates(synth_rates), **settings)
    registry.check(spec)
    cache = spec.ngram_cache
    if cache.static is not None or cache.dynamic is not None:
        from speculative.drafters import lookup_cache  # (numpy: imported only when needed, for start-up time)

        if cache.static is not None:
            lookup_cache.check_static(cache.static)
        if cache.dynamic is not None:
            lookup_cache.check_writable(cache.dynamic)  # refused now, not after loading the models
    return spec


def _rates(text: Optional[str]) -> tuple[float, ...]:
    """--spec-synth-rates P0,P1,...: numbers, as llama.cpp reads them."""
    try:
        return tuple(float(item) for item in text.split(",")) if text is not None else ()
    except ValueError:
        raise UsageError(f"--spec-synth-rates: expected comma-separated numbers, got {text!r}") from None


@dataclass(frozen=True)
class TalkOptions:
    """The conversation's flags (-cnv, -no-cnv, -st, -mli, --context-shift, --show-timings)."""
    asked: bool = False
    refused: bool = False
    single_turn: bool = False
    multiline: bool = False
    context_shift: bool = False
    show_timings: bool = True

    def __post_init__(self):
        if self.asked and self.refused:
            raise UsageError("give -cnv or -no-cnv, not both")
        if self.refused and self.single_turn:
            raise UsageError("-st is a conversation of one turn: it cannot go with -no-cnv")

    @classmethod
    def from_flags(cls, conversation: bool = False, no_conversation: bool = False, single_turn: bool = False,
                   multiline: bool = False, context_shift: bool = False, show_timings: bool = True) -> "TalkOptions":
        return cls(conversation, no_conversation, single_turn, multiline, context_shift, show_timings)

    def holds(self, prompt_given: bool, prompt_from_stdin: bool) -> bool:
        """Whether to hold a conversation: asked for (-cnv, -st), or, as llama-cli, when no prompt is
        given and a person types at a terminal."""
        from . import terminal

        talk = self.asked or self.single_turn or (not self.refused and not prompt_given
                                                  and terminal.is_terminal(sys.stdin))
        if not talk and self.context_shift:
            raise UsageError("--context-shift drops a conversation's oldest turns: it needs a conversation (-cnv)")
        if talk and prompt_from_stdin:
            raise UsageError("a conversation reads its messages from standard input: give the first one with "
                             "-p TEXT or -f FILE, not '-'")
        return talk


@dataclass(frozen=True)
class PoolOptions:
    """--spec-pool FILE and --spec-pool-tokens N, checked (a FILE that is not a pool is refused
    before anything loads)."""
    file: Optional[Path] = None
    tokens: int = POOL_TOKENS

    def __post_init__(self):
        if self.tokens < 0:
            raise UsageError(f"--spec-pool-tokens must be >= 0, got {self.tokens}")
        if self.file is not None:
            if self.tokens == 0:
                raise UsageError("--spec-pool FILE needs a pool: --spec-pool-tokens must be > 0")
            from speculative.drafters.pool import check_pool_file

            check_pool_file(self.file)

    def engine_args(self) -> dict:
        return {"pool_tokens": self.tokens, "pool_file": self.file}


def pool_options(spec_pool: Optional[Path] = None, spec_pool_tokens: int = POOL_TOKENS) -> PoolOptions:
    return PoolOptions(spec_pool, spec_pool_tokens)


def with_spec_default(types: tuple[str, ...] | None, spec_default: bool) -> tuple[str, ...]:
    """--spec-type's list (None: not given), with ngram-mod added by --spec-default. llama.cpp's
    flag pushes ngram-mod onto the list, and llama.cpp tries the types in a fixed order (n-gram
    types, ngram-mod after ngram-simple, -map-k and -map-k4v, then ngram-cache, then models):
    here it goes where that order puts it. Without --spec-type, it is the only type."""
    if not spec_default:
        return types if types is not None else ("auto",)
    if types is None:
        return ("ngram-mod",)
    if "ngram-mod" in types:
        return types
    if "none" in types or "auto" in types:
        raise UsageError(f"--spec-default adds ngram-mod, which --spec-type {','.join(types)} cannot take")
    order = list(registry.TYPES)  # llama.cpp's: n-gram types, ngram-mod after the lookups, then the rest
    later = [i for i, t in enumerate(types) if t in order and order.index(t) > order.index("ngram-mod")]
    at = later[0] if later else len(types)
    return (*types[:at], "ngram-mod", *types[at:])


def _first(*values):
    return next((v for v in values if v is not None), None)


@dataclass(frozen=True)
class ModelOptions:
    """The model flags as given; `specs` checks them and resolves -m/-md into files."""
    model: Optional[str] = None
    model_draft: Optional[str] = None
    ctx_size: int = ModelSpec.n_ctx
    ctx_size_draft: Optional[int] = None
    n_gpu_layers: int = ModelSpec.n_gpu_layers
    n_gpu_layers_draft: Optional[int] = None
    threads: Optional[int] = None
    threads_draft: Optional[int] = None
    threads_batch: Optional[int] = None
    threads_batch_draft: Optional[int] = None
    batch_size: int = ModelSpec.n_batch
    flash_attn: str = ModelSpec.flash_attn
    lora: Optional[List[str]] = None
    lora_scaled: Optional[List[str]] = None
    lora_draft: Optional[List[str]] = None
    rpc: Optional[str] = None
    device: Optional[str] = None
    device_draft: Optional[str] = None
    hf_repo: Optional[str] = None
    hf_repo_draft: Optional[str] = None
    hf_file: Optional[str] = None
    hf_token: Optional[str] = None
    cache_type_k: str = ModelSpec.cache_type_k
    cache_type_v: str = ModelSpec.cache_type_v
    cache_type_k_draft: str = ModelSpec.cache_type_k  # llama.cpp's draft default, whatever -ctk says
    cache_type_v_draft: str = ModelSpec.cache_type_v
    override_tensor: Optional[List[str]] = None
    override_tensor_draft: Optional[List[str]] = None
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    n_cpu_ffn: int = 0
    cpu_moe_draft: bool = False
    n_cpu_moe_draft: int = 0
    ubatch_size: int = ModelSpec.n_ubatch
    load_mode: str = ModelSpec.load_mode
    repack: bool = True
    mlock: bool = False  # older llama.cpp's load flags: memory.load_mode reads them as -lm
    mmap: Optional[bool] = None
    split_mode: str = ModelSpec.split_mode
    tensor_split: Optional[str] = None
    main_gpu: int = ModelSpec.main_gpu
    swa_full: bool = False  # accepted: the full sliding-window cache is always kept
    jinja: bool = True
    chat_template: Optional[str] = None
    chat_template_file: Optional[Path] = None
    verbose: bool = False
    offline: bool = False

    @property
    def draft_available(self) -> bool:
        """A draft model is at hand: -md or -hfd, or the registry's default pair when no target is named."""
        return self.model_draft is not None or self.hf_repo_draft is not None or (
            self.model is None and self.hf_repo is None)

    @property
    def head_given(self) -> str | None:
        """The drafter -md names when it is no draft model but a head that drafts from the target's
        hidden states: "draft-mtp" (an MTP head file, NextN layers without a model) or
        a drafter that reads the target's layer inputs ("draft-eagle3", "draft-dflash",
        "draft-dspark"); None otherwise."""
        from speculative.models.gguf_meta import feature_drafter_kind, is_mtp_head

        path = Path(self.model_draft) if self.model_draft is not None else None
        if path is None or not path.is_file():
            return None
        return "draft-mtp" if is_mtp_head(path) else feature_drafter_kind(path)

    def uses_draft(self, spec: SpecSettings) -> bool:
        """Whether a draft model is loaded: named in --spec-type, or auto with one at hand."""
        if "draft" in spec.drafters:
            if not self.draft_available:
                raise UsageError(registry.TYPES["draft"].refusal())
            return True
        return spec.auto and not spec.drafters and self.draft_available and not self.head_given

    def specs(self, use_draft: bool, branches: int = 1, longest_draft: int = 0,
              mtp: str | None = None, features: str | None = None) -> tuple[ModelSpec, ModelSpec | None]:
        """Validate the model options, resolve -m/-md (pulling registry models as needed).
        `longest_draft`: what a recurrent target keeps snapshots for (cache.py); `mtp` and
        `features` (registry.heads): whether the target's NextN layers are loaded to draft with,
        and which drafter of its own file reading the target's layer inputs (-md) may draft."""
        self._check(use_draft)
        memory.check_values(self)
        placed = memory.overrides(self.override_tensor, self.cpu_moe, self.n_cpu_moe, self.n_cpu_ffn, "-ot")
        placed_draft = memory.overrides(self.override_tensor_draft, self.cpu_moe_draft, self.n_cpu_moe_draft, 0,
                                        "-otd")
        loras = ([(name, 1.0) for name in _names(self.lora, "--lora")] + _scaled(self.lora_scaled),
                 [(name, 1.0) for name in _names(self.lora_draft, "--lora-draft")])
        # llama.cpp loads from here on (imported this late, a refused command line answers at once)
        from speculative.engine.engine import MAX_SNAPSHOTS
        from speculative.llamacpp.devices import max_devices, show_llama_log

        if self.verbose:
            show_llama_log()
        template = _chat_template(self.chat_template, self.chat_template_file, self.jinja)
        split = memory.tensor_split(self.tensor_split, max_devices())
        devices = self._devices()  # RPC servers checked and registered before anything loads
        memory.check_buffer_types(placed, "-ot")
        memory.check_buffer_types(placed_draft, "-otd")
        # -md is resolved for draft-mtp too: it may be an MTP head file (convert_hf_to_gguf.py --mtp)
        # and for the drafters of a file of their own (draft-eagle3, ...), which it names
        with_md = use_draft or ((mtp or features) is not None and (self.model_draft or self.hf_repo_draft) is not None)
        target, draft = resolve_models(
            Registry.load(), self.model, self.model_draft, with_md, ctx=(self.ctx_size, self.ctx_size_draft),
            ngl=(self.n_gpu_layers, self.n_gpu_layers_draft), threads=(self.threads, self.threads_draft),
            n_batch=self.batch_size, flash_attn=self.flash_attn, loras=tuple(_adapters(names) for names in loras),
            hf_repo=(self.hf_repo, self.hf_repo_draft), hf_file=self.hf_file, hf_token=self.hf_token,
            offline=self.offline)
        target, draft = _place_head(target, draft, use_draft, mtp, features)
        target, draft = memory.apply(target, draft, self, placed, placed_draft, split)
        target = replace(target, n_rs_seq=min(longest_draft, MAX_SNAPSHOTS), devices=devices[0],
                         mtp=mtp is not None and not target.mtp_sidecar and not target.feature_drafter,
                         n_threads_batch=self.threads_batch, chat_template=template, jinja=self.jinja)
        draft = None if draft is None else replace(draft, devices=devices[1],
                                                   n_threads_batch=_first(self.threads_batch_draft, self.threads_batch))
        if branches <= 1:
            return target, draft
        # Both models get a KV-cache sequence per draft-tree branch (-np).
        return replace(target, n_seq=branches), None if draft is None else replace(draft, n_seq=branches)

    def _check(self, use_draft: bool) -> None:
        """The model flags on their own: numbers in range, one source per model."""
        for flag, value, least in (("-c/--ctx-size", self.ctx_size, 0), ("-b/--batch-size", self.batch_size, 1),
                                   ("-cd/--ctx-size-draft", self.ctx_size_draft, 0),
                                   ("-t/--threads", self.threads, 1), ("-td/--threads-draft", self.threads_draft, 1),
                                   ("-tb/--threads-batch", self.threads_batch, 1),
                                   ("-tbd/--threads-batch-draft", self.threads_batch_draft, 1)):
            if value is not None and value < least:
                raise UsageError(f"{flag} must be >= {least}, got {value}")
        for flag, value in (("-ngl/--n-gpu-layers", self.n_gpu_layers),
                            ("-ngld/--n-gpu-layers-draft", self.n_gpu_layers_draft)):
            if value is not None and value < -1:
                raise UsageError(f"{flag} must be -1 (all) or >= 0, got {value}")
        for role, local, hub, variable in (("target", self.model, self.hf_repo, HF_REPO.envvar),
                                           ("draft", self.model_draft, self.hf_repo_draft, HF_REPO_DRAFT.envvar)):
            if local is not None and hub is not None:
                flags = "-m and -hf" if role == "target" else "-md and -hfd"
                raise UsageError(f"{flags} both name the {role} model{_set_by(hub, variable)}; give one of them")
        if self.hf_file is not None and self.hf_repo is None:
            raise UsageError(f"-hff/--hf-file names a file in the -hf repository{_set_by(self.hf_file, HF_FILE.envvar)}; "
                             "give -hf too")
        if self.flash_attn not in FLASH_ATTN_MODES:
            raise UsageError(f"-fa/--flash-attn: expected one of {', '.join(FLASH_ATTN_MODES)}, "
                             f"got {self.flash_attn!r}")
        if self.lora_draft and not use_draft:
            raise UsageError("--lora-draft is for the draft model, which this run does not load")

    def _devices(self) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
        """The devices of the target's and the draft's offloaded layers (None: llama.cpp's choice),
        as llama.cpp's --rpc, -dev and -devd choose them; --rpc's servers are checked and their
        devices registered."""
        from speculative.llamacpp import rpc
        from speculative.llamacpp.devices import offload_devices

        remote = tuple(rpc.connect(rpc.parse(self.rpc))) if self.rpc is not None else None
        target = _device_list(self.device, "-dev/--device")
        draft = _device_list(self.device_draft, "-devd/--device-draft")
        if remote is None:
            return target, draft if draft is not None else target
        return (target if target is not None else remote,
                draft if draft is not None else tuple(offload_devices(remote=False)))


def _chat_template(text: Optional[str], file: Optional[Path], jinja: bool) -> str | None:
    """--chat-template or --chat-template-file's template (None: the model's), checked."""
    from speculative.engine.chat import check_template

    if text is not None and file is not None:
        raise UsageError("give --chat-template or --chat-template-file, not both")
    if file is not None:
        try:
            text = file.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read --chat-template-file {file}: {getattr(e, 'strerror', None) or e}") from None
    if text is not None:
        check_template(text, jinja)
    return text


def _device_list(value: Optional[str], flag: str) -> tuple[str, ...] | None:
    """-dev/-devd as llama.cpp reads them: device names, or none (no offloading)."""
    if value is None:
        return None
    if value.strip() == "none":
        return ()
    from speculative.llamacpp.devices import offload_devices

    names = tuple(_names([value], flag))
    known = offload_devices()
    for name in names:
        if name not in known:
            raise UsageError(f"{flag}: invalid device {name!r} (devices: {', '.join(known) or 'none'}; "
                             "--rpc adds those of RPC servers)")
    return names


def _names(values: Optional[List[str]], flag: str) -> list[str]:
    """The items of a repeatable, comma-separated flag (llama.cpp's --lora a.gguf,b.gguf)."""
    items = [item for value in values or () for item in value.split(",")]
    if "" in items:
        raise UsageError(f"{flag}: empty file name in {','.join(items)!r}")
    return items


def _scaled(values: Optional[List[str]]) -> list[tuple[str, float]]:
    """--lora-scaled FNAME:SCALE items (llama.cpp's form; a path may contain ':')."""
    out = []
    for item in _names(values, "--lora-scaled"):
        name, _, scale = item.rpartition(":")
        try:
            value = float(scale)
        except ValueError:
            value = math.nan
        if not name or not math.isfinite(value):
            raise UsageError(f"--lora-scaled: expected FNAME:SCALE with a finite SCALE, got {item!r}")
        out.append((name, value))
    return out


def _adapters(loras: list[tuple[str, float]]) -> tuple[tuple[Path, float], ...]:
    """Adapter files, checked before any model is pulled or loaded."""
    adapters = tuple((Path(name).expanduser(), scale) for name, scale in loras)
    for path, _ in adapters:
        check_gguf_file(path, "LoRA adapter")
    return adapters


def _set_by(value: str, variable: str) -> str:
    """Where a hub flag's value came from, when the environment gave it (llama.cpp's LLAMA_ARG_*
    variables: a user may have them set for llama-server and not think of them)."""
    return f" ({variable} is set to {value!r})" if os.environ.get(variable) == value else ""

PARALLEL_AUTO = 4  # llama-server's -np -1
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: every slot's draft-tree branches together
SLOTS_PARALLEL = typer.Option(
    -1, "-np", "--parallel", rich_help_panel=R, metavar="N",
    help=f"Requests decoded together, each in its own sequence of one context, one batch per step "
         f"(llama-server's slots; -1: auto, {PARALLEL_AUTO}).")
KV_UNIFIED = typer.Option(
    None, "-kvu/-no-kvu", "--kv-unified/--no-kv-unified", rich_help_panel=R, show_default=False,
    help="One pool of -c cells for every request (a request may use all of it; one that finds no cell "
         "left ends with finish_reason length). --no-kv-unified: -c / N cells each, no draft trees. Default "
         "as llama-server's: one pool with -np -1 (auto) or draft trees, -c / N each with -np N.")
PREFILL_BUDGET = typer.Option(
    500.0, "--prefill-budget", rich_help_panel=R, metavar="MS",
    help="While another request streams its answer, a prompt goes in chunks of about this many milliseconds, "
         "one per step, so the stream keeps going (0: whole -b chunks, as llama-server, as when nothing streams).")
SLOT_SIMILARITY = typer.Option(
    0.1, "-sps", "--slot-prompt-similarity", rich_help_panel=R, metavar="SIMILARITY",
    help="A request takes the free slot whose cache holds more than this share of its prompt, else the "
         "one used least recently (0.0: always the least recently used).")


@dataclass(frozen=True)
class SlotOptions:
    """-np, -kvu, --prefill-budget and -sps of serve and batch, checked."""
    parallel: int = -1
    kv_unified: bool | None = None  # None: unified()'s choice
    prefill_budget: float = 500.0
    similarity: float = 0.1

    def __post_init__(self):
        if self.parallel == 0 or self.parallel < -1:
            raise UsageError(f"-np/--parallel must be >= 1, or -1 (auto: {PARALLEL_AUTO}), got {self.parallel}")
        if not self.prefill_budget >= 0 or math.isinf(self.prefill_budget):
            raise UsageError(f"--prefill-budget must be a number of milliseconds >= 0, got {self.prefill_budget}")
        if not 0 <= self.similarity <= 1:
            raise UsageError(f"-sps/--slot-prompt-similarity must be in [0, 1], got {self.similarity}")

    @property
    def n_slots(self) -> int:
        return PARALLEL_AUTO if self.parallel == -1 else self.parallel

    def check(self, spec: SpecSettings) -> None:
        """What the slots cannot do with these speculation settings (exit 2)."""
        if self.n_slots * spec.branches > MAX_SEQUENCES:
            raise UsageError(f"-np {self.n_slots} requests with --draft-branches {spec.branches} each need "
                             f"{self.n_slots * spec.branches} sequences; llama.cpp has {MAX_SEQUENCES}")
        if not self.unified(spec.branches) and spec.branches > 1:
            raise UsageError("--no-kv-unified: draft trees (--draft-branches > 1) need the unified KV cache")

    def unified(self, branches: int = 1) -> bool:
        """-kvu as given; unset, llama-server's choice (one pool with -np auto, -c / N cells each with
        -np N), and one pool for draft trees, whose branches need it."""
        if self.kv_unified is not None:
            return self.kv_unified
        return self.parallel == -1 or branches > 1

    def for_spec(self, spec: SpecSettings) -> "SlotOptions":
        """-np and -kvu as they run (auto: PARALLEL_AUTO), checked with this speculation (check)."""
        slots = replace(self, parallel=self.n_slots, kv_unified=self.unified(spec.branches))
        slots.check(spec)
        return slots

    def apply(self, spec: ModelSpec | None) -> ModelSpec | None:
        """A model spec loaded for these slots."""
        return None if spec is None else replace(spec, n_slots=self.n_slots, kv_unified=self.unified())

    def parallel_args(self) -> dict:
        return {"prefill_budget": self.prefill_budget / 1000, "similarity": self.similarity}


def slot_options(parallel: int = -1, kv_unified: bool | None = None, prefill_budget: float = 500.0,
                 slot_prompt_similarity: float = 0.1) -> SlotOptions:
    return SlotOptions(parallel, kv_unified, prefill_budget, slot_prompt_similarity)


# -- option groups: declared once, attached to every command that takes them --------


@dataclass(frozen=True)
class Group:
    """Flags that travel together. A command given the group (see `with_options`) takes
    every flag in it and receives, under `name`, what `build` makes of their values."""
    name: str
    options: tuple[tuple[str, object, object], ...]  # (parameter, type, typer.Option)
    build: Callable[..., object]

    def only(self, *names: str) -> "Group":
        return replace(self, options=tuple(o for o in self.options if o[0] in names))

    def but(self, **changes: tuple[object, object] | None) -> "Group":
        """Some options swapped for (type, typer.Option), or dropped (None)."""
        options = ((name, *(changes.get(name) or (kind, option))) for name, kind, option in self.options
                   if name not in changes or changes[name] is not None)
        return replace(self, options=tuple(options))


MODELS = Group("models", (
    ("model", Optional[str], MODEL), ("model_draft", Optional[str], MODEL_DRAFT),
    ("hf_repo", Optional[str], HF_REPO), ("hf_repo_draft", Optional[str], HF_REPO_DRAFT),
    ("hf_file", Optional[str], HF_FILE), ("hf_token", Optional[str], HF_TOKEN),
    ("ctx_size", int, CTX_SIZE), ("ctx_size_draft", Optional[int], CTX_SIZE_DRAFT),
    ("n_gpu_layers", int, N_GPU_LAYERS), ("n_gpu_layers_draft", Optional[int], N_GPU_LAYERS_DRAFT),
    ("threads", Optional[int], THREADS), ("threads_draft", Optional[int], THREADS_DRAFT),
    ("threads_batch", Optional[int], THREADS_BATCH), ("threads_batch_draft", Optional[int], THREADS_BATCH_DRAFT),
    ("batch_size", int, BATCH_SIZE), ("flash_attn", str, FLASH_ATTN), ("lora", Optional[List[str]], LORA),
    ("lora_scaled", Optional[List[str]], LORA_SCALED), ("lora_draft", Optional[List[str]], LORA_DRAFT),
    ("rpc", Optional[str], RPC), ("device", Optional[str], DEVICE), ("device_draft", Optional[str], DEVICE_DRAFT),
    ("cache_type_k", str, CACHE_TYPE_K), ("cache_type_v", str, CACHE_TYPE_V),
    ("cache_type_k_draft", str, CACHE_TYPE_K_DRAFT), ("cache_type_v_draft", str, CACHE_TYPE_V_DRAFT),
    ("override_tensor", Optional[List[str]], OVERRIDE_TENSOR),
    ("override_tensor_draft", Optional[List[str]], OVERRIDE_TENSOR_DRAFT),
    ("cpu_moe", bool, CPU_MOE), ("n_cpu_moe", int, N_CPU_MOE), ("n_cpu_ffn", int, N_CPU_FFN),
    ("cpu_moe_draft", bool, CPU_MOE_DRAFT), ("n_cpu_moe_draft", int, N_CPU_MOE_DRAFT),
    ("ubatch_size", int, UBATCH_SIZE), ("load_mode", str, LOAD_MODE), ("repack", bool, REPACK),
    ("mlock", bool, MLOCK),
    ("mmap", Optional[bool], MMAP), ("split_mode", str, SPLIT_MODE),
    ("tensor_split", Optional[str], TENSOR_SPLIT), ("main_gpu", int, MAIN_GPU), ("swa_full", bool, SWA_FULL),
    ("jinja", bool, JINJA), ("chat_template", Optional[str], CHAT_TEMPLATE),
    ("chat_template_file", Optional[Path], CHAT_TEMPLATE_FILE), ("verbose", bool, VERBOSE), ("offline", bool, OFFLINE),
), ModelOptions)

# the memory flags of the target alone (doctor's)
TARGET_MEMORY_FLAGS = ("cache_type_k", "cache_type_v", "override_tensor", "cpu_moe", "n_cpu_moe", "n_cpu_ffn",
                       "ubatch_size", "load_mode", "repack", "mlock", "mmap", "split_mode", "tensor_split", "main_gpu",
                       "swa_full")

SAMPLING = Group("sampling", (
    ("temp", float, TEMP), ("top_k", int, TOP_K), ("top_p", float, TOP_P), ("min_p", float, MIN_P),
    ("typical_p", float, TYPICAL), ("repeat_penalty", float, REPEAT_PENALTY),
    ("repeat_last_n", int, REPEAT_LAST_N), ("presence_penalty", float, PRESENCE_PENALTY),
    ("frequency_penalty", float, FREQUENCY_PENALTY), ("seed", int, SEED), ("sampling_seq", str, SAMPLING_SEQ),
    ("grammar", Optional[str], GRAMMAR), ("grammar_file", Optional[Path], GRAMMAR_FILE),
    ("json_schema", Optional[str], JSON_SCHEMA), ("json_schema_file", Optional[Path], JSON_SCHEMA_FILE),
), sampler_settings)

SPECULATION = Group("spec", (
    ("n_predict", int, N_PREDICT), ("ignore_eos", bool, IGNORE_EOS),  # in the Sampling panel, as llama.cpp has them
    ("spec_type", Optional[List[str]], SPEC_TYPE), ("draft_max", Optional[int], DRAFT_MAX),
    ("draft_min", int, DRAFT_MIN), ("draft_p_min", float, DRAFT_P_MIN), ("spec_accept", str, SPEC_ACCEPT),
    ("branches", int, PARALLEL), ("draft_p_split", float, DRAFT_P_SPLIT),
    ("ngram_n", Optional[int], NGRAM_N), ("ngram_m", Optional[int], NGRAM_M),
    ("ngram_min_hits", Optional[int], NGRAM_MIN_HITS), *TYPE_FLAGS, ("spec_default", bool, SPEC_DEFAULT),
    ("synth_len", Optional[float], SYNTH_LEN), ("synth_rates", Optional[str], SYNTH_RATES),
), spec_settings)


def grammar_text(grammar: Optional[str] = None, grammar_file: Optional[Path] = None,
                 json_schema: Optional[str] = None, json_schema_file: Optional[Path] = None) -> str:
    from speculative.grammar import given

    return given.from_flags(grammar, grammar_file, json_schema, json_schema_file)


# the grammar flags alone (bench, whose other sampling flags are its own), as GBNF text
GRAMMAR_GROUP = Group("grammar", SAMPLING.options[-4:], grammar_text)

POOL = Group("pool", (("spec_pool", Optional[Path], SPEC_POOL), ("spec_pool_tokens", int, SPEC_POOL_TOKENS)),
             pool_options)

TALK = Group("talk", (("conversation", bool, CONVERSATION), ("no_conversation", bool, NO_CONVERSATION),
                      ("single_turn", bool, SINGLE_TURN), ("multiline", bool, MULTILINE),
                      ("context_shift", bool, CONTEXT_SHIFT), ("show_timings", bool, SHOW_TIMINGS)),
             TalkOptions.from_flags)


SLOTS = Group("slots", (
    ("parallel", int, SLOTS_PARALLEL), ("kv_unified", Optional[bool], KV_UNIFIED), ("prefill_budget", float, PREFILL_BUDGET),
    ("slot_prompt_similarity", float, SLOT_SIMILARITY),
), slot_options)


def with_options(*groups: Group):
    """Attach option groups to a Typer command: their flags join the command's own (Typer
    reads the signature), and the command is called with each group's built value in
    place of its flags."""

    def attach(command: Callable) -> Callable:
        signature = inspect.signature(command)
        flags = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
                 for group in groups for name, kind, option in group.options]
        own = [p for p in signature.parameters.values() if p.name not in {g.name for g in groups}]

        @functools.wraps(command)
        def run(**values):
            for group in groups:
                values[group.name] = group.build(**{name: values.pop(name) for name, _, _ in group.options})
            return command(**values)

        run.__signature__ = signature.replace(parameters=[*own, *flags])
        return run

    return attach


def _place_head(target: ModelSpec, draft: ModelSpec | None, use_draft: bool, mtp: str | None,
                features: str | None) -> tuple[ModelSpec, ModelSpec | None]:
    """-md as what the file is (as llama.cpp tells it): a draft model, or a head that drafts from
    the target's hidden states (an MTP head file or Gemma-4 assistant; an EAGLE-3, DFlash or
    DSpark drafter), which goes with the target; the drafter types named must have theirs."""
    from speculative.models.gguf_meta import feature_drafter_kind, has_nextn_layers, is_mtp_head

    if draft is not None and is_mtp_head(draft.path):  # as llama.cpp tells it from the file
        if use_draft:
            raise UsageError(f"-md {draft.name} is an MTP head (NextN layers without a model), not a "
                             "draft model: use it with --spec-type draft-mtp")
        target, draft = replace(target, mtp_sidecar=draft.path), None
    elif draft is not None and (kind := feature_drafter_kind(draft.path)) is not None:
        if use_draft or features not in (kind, "auto"):
            what = "a draft model" if use_draft else "what this --spec-type drafts with"
            raise UsageError(f"-md {draft.name} is {registry.TYPES[kind].model}, not {what}: use it with "
                             f"--spec-type {kind} (or auto)")
        target, draft = replace(target, feature_drafter=draft.path), None
    elif not use_draft:
        draft = None  # draft-mtp with a draft model: the target's own NextN layers draft
    if mtp == "named" and not target.mtp_sidecar and not has_nextn_layers(target.path):
        raise UsageError(registry.TYPES["draft-mtp"].refusal(target.name))
    if features not in (None, "auto") and not target.feature_drafter:
        raise UsageError(registry.TYPES[features].refusal(target.name))
    return target, draft
