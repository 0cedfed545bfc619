"""``python -m sparse_scan.cli``: the ``sparse-scan`` command without its console script."""

from .app import main

main(prog_name="sparse-scan")
