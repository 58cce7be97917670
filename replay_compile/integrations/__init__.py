"""Integrations with model libraries (imported lazily, only when that library is in use)."""
