"""Rounds of a benchmark -> median and spread, and whether the rounds disagree more than the ranking they decide.

Every benchmark of the project repeats its candidates in interleaved rounds and reports each candidate's median
round (the lower middle for an even count, so it is always a round that ran) with the spread: min..max and
(max - min) / median.

Example:
    >>> stats = summarize([90.0, 110.0, 100.0])
    >>> stats.median, stats.low, stats.high, stats.spread
    (100.0, 90.0, 110.0, 0.2)
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class RoundStats:
    """Median, minimum and maximum of a candidate's rounds."""

    median: float
    low: float
    high: float
    rounds: int

    @property
    def spread(self) -> float:
        """(max - min) / median; 0 for a zero median."""
        return round((self.high - self.low) / self.median, 4) if self.median else 0.0

    def describe(self, digits: int = 0) -> str:
        """"100 (90..110, spread 20.0%)".

        Example:
            >>> summarize([90.0, 110.0, 100.0]).describe()
            '100 (90..110, spread 20.0%)'
        """
        return (f"{self.median:.{digits}f} ({self.low:.{digits}f}..{self.high:.{digits}f}, "
                f"spread {100 * self.spread:.1f}%)")


def median_index(values: Sequence[Optional[float]]) -> Optional[int]:
    """Index of the median round among the values that are not None (the lower middle for an even count), or
    None when there is none.

    Example:
        >>> median_index([None, 600.0, 800.0])
        1
    """
    measured = sorted((value, index) for index, value in enumerate(values) if value is not None)
    return measured[(len(measured) - 1) // 2][1] if measured else None


def summarize(values: Sequence[Optional[float]]) -> RoundStats:
    """The median round, min and max of `values` (None entries, failed rounds, are left out).

    Example:
        >>> summarize([3.0, None, 1.0, 2.0, 4.0]).median
        2.0
    """
    measured = [value for value in values if value is not None]
    if not measured:
        raise ValueError(f"summarize needs at least one measured round. Received: {list(values)!r}")
    return RoundStats(median=values[median_index(values)], low=min(measured), high=max(measured),
                      rounds=len(measured))


def overlap_warning(stats: Mapping[str, RoundStats]) -> Optional[str]:
    """A warning when rounds disagree more than the differences being ranked: the candidates, ordered by median,
    whose neighbours' min..max ranges overlap theirs (their order could flip in another run); None when every
    neighbour pair is separated (or there is one candidate).

    Example:
        >>> overlap_warning({"a": summarize([100.0, 104.0]), "b": summarize([102.0, 108.0]),
        ...                  "c": summarize([200.0, 201.0])}).split(":")[1]
        ' b (102..108) and a (100..104) overlap; more rounds or steps would settle their order'
    """
    ranked = sorted(((s.median, name) for name, s in stats.items() if s.rounds > 1), reverse=True)
    pairs = []
    for (_, upper), (_, lower) in zip(ranked, ranked[1:]):
        if stats[upper].low <= stats[lower].high:
            pairs.append(f"{upper} ({stats[upper].low:.0f}..{stats[upper].high:.0f}) and {lower} "
                         f"({stats[lower].low:.0f}..{stats[lower].high:.0f})")
    if not pairs:
        return None
    return (f"rounds disagree more than the medians differ: {'; '.join(pairs)} overlap; more rounds or steps would "
            f"settle their order")
