// llama.cpp's own JSON Schema converter, for tests/test_json_schema.py to hold
// speculative/grammar/json_schema.py to: reads one schema (JSON) from the file named by the
// first argument, or from stdin, and prints json_schema_to_grammar(schema) as llama-server and
// llama-cli call it (GBNF always, never llguidance). A schema it refuses: "error: " and the
// message on stdout, exit status 1. Its warnings go to stderr, as llama.cpp prints them.
// Built against the pinned sdist's common/json-schema-to-grammar.h and linked to the installed
// wheel's libllama-common (tests/test_json_schema.py: build_json_schema_harness).

#include "json-schema-to-grammar.h"

#include <exception>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

int main(int argc, char ** argv) {
    std::string text;
    if (argc > 1) {
        std::ifstream file(argv[1], std::ios::binary);
        if (!file) {
            std::cerr << "cannot read " << argv[1] << "\n";
            return 2;
        }
        text.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
    } else {
        text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
    }
    try {
        std::cout << json_schema_to_grammar(common_json::parse(text), /* force_gbnf= */ true);
    } catch (const std::exception & e) {
        std::cout << "error: " << e.what() << "\n";
        return 1;
    }
    return 0;
}
