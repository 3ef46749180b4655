// llama.cpp's own reading of a chat format's tool grammar and lazy triggers, for
// tests/test_chat_formats_more.py to hold speculative/chat/formats/ to, as the pinned
// tests/test-chat.cpp checks its formats: the grammar built by llama_grammar_init_impl (no
// vocabulary) must accept the call text code point by code point and be complete after it
// (match_string), and each trigger is found as a lazy grammar finds it
// (llama_grammar_trigger_pattern::find: std::regex ECMAScript, the first non-empty group's start).
//
// Reads jobs from stdin until its end, each field as "<byte length>\n<bytes>":
//   grammar, text the grammar must accept, text the triggers are searched in,
//   then "<count>\n" and that many trigger patterns.
// Writes a line per job: the grammar's verdict (1 accepts, 2 accepts a prefix only: it wants
// more, 0 refuses, -1 the grammar does not load), then per trigger the byte where the grammar
// would start (-1: not found, -2: std::regex refuses the pattern).
// Built against the pinned sdist's src/llama-grammar.h, linked to the installed wheel's libllama.

#include "llama-grammar.h"

#include <algorithm>
#include <exception>
#include <iostream>
#include <regex>
#include <string>
#include <vector>

static bool read_field(std::string & out) {
    size_t n = 0;
    if (!(std::cin >> n)) {
        return false;
    }
    std::cin.get();  // the newline after the length
    out.assign(n, '\0');
    std::cin.read(out.data(), static_cast<std::streamsize>(n));
    return static_cast<bool>(std::cin);
}

static int verdict(const std::string & grammar_text, const std::string & text) {
    llama_grammar * grammar = llama_grammar_init_impl(nullptr, grammar_text.c_str(), "root", false, nullptr, 0, nullptr, 0);
    if (grammar == nullptr) {
        return -1;
    }
    int result = 0;
    try {
        llama_grammar_accept_str(*grammar, text);
        const auto & stacks = llama_grammar_get_stacks(grammar);
        result = std::any_of(stacks.begin(), stacks.end(), [](const auto & stack) { return stack.empty(); }) ? 1 : 2;
    } catch (const std::exception &) {
        result = 0;  // no stack left: a character the grammar does not allow
    }
    llama_grammar_free_impl(grammar);
    return result;
}

static long trigger_start(const std::string & pattern, const std::string & search) {
    try {
        llama_grammar_trigger_pattern trigger{ pattern, std::regex(pattern) };
        size_t start = trigger.find(search);
        return start == std::string::npos ? -1 : static_cast<long>(start);
    } catch (const std::regex_error &) {
        return -2;
    }
}

int main() {
    std::string grammar_text, text, search, pattern;
    while (read_field(grammar_text) && read_field(text) && read_field(search)) {
        size_t count = 0;
        std::cin >> count;
        std::cin.get();
        std::cout << verdict(grammar_text, text);
        for (size_t i = 0; i < count && read_field(pattern); i++) {
            std::cout << " " << trigger_start(pattern, search);
        }
        std::cout << "\n" << std::flush;
    }
    return 0;
}
