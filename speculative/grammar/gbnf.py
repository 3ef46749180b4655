r"""GBNF checked ahead of llama.cpp's parser, which names no place when it refuses a grammar (it prints
the whole grammar to stderr). `check` parses as the pinned llama.cpp does (llama-grammar.cpp's
llama_grammar_parser, then llama_grammar_init_impl's checks) and raises GrammarError at the first
problem, with ONE line:

    grammar line L, column C: <what is wrong>

L and C are 1-based; C counts characters (code points; a tab is one), and \n, \r\n and a lone \r
end a line. A caller that read the grammar from a file puts the file's name in front
("calc.gbnf: grammar line 3, column 7: ..."). The error also carries `line`, `column` and `detail`
(what follows "column C: ").

What it refuses, in this order: a syntax error, at the place (an unterminated literal, class or
token at where it opens); a rule used but never defined, at its first use; no rule named `root`
(or the root asked for), at line 1, column 1; left recursion as llama.cpp finds it, at the
definition of the cycle's first rule (at the operator for `x?*`, `x**`); then what llama.cpp lets
through: left recursion its check misses and would loop forever on; a character class or literal
that matches nothing (`[^\x00-\U0010FFFF]`, `[z-a]`, `[]`, `"\U00110000"`), at it; a rule reachable
from the root that can never complete (`root ::= "a" root`), at its definition.

Where it parts from llama.cpp (everything else is refused exactly when llama.cpp refuses it):
  - the last three classes, which llama.cpp accepts. llama.cpp counts a rule as empty for left
    recursion only where it has an empty alternative, so `a ::= w a "x"`, `w ::= v`,
    `v ::= "" | "q"` passes its check and then loops without end once generation reaches `a`;
    where nothing follows the recursion (`("a"? | "b")*`) it does not loop, and it is accepted;
  - what it loops or crashes on: a repetition `{m,n}` with n < m, a root that is only referenced;
  - a NUL character (llama.cpp would stop reading there); "" (llama.cpp's sampler reads it as no
    grammar at all).
A later definition of a rule replaces the earlier one, as in llama.cpp. Token references (`<[id]>`,
`<text>`, and `!` before either) are returned, not looked up: whether `<text>` is one token of the
model's vocabulary is for the caller to ask (llama.cpp refuses the grammar otherwise). Rule names
llama.cpp makes for groups and repetitions (`root_3`) cannot meet a grammar's: '_' is no name character.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import NoReturn

from speculative.errors import GrammarError

MAX_REPETITION = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD
MAX_CODEPOINT = 0x10FFFF
_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


@dataclass(frozen=True)
class TokenRef:
    """A token the grammar names: `<[id]>` (id set) or `<text>` (text set, with its angle brackets,
    as llama.cpp tokenizes it), `negated` for the `!` forms; the place is where it starts."""

    text: str | None
    id: int | None
    line: int
    column: int
    negated: bool


@dataclass(frozen=True)
class Gbnf:
    """A grammar that passed `check`: its rules' names in the order first defined, its token
    references in the order written, and the rule generation starts from."""

    rules: tuple[str, ...]
    tokens: tuple[TokenRef, ...]
    root: str = "root"


def check(text: str, root: str = "root") -> Gbnf:
    """`text` as GBNF, checked as described above (GrammarError at the first problem)."""
    parser = _Parser(text)
    parser.parse()
    _check_defined(parser)
    if root not in parser.defined:
        defined = _chain(list(parser.defined), ", ", False)
        parser.fail(0, f"no rule named '{root}' (generation starts from it; the grammar defines {defined})")
    _check_left_recursion(parser)
    reachable = _reachable(parser.rules, parser.symbols[root])
    _check_looping(parser, reachable)
    if parser.dead:
        parser.fail(*min(parser.dead))
    _check_productive(parser, reachable)
    return Gbnf(tuple(parser.defined), tuple(parser.tokens), root)


def _space(s: str, pos: int, newline_ok: bool) -> int:
    """llama.cpp's parse_space: blanks and # comments, and line ends where `newline_ok`."""
    n = len(s)
    while pos < n:
        c = s[pos]
        if c == "#":
            while pos < n and s[pos] not in "\r\n":
                pos += 1
        elif c in " \t" or (newline_ok and c in "\r\n"):
            pos += 1
        else:
            break
    return pos


def _run_end(s: str, pos: int, chars: frozenset) -> int:
    while pos < len(s) and s[pos] in chars:
        pos += 1
    return pos


