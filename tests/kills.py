"""Kill injection into ``moetrace.atomic``'s replacing writers, shared by tests/test_replace_kills.py and
tests/test_hostile_round5.py.

A kill is simulated by raising ``Killed`` (a ``BaseException`` no handler catches) at step *i* and at
every later step of the same kind (a dead process does nothing more): the exchange (``die_at_exchange``),
each rename of the two-rename fallback (``DyingOs``, with ``no_exchange``), the removal of the old folder
(``die_at_rmtree``).

A helper module, not a test module: test modules import from here (``from kills import ...``), never from
each other.
"""

from __future__ import annotations

import os
import shutil

from moetrace import atomic


class Killed(BaseException):
    """The process died here (no handler runs anything more of the swap)."""


class DyingOs:
    """``os`` for moetrace.atomic whose ``rename`` dies from call ``at`` on (1-based)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __getattr__(self, name: str):
        return getattr(os, name)

    def rename(self, a, b) -> None:
        self.calls += 1
        if self.calls >= self.at:
            raise Killed(f"killed at rename {self.calls}")
        os.rename(a, b)


class DyingShutil:
    """``shutil`` for moetrace.atomic whose ``rmtree`` dies."""

    def __getattr__(self, name: str):
        return getattr(shutil, name)

    def rmtree(self, *_a, **_k) -> None:
        raise Killed("killed while removing the old folder")


def die_at_rmtree(monkeypatch) -> None:
    """The removal of the old folder (after the swap) dies."""
    monkeypatch.setattr(atomic, "shutil", DyingShutil())


def no_exchange(monkeypatch) -> None:
    """The file system cannot exchange: the two-rename fallback runs."""
    monkeypatch.setattr(atomic, "exchange_paths", lambda a, b: False)


def die_at_exchange(monkeypatch) -> None:
    """The exchange itself dies (before it is made)."""

    def exchange(a, b):
        raise Killed("killed at the exchange")

    monkeypatch.setattr(atomic, "exchange_paths", exchange)
