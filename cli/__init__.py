"""The ``sparse-scan`` command line, installed as :mod:`sparse_scan.cli`.

A thin click application: commands parse their input, call the library and print or write results.
No algorithm lives here. The entry point is :func:`sparse_scan.cli.app.main`.
"""
