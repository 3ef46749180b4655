// llama.cpp's own ngram-map-k4v and ngram-mod drafters replayed on token streams, each draft
// printed: what tests/test_ngram_llama.py compares speculate's drafters with, token for token.
// The test builds it two ways from the pinned sdist:
//
//   -DNGRAM_MAP  with common/ngram-map.cpp (and stub headers): common_ngram_map with values,
//                called as common/speculative.cpp's ngram-map-k4v type calls it;
//   -DNGRAM_MOD  with the sdist's headers, linked against the wheel's libllama-common:
//                common_speculative_init with the ngram-mod type, driven through
//                common_speculative_begin / _draft / _accept as tools/server drives it (one
//                sequence, so one table and one low-acceptance streak for every request).
//
// Input, whitespace-separated integers on stdin:
//   A B C                          map: size_n size_m min_hits; mod: n_match n_min n_max
//   then requests until the end, each:
//   N prompt[N]  M output[M]  N_STOP DRAFT_MAX
//
// A request begins with the prompt; the target is greedy and its text is `output`. Each step,
// while fewer than N_STOP tokens were generated, drafts up to k = min(DRAFT_MAX, what is left
// of the output - 1) tokens after the history (speculate's loop leaves room for the target's
// own token; llama-server's n_draft_max does the same with n_remaining), the target accepts
// the draft's longest prefix that agrees with the output, and the accepted tokens and the
// target's next one join the history. Output: "begin" for each request, then one line per
// step: "k: drafted tokens".
//
// Like speculate, a step drafts from everything so far: the history but its last token is
// what llama.cpp calls the prompt, the last one its id_last. The very first step (the history
// is the prompt) is one llama-server never makes, as it samples first: ngram-mod's code takes
// it alike; common_ngram_map would abort on it (its history would be shorter than at begin),
// so this harness skips it there, and speculate's ngram-map-k4v drafts nothing at it.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <vector>

#ifdef NGRAM_MAP
#include "ngram-map.h"

struct drafter {
    uint16_t n, m, min_hits;
    common_ngram_map map;
    size_t n_prompt = 0;

    drafter(int a, int b, int c) : n(a), m(b), min_hits(c), map(a, b, false, c) {}

    void begin(const llama_tokens & prompt) {
        map = common_ngram_map(n, m, false, min_hits);  // speculate's map lives for one request
        common_ngram_map_begin(map, prompt);
        n_prompt = prompt.size();
    }

    llama_tokens draft(const llama_tokens & prompt, llama_token id_last, int k) {
        llama_tokens result;
        if (prompt.size() < n_prompt) {
            return result;  // the first step: see above
        }
        common_ngram_map_draft(map, prompt, id_last, result);
        if ((int) result.size() > k) {
            result.resize(k);  // common_speculative_draft's cut to the step's n_max
        }
        return result;
    }

    void accept(int n_accepted) { common_ngram_map_accept(map, n_accepted); }
};
#endif

#ifdef NGRAM_MOD
#include "speculative.h"

struct drafter {
    common_speculative * spec;

    drafter(int n_match, int n_min, int n_max) {
        common_params_speculative params;  // nothing else: the n-gram types need no model or context
        params.types = {COMMON_SPECULATIVE_TYPE_NGRAM_MOD};
        params.ngram_mod.n_match = n_match;
        params.ngram_mod.n_min = n_min;
        params.ngram_mod.n_max = n_max;
        spec = common_speculative_init(params, 1);
        if (spec == nullptr) {
            fprintf(stderr, "common_speculative_init returned nothing\n");
            exit(1);
        }
    }

    void begin(const llama_tokens & prompt) { common_speculative_begin(spec, 0, prompt); }

    llama_tokens draft(const llama_tokens & prompt, llama_token id_last, int k) {
        llama_tokens result;
        common_speculative_get_draft_params(spec, 0) = {
            /* .drafting = */ true,
            /* .n_max    = */ k,
            /* .pos0     = */ (llama_pos) prompt.size(),
            /* .id_last  = */ id_last,
            /* .prompt   = */ &prompt,
            /* .result   = */ &result,
        };
        common_speculative_draft(spec);
        return result;
    }

    void accept(int n_accepted) { common_speculative_accept(spec, 0, n_accepted); }
};
#endif

static bool read_tokens(llama_tokens & out) {
    size_t count;
    if (!(std::cin >> count)) {
        return false;
    }
    out.resize(count);
    for (auto & t : out) {
        std::cin >> t;
    }
    return bool(std::cin);
}

int main() {
    std::ios::sync_with_stdio(false);  // a prompt of a million tokens is read in a fraction of a second
    int a, b, c;
    if (!(std::cin >> a >> b >> c)) {
        fprintf(stderr, "usage: harness < 'A B C' then requests 'N prompt M output N_STOP DRAFT_MAX'\n");
        return 2;
    }
    drafter d(a, b, c);
    llama_tokens prompt, output;
    while (read_tokens(prompt)) {
        int n_stop, draft_max;
        if (!read_tokens(output) || !(std::cin >> n_stop >> draft_max)) {
            fprintf(stderr, "a request cut short\n");
            return 2;
        }
        if (prompt.empty()) {
            fprintf(stderr, "an empty prompt\n");  // speculate refuses one before any drafter sees it
            return 2;
        }
        d.begin(prompt);
        printf("begin\n");
        // llama.cpp's prompt argument: the history but its last token, which is id_last
        llama_tokens history(prompt.begin(), prompt.end() - 1);
        llama_token last = prompt.back();
        for (int generated = 0; generated < n_stop;) {
            const int k = std::min(draft_max, (int) output.size() - generated - 1);
            llama_tokens draft;
            if (k > 0) {
                draft = d.draft(history, last, k);
            }
            size_t accepted = 0;
            while (accepted < draft.size() && draft[accepted] == output[generated + accepted]) {
                accepted++;
            }
            if (!draft.empty()) {  // llama-server verifies and accepts only drafts it got
                d.accept(accepted);
            }
            printf("%d:", k);
            for (llama_token t : draft) {
                printf(" %d", t);
            }
            printf("\n");
            for (size_t i = 0; i <= accepted; ++i) {
                history.push_back(last);
                last = output[generated++];
            }
        }
    }
    return 0;
}
