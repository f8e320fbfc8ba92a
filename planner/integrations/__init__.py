"""Integrations with training frameworks (optional dependencies, imported only when used)."""
