"""Byte accounting shared by the quantized collectives.

Each collective owns one :class:`CommStats` and records, per call, the bytes *this rank* puts on the wire
for each level of the collective (e.g. ``"intra"``/``"inter"`` for the gradient reduce-scatter, any other
name for the weight all-gather), plus what the uncompressed collective it replaces would have sent
(``baseline_bytes``), so that the compression ratio is measured rather than assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict


@dataclass
class CommStats:
    """Cumulative and last-call byte counts of one collective on one rank.

    Attributes:
        bytes_by_level: total bytes sent per level name since the last :meth:`reset`.
        values_by_level: total values (elements, padding included) those bytes carried, per level; lets a
            caller report bits per value (``8 * bytes / values``).
        baseline_bytes: total bytes the replaced uncompressed collective would have sent.
        calls: number of collective calls recorded (:meth:`begin_call`).
        last_call: bytes per level of the most recent call only.
        last_baseline_bytes: ``baseline_bytes`` of the most recent call only.
    """

    bytes_by_level: Dict[str, int] = field(default_factory=dict)
    values_by_level: Dict[str, int] = field(default_factory=dict)
    baseline_bytes: int = 0
    calls: int = 0
    last_call: Dict[str, int] = field(default_factory=dict)
    last_baseline_bytes: int = 0

    def begin_call(self) -> None:
        """Start recording a new collective call (clears the last-call counters)."""
        self.calls += 1
        self.last_call = {}
        self.last_baseline_bytes = 0

    def add(self, level: str, nbytes: int, values: int = 0) -> None:
        """Record ``nbytes`` sent at ``level`` carrying ``values`` elements (both non-negative ints)."""
        if not isinstance(level, str) or not level:
            raise ValueError(f"level must be a non-empty string, got {level!r}")
        nbytes, values = int(nbytes), int(values)
        if nbytes < 0 or values < 0:
            raise ValueError(f"nbytes and values must be >= 0, got {nbytes} and {values}")
        self.bytes_by_level[level] = self.bytes_by_level.get(level, 0) + nbytes
        self.values_by_level[level] = self.values_by_level.get(level, 0) + values
        self.last_call[level] = self.last_call.get(level, 0) + nbytes

    def add_baseline(self, nbytes: int) -> None:
        """Record what the uncompressed collective would have sent for this call."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.baseline_bytes += nbytes
        self.last_baseline_bytes += nbytes

    @property
    def total_bytes(self) -> int:
        """Bytes sent over all levels."""
        return sum(self.bytes_by_level.values())

    def bits_per_value(self, level: str) -> float:
        """Average wire bits per value carried at ``level`` (0.0 if nothing was recorded)."""
        v = self.values_by_level.get(level, 0)
        return 8.0 * self.bytes_by_level.get(level, 0) / v if v else 0.0

    def reset(self) -> None:
        """Zero every counter."""
        self.bytes_by_level = {}
        self.values_by_level = {}
        self.baseline_bytes = 0
        self.calls = 0
        self.last_call = {}
        self.last_baseline_bytes = 0

    def as_dict(self) -> Dict[str, object]:
        """A plain, JSON-serialisable snapshot (copies of the dicts)."""
        total = self.total_bytes
        return {
            "calls": self.calls,
            "bytes_by_level": dict(self.bytes_by_level),
            "values_by_level": dict(self.values_by_level),
            "total_bytes": total,
            "baseline_bytes": self.baseline_bytes,
            "last_call": dict(self.last_call),
            "last_baseline_bytes": self.last_baseline_bytes,
            "compression": (self.baseline_bytes / total) if total else None,
        }