def _number(digits: str) -> int:
    """Decimal digits as an int, any huge one as 2**100 (all that matters is that it is too big)."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 30 else 1 << 100


def _describe(c: str) -> str:
    if not c:
        return "the end of the grammar"
    if c in "\r\n":
        return "the end of the line"
    return repr(c) if c.isprintable() else f"U+{ord(c):04X}"


def _dead_class(spans: list[tuple[int, int]], negated: bool) -> str | None:
    """Why a character class matches no character at all, or None when it matches some."""
    if not spans:
        return "empty character class: it matches nothing (llama.cpp would read it as the empty string)"
    spans = sorted((lo, min(hi, MAX_CODEPOINT)) for lo, hi in spans if lo <= hi and lo <= MAX_CODEPOINT)
    if not negated:
        return None if spans else "character class matches no character (its ranges are reversed or past U+10FFFF)"
    reach = 0  # the first character not yet excluded
    for lo, hi in spans:
        if lo > reach:
            return None
        reach = max(reach, hi + 1)
    return "negated character class excludes every character, so it matches nothing" if reach > MAX_CODEPOINT else None


class _Source:
    """The grammar's text: places, errors, and the terminals (literals, classes, tokens) as
    llama.cpp's parse_char and parse_token read them."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.line_starts = [0] + [m.end() for m in re.finditer(r"\r\n|\r|\n", text)]
        self.tokens: list[TokenRef] = []
        self.dead: list[tuple[int, str]] = []  # classes and literals that match nothing

    def where(self, pos: int) -> tuple[int, int]:
        line = bisect_right(self.line_starts, pos)
        return line, pos - self.line_starts[line - 1] + 1

    def fail(self, pos: int, detail: str) -> NoReturn:
        line, column = self.where(pos)
        error = GrammarError(f"grammar line {line}, column {column}: {detail}")
        error.line, error.column, error.detail = line, column, detail
        raise error

    def at(self, pos: int) -> str:
        """The character at `pos`, '' past the end (where llama.cpp reads its NUL)."""
        return self.s[pos] if pos < len(self.s) else ""

    def char(self, pos: int, opening: int, what: str) -> tuple[int, int]:
        """llama.cpp's parse_char at `pos` (not past the end): (code point, position after it)."""
        s = self.s
        if s[pos] != "\\":
            return ord(s[pos]), pos + 1
        e = self.at(pos + 1)
        if e in _HEX_ESCAPES:
            size = _HEX_ESCAPES[e]
            digits = s[pos + 2:pos + 2 + size]
            if len(digits) < size or not set(digits) <= _HEX:
                self.fail(pos, f"escape \\{e} needs {size} hex digits")
            return int(digits, 16), pos + 2 + size
        if e in _ESCAPES:
            return ord(_ESCAPES[e]), pos + 2
        if not e:
            self.fail(opening, f"unterminated {what}")
        shown = f"'\\{e}'" if e.isprintable() else f"'\\' before {_describe(e)}"
        self.fail(pos, f"unknown escape {shown} (known: \\x.. \\u.... \\U........ \\t \\r \\n "
                       "\\\\ \\\" \\[ \\] \\-)")

    def literal(self, pos: int, seq: list) -> int:
        start, pos = pos, pos + 1
        while self.at(pos) != '"':
            if pos >= len(self.s):
                self.fail(start, "unterminated string literal: no closing '\"'")
            code, end = self.char(pos, start, "string literal")
            if code > MAX_CODEPOINT:
                self.dead.append((pos, f"U+{code:X} is past U+10FFFF: the literal can never match"))
            pos = end
        if pos > start + 1:
            seq.append(None)
        return pos + 1

    def char_class(self, pos: int, seq: list) -> int:
        start, n = pos, len(self.s)
        negated = self.at(pos + 1) == "^"
        pos += 1 + negated
        spans = []
        while self.at(pos) != "]":
            if pos >= n:
                self.fail(start, "unterminated character class: no closing ']'")
            low, pos = self.char(pos, start, "character class")
            high = low
            if self.at(pos) == "-" and self.at(pos + 1) != "]":
                if pos + 1 >= n:
                    self.fail(start, "unterminated character class: no closing ']'")
                high, pos = self.char(pos + 1, start, "character class")
            spans.append((low, high))
        if spans:
            seq.append(None)
        dead = _dead_class(spans, negated)
        if dead:
            self.dead.append((start, dead))
        return pos + 1

    def token(self, pos: int, seq: list) -> int:
        s, start = self.s, pos
        negated = s[pos] == "!"
        pos += negated
        if self.at(pos) != "<":
            self.fail(pos, "expecting '<' after '!' (a negated token is !<text> or !<[id]>), "
                           f"found {_describe(self.at(pos))}")
        if self.at(pos + 1) == "[":
            first = pos + 2
            end = _run_end(s, first, _DIGITS)
            if end == first:
                self.fail(first, f"expecting a token id (digits) after '<[', found {_describe(self.at(first))}")
            text, ident = None, _number(s[first:end])
            if ident > 0xFFFFFFFF:
                self.fail(first, "token id too big (at most 4294967295)")
            if self.at(end) != "]":
                self.fail(end, f"expecting ']' after the token id, found {_describe(self.at(end))}")
            if self.at(end + 1) != ">":
                self.fail(end + 1, f"expecting '>' after ']', found {_describe(self.at(end + 1))}")
            end += 2
        else:
            end = s.find(">", pos + 1) + 1
            if not end:
                self.fail(pos, "unterminated token: no closing '>' after '<'")
            text, ident = s[pos:end], None
        self.tokens.append(TokenRef(text, ident, *self.where(start), negated))
        seq.append(None)
        return end


