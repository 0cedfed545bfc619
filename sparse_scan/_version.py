"""The package version, read by setup.cfg and ``sparse-scan --version``."""

__version__ = "0.1.0"
