// llama.cpp's own speculative drivers (common/speculative.cpp, in the wheel's libllama-common)
// run greedily on a target and a draft GGUF, each step's draft printed: what speculate's ports of
// those drivers (draft-eagle3, ...) are compared with. tests/driver_harness.py builds it from the
// pinned sdist's headers and runs it.
//
//   harness TYPE TARGET.gguf DRAFT.gguf N_MAX N_STEPS TOKEN_ID [TOKEN_ID ...]
//
// TYPE is llama.cpp's name of a speculative type (draft-eagle3, draft-mtp, draft-dflash,
// draft-dspark, draft-simple; the n-gram types too). DRAFT.gguf is the draft model (-md); "-"
// means none: draft-mtp on a target that carries its MTP head (llama-server without -md), the
// n-gram types. The token ids are the prompt, BOS included.
//
// The target is loaded with llama.cpp's default model parameters (and its MTP layers for
// draft-mtp, as common_model_params_to_llama loads them) and gets speculate's context parameters
// (a recurrent or hybrid target also llama-server's n_rs_seq state snapshots, N_MAX for the draft
// types, so that a rejected draft rolls back without a checkpoint).
// Everything of the drafter is llama.cpp's: common_base_params_to_speculative and
// common_speculative_init_from_params make the draft context (n_ctx the target's, ctx_other the
// target context, ...) as llama-server does, from a common_params holding speculate's settings
// where llama-server's would reach it (threads, batch sizes, kv_unified, swa_full, no_perf,
// flash attention off); common_speculative_init makes the driver.
//
// The loop is llama-server's (tools/server/server-context.cpp), for one slot, greedy:
//   - the prompt is decoded into the target in batches of n_batch, the last token's logits
//     wanted; after each decode common_speculative_process sees the batch; then
//     common_speculative_begin(prompt) and the target's argmax is the first generated token;
//   - each step: the driver drafts at most N_MAX tokens (p_min 0, n_min 0) after the tokens so
//     far (prompt: all but the last, id_last: the last, pos0: its position); the draft context is
//     cut back past the target's last position (llama-server's ckpt.pos_max + 1); the target
//     decodes [id_last, draft...] with logits at every position and common_speculative_process
//     sees that batch; the target's argmax at each position accepts the draft's longest agreeing
//     prefix, and gives the next token; common_speculative_accept is told how many (when there
//     was a draft, as llama-server only then calls it); both contexts drop what follows the
//     kept tokens (llama_memory_seq_rm, llama-server's slot.mem.seq_rm).
//
// Output, one JSON line per step on stdout:
//   {"step": i, "draft": [ids...], "accepted": n, "next": id}
// The first generated token (the argmax after the prompt) is not printed: it is the id_last of
// step 0. llama.cpp's logs go to stderr (warnings and errors only; all with SPEC_HARNESS_VERBOSE=1).
// SPEC_HARNESS_BACKEND_SAMPLING=0 turns off the drafters' backend sampling (llama.cpp's default:
// on, as llama-server runs them). Any failure: a message on stderr and exit status 1 (2: usage).
#include "common.h"
#include "llama.h"
#include "log.h"
#include "speculative.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

static bool verbose = false;

