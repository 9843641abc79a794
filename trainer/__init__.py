"""Nightshift trainer stage (not built yet: see the issue tracker)."""
