"""Nightshift transform stage (not built yet: see the issue tracker)."""
