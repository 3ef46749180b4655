"""llama.cpp's flags parsed as llama.cpp parses them (common/arg.cpp): every argument one flag
name, never short flags run together (`-cnv` is not -c with the value "nv"), `--a_b` as
`--a-b`; a flag a command does not take refused by its whole name in one line (exit 2), with
what llama.cpp's flag is and what to use. cli/llama_flags.py's list of llama.cpp's flags is
held to the pinned sdist's common/arg.cpp; every command is found in the click app itself."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from typer.main import get_command

from speculative.cli import llama_flags, memory
from speculative.cli.main import app
from speculative.cli.options import ModelOptions
from speculative.decoding.settings import SpecSettings
from speculative.drafters.registry import ALIASES, SPEC_TYPES, canonical
from speculative.engine.bench import make_configs
from speculative.engine.chat import check_template, format_chat
from speculative.serving.generation import speculation
from tests.conftest import assert_refused, speculate, speculate_here, speculate_json, vendored
from tests.gguf_builder import write_tiny_llama

try:  # typer >= 0.22 vendors click
    from typer._click.core import Context
except ImportError:  # pragma: no cover
    from click import Context


def commands(command=None, path: str = "speculate", parent=None):
    """(path, command, context) of the app and every command under it, each context a child of
    its parent's, as a run makes them (help_option_names comes down from the app's)."""
    command = command or get_command(app)
    ctx = Context(command, info_name=path.split()[-1], parent=parent)
    yield path, command, ctx
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, f"{path} {name}", ctx)


ALL = list(commands())
IDS = [path for path, _, _ in ALL]
# speculate rpc-server's flags are those of llama.cpp's rpc-server (tools/rpc), not of common/arg.cpp
ARG_CPP_COMMANDS = [(path, command, ctx) for path, command, ctx in ALL if path != "speculate rpc-server"]


def options(command, ctx):
    return [p for p in command.get_params(ctx) if p.param_type_name == "option"]


def parse(command, ctx, *args: str) -> tuple[dict, list]:
    """What the command's parser makes of `args`: {parameter: value}, and the parameters in order."""
    opts, _, order = command.make_parser(ctx).parse_args(list(args))
    flags = {p.name for p in options(command, ctx)}  # without the arguments, which come out unset
    return {k: v for k, v in opts.items() if k in flags}, [p.name for p in order if p.name in flags]


# -- llama.cpp's list -------------------------------------------------------------------------


def without_comments(source: str) -> str:
    """C++ source without its comments (string and character literals kept whole)."""
    out, i = [], 0
    while i < len(source):
        if source.startswith("//", i):
            i = source.find("\n", i) % (len(source) + 1)
        elif source.startswith("/*", i):
            i = source.index("*/", i + 2) + 2
        elif source[i] in "\"'":
            j = i + 1
            while source[j] != source[i]:
                j += 2 if source[j] == "\\" else 1
            out.append(source[i:j + 1])
            i = j + 1
        else:
            out.append(source[i])
            i += 1
    return "".join(out)


_STRING = r'"(?:[^"\\]|\\.)*"'
_NAMES = re.compile(rf"\s*\{{\s*({_STRING}(?:\s*,\s*{_STRING})*)\s*\}}\s*,")


def arg_cpp_options(source: str) -> list[tuple[tuple[str, ...], ...]]:
    """Each add_opt(common_arg(...)) of arg.cpp: its lists of flag names (the names, then those that
    turn it off) that open the constructor's arguments."""
    code = without_comments(source)
    found = []
    for m in re.finditer(r"\badd_opt\(\s*common_arg\(", code):
        lists, at = [], m.end()
        while match := _NAMES.match(code, at):
            names = tuple(re.findall(r'"([^"]*)"', match.group(1)))
            if not all(name.startswith("-") for name in names):  # a preset key, or the values of a flag
                break
            lists.append(names)
            at = match.end()
        found.append(tuple(lists))
    return found


@pytest.fixture(scope="module")
def arg_cpp() -> str:
    return vendored("common/arg.cpp").decode()


def test_the_list_of_llama_cpp_flags_is_the_pinned_arg_cpps(arg_cpp):
    pinned = [(names[0], names[1] if len(names) > 1 else ()) for names in arg_cpp_options(arg_cpp)]
    assert len(pinned) == arg_cpp.count("add_opt(common_arg(") - arg_cpp.count("// add_opt(common_arg(")
    assert all(on for on, _ in pinned)
    assert list(llama_flags.OPTIONS) == pinned


