"""The ``sparse-scan`` click group.

Subcommands are registered on :data:`main` with ``@main.command()`` (or ``main.add_command``) in
later modules; each one only reads its input, calls :mod:`sparse_scan` and prints the result.

Examples
--------
>>> from click.testing import CliRunner
>>> from sparse_scan import __version__
>>> result = CliRunner().invoke(main, ["--version"])
>>> result.output == f"sparse-scan {__version__}\\n"
True
"""

from __future__ import annotations

import click

from sparse_scan import __version__

__all__ = ["main"]

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(
    __version__, "--version", prog_name="sparse-scan", message="%(prog)s %(version)s"
)
def main() -> None:
    """Back-propagation as a parallel scan (BPPSA) over sparse transposed Jacobians.

    The engine's foundation is in place: layers whose transposed Jacobians are generated
    analytically in CSR, on the CPU (NumPy/SciPy) or the GPU (CuPy RawKernels). Commands that
    run a model, the scan and FLOP analysis come in later releases; use the Python library
    (import sparse_scan) meanwhile.
    """


if __name__ == "__main__":  # pragma: no cover - `python -m sparse_scan.cli.app`
    main()