class _Parser(_Source):
    """A port of llama_grammar_parser: the same symbol ids, rules and expansion of repetitions (a run
    of terminals is one element, None; a rule reference is its id), keeping the places the checks
    after parsing name. Alternatives are lists of elements, a rule a list of alternatives."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.symbols: dict[str, int] = {}  # llama.cpp's symbol_ids
        self.rules: list[list[list[int | None]] | None] = []
        self.first: dict[int, int] = {}  # symbol id -> where its name first appears
        self.place: dict[int, int] = {}  # rule id -> where the rule (its owner's for a made one) is defined
        self.owner: dict[int, str] = {}  # made rule id -> the rule it is part of
        self.made_at: dict[int, int] = {}  # made rule id -> where its group or repetition is
        self.defined: dict[str, int] = {}  # rule name -> where it is (last) defined; in first-definition order
        self.name, self.def_pos = "", 0  # the rule being parsed

    def name_of(self, symbol: int) -> str:
        return self.owner.get(symbol) or next(k for k, v in self.symbols.items() if v == symbol)

    def symbol(self, name: str, pos: int) -> int:
        """llama.cpp's get_symbol_id."""
        if name not in self.symbols:
            self.symbols[name] = len(self.symbols)
            self.first[self.symbols[name]] = pos
        return self.symbols[name]

    def generate(self, at: int) -> int:
        """llama.cpp's generate_symbol_id, for the group or repetition at `at` of the rule being
        parsed: its name, `<rule>_<id>`, is one no rule can have ('_' is no name character)."""
        symbol = len(self.symbols)
        self.symbols[f"{self.name}_{symbol}"] = symbol
        self.owner[symbol], self.place[symbol], self.made_at[symbol] = self.name, self.def_pos, at
        return symbol

    def add_rule(self, symbol: int, alternatives: list[list[int | None]]) -> None:
        self.rules.extend([None] * (symbol + 1 - len(self.rules)))
        self.rules[symbol] = alternatives

    def parse(self) -> None:
        nul = self.s.find("\0")
        if nul >= 0:
            self.fail(nul, "NUL character (llama.cpp would stop reading the grammar here)")
        pos = _space(self.s, 0, True)
        if pos == len(self.s):
            self.fail(0, "the grammar is empty: it defines no rule")
        while pos < len(self.s):
            pos = self.rule(pos)

    def rule(self, pos: int) -> int:
        s = self.s
        end = _run_end(s, pos, _WORD)
        if end == pos:
            hint = (" (a line cannot start with '|': end the line before with it, or put the alternatives "
                    "in parentheses)" if s[pos] == "|" else "")
            self.fail(pos, f"expecting a rule name, found {_describe(s[pos])}{hint}")
        self.name, self.def_pos = s[pos:end], pos
        symbol = self.symbol(self.name, pos)
        self.defined[self.name] = self.place[symbol] = pos
        pos = _space(s, end, False)
        if s[pos:pos + 3] != "::=":
            self.fail(pos, f"expecting '::=' after the rule name '{self.name}', found {_describe(self.at(pos))}")
        pos = self.alternates(_space(s, pos + 3, True), symbol, False)
        c = self.at(pos)
        if c == "\r":
            pos += 2 if self.at(pos + 1) == "\n" else 1
        elif c == "\n":
            pos += 1
        elif c == ")":
            self.fail(pos, "unexpected ')': no '(' is open")
        elif s.startswith("::=", pos):
            self.fail(pos, "unexpected '::=': a rule must start on a line of its own "
                           "(and an empty rule is written `name ::= \"\"`)")
        elif c:
            hint = " (string literals take double quotes)" if c == "'" else ""
            self.fail(pos, f"unexpected {_describe(c)}{hint}")
        return _space(s, pos, True)

    def alternates(self, pos: int, symbol: int, nested: bool) -> int:
        sequence, pos = self.sequence(pos, nested)
        alternatives = [sequence]
        while self.at(pos) == "|":
            sequence, pos = self.sequence(_space(self.s, pos + 1, True), nested)
            alternatives.append(sequence)
        self.add_rule(symbol, alternatives)
        return pos

    def sequence(self, pos: int, nested: bool) -> tuple[list[int | None], int]:
        """llama.cpp's parse_sequence; `last` is its last_sym_start, `n_prev` its n_prev_rules."""
        seq: list[int | None] = []
        last, n_prev = 0, 1
        while pos < len(self.s):
            c, start = self.s[pos], pos
            if c in "*+?{":
                pos, low, high = self.bounds(pos, nested)
                n_prev = self.repeat(seq, last, n_prev, low, high, start)
                continue
            last, n_prev = len(seq), 1
            if c == '"':
                pos = self.literal(pos, seq)
            elif c == "[":
                pos = self.char_class(pos, seq)
            elif c in "<!":
                pos = self.token(pos, seq)
            elif c in _WORD:
                end = _run_end(self.s, pos, _WORD)
                seq.append(self.symbol(self.s[pos:end], pos))
                pos = end
            elif c == "(":
                pos, n_prev = self.group(pos, seq)
            elif c == ".":
                seq.append(None)
                pos += 1
            else:
                break
            pos = _space(self.s, pos, nested)
        return seq, pos

    def group(self, pos: int, seq: list) -> tuple[int, int]:
        """`( alternates )` as a rule of its own; (position after it, llama.cpp's n_prev_rules)."""
        opening = pos
        pos = _space(self.s, pos + 1, True)
        before = len(self.symbols)
        symbol = self.generate(opening)
        pos = self.alternates(pos, symbol, True)
        seq.append(symbol)
        if self.at(pos) != ")":
            line, column = self.where(opening)
            self.fail(opening if pos >= len(self.s) else pos,
                      "'(' is never closed" if pos >= len(self.s) else
                      f"expecting ')' to close the '(' of line {line}, column {column}, found {_describe(self.s[pos])}")
        return pos + 1, max(1, len(self.symbols) - before)

    def bounds(self, pos: int, nested: bool) -> tuple[int, int, int | None]:
        """`*`, `+`, `?` or `{m}`, `{m,}`, `{m,n}`: (position after it, least, most or None)."""
        s, opening = self.s, pos
        if s[pos] != "{":
            return _space(s, pos + 1, nested), int(s[pos] == "+"), 1 if s[pos] == "?" else None
        pos = _space(s, pos + 1, nested)
        end = _run_end(s, pos, _DIGITS)
        if end == pos:
            self.fail(pos, f"expecting a number after '{{' ({{m}}, {{m,}} or {{m,n}}), found {_describe(self.at(pos))}")
        written = s[pos:end]
        low = high = _number(written)
        pos = _space(s, end, nested)
        if self.at(pos) == ",":
            pos = _space(s, pos + 1, nested)
            end = _run_end(s, pos, _DIGITS)
            written += "," + s[pos:end]
            high = _number(s[pos:end]) if end > pos else None
            pos = _space(s, end, nested)
            if self.at(pos) != "}":
                self.fail(pos, f"expecting '}}' to close the repetition, found {_describe(self.at(pos))}")
        elif self.at(pos) != "}":
            self.fail(pos, f"expecting ',' or '}}' in the repetition, found {_describe(self.at(pos))}")
        if low > MAX_REPETITION:
            self.fail(opening, f"repetition {{{written}}}: llama.cpp repeats at most {MAX_REPETITION} times")
        if high is not None and high >= 1 << 64:
            self.fail(opening, f"repetition {{{written}}}: the number is too large for llama.cpp")
        if high is not None and high > MAX_REPETITION:
            high = None  # as llama.cpp reads it
        if high is not None and high < low:
            self.fail(opening, f"repetition {{{written}}}: the most is less than the least")
        return _space(s, pos + 1, nested), low, high

    def repeat(self, seq: list, last: int, n_prev: int, low: int, high: int | None, at: int) -> int:
        """llama.cpp's handle_repetitions on seq[last:]; returns the new n_prev_rules."""
        if last == len(seq):
            self.fail(at, f"{self.s[at]!r} has nothing before it to repeat")
        total = high or low or 1
        if n_prev * total > MAX_REPETITION:
            self.fail(at, f"nested repetitions make more than {MAX_REPETITION} rules, more than llama.cpp allows")
        prev = seq[last:]
        seq[last:] = prev * low
        n_opt = 1 if high is None else high - low
        ref = 0
        for i in range(n_opt):
            symbol = self.generate(at)
            self.add_rule(symbol, [prev + ([symbol if high is None else ref] if i or high is None else []), []])
            ref = symbol
        if n_opt:
            seq.append(ref)
        return n_prev * total


