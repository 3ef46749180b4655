"""What every benchmark scenario shares, written once: its command line, the processes it runs,
its repeats and baseline, the models it loads, the prompts it sends, and the file it writes.

- **The command.** `parser(__name__, __doc__)` names a scenario `python -m scripts.bench NAME`, and
  `parse(parser, argv)` keeps what it was given for the results' meta.
- **Repeats interleaved.** `interleaved(configs, repeats)` runs every configuration once per
  repeat, so that drift hits all alike; `rotate=True` also moves which one goes first.
- **The same-run baseline.** `ratio(value, baseline)`: a figure is published against one measured
  in the same run, on the same machine, never against a number kept from elsewhere.
- **Processes.** `speculate(given)` is the executable; `run_json` runs a command whose standard
  output is one JSON document (`speculate ... --json`, a scenario run by another); `run_logged`
  runs one in a fresh process, its output in a log, with its peak resident memory; either exits
  naming the command, its status and the end of its output where it fails (`failed`).
- **Models through the binding.** `model_file(name)` resolves a registry name as speculate does;
  `load(path, ...)` loads through `speculative.llamacpp` (weights where its CPU kernels run: on an
  AMX CPU, llama.cpp's defaults put them in a buffer type that crashes a batch on the pinned
  build); `llama_log()` captures what llama.cpp logs meanwhile.
- **Results.** `meta(**extra)` is when, where and how a run ran; `write(path, data)` writes
  `{"meta": ..., ...}` as JSON, gzipped when the name ends in `.gz`, so that `-o
  docs/results/NAME.json.gz` is the committed file that scripts/tables.py renders.

Nothing here imports the binding until a model is loaded, so `--help` needs no llama.cpp.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence, TypeVar

if TYPE_CHECKING:
    from speculative.llamacpp.model import LlamaModel

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "scripts" / "prompts.jsonl"
T = TypeVar("T")

# -- the command -----------------------------------------------------------------------------

_ran: list[str] = []  # the command line parse() was given, for meta()


def scenario(module: str) -> str:
    """A scenario's name on the command line: its module's, with dashes (scripts.bench.cache_ram: cache-ram)."""
    return module.rsplit(".", 1)[-1].replace("_", "-")


def parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """A scenario's parser: `python -m scripts.bench NAME`, its docstring's first paragraph as
    the description and the rest after the options."""
    head, _, rest = (doc or "").strip().partition("\n\n")
    return argparse.ArgumentParser(prog=f"python -m scripts.bench {scenario(module)}", description=head,
                                   epilog=rest or None, formatter_class=argparse.RawDescriptionHelpFormatter)


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None, known: bool = False):
    """p's arguments from argv (None: this process's); known=True also returns what p does not
    know, and everything after a `--`, for flags passed on to speculate."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _ran[:] = [*p.prog.split(), *argv]
    if not known:
        return p.parse_args(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = p.parse_known_args(argv[:cut])
    return args, [*extra, *argv[cut + 1:]]


def add_output(p: argparse.ArgumentParser, what: str = "every run's figures") -> None:
    p.add_argument("-o", "--output", type=Path,
                   help=f"write {what} here (JSON with meta; gzipped when the name ends in .gz)")


def add_threads(p: argparse.ArgumentParser, default: int | None = None) -> None:
    p.add_argument("-t", "--threads", type=int, default=default or len(os.sched_getaffinity(0)),
                   help="CPU threads, every tool (default: %(default)s)")


def add_speculate(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--speculate", default=default,
                   help="the speculate executable (default: " + (default or "beside this Python, else on PATH") + ")")


# -- processes ---------------------------------------------------------------------------------


def speculate(given: str | None = None, venv: Path | None = None) -> str:
    """The `speculate` command: `given`, else the one of the virtual environment `venv`, else the
    one beside this Python, else on PATH; a one-line exit where there is none."""
    if venv is not None:
        executable = Path(venv) / "bin" / "speculate"
        if not os.access(executable, os.X_OK):
            sys.exit(f"{venv}: no speculate installed in it ({executable})")
        return str(executable)
    if given:
        if not os.access(given, os.X_OK):
            sys.exit(f"{given}: not an executable (--speculate)")
        return given
    beside = Path(sys.executable).with_name("speculate")
    found = str(beside) if beside.exists() else shutil.which("speculate")
    return found or sys.exit("speculate is not installed beside this Python nor on PATH")


def python_of(speculate_path: str) -> str:
    """The Python of the environment a speculate executable belongs to (its build of llama.cpp)."""
    beside = Path(speculate_path).with_name("python")
    return str(beside) if beside.exists() else sys.executable


def failed(cmd: Sequence[str], code: int, output: str) -> None:
    """Exit with what failed: the command, its status and the end of its output."""
    sys.exit(f"{' '.join(map(str, cmd))} exited {code}:\n{output[-3000:]}")


def run_json(cmd: Sequence[str], *, input: str | None = None, env: dict | None = None, cwd: Path | None = None):
    """A command whose standard output is one JSON document, run to its end and parsed; its
    standard error is kept in the exit message where it fails."""
    proc = subprocess.run(list(map(str, cmd)), input=input, capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode:
        failed(cmd, proc.returncode, proc.stderr)
    try:
        return json.loads(proc.stdout)
    except ValueError:
        failed(cmd, 0, f"not JSON on its standard output: {proc.stdout[:300]}\n{proc.stderr}")


def run_logged(cmd: Sequence[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> float:
    """A command in a fresh process, its output in `log`, to its end: its peak resident MiB
    (wait4's ru_maxrss); a one-line exit where it fails."""
    with open(log, "wb") as sink:
        proc = subprocess.Popen(list(map(str, cmd)), stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # interrupted or terminated: the run does not go on without us
            proc.kill()
            proc.wait()
            raise
    code = os.waitstatus_to_exitcode(status)
    if code:
        failed(cmd, code, log.read_text(errors="replace"))
    return usage.ru_maxrss / 1024


def peak_rss_mib(pid: int) -> float | None:
    """A live process's peak resident memory (VmHWM), in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


# -- repeats and baselines ---------------------------------------------------------------------


def interleaved(configs: Sequence[T], repeats: int, rotate: bool = False) -> Iterator[tuple[int, T]]:
    """(repeat, configuration): every configuration once per repeat, so drift hits all alike; with
    rotate, repeat r starts at configuration r (each takes each place in turn)."""
    for repeat in range(repeats):
        shift = repeat % len(configs) if rotate and configs else 0
        for config in [*configs[shift:], *configs[:shift]]:
            yield repeat, config


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value over a baseline measured in the same run (None where either is missing or it is 0)."""
    return value / baseline if value is not None and baseline else None


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def percentile(values: Sequence[float], q: int) -> float:
    values = list(values)
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


# -- models -------------------------------------------------------------------------------------


def model_file(model: str | None, speculate: str | None = None) -> Path:
    """A GGUF path: `model` itself if it is a file, else the registry's file of that name, pulled
    first if it is not there yet, as speculate resolves -m (None: the registry's default target);
    a one-line exit where it is not known. With `speculate`, that executable says where (`speculate
    models path`), so a scenario run by any Python finds what the build it measures would load."""
    if model and Path(model).is_file():
        return Path(model)
    if speculate:
        proc = subprocess.run([speculate, "models", "path", *([model] if model else [])], capture_output=True,
                              text=True)
        if proc.returncode:
            sys.exit(f"{model}: not a file, and `speculate models path` says: {proc.stderr.strip()}")
        return Path(proc.stdout.strip())
    from speculative.errors import SpeculateError
    from speculative.models.pull import pull
    from speculative.models.registry import Registry, resolve

    try:
        registry = Registry.load()
        return resolve(model or registry.default_target, registry, pull)[0]
    except SpeculateError as e:
        sys.exit(f"-m {model}: {e}")


def load(path: Path, **spec) -> "LlamaModel":
    """A model loaded through the binding, as speculate loads it; `spec`: ModelSpec's fields
    (n_ctx, n_threads, n_slots, ...)."""
    from speculative.decoding.settings import ModelSpec
    from speculative.llamacpp.model import LlamaModel

    return LlamaModel(ModelSpec(Path(path), spec.pop("name", Path(path).stem), **spec))


@contextlib.contextmanager
def llama_log() -> Iterator[list[str]]:
    """What llama.cpp logs (SPECULATE_LLAMA_LOG=1, on file descriptor 2) inside the block: the
    list it yields holds that text once the block ends."""
    captured: list[str] = []
    with tempfile.TemporaryFile() as log:
        saved, before = os.dup(2), os.environ.get("SPECULATE_LLAMA_LOG")
        os.environ["SPECULATE_LLAMA_LOG"] = "1"
        sys.stderr.flush()
        os.dup2(log.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if before is None:
                os.environ.pop("SPECULATE_LLAMA_LOG")
            else:
                os.environ["SPECULATE_LLAMA_LOG"] = before
            log.seek(0)
            captured.append(log.read().decode(errors="replace"))


# -- prompts --------------------------------------------------------------------------------------


def jsonl(path: Path, numbered: bool = False) -> list:
    """The rows of a JSON-lines file, blank lines skipped (numbered: (line number, row) pairs, for
    messages that name a line); ValueError names the line that is not JSON."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append((number, json.loads(line)) if numbered else json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e})") from None
    return rows


def by_ids(items: list[dict], ids: Sequence[str] | None, what: str, path: Path) -> list[dict]:
    """The items with these ids, in the order asked (None: all); ValueError names what is missing."""
    if ids is None:
        return items
    known = {item["id"]: item for item in items}
    missing = [i for i in ids if i not in known]
    if missing:
        raise ValueError(f"no {what} {', '.join(missing)} in {path}; there are: {', '.join(known)}")
    return [known[i] for i in ids]


# -- results ------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str | None:
    """The repository's commit, with '+' when the working tree differs from it."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


def meta(**extra) -> dict:
    """The date, the command line, the machine and the commit; plus `extra`."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": _ran or [Path(sys.argv[0]).as_posix(), *sys.argv[1:]],
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "commit": commit(),
        **extra,
    }


def write(path: Path, data: dict) -> None:
    """`data` as JSON at `path` (gzipped when it ends in .gz), through a file beside it renamed at
    the end, so that a run stopped midway leaves what was there before."""
    text = json.dumps(data, indent=1, ensure_ascii=False).encode()
    if path.name.endswith(".gz"):
        text = gzip.compress(text, compresslevel=9, mtime=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(text)
    partial.replace(path)
