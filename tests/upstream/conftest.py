"""Vendored upstream test code: imported by tests/test_upstream_*.py, never collected."""

collect_ignore_glob = ["*"]