def _check_defined(p: _Parser) -> None:
    """llama.cpp's check at the end of parse(): every rule slot filled, every reference defined."""
    size = len(p.rules)
    missing = {i for i, alternatives in enumerate(p.rules) if alternatives is None}
    missing |= {e for alternatives in p.rules if alternatives for alt in alternatives for e in alt
                if e is not None and (e >= size or p.rules[e] is None)}
    if missing:
        symbol = min(missing, key=p.first.__getitem__)
        p.fail(p.first[symbol], f"rule '{p.name_of(symbol)}' is used but never defined")


def _holds(rules: list, terminals: bool) -> list[bool]:
    """The least fixed point: a rule holds when one of its alternatives has only rules that hold
    (and terminals, where `terminals`, else none). Nullable: False; can complete: True."""
    holds = [False] * len(rules)
    waiting: dict[int, list[list[int]]] = {}
    ready = []
    for i, alternatives in enumerate(rules):
        for alt in alternatives:
            needs = {e for e in alt if e is not None}
            if None in alt and not terminals:
                continue
            if not needs:
                ready.append(i)
                continue
            counter = [len(needs), i]
            for e in needs:
                waiting.setdefault(e, []).append(counter)
    while ready:
        i = ready.pop()
        if holds[i]:
            continue
        holds[i] = True
        for counter in waiting.get(i, ()):
            counter[0] -= 1
            if counter[0] == 0:
                ready.append(counter[1])
    return holds