static void log_callback(ggml_log_level level, const char * text, void * /*user_data*/) {
    static ggml_log_level last = GGML_LOG_LEVEL_NONE;
    if (level != GGML_LOG_LEVEL_CONT) {
        last = level;
    }
    if (verbose || last == GGML_LOG_LEVEL_WARN || last == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

[[noreturn]] static void fail(const char * fmt, ...) {
    common_log_flush(common_log_main());  // llama.cpp's own messages first
    fprintf(stderr, "spec_driver_harness: ");
    va_list args;
    va_start(args, fmt);
    vfprintf(stderr, fmt, args);
    va_end(args);
    fprintf(stderr, "\n");
    fflush(stderr);
    exit(1);
}

static long parse_int(const char * text, const char * what) {
    char * end = nullptr;
    const long value = strtol(text, &end, 10);
    if (end == text || *end != '\0') {
        fprintf(stderr, "spec_driver_harness: %s must be an integer, got '%s'\n", what, text);
        exit(2);
    }
    return value;
}

static llama_token argmax(llama_context * ctx, int32_t i, int32_t n_vocab) {
    const float * logits = llama_get_logits_ith(ctx, i);
    if (logits == nullptr) {
        fail("the target has no logits at batch index %d", i);
    }
    llama_token best = 0;
    for (llama_token t = 1; t < n_vocab; ++t) {
        if (logits[t] > logits[best]) {
            best = t;  // the first of equal maxima, as llama.cpp's greedy sampler takes it
        }
    }
    return best;
}

static void decode(llama_context * ctx, common_batch & batch, const char * what) {
    const int32_t rc = llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch.get());
    if (rc != 0) {
        fail("the target's decode of %s failed (llama_process returned %d)", what, rc);
    }
    llama_synchronize(ctx);
}

static int run(int argc, char ** argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s TYPE TARGET.gguf DRAFT.gguf N_MAX N_STEPS TOKEN_ID [TOKEN_ID ...]\n", argv[0]);
        return 2;
    }
    const std::string type_name = argv[1];
    const std::string target = argv[2];
    const std::string draft_path = argv[3];
    const long n_max = parse_int(argv[4], "N_MAX");
    const long n_steps = parse_int(argv[5], "N_STEPS");
    llama_tokens prompt;
    for (int i = 6; i < argc; ++i) {
        prompt.push_back((llama_token) parse_int(argv[i], "a token id"));
    }
    if (n_max < 1 || n_steps < 0) {
        fprintf(stderr, "spec_driver_harness: N_MAX must be at least 1 and N_STEPS at least 0\n");
        return 2;
    }

    const common_speculative_type type = common_speculative_type_from_name(type_name);
    if (type == COMMON_SPECULATIVE_TYPE_COUNT || type == COMMON_SPECULATIVE_TYPE_NONE) {
        fprintf(stderr, "spec_driver_harness: unknown speculative type '%s' (llama.cpp's: %s)\n", type_name.c_str(),
                common_speculative_all_types_str());
        return 2;
    }

    const char * env_verbose = getenv("SPEC_HARNESS_VERBOSE");
    verbose = env_verbose != nullptr && strcmp(env_verbose, "") != 0 && strcmp(env_verbose, "0") != 0;
    llama_log_set(log_callback, nullptr);
    if (!verbose) {
        common_log_set_verbosity_thold(LOG_LEVEL_WARN);  // common/speculative.cpp's SPC_WRN and SPC_ERR only
    }
    const char * env_backend = getenv("SPEC_HARNESS_BACKEND_SAMPLING");
    const bool backend_sampling = env_backend == nullptr || strcmp(env_backend, "0") != 0;

    llama_backend_init();

    // llama-server's parameters, with speculate's settings where they reach the draft context: the
    // drafter is made from them as llama-server makes it (tools/server/server-context.cpp, load_model)
    common_params params;
    params.model.path = target;
    params.n_ctx = 4096;
    params.n_batch = 512;
    params.n_ubatch = 512;
    params.n_parallel = 1;
    params.kv_unified = true;
    params.cpuparams.n_threads = 2;
    params.cpuparams_batch.n_threads = 2;
    params.swa_full = true;
    params.no_perf = true;
    params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    params.speculative.types = {type};
    params.speculative.draft.n_max = (int32_t) n_max;
    params.speculative.draft.n_min = 0;
    params.speculative.draft.p_min = 0.0f;
    params.speculative.draft.backend_sampling = backend_sampling;
    const bool has_draft = draft_path != "-";
    if (has_draft) {
        params.speculative.draft.mparams.path = draft_path;
    }

    // the target: llama.cpp's default model parameters (MTP layers loaded for draft-mtp, as
    // common_model_params_to_llama does), speculate's context parameters
    llama_model_params mparams = llama_model_default_params();
    mparams.load_mtp = type == COMMON_SPECULATIVE_TYPE_DRAFT_MTP;
    llama_model * model_tgt = llama_model_load_from_file(target.c_str(), mparams);
    if (model_tgt == nullptr) {
        fail("llama.cpp could not load the target %s", target.c_str());
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = 4096;
    cparams.n_batch = 512;
    cparams.n_ubatch = 512;
    cparams.n_seq_max = 1;
    cparams.kv_unified = true;
    cparams.n_threads = 2;
    cparams.n_threads_batch = 2;
    cparams.swa_full = true;
    cparams.no_perf = true;
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    if (llama_model_is_recurrent(model_tgt) || llama_model_is_hybrid(model_tgt)) {
        // a recurrent state rolls back through its snapshots: as many as llama-server keeps
        // (common_context_params_to_llama), and speculate (its n_rs_seq for a recurrent target)
        cparams.n_rs_seq = params.speculative.need_n_rs_seq();
    }
    llama_context * ctx_tgt = llama_init_from_model(model_tgt, cparams);
    if (ctx_tgt == nullptr) {
        fail("llama.cpp could not create the target's context");
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model_tgt));
    for (llama_token t : prompt) {
        if (t < 0 || t >= n_vocab) {
            fail("token id %d is outside the target's vocabulary of %d", t, n_vocab);
        }
    }
    const int32_t n_ctx = (int32_t) llama_n_ctx(ctx_tgt);
    const int32_t n_batch = (int32_t) llama_n_batch(ctx_tgt);
    if ((long) prompt.size() + 1 > n_ctx) {
        fail("a prompt of %zu tokens leaves no room in the context of %d", prompt.size(), n_ctx);
    }
    if (n_max + 1 > n_batch) {
        fail("N_MAX %ld: the verification batch [last token, draft...] must fit in n_batch %d", n_max, n_batch);
    }

    common_params params_dft = common_base_params_to_speculative(params);
    common_speculative_init_result_ptr spec_init = common_speculative_init_from_params(params_dft, model_tgt, ctx_tgt);
    if (has_draft && spec_init->model() == nullptr) {
        fail("llama.cpp could not load the draft %s", draft_path.c_str());
    }
    llama_context * ctx_dft = spec_init->context();
    if ((has_draft || type == COMMON_SPECULATIVE_TYPE_DRAFT_MTP) && ctx_dft == nullptr) {
        fail("llama.cpp could not create the draft context");
    }
    params.speculative.draft.ctx_tgt = ctx_tgt;
    params.speculative.draft.ctx_dft = ctx_dft;

    common_speculative * spec = common_speculative_init(params.speculative, 1);
    if (spec == nullptr) {
        fail("common_speculative_init made no %s driver (does it need a draft model?)", type_name.c_str());
    }

    llama_memory_t mem_tgt = llama_get_memory(ctx_tgt);
    llama_memory_t mem_dft = ctx_dft ? llama_get_memory(ctx_dft) : nullptr;
    const llama_seq_id seq = 0;

    // the prompt, in batches of n_batch; the driver sees each
    common_batch batch(ctx_tgt);
    const int32_t n_prompt = (int32_t) prompt.size();
    int32_t i_last = 0;
    for (int32_t off = 0; off < n_prompt; off += n_batch) {
        const int32_t n = std::min(n_batch, n_prompt - off);
        batch.clear();
        for (int32_t i = 0; i < n; ++i) {
            batch.add(prompt[off + i], off + i, seq, off + i == n_prompt - 1);
        }
        decode(ctx_tgt, batch, "the prompt");
        if (!common_speculative_process(spec, batch)) {
            fail("common_speculative_process failed on the prompt's batch at %d", off);
        }
        i_last = n - 1;
    }
    common_speculative_begin(spec, seq, prompt);

    llama_tokens history = prompt;  // llama-server's slot.prompt.tokens: everything but id_last
    llama_token id_last = argmax(ctx_tgt, i_last, n_vocab);
    llama_tokens draft;
    llama_tokens spec_prompt;  // llama-server's slot.spec_prompt: alive while the driver may look at it

    for (long step = 0; step < n_steps; ++step) {
        const llama_pos pos0 = (llama_pos) history.size();  // id_last's position
        const llama_pos pos_max = llama_memory_seq_pos_max(mem_tgt, seq);
        if (pos_max != pos0 - 1) {
            fail("step %ld: the target holds positions up to %d, not %d", step, pos_max, pos0 - 1);
        }
        // llama-server's get_n_draft_max: room for the draft, id_last and one more
        const int32_t n_draft_max = std::min<int32_t>((int32_t) n_max, n_ctx - (int32_t) history.size() - 2);
        if (n_draft_max < 0 || pos0 + 1 > n_ctx) {
            fail("step %ld: the context of %d is full", step, n_ctx);
        }

        draft.clear();
        if (n_draft_max > 0) {
            spec_prompt = history;
            common_speculative_get_draft_params(spec, seq) = {
                /* .drafting = */ true,
                /* .n_max    = */ n_draft_max,
                /* .pos0     = */ pos0,
                /* .id_last  = */ id_last,
                /* .prompt   = */ &spec_prompt,
                /* .result   = */ &draft,
            };
            common_speculative_draft(spec);
            if ((int32_t) draft.size() > n_draft_max) {
                fail("step %ld: a draft of %zu tokens, more than %d", step, draft.size(), n_draft_max);
            }
        }
        // llama-server: the draft context back to the target's state before verification
        if (mem_dft != nullptr && !llama_memory_seq_rm(mem_dft, seq, pos_max + 1, -1)) {
            fail("step %ld: the draft context could not drop positions from %d", step, pos_max + 1);
        }

        batch.clear();
        batch.add(id_last, pos0, seq, true);
        for (size_t i = 0; i < draft.size(); ++i) {
            batch.add(draft[i], pos0 + 1 + (llama_pos) i, seq, true);
        }
        decode(ctx_tgt, batch, "a draft");
        if (!common_speculative_process(spec, batch)) {
            fail("step %ld: common_speculative_process failed on the verification batch", step);
        }

        size_t accepted = 0;
        llama_token next = argmax(ctx_tgt, 0, n_vocab);
        while (accepted < draft.size() && next == draft[accepted]) {
            ++accepted;
            next = argmax(ctx_tgt, (int32_t) accepted, n_vocab);
        }
        if (!draft.empty()) {
            common_speculative_accept(spec, seq, (uint16_t) accepted);
        }

        history.push_back(id_last);
        history.insert(history.end(), draft.begin(), draft.begin() + accepted);
        id_last = next;
        const llama_pos pos_next = (llama_pos) history.size();
        if (!llama_memory_seq_rm(mem_tgt, seq, pos_next, -1)) {
            fail("step %ld: the target cannot drop positions from %d (a recurrent state without snapshots for "
                 "this: llama-server would restore a checkpoint, which this harness does not do)", step, pos_next);
        }
        if (mem_dft != nullptr && !llama_memory_seq_rm(mem_dft, seq, pos_next, -1)) {
            fail("step %ld: the draft context cannot drop positions from %d", step, pos_next);
        }

        std::string line = "{\"step\": " + std::to_string(step) + ", \"draft\": [";
        for (size_t i = 0; i < draft.size(); ++i) {
            line += (i ? ", " : "") + std::to_string(draft[i]);
        }
        line += "], \"accepted\": " + std::to_string(accepted) + ", \"next\": " + std::to_string(next) + "}\n";
        fputs(line.c_str(), stdout);
        fflush(stdout);
    }

    common_speculative_free(spec);
    spec_init.reset();  // the draft context and model
    llama_free(ctx_tgt);
    llama_model_free(model_tgt);
    llama_backend_free();
    common_log_flush(common_log_main());
    return 0;
}

int main(int argc, char ** argv) {
    try {
        return run(argc, argv);
    } catch (const std::exception & e) {
        fail("%s", e.what());
    }
}
