"""Byte counts for people: one formatter for every message and report line."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; whole bytes below 1 KiB, binary units above."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
