"""The command line, `speculate`: the Typer app over the library.

Its modules live in the repository's top-level cli/ folder. A built wheel installs them here,
as speculative/cli, in place of this file; in a source checkout (or an editable install) this
package reads them from cli/, so `speculative.cli.main` is the same module either way.
"""

from pathlib import Path

__path__.append(str(Path(__file__).resolve().parents[2] / "cli"))  # noqa: F821 (a package's __path__)
