"""The package version, in a module of its own so that core modules can read it without importing
the package root (which imports them: a cycle)."""

__version__ = "0.1.0"
