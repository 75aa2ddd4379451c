"""The package version (one place; read by provenance and export without importing the package)."""

__version__ = "0.1.0"