def test_the_arg_cpp_reader_finds_what_it_must():
    """Comments (and a `//` inside a string) skipped, a flag's two lists of names, a preset key
    (no dash) not a flag."""
    source = '''
        add_opt(common_arg(
            // a note: "-x" is not a flag
            {"-a", "--aa"}, {"-no-a", "--no-aa"}, "see http://x", [](common_params &) {}));
        // add_opt(common_arg({"--gone"}, "old"));
        /* add_opt(common_arg({"--gone-too"}, "old")); */
        add_opt(common_arg({"load-on-startup"}, "NAME", "h", [](common_params &, const std::string &) {}));
        add_opt(common_arg({"-n", "--n-predict"}, "N", "h // not a comment", [](common_params &, int) {}));
    '''
    assert arg_cpp_options(source) == [(("-a", "--aa"), ("-no-a", "--no-aa")), (), (("-n", "--n-predict"),)]


# -- every flag whole ---------------------------------------------------------------------------


def llama_flags_of(command, ctx) -> list[tuple[str, object, bool]]:
    """(flag name, its parameter, whether it turns the option off) for each name of the command's
    options that llama.cpp has too."""
    known = {name for option in llama_flags.OPTIONS for side in option for name in side}
    return [(name, p, off) for p in options(command, ctx) for off, names in ((False, p.opts), (True, p.secondary_opts))
            for name in names if name in known]


@pytest.mark.parametrize("path,command,ctx", ALL, ids=IDS)
def test_every_llama_cpp_flag_of_a_command_parses_as_that_one_flag(path, command, ctx):
    """Multi-letter single-dash flags above all (-ngl, -ctk, -sys, -np): a value given or not,
    the parse names that flag, never a short flag with the rest of the name as its value."""
    for name, param, off in llama_flags_of(command, ctx):
        args = (name,) if param.is_flag or param.count else (name, "7")
        opts, order = parse(command, ctx, *args)
        assert order == [param.name] and list(opts) == [param.name], f"{path} {' '.join(args)}: {opts}"
        value = opts[param.name]
        if not (param.is_flag or param.count):
            assert value in ("7", ["7"], ("7",)), f"{path} {' '.join(args)}: {value!r}"
        elif param.is_bool_flag:
            assert value is (not off), f"{path} {name}: {value!r}"


def test_commands_have_their_single_dash_llama_cpp_flags():
    """The test above has something to check: the multi-letter single-dash flags are there."""
    found = {name for _, command, ctx in ALL for name, _, _ in llama_flags_of(command, ctx)}
    assert {"-ngl", "-ngld", "-ctk", "-ctvd", "-np", "-sys", "-md", "-hf", "-lcs", "-cram", "-sps"} <= found


# llama.cpp's flags a command takes under some of their names only, on purpose
NOT_ALL_NAMES = {
    "--help": "--usage: help is -h and --help",
    "--color": "llama.cpp's -co/--color takes on|off|auto; speculate's --color is a switch",
    "-C": "bench's -C is --config, llama.cpp's -C --cpu-mask",
}


@pytest.mark.parametrize("path,command,ctx", ARG_CPP_COMMANDS, ids=[p for p, _, _ in ARG_CPP_COMMANDS])
def test_a_llama_cpp_flag_is_taken_under_all_its_names(path, command, ctx):
    """A user's llama.cpp command line says --n-gpu-layers-draft or --gpu-layers-draft, -ngld or
    --spec-draft-ngl: a command that takes llama.cpp's flag takes each of its names."""
    names = {name for p in options(command, ctx) for name in (*p.opts, *p.secondary_opts)}
    for option in llama_flags.OPTIONS:
        for side in option:
            have = [name for name in side if name in names]
            if have and len(have) < len(side) and not any(name in NOT_ALL_NAMES for name in have):
                pytest.fail(f"{path} takes {have} but not {[n for n in side if n not in names]}")


@pytest.mark.parametrize("spelling", ["--n_predict", "--n-predict"])
def test_long_flags_may_be_spelt_with_underscores_as_in_llama_cpp(spelling):
    path, command, ctx = ALL[0]
    opts, order = parse(command, ctx, spelling, "5", "--spec_draft_n_max=4", "-sys", "be")
    assert opts == {"n_predict": "5", "draft_max": "4", "system_prompt": "be"}


