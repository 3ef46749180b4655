"""speculative/grammar/gbnf.py against the pinned llama.cpp: the grammars it ships parse, and over a
corpus of good and bad grammars our checker refuses exactly what llama.cpp's parser refuses
(llama_sampler_init_grammar over the vocabulary of a tiny model the test writes), except where
gbnf.py says it goes further: a class or literal that matches nothing, a rule that can never
complete, and what llama.cpp would loop on or crash over. Each refusal is one line naming the place."""

from __future__ import annotations

import re

import llama_cpp as ll
import pytest

from speculative.errors import GrammarError
from speculative.grammar.gbnf import Gbnf, TokenRef, check
from speculative.llamacpp.devices import init_once
from tests.conftest import vendored_tree
from tests.gguf_builder import write_tiny_llama


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> dict[str, str]:
    """The pinned llama.cpp's grammars/*.gbnf, by file name."""
    folder = vendored_tree(tmp_path_factory.mktemp("llama-cpp"), "grammars") / "grammars"
    found = {path.name: path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.gbnf"))}
    assert len(found) >= 8, sorted(found)
    return found


@pytest.fixture(scope="module")
def llama_accepts(tmp_path_factory):
    """text -> whether llama.cpp makes a grammar sampler of it, over the vocabulary of the tiny
    model (<unk> <s> </s> <0x0A> ▁hi ▁ h i: `<s>` is one token there, `<hi>` is not)."""
    init_once()
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    assert model
    vocab = ll.llama_model_get_vocab(model)

    def accepts(text: str, root: str = "root") -> bool:
        sampler = ll.llama_sampler_init_grammar(vocab, text.encode(), root.encode())
        if sampler:
            ll.llama_sampler_free(sampler)
        return bool(sampler)

    yield accepts
    ll.llama_model_free(model)


def refusal(text: str, root: str = "root") -> GrammarError:
    with pytest.raises(GrammarError) as info:
        check(text, root)
    return info.value


GOOD = [
    'root ::= "a"',
    'root ::= "" | "a"',
    'root ::= <s> "a" !<s> !<[3]> <[1]>*',
    'root ::= [a-z-]+ [-a] [\\]\\[] "\\x41\\u00e9\\U0001F600\\t\\r\\n\\\\\\"\\[\\]\\-"',
    'root ::= .* "\\n" # a comment\n# another\n',
    'root ::= "é" [α-ω]+ "日本"',
    'root ::=\n  "a" |\n  "b"',
    'root ::= ("a"\n  "b" |\n  "c")',
    'root ::= ( "a" ) { 1 , 2 } "b"{2}{3} "c"+? "d"?{2} "e"{0,} "f"{0,9999999999} "g"+{3,} ("h"? "i")*',
    'root ::= "a"{2000}',
    'root ::= "a"\r\nb ::= "c"\r\n',
    'root ::= "a"\rb ::= "c"',
    '1 ::= "x"\nroot ::= 1 -a-\n-a- ::= "y"',
    'root ::= x? y\nx ::= "a"\ny ::= x "b"',
    'root ::= a\na ::= b "x"\nb ::= "y" a | "z"',
    'root ::= foo\nroot ::= "a"',  # a later definition replaces the earlier one
    'root ::= "a" foo{0}',  # llama.cpp drops the reference, and with it the need for foo
    'root ::= "a"\nz ::= "b" z',  # never completes, but out of root's reach
    'root ::= "line one\nline two" [\n]',  # literals and classes may hold line ends
    # left recursion llama.cpp's check misses (the group, w, are empty only by way of other
    # rules) with nothing after it: llama.cpp's stacks repeat, and the grammar works
    'root ::= ("a"? | "b")* "c"',
    'root ::= "x" ("a"?){2,}',
    'root ::= w root | "c"\nw ::= v\nv ::= "" | "q"',
]

# (text, line, column, part of the message): llama.cpp refuses each, and so do we, there
BAD = [
    ('root ::= "abc', 1, 10, "unterminated string literal"),
    ('root ::= "a"\nnext ::= "b" "c\n', 2, 14, "unterminated string literal"),
    ("root ::= [abc", 1, 10, "unterminated character class"),
    ("root ::= [a-", 1, 10, "unterminated character class"),
    ('root ::= "\\q"', 1, 11, "unknown escape '\\q'"),
    ('root ::= "\\\n"', 1, 11, "unknown escape '\\' before the end of the line"),
    ('root ::= "ab\\', 1, 10, "unterminated string literal"),
    ('root ::= "\\x4g"', 1, 11, "needs 2 hex digits"),
    ('root ::= [\\u12]', 1, 11, "needs 4 hex digits"),
    ('::= "a"', 1, 1, "expecting a rule name"),
    ('root ::= "a"\n  | "b"', 2, 3, "expecting a rule name, found '|'"),
    ('root "a"', 1, 6, "expecting '::='"),
    ('root := "a"', 1, 6, "expecting '::='"),
    ('root ::= ("a"', 1, 10, "'(' is never closed"),
    ('root ::= ("a" ("b")', 1, 10, "'(' is never closed"),
    ('root ::= "a")', 1, 13, "unexpected ')'"),
    ('root ::= ("a" ]', 1, 15, "expecting ')'"),
    ('root ::= *"a"', 1, 10, "'*' has nothing before it to repeat"),
    ('root ::= "a" | +', 1, 16, "'+' has nothing before it"),
    ('root ::= ""*', 1, 12, "'*' has nothing before it"),
    ('root ::= []?', 1, 12, "'?' has nothing before it"),
    ('root ::= "a"{0}{2}', 1, 16, "'{' has nothing before it"),
    ('root ::= "a"{,3}', 1, 14, "expecting a number after '{'"),
    ('root ::= "a"{2', 1, 15, "expecting ',' or '}'"),
    ('root ::= "a"{2,3', 1, 17, "expecting '}'"),
    ('root ::= ("a"{2,\n  # two\n  x})', 3, 3, "expecting '}'"),
    ('root ::= "a"{2001}', 1, 13, "at most 2000"),
    ('root ::= "a"{0,99999999999999999999999}', 1, 13, "too large for llama.cpp"),
    ('root ::= "a"{10}{10}{10}{10}', 1, 25, "more than 2000 rules"),
    ("root ::= 'a'", 1, 10, "double quotes"),
    ('root ::= "a" @', 1, 14, "unexpected '@'"),
    ('root ::= "a" }', 1, 14, "unexpected '}'"),
    ('root ::=\nnext ::= "x"', 2, 6, "unexpected '::='"),
    ("root ::= <[12", 1, 14, "expecting ']'"),
    ("root ::= <[]>", 1, 12, "expecting a token id"),
    ("root ::= <[12]", 1, 15, "expecting '>'"),
    ("root ::= <[4294967296]>", 1, 12, "token id too big"),
    ('root ::= !"a"', 1, 11, "expecting '<' after '!'"),
    ("root ::= <abc", 1, 10, "unterminated token"),
    (" \n# only a comment\n", 1, 1, "the grammar is empty"),
    # a rule used but never defined
    ("root ::= foo", 1, 10, "rule 'foo' is used but never defined"),
    ('root ::= "a"\nroot ::= "b" foo', 2, 14, "rule 'foo' is used"),
    ('root ::= "a" | ("b" bar)*\nbar ::= baz\n', 2, 9, "rule 'baz' is used"),
    ('root ::= foo{0} ("b")', 1, 10, "rule 'foo' is used"),  # llama.cpp: an empty slot
    # no root
    ('a ::= "x"', 1, 1, "no rule named 'root'"),
    # left recursion
    ('root ::= root "a" | "b"', 1, 1, "rule 'root' is left-recursive (root -> root)"),
    ('root ::= a\na ::= b "x"\nb ::= a "y" | "z"', 2, 1, "(a -> b -> a)"),
    ('root ::= "x" a\na ::= b? a "y" | "z"\nb ::= "b"', 2, 1, "rule 'a' is left-recursive"),
    ('root ::= ("a" | root) "b"', 1, 1, "rule 'root' is left-recursive"),
    ("root ::= x* root\nx ::= \"x\"", 1, 1, "rule 'root' is left-recursive"),
    ('root ::= "a"\nz ::= z "b"', 2, 1, "rule 'z' is left-recursive"),  # out of reach, all the same
    ('root ::= "a" "c"**', 1, 18, "'*' repeats something that can be empty"),
    ('root ::= "a" "d"?+', 1, 18, "'+' repeats something that can be empty"),
]

# (text, line, column, part of the message): llama.cpp accepts each, we refuse it
NEVER_COMPLETE = [
    ('root ::= "a" root', 1, 1, "rule 'root' can never complete"),
    ('root ::= ("a" root)+', 1, 1, "rule 'root' can never complete"),
    ('root ::= "a" x\nx ::= "b" y | "c" y\ny ::= x "d"', 2, 1, "rules x, y can never complete"),
]
MATCHES_NOTHING = [
    ("root ::= [^\\x00-\\U0010FFFF]", 1, 10, "excludes every character"),
    ('root ::= "a" [z-a]', 1, 14, "matches no character"),
    ('root ::= "a\\U00110000"', 1, 12, "past U+10FFFF"),
    ("root ::= []", 1, 10, "empty character class"),
    ('root ::= "a" | [^]', 1, 16, "empty character class"),
]
ALSO_REFUSED = [
    # left recursion llama.cpp's check misses (w is empty only by way of v); it would loop after "a"
    ('root ::= "a" x\nx ::= w x "b" | "c"\nw ::= v\nv ::= "" | "q"', 2, 1, "llama.cpp's check misses it"),
    ('root ::= "a"\0 junk', 1, 13, "NUL character"),
]
# refused by us; llama.cpp is not asked: it loops without end (the first three) or crashes (the last)
NOT_FOR_LLAMA = [
    ('root ::= "a"{5,3}', 1, 13, "repetition {5,3}: the most is less than the least"),
    ('root ::= ("a"{ 5 ,\n 3 })', 1, 14, "repetition {5,3}: the most is less than the least"),
    ('root ::= x root "y"\nx ::= y\ny ::= "" | "q"', 1, 1, "rule 'root' is left-recursive (root -> root)"),
    ("a ::= root{0}", 1, 1, "no rule named 'root'"),
]


def test_the_grammars_llama_cpp_ships_parse(shipped, llama_accepts):
    for name, text in shipped.items():
        grammar = check(text)
        assert grammar.rules[0] == "root" and grammar.tokens == (), name
        assert llama_accepts(text), name


def test_we_accept_what_llama_cpp_accepts(llama_accepts):
    for text in GOOD:
        assert llama_accepts(text), text
        assert isinstance(check(text), Gbnf), text


@pytest.mark.parametrize("text, line, column, what", BAD, ids=[repr(case[0])[:40] for case in BAD])
def test_we_refuse_what_llama_cpp_refuses_at_the_place(llama_accepts, text, line, column, what):
    assert not llama_accepts(text)
    assert_refused(text, line, column, what)


@pytest.mark.parametrize("text, line, column, what", NEVER_COMPLETE + MATCHES_NOTHING + ALSO_REFUSED,
                         ids=[repr(case[0])[:40] for case in NEVER_COMPLETE + MATCHES_NOTHING + ALSO_REFUSED])
def test_we_refuse_more_than_llama_cpp(llama_accepts, text, line, column, what):
    assert llama_accepts(text)
    assert_refused(text, line, column, what)


@pytest.mark.parametrize("text, line, column, what", NOT_FOR_LLAMA, ids=[case[0][:30] for case in NOT_FOR_LLAMA])
def test_we_refuse_what_llama_cpp_would_hang_or_crash_on(text, line, column, what):
    assert_refused(text, line, column, what)


def assert_refused(text: str, line: int, column: int, what: str) -> None:
    error = refusal(text)
    message = str(error)
    assert "\n" not in message and "\r" not in message, message
    assert re.fullmatch(r"grammar line \d+, column \d+: .+", message), message
    assert (error.line, error.column) == (line, column), message
    assert message.startswith(f"grammar line {line}, column {column}: "), message
    assert what in error.detail, message


def test_the_corpus_is_wide_enough():
    assert len(BAD) >= 30 and NEVER_COMPLETE and MATCHES_NOTHING
    kinds = {"unterminated", "escape", "rule name", "'::='", "never closed", "unexpected", "nothing before it",
             "expecting a number", "at most 2000", "more than 2000 rules", "token", "empty", "never defined",
             "no rule named", "left-recursive"}
    for kind in kinds:
        assert any(kind in case[3] for case in BAD), kind


def test_a_different_root(llama_accepts):
    text = 'start ::= "a" item\nitem ::= "b"'
    assert check(text, "start").root == "start"
    assert llama_accepts(text, "start") and not llama_accepts(text)
    error = refusal(text)
    assert str(error) == "grammar line 1, column 1: no rule named 'root' (generation starts from it; " \
                         "the grammar defines start, item)"
    assert not llama_accepts(text, "other")
    assert "no rule named 'other'" in str(refusal(text, "other"))


def test_rules_and_tokens_are_reported(llama_accepts):
    grammar = check('root ::= <[12]> body !<|im_end|>\nbody ::= ( <think> | "x"\n  !<[7]> )*\nroot ::= body <a\nb>')
    assert grammar.rules == ("root", "body")  # root defined twice: the second replaces the first
    assert grammar.tokens == (TokenRef(None, 12, 1, 10, False), TokenRef("<|im_end|>", None, 1, 22, True),
                              TokenRef("<think>", None, 2, 12, False), TokenRef(None, 7, 3, 3, True),
                              TokenRef("<a\nb>", None, 4, 15, False))  # '<text>' runs to the first '>'
    # whether '<text>' is one token is the vocabulary's business: the caller's, with the model
    assert check("root ::= <think>").tokens == (TokenRef("<think>", None, 1, 10, False),)
    assert not llama_accepts("root ::= <think>") and llama_accepts("root ::= <s>")


def test_places_count_characters_and_line_ends():
    def place(text: str) -> tuple[int, int]:
        error = refusal(text)
        return error.line, error.column

    assert place('root ::= "é" "\\q"') == (1, 15)  # code points, not bytes
    assert place('a ::= "x"\r\nroot ::= "\\q"') == (2, 11)
    assert place('a ::= "x"\rroot ::= "\\q"') == (2, 11)
    assert place('root ::=\t"\\q"') == (1, 11)  # a tab is one


def test_unterminated_literal_names_where_it_opens_across_lines():
    error = refusal('root ::= "a"\nitem ::= "b" "c\n\nmore ::= "d"')
    assert (error.line, error.column) == (4, 12)  # "c\n\nmore ::= " is one literal; the next '"' opens one more
