"""Percentiles and summaries of samples (seconds, bytes, anything)."""

from __future__ import annotations

import math
import statistics


def percentile(samples: list[float], p: float) -> float:
    """The p-th percentile (p in 0..100), interpolating linearly between the closest ranks
    (numpy's default). NaN for no samples."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summary(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"n": 0}
    return {
        "n": len(samples),
        "min": min(samples),
        "p50": percentile(samples, 50),
        "p95": percentile(samples, 95),
        "p99": percentile(samples, 99),
        "max": max(samples),
        "mean": statistics.fmean(samples),
    }