# -- refused by name -----------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (("-i",), "-i is llama-completion's interactive mode, which speculate does not have: its conversation is "
              "llama-cli's (-cnv, the default on a terminal)"),
    (("-if",), "-if is llama-completion's interactive mode"),
    (("-p", "x", "-n16"), "no flag -n16: llama.cpp's flags take their value as the next argument: -n 16"),
    (("-p", "x", "-ngl=99"), "-ngl 99"),
    (("-p", "x", "-xyz"), "No such option: -xyz"),
    (("-p", "x", "--context_shift"), "--context-shift drops a conversation's oldest turns: it needs a conversation"),
    (("-cnv", "-no-cnv"), "give -cnv or -no-cnv, not both"),
    (("-st", "-no-cnv"), "-st is a conversation of one turn"),
    (("-cnv", "-p", "-"), "a conversation reads its messages from standard input"),
    (("-p", "x", "--mmproj", "m.gguf"), "--mmproj is for multimodal models"),
    (("-p", "x", "--host", "0.0.0.0"), "--host is a flag of `speculate serve`, `speculate rpc-server`, not of "
                                       "`speculate`"),
    (("-p", "x", "-lv", "3"), "-lv is a llama.cpp flag that `speculate` does not have"),
    (("models", "list", "-ngl", "3"), "-ngl is a flag of `speculate`"),
    (("serve", "-sys", "be brief"), "-sys is a flag of `speculate`, not of `speculate serve`"),
    (("batch", "--context-shift", "x.jsonl"), "--context-shift is llama.cpp's context shift within a request, "
                                              "which this command does not have"),
    (("serve", "-nocb"), "-nocb is"),
    (("serve", "--no-cont-batching"), "--no-cont-batching is"),
    (("serve", "--slot-save-path", "/tmp"), "--slot-save-path is for llama-server's slot files"),
    (("serve", "--embedding"), "--embedding is for embeddings and reranking"),
    (("serve", "--models-dir", "/tmp"), "--models-dir is llama-server's router mode"),
    (("serve", "--grp-attn-n", "4"), "--grp-attn-n is llama.cpp's self-extend"),
    (("-p", "x", "--spec-synth-len", "2", "--spec-synth-rates", "0.5"), "mutually exclusive"),
    (("-p", "x", "--spec-synth-rates", "0.5,x"), "--spec-synth-rates: expected comma-separated numbers"),
    (("serve", "--tools", "all"), "--tools is for llama-server's tools"),
    (("serve", "-mu", "http://x/m.gguf"), "-mu is llama.cpp's download of a model URL"),
])
def test_flags_a_command_lacks_are_refused_by_name_in_one_line(args, message):
    assert_refused(speculate_here(*args), message)


def test_every_refusal_is_of_a_llama_cpp_flag_some_command_lacks():
    """A refusal that names a flag llama.cpp does not have, or one every command takes, is dead text
    (--context-shift is the conversation's and serve's, and refused by the commands without one)."""
    taken = [{name for p in options(command, ctx) for name in (*p.opts, *p.secondary_opts)} for _, command, ctx in ALL]
    for flag in llama_flags.REFUSED:
        names = llama_flags.llama_names(flag)
        assert names, f"{flag} is not a flag of the pinned arg.cpp"
        assert any(not set(names) & own for own in taken), f"{flag} is refused, but every command takes it"


# -- llama.cpp's flags speculate takes ---------------------------------------------------------


def test_every_speculative_type_name_of_llama_cpp_is_taken():
    """common/speculative.cpp's names: speculate's own, or llama.cpp's name of one (draft-simple is
    draft), read as speculate's wherever a type is named: the flag, a request, bench's -C."""
    source = vendored("common/speculative.cpp").decode()
    table = source[source.index("common_speculative_type_from_name_map"):]
    names = re.findall(r'\{"([a-z0-9-]+)",\s*COMMON_SPECULATIVE_TYPE_', table[:table.index("};")])
    assert "draft-simple" in names and len(names) >= 10
    assert set(names) <= set(SPEC_TYPES) | set(ALIASES)
    assert canonical(("draft-simple", "ngram-simple")) == ("draft", "ngram-simple")
    assert replace(SpecSettings(), **speculation({"speculative.type": "draft-simple"})).types == ("draft",)
    assert [c.spec.types for c in make_configs(["draft-simple"], {}, SpecSettings())][1:] == [("draft",)]