def _find_cycle(edges: list[list[int]]) -> list[int] | None:
    """A cycle of the graph (depth first, without recursion: chains run 2000 rules deep)."""
    state = [0] * len(edges)  # 0 unseen, 1 on the path, 2 done
    for start in range(len(edges)):
        if state[start]:
            continue
        state[start] = 1
        stack = [(start, iter(edges[start]))]
        while stack:
            node, targets = stack[-1]
            target = next(targets, None)
            if target is None:
                state[node] = 2
                stack.pop()
            elif state[target] == 1:
                path = [n for n, _ in stack]
                return path[path.index(target):]
            elif state[target] == 0:
                state[target] = 1
                stack.append((target, iter(edges[target])))
    return None


def _names(p: _Parser, cycle: list[int]) -> list[str]:
    """The rules of `cycle` as written (a made rule as its owner), from the first defined one."""
    start = min(range(len(cycle)), key=lambda i: p.place[cycle[i]])
    names = []
    for symbol in cycle[start:] + cycle[:start]:
        if p.name_of(symbol) not in names:
            names.append(p.name_of(symbol))
    return names


def _left_edges(rules: list, empty: list[bool]) -> list[list[tuple[int, bool]]]:
    """For each rule, the rules its alternatives start with, after rules that can be `empty`; each
    with whether it ends its alternative (expanding it then leaves nothing behind on the stack)."""
    edges = []
    for alternatives in rules:
        leftmost = []
        for alt in alternatives:
            for i, e in enumerate(alt):
                if e is None:
                    break
                leftmost.append((e, i == len(alt) - 1))
                if not empty[e]:
                    break
        edges.append(leftmost)
    return edges


def _chain(names: list[str], joint: str, closed: bool) -> str:
    """`names` joined, the cycle closed on its first name where `closed`; at most 8 written out."""
    shown = names if len(names) <= 8 else names[:4] + ["..."] + names[-3:]
    text = joint.join(shown + (names[:1] if closed else []))
    return text if len(names) <= 8 else f"{text} ({len(names)} rules)"


