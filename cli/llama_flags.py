"""llama.cpp's flags as the pinned llama.cpp declares them (common/arg.cpp), and what speculate
says of one that a command does not take: refused by its whole name, in one line, with what to
use instead where speculate has a way (cli/helpformat.py's parser asks `refusal`).

llama.cpp reads each argument as one flag name (common/arg.cpp, common_params_parse_ex):
`-cnv` is one flag, never -c with the value "nv"; `--a_b` is `--a-b`; a value is the next
argument, never attached (`-n16` is no flag)."""

from __future__ import annotations

import difflib
from typing import Mapping, Sequence

# Every option of the pinned common/arg.cpp, in its order: its names, and after " / " the names
# that turn it off. tests/test_flags.py holds this to the sdist's arg.cpp.
_ARG_CPP = """\
-h --help --usage
--version
-cl --cache-list
--completion-bash
--server-base
--verbose-prompt
--display-prompt / --no-display-prompt
-co --color
-t --threads
-tb --threads-batch
-C --cpu-mask
-Cr --cpu-range
--cpu-strict
--prio
--poll
-Cb --cpu-mask-batch
-Crb --cpu-range-batch
--cpu-strict-batch
--prio-batch
--poll-batch
-lcs --lookup-cache-static
-lcd --lookup-cache-dynamic
-c --ctx-size
--kv-unified-per-slot
-n --predict --n-predict
-b --batch-size
-ub --ubatch-size
--keep
--swa-full
-ctxcp --ctx-checkpoints --swa-checkpoints
-cms --checkpoint-min-step
-cram --cache-ram
-kvu --kv-unified / -no-kvu --no-kv-unified
--cache-idle-slots / --no-cache-idle-slots
--context-shift / --no-context-shift
--chunks
-fa --flash-attn
-p --prompt
-sys --system-prompt
--perf / --no-perf
--show-timings / --no-show-timings
-f --file
-sysf --system-prompt-file
--in-file
-bf --binary-file
-e --escape / --no-escape
-ptc --print-token-count
--prompt-cache
--prompt-cache-all
--prompt-cache-ro
-r --reverse-prompt
-sp --special
-cnv --conversation / -no-cnv --no-conversation
-st --single-turn
-i --interactive
-if --interactive-first
-mli --multiline-input
--in-prefix-bos
--in-prefix
--in-suffix
--warmup / --no-warmup
--spm-infill
--samplers
-s --seed
--sampler-seq --sampling-seq
--ignore-eos
--temp --temperature
--top-k
--top-p
--min-p
--top-nsigma --top-n-sigma
--xtc-probability
--xtc-threshold
--typical --typical-p
--repeat-last-n
--repeat-penalty
--presence-penalty
--frequency-penalty
--dry-multiplier
--dry-base
--dry-allowed-length
--dry-penalty-last-n
--dry-sequence-breaker
--adaptive-target
--adaptive-decay
--dynatemp-range
--dynatemp-exp
--mirostat
--mirostat-lr
--mirostat-ent
-l --logit-bias
--grammar
--grammar-file
-j --json-schema
-jf --json-schema-file
-bs --backend-sampling
--pooling
--attention
--rope-scaling
--rope-scale
--rope-freq-base
--rope-freq-scale
--yarn-orig-ctx
--yarn-ext-factor
--yarn-attn-factor
--yarn-beta-slow
--yarn-beta-fast
-gan --grp-attn-n
-gaw --grp-attn-w
-kvo --kv-offload / -nkvo --no-kv-offload
--repack / -nr --no-repack
--no-host
-ctk --cache-type-k
-ctv --cache-type-v
--hellaswag
--hellaswag-tasks
--winogrande
--winogrande-tasks
--multiple-choice
--multiple-choice-tasks
--kl-divergence
--save-all-logits --kl-divergence-base
--ppl-stride
--ppl-output-type
-dt --defrag-thold
-np --parallel
-np --parallel
-ns --sequences
-cb --cont-batching / -nocb --no-cont-batching
-mm --mmproj
-mmu --mmproj-url
--mmproj-auto / --no-mmproj --no-mmproj-auto
--mmproj-offload / --no-mmproj-offload
-mmdev --mmproj-device
--image --audio --video
--image-min-tokens
--image-max-tokens
--mtmd-batch-max-tokens
--video-fps
--video-timestamp-interval
--video-ffmpeg-dir
--rpc
-lm --load-mode
-lzm --lazy-mode
--numa
-dev --device
--list-devices
-ot --override-tensor
-cmoe --cpu-moe
-ncmoe --n-cpu-moe
-ncffn --n-cpu-ffn
-ngl --gpu-layers --n-gpu-layers
-sm --split-mode
-ts --tensor-split
-mg --main-gpu
-fit --fit
-fitp --fit-print
-fitt --fit-target
-fitc --fit-ctx
--check-tensors
--override-kv
--op-offload / --no-op-offload
--lora
--lora-scaled
--control-vector
--control-vector-scaled
--control-vector-layer-range
-a --alias
--tags
-m --model
-mu --model-url
-dr --docker-repo
-hf -hfr --hf-repo
-hff --hf-file
-hft --hf-token
--mtp
--dflash
--eagle3
--context-file
--chunk-size
--chunk-separator
--junk
--pos
-o --output --output-file
-ofreq --output-frequency
--output-format
--save-frequency
--process-output
--ppl / --no-ppl
--chunk --from-chunk
--show-statistics
--parse-special
--ids
--stdin
--no-bos
--no-parse-special
--show-count
-pps
-tgs
-npp
-ntg
-npl
--embd-normalize
--embd-output-format
--embd-separator
--cls-separator
--host
--port
--reuse-port
--path
--cors-origins
--cors-methods
--cors-headers
--cors-credentials / --no-cors-credentials
--api-prefix
--ui-config --webui-config
--ui-config-file --webui-config-file
--ui-mcp-proxy --webui-mcp-proxy / --no-ui-mcp-proxy --no-webui-mcp-proxy
--tools
--tools-runtime
--mcp-servers-config
--mcp-servers-json
-ag --agent / -no-ag --no-agent
--ui --webui / --no-ui --no-webui
--embedding --embeddings
--rerank --reranking
--api-key
--api-key-file
--ssl-key-file
--ssl-cert-file
--chat-template-kwargs
-to --timeout
--sse-ping-interval
--threads-http
--cache-prompt / --no-cache-prompt
--cache-reuse
--metrics
--props
--slots / --no-slots
--slot-save-path
--media-path
--models-dir
--models-preset
--models-max
--models-autoload / --no-models-autoload
--jinja / --no-jinja
--reasoning-format
-rea --reasoning
--reasoning-effort
--reasoning-budget
--reasoning-budget-message
--reasoning-preserve / --no-reasoning-preserve
--chat-template
--chat-template-file
--skip-chat-parsing / --no-skip-chat-parsing
--prefill-assistant / --no-prefill-assistant
-sps --slot-prompt-similarity
--lora-init-without-apply
--sleep-idle-seconds
--simple-io
--positive-file
--negative-file
--pca-batch
--pca-iter
--method
--output-format
--log-disable
--log-file
--log-jsonl / --no-log-jsonl
--log-prompts-dir
--log-colors
-v --verbose --log-verbose
--offline
-lv --verbosity --log-verbosity
--log-prefix / --no-log-prefix
--log-timestamps / --no-log-timestamps
--spec-draft-hf -hfd -hfrd --hf-repo-draft
--spec-draft-threads -td --threads-draft
--spec-draft-threads-batch -tbd --threads-batch-draft
--spec-draft-cpu-mask -Cd --cpu-mask-draft
--spec-draft-cpu-range -Crd --cpu-range-draft
--spec-draft-cpu-strict --cpu-strict-draft
--spec-draft-prio --prio-draft
--spec-draft-poll --poll-draft
--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft
--spec-draft-cpu-range-batch -Crbd --cpu-range-batch-draft
--spec-draft-cpu-strict-batch --cpu-strict-batch-draft
--spec-draft-prio-batch --prio-batch-draft
--spec-draft-poll-batch --poll-batch-draft
--spec-draft-type-k -ctkd --cache-type-k-draft
--spec-draft-type-v -ctvd --cache-type-v-draft
--spec-draft-override-tensor -otd --override-tensor-draft
--spec-draft-cpu-moe -cmoed --cpu-moe-draft
--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft
--spec-draft-n-max
--spec-draft-n-min
--spec-synth-len
--spec-synth-rates
--spec-draft-p-split --draft-p-split
--spec-draft-p-min --draft-p-min
--spec-draft-backend-sampling / --no-spec-draft-backend-sampling
--spec-draft-device -devd --device-draft
--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft
--spec-draft-model -md --model-draft
--spec-type
--spec-ngram-mod-n-min
--spec-ngram-mod-n-max
--spec-ngram-mod-n-match
--spec-ngram-simple-size-n
--spec-ngram-simple-size-m
--spec-ngram-simple-min-hits
--spec-ngram-map-k-size-n
--spec-ngram-map-k-size-m
--spec-ngram-map-k-min-hits
--spec-ngram-map-k4v-size-n
--spec-ngram-map-k4v-size-m
--spec-ngram-map-k4v-min-hits
--draft --draft-n --draft-max
--draft-min --draft-n-min
--spec-ngram-size-n
--spec-ngram-size-m
--spec-ngram-min-hits
--tts-lang
--tts-speaker-file
--diffusion-steps
--diffusion-visual
--diffusion-eps
--diffusion-algorithm
--diffusion-alg-temp
--diffusion-block-length
--diffusion-cfg-scale
--diffusion-add-gumbel-noise
-lr --learning-rate
-lr-min --learning-rate-min
-decay-epochs --learning-rate-decay-epochs
-wd --weight-decay
-val-split --val-split
-epochs --epochs
-opt --optimizer
--check
--save-logits
--logits-output-dir
--tensor-filter
--embd-gemma-default
--fim-qwen-1.5b-default
--fim-qwen-3b-default
--fim-qwen-7b-default
--fim-qwen-7b-spec
--fim-qwen-14b-spec
--fim-qwen-30b-default
--gpt-oss-20b-default
--gpt-oss-120b-default
--vision-gemma-4b-default
--vision-gemma-12b-default
--spec-default
"""