@pytest.mark.parametrize("args, message", [
    (("--spec-type", "ngram-simple", "--spec-type", "eagle"), "unknown type eagle"),  # the second is read too
    (("--spec-type", "draft-simple", "--spec-type", "draft"), "names a type twice: draft,draft"),
    (("--mlock", "-lm", "mmap"), "-lm/--load-mode mmap and --mlock/--mmap/--no-mmap both say how the weights load"),
    (("-tb", "0"), "-tb/--threads-batch must be >= 1"),
    (("-tbd", "0"), "-tbd/--threads-batch-draft must be >= 1"),
    (("--chat-template", "llama9"), "--chat-template: neither one of llama.cpp's built-in formats (bailing,"),
    (("--chat-template", "{{ messages[0].content }}", "--no-jinja"),
     "--chat-template: llama.cpp's built-in chat formats do not recognise this chat template"),
    (("--chat-template", "chatml", "--chat-template-file", "t.jinja"), "give --chat-template or --chat-template-file"),
    (("--chat-template-file", "/nonexistent/t.jinja"), "cannot read --chat-template-file /nonexistent/t.jinja"),
    (("-sys", "be brief", "-sysf", "s.txt"), "give the system message with -sys or -sysf, not both"),
])
def test_llama_cpp_flags_are_checked_before_any_model_loads(args, message):
    assert_refused(speculate_here("-p", "x", "-m", "/nonexistent/model.gguf", *args), message)


@pytest.mark.parametrize("flags, mode", [
    ((), "auto"), (("--mlock",), "mmap+mlock"), (("--no-mmap",), "none"), (("--mmap",), "mmap"),
    (("--mlock", "--no-mmap"), "mlock"), (("--mlock", "--mmap"), "mmap+mlock"), (("-lm", "dio"), "dio"),
])
def test_older_llama_cpps_load_flags_are_the_load_modes_they_mean(flags, mode):
    path, command, ctx = ALL[0]
    opts, _ = parse(command, ctx, *flags)
    values = {"mlock": opts.get("mlock", False), "mmap": opts.get("mmap"), "load_mode": opts.get("load_mode", "auto")}
    assert memory.load_mode(ModelOptions(**values)) == mode


