// llama.cpp's own n-gram cache code (common/ngram-cache.cpp, compiled from the pinned sdist by
// tests/test_ngram_llama.py), driven from the command line:
//
//   harness write OUT MIN MAX < tokens   common_ngram_cache_update over the tokens, then _save
//   harness merge A B OUT                 _load A and B, common_ngram_cache_merge B into A, _save
//   harness dump IN                       _load, then every (n-gram, token, count), sorted
#include "ngram-cache.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

int main(int argc, char ** argv) {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "write" && argc == 5) {
        std::vector<llama_token> tokens;
        for (llama_token t; std::cin >> t;) {
            tokens.push_back(t);
        }
        common_ngram_cache cache;
        common_ngram_cache_update(cache, std::atoi(argv[3]), std::atoi(argv[4]), tokens, tokens.size(), false);
        common_ngram_cache_save(cache, argv[2]);
        return 0;
    }
    if (mode == "merge" && argc == 5) {
        common_ngram_cache a = common_ngram_cache_load(argv[2]);
        common_ngram_cache b = common_ngram_cache_load(argv[3]);
        common_ngram_cache_merge(a, b);
        common_ngram_cache_save(a, argv[4]);
        return 0;
    }
    if (mode == "dump" && argc == 3) {
        std::vector<std::tuple<std::array<llama_token, LLAMA_NGRAM_MAX>, llama_token, int32_t>> rows;
        for (const auto & [ngram, part] : common_ngram_cache_load(argv[2])) {
            std::array<llama_token, LLAMA_NGRAM_MAX> gram;
            std::copy(ngram.tokens, ngram.tokens + LLAMA_NGRAM_MAX, gram.begin());
            for (const auto & [token, count] : part) {
                rows.emplace_back(gram, token, count);
            }
        }
        std::sort(rows.begin(), rows.end());
        for (const auto & [gram, token, count] : rows) {
            printf("%d %d %d %d %d %d\n", gram[0], gram[1], gram[2], gram[3], token, count);
        }
        return 0;
    }
    fprintf(stderr, "usage: harness write OUT MIN MAX < tokens | merge A B OUT | dump IN\n");
    return 2;
}
