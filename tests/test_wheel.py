"""The wheel installs one package, `speculative`, with the command line inside it.

Built here without the network (hatchling from the test extra, --no-build-isolation), then
unpacked and run: no generic top-level name such as `cli` lands in site-packages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", str(ROOT), "-w", str(out)], check=True, capture_output=True, timeout=600)
    (built,) = out.glob("speculate-*.whl")
    return built


def test_the_wheel_has_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"speculative"}
    assert "speculative/models.toml" in names
    # cli/ is installed as speculative/cli, its own __init__ in place of the checkout's bridge
    cli = sorted(p.name for p in (ROOT / "cli").glob("*.py"))
    assert sorted(n.removeprefix("speculative/cli/") for n in names if n.startswith("speculative/cli/")) == cli
    assert (zipfile.ZipFile(wheel).read("speculative/cli/__init__.py")
            == (ROOT / "cli" / "__init__.py").read_bytes())
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "speculate = speculative.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_unpacked_wheel_runs_its_own_command_line(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    script = ("import sys, speculative.cli.main as m\n"
              "print(m.__file__)\n"
              "sys.argv = ['speculate', 'models', 'list']\n"
              "m.main()\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(tmp_path / "site"), "SPECULATE_HOME": str(tmp_path / "home"),
                              "PATH": "/usr/bin:/bin", "COLUMNS": "300"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == str(tmp_path / "site" / "speculative" / "cli" / "main.py")
    assert "qwen2.5-coder-1.5b-instruct" in run.stdout  # the registry shipped inside the package