def _check_left_recursion(p: _Parser) -> None:
    """llama_grammar_detect_left_recursion over every rule: it counts as empty only a rule with an
    empty alternative (`x?`, `x*`, `( | x)`, `""`), not one that is empty by way of other rules."""
    empty = [any(not alt for alt in alternatives) for alternatives in p.rules]
    cycle = _find_cycle([[e for e, _ in leftmost] for leftmost in _left_edges(p.rules, empty)])
    if cycle and all(symbol in p.made_at for symbol in cycle):  # a repetition of what can be empty
        at = p.made_at[max(cycle)]
        p.fail(at, f"{p.s[at]!r} repeats something that can be empty, which llama.cpp refuses as left "
                   "recursion (write x* rather than x?* or x**)")
    if cycle:
        names = _names(p, cycle)
        p.fail(p.place[min(cycle, key=p.place.__getitem__)],
               f"rule '{names[0]}' is left-recursive ({_chain(names, ' -> ', True)}), which llama.cpp "
               "refuses: put something that cannot be empty first, or use repetition")


def _path(edges: list[list[tuple[int, bool]]], start: int, goal: int) -> list[int] | None:
    """The shortest path of `edges` from `start` to `goal` (both in it), or None."""
    parent: dict[int, int | None] = {start: None}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        if node == goal:
            path = []
            while node is not None:
                path.append(node)
                node = parent[node]
            return path[::-1]
        for target, _ in edges[node]:
            if target not in parent:
                parent[target] = node
                todo.append(target)
    return None


def _components(edges: list[list[tuple[int, bool]]]) -> list[int]:
    """Each node's strongly connected component (Tarjan's, without recursion)."""
    n = len(edges)
    index, low, component, on_stack = [-1] * n, [0] * n, [-1] * n, [False] * n
    stack: list[int] = []
    counter = 0
    for root in range(n):
        if index[root] >= 0:
            continue
        index[root] = low[root] = counter = counter + 1
        stack.append(root)
        on_stack[root] = True
        work = [(root, iter(edges[root]))]
        while work:
            node, targets = work[-1]
            for target, _ in targets:
                if index[target] < 0:
                    index[target] = low[target] = counter = counter + 1
                    stack.append(target)
                    on_stack[target] = True
                    work.append((target, iter(edges[target])))
                    break
                if on_stack[target]:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    while True:
                        member = stack.pop()
                        on_stack[member], component[member] = False, node
                        if member == node:
                            break
    return component


def _check_looping(p: _Parser, reachable: dict[int, None]) -> None:
    """Left recursion llama.cpp's check misses, through rules empty only by way of other rules, where
    something follows the recursion: llama.cpp's stacks would then grow without end. (Where nothing
    follows, as in `("a"? | "b")*`, its stacks repeat and the grammar works: it is let through.)"""
    edges = _left_edges(p.rules, _holds(p.rules, False))
    component = _components(edges)
    for start in reachable:
        for target, last in edges[start]:
            if not last and component[target] == component[start]:
                cycle = _path(edges, target, start)
                names = _names(p, cycle)
                p.fail(p.place[min(cycle, key=p.place.__getitem__)],
                       f"rule '{names[0]}' is left-recursive ({_chain(names, ' -> ', True)}) through "
                       "rules that can be empty: llama.cpp's check misses it, and would loop forever")


def _reachable(rules: list, root: int) -> dict[int, None]:
    """The rules `root` can reach (root first), as an ordered set."""
    reachable, todo = {root: None}, [root]
    while todo:
        for alt in rules[todo.pop()]:
            for e in alt:
                if e is not None and e not in reachable:
                    reachable[e] = None
                    todo.append(e)
    return reachable


def _check_productive(p: _Parser, reachable: dict[int, None]) -> None:
    """Every rule reachable from the root can complete: one of its alternatives needs only rules
    that can. One that cannot is part of a cycle of such rules; that cycle is named."""
    complete = _holds(p.rules, True)
    stuck = [i for i in reachable if not complete[i]]
    if not stuck:
        return
    walk, symbol = [], stuck[0]
    while symbol not in walk:
        walk.append(symbol)
        symbol = next(e for alt in p.rules[symbol] for e in alt if e is not None and not complete[e])
    cycle = walk[walk.index(symbol):]
    names = _names(p, cycle)
    what = (f"rule '{names[0]}' can never complete: every alternative of it needs '{names[0]}' again"
            if len(names) == 1 else
            f"rules {_chain(names, ', ', False)} can never complete: every alternative of each needs one of them again")
    p.fail(p.place[min(cycle, key=p.place.__getitem__)], what)