OPTIONS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = tuple(
    (tuple(on.split()), tuple(off.split())) for on, _, off in (line.partition(" / ") for line in _ARG_CPP.splitlines()))


def llama_names(flag: str) -> tuple[str, ...]:
    """The names of the llama.cpp flag that `flag` is one name of (an option's names, or the names
    that turn it off); empty when llama.cpp has no such flag."""
    return next((names for option in OPTIONS for names in option if flag in names), ())


_CONVERSATION = "which speculate does not have: its conversation is llama-cli's (-cnv, the default on a terminal)"
_ROUTER = "llama-server's router mode (models loaded on demand), which speculate serve does not have: it serves -m"
_MULTIMODAL = "for multimodal models, which speculate does not run (text only)"
_TOOLS = "for llama-server's tools, which speculate serve does not have"
_EMBEDDINGS = "for embeddings and reranking, which speculate serve does not compute (it generates text)"
_SELF_EXTEND = "llama.cpp's self-extend (group attention), which speculate does not have"

# llama.cpp's flags that speculate refuses, and why or what to use instead: under one of each
# flag's names (its other names find it through OPTIONS). A flag whose other side speculate
# takes (-no-cnv, -cb, --no-ui) has only the side it refuses here.
REFUSED = {
    "-i": f"llama-completion's interactive mode, {_CONVERSATION}",
    "-if": f"llama-completion's interactive mode, {_CONVERSATION}",
    "--in-prefix": f"for llama-completion's interactive mode, {_CONVERSATION}",
    "--in-suffix": f"for llama-completion's interactive mode, {_CONVERSATION}",
    "--in-prefix-bos": f"for llama-completion's interactive mode, {_CONVERSATION}",
    "--context-shift": "llama.cpp's context shift within a request, which this command does not have: a generation "
                       "stops at the context's end (finish_reason length); raise -c/--ctx-size for longer ones "
                       "(`speculate serve` has it; a conversation's --context-shift drops its oldest turns)",
    "-nocb": "no continuous batching, which speculate serve does not have: it always decodes the requests of "
             "its -np slots together",
    "--slot-save-path": "for llama-server's slot files (/slots?action=save), which speculate serve does not have: "
                        "-cram/--cache-ram keeps earlier conversations in host memory",
    "-mu": "llama.cpp's download of a model URL, which speculate does not have: give the file with -m, or a "
           "Hugging Face repository with -hf",
    "--models-dir": _ROUTER, "--models-preset": _ROUTER, "--models-max": _ROUTER, "--models-autoload": _ROUTER,
    "--no-models-autoload": _ROUTER,
    "--embedding": _EMBEDDINGS, "--rerank": _EMBEDDINGS, "--pooling": _EMBEDDINGS,
    "-mm": _MULTIMODAL, "-mmu": _MULTIMODAL, "--mmproj-auto": _MULTIMODAL, "--media-path": _MULTIMODAL,
    "--tools": _TOOLS, "--tools-runtime": _TOOLS, "--mcp-servers-config": _TOOLS, "--mcp-servers-json": _TOOLS,
    "--ui-mcp-proxy": _TOOLS,
    "--ui": "llama-server's web UI, which speculate serve does not have",
    "-gan": _SELF_EXTEND, "-gaw": _SELF_EXTEND,
    "--no-cache-idle-slots": "for llama-server's idle slots, which speculate serve always saves to -cram/--cache-ram "
                             "when another conversation takes their place",
    "-bs": "llama.cpp's sampling on the device, which speculate does not have: it samples on the CPU",
}


def refusal(flag: str, command: str, own: Mapping[str, bool], elsewhere: Sequence[str]) -> str:
    """Why `command` (`speculate serve`) refuses `flag`, in one line. `own`: the command's flag
    names, each with whether it takes a value; `elsewhere`: the other commands that take the flag."""
    names = llama_names(flag)
    reason = next((REFUSED[name] for name in names if name in REFUSED), None)
    if reason is not None:
        return f"{flag} is {reason}"
    attached = next((name for name in sorted(own, key=len, reverse=True) if own[name] and flag.startswith(name)
                     and len(flag) > len(name) and not flag.startswith("--")), None)
    if attached is not None and not names:
        value = flag[len(attached):].removeprefix("=")
        return f"no flag {flag}: llama.cpp's flags take their value as the next argument: {attached} {value}"
    if elsewhere:
        return f"{flag} is a flag of {', '.join(f'`{c}`' for c in elsewhere)}, not of `{command}`"
    if names:
        return f"{flag} is a llama.cpp flag that `{command}` does not have (`{command} --help-all` lists its flags)"
    close = difflib.get_close_matches(flag, list(own), n=3)
    return f"No such option: {flag}" + (f" (Possible options: {', '.join(close)})" if close else "")