def test_builtin_chat_formats_are_llama_cpps():
    """--no-jinja formats as llama.cpp recognises the template; a format's name is that format."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chatml = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    jinja = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert format_chat("chatml", messages) == chatml == format_chat("chatml", messages, jinja=False)
    assert format_chat(jinja, messages) == chatml == format_chat(jinja, messages, jinja=False)
    assert format_chat("llama3", messages).startswith("<|start_header_id|>system<|end_header_id|>")
    check_template("gemma", jinja=True)
    check_template(jinja, jinja=False)


@pytest.mark.parametrize("args, message", [
    (("-p", ""), 'the prompt is empty (-p ""): give the text to generate from'),
    (("-f", "EMPTY"), "the prompt is empty (the prompt file EMPTY is empty)"),
    (("-p", "-"), "the prompt is empty (standard input gave nothing)"),
    (("-f", "-"), "the prompt is empty (standard input gave nothing)"),
])
def test_an_empty_prompt_exits_2_with_the_reason(tmp_path, args, message):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    args = tuple(str(empty) if a == "EMPTY" else a for a in args)
    assert_refused(speculate_here(*args, "-m", "/nonexistent/model.gguf"), message.replace("EMPTY", str(empty)))


def test_version_prints_speculates_and_llama_cpps_and_loads_no_model():
    proc = speculate_here("--version", "-m", "/nonexistent/model.gguf")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.decode().splitlines()
    assert re.fullmatch(r"speculate \S+", lines[0]), lines
    assert re.fullmatch(r"llama-cpp-python 0\.3\.36 \(libllama \S+, ggml \S+, commit \S+\)", lines[1]), lines


# -- serve and llama.cpp's server tests -----------------------------------------------------------


def server_test_flags() -> list[str]:
    """The flags llama.cpp's server tests start llama-server with (tools/server/tests/utils.py,
    ServerProcess.start)."""
    source = vendored("tools/server/tests/utils.py").decode()
    start = source[source.index("    def start("):]
    start = start[:start.index("\n    def ", 10)]
    return sorted(set(re.findall(r'"(--?[a-z][a-z0-9_-]*)"', start)))


def test_serve_takes_or_refuses_by_name_every_flag_of_llama_cpps_server_tests():
    """Accepted with llama-server's meaning, or refused with a reason of its own (not the generic
    'speculate serve does not have it'): never an unknown flag, nor a cluster of short ones."""
    path, command, ctx = next(item for item in ALL if item[0] == "speculate serve")
    flags = server_test_flags()
    assert {"--temp", "--seed", "--alias", "--n-predict", "--cont-batching", "--jinja", "--no-jinja",
            "--chat-template", "--reasoning-format", "--verbose", "--context-shift"} <= set(flags)
    names = {name for p in options(command, ctx) for name in (*p.opts, *p.secondary_opts)}
    for flag in flags:
        flag = flag.replace("_", "-") if flag.startswith("--") else flag
        if flag in names:
            continue
        reason = llama_flags.refusal(flag, path, {}, [])
        assert any(name in llama_flags.REFUSED for name in llama_flags.llama_names(flag)), f"{flag}: {reason}"


def test_the_usual_server_test_flags_parse_to_llama_servers_meaning():
    path, command, ctx = next(item for item in ALL if item[0] == "speculate serve")
    opts, _ = parse(command, ctx, "--temp", "0.8", "--seed", "42", "--no-jinja", "--alias", "x", "-n", "16", "-cb",
                    "--spec-type", "draft-simple", "--reasoning-format", "none", "--verbose", "--top-k", "5")
    assert opts == {"temp": "0.8", "seed": "42", "jinja": False, "alias": "x", "n_predict": "16",
                    "cont_batching": True, "spec_type": ["draft-simple"], "reasoning_format": "none",
                    "verbose": True, "top_k": "5"}


@pytest.mark.parametrize("args, message", [
    (("--reasoning-format", "deepseek-r1"), "--reasoning-format: one of auto, deepseek, deepseek-legacy, none"),
    (("-rea", "maybe"), "-rea/--reasoning: on, off or auto"),
    (("--reasoning-budget", "-2"), "--reasoning-budget: -1 (unrestricted) or more"),
    (("--chat-template-kwargs", "[1]"), "--chat-template-kwargs: must be a JSON object"),
    (("--chat-template-kwargs", "{x"), "--chat-template-kwargs: not JSON"),
])
def test_serve_refuses_bad_chat_flags(args, message):
    assert_refused(speculate_here("serve", "-m", "/nonexistent/model.gguf", *args), message)


# -- with a model -------------------------------------------------------------------------------

# the tiny model's 8 tokens spell only "hi", spaces and newlines (llama.cpp's tokenizer aborts on
# a character without a token): a template and messages of those
TINY_TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}hi{% endif %}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", chat_template=TINY_TEMPLATE))


def n_prompt(tiny: str, *args: str) -> int:
    # --ignore-eos: the random tiny model's greedy pick may be EOS, and which it is depends on the CPU
    return speculate_json("-m", tiny, "-p", "hi", "-n", "1", "--temp", "0", "--ignore-eos", "--spec-type", "none",
                          *args)["n_prompt"]


@pytest.mark.real
def test_a_system_message_turns_the_chat_template_on_as_in_llama_cli(tiny, tmp_path):
    """-sys without --chat was dropped (the prompt alone was generated from): it is a chat."""
    system = tmp_path / "system.txt"
    system.write_text("hi hi\n")
    plain, chat = n_prompt(tiny), n_prompt(tiny, "--chat", "-sys", "hi hi")
    assert chat > n_prompt(tiny, "--chat") > plain
    assert n_prompt(tiny, "-sys", "hi hi") == chat == n_prompt(tiny, "-sysf", str(system))
    # llama.cpp's own formatting recognises no format in this template: one line, exit 3
    proc = speculate("-m", tiny, "-p", "hi", "-n", "1", "-sys", "hi", "--no-jinja")
    assert proc.returncode == 3 and "do not recognise this chat template" in proc.stderr.strip(), proc.stderr


@pytest.mark.real
def test_threads_batch_reach_llama_cpps_context(tiny):
    """-tb sets llama.cpp's n_threads_batch (its batches: prompts, and the drafts verified)."""
    import llama_cpp as ll

    from speculative.decoding.settings import ModelSpec
    from speculative.llamacpp.model import LlamaModel

    for threads_batch, expected in ((None, 2), (1, 1)):
        with LlamaModel(ModelSpec(Path(tiny), "tiny", n_ctx=64, n_threads=2, n_threads_batch=threads_batch)) as model:
            assert (ll.llama_n_threads(model._ctx), ll.llama_n_threads_batch(model._ctx)) == (2, expected)
            assert ("threads_batch" in model.identity()) == (threads_batch is not None)


@pytest.mark.real
def test_verbose_shows_llama_cpps_log(tiny):
    quiet = speculate("-m", tiny, "-p", "hi", "-n", "1", "--spec-type", "none", env={"SPECULATE_LLAMA_LOG": ""})
    loud = speculate("-m", tiny, "-p", "hi", "-n", "1", "--spec-type", "none", "-v", env={"SPECULATE_LLAMA_LOG": ""})
    assert quiet.returncode == loud.returncode == 0, quiet.stderr + loud.stderr
    assert "llama_model_loader" not in quiet.stderr and "llama_model_loader" in loud.stderr
