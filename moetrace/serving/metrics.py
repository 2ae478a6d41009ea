"""The proxy's metrics in Prometheus text exposition format (version 0.0.4), standard library only.

``ProxyMetrics`` counts what the router does not (requests by endpoint and status, retries, broken
streams, engine errors) and times each decision; ``render`` writes it together with the router's own
``stats()`` (decisions per rank, fallbacks by reason, in flight per rank) and the live ranks.
Not thread-safe: the proxy updates it from its event loop only.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

__all__ = ["DECISION_BUCKETS_S", "Histogram", "ProxyMetrics"]

#: upper bounds of the decision-latency histogram, seconds
DECISION_BUCKETS_S: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class Histogram:
    """A cumulative histogram over fixed upper bounds (seconds)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last: over every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.9g}")
        out.append(f"{name}_count {self.count}")
        return out


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


class ProxyMetrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, HTTP status to the client)
        self.retries: Counter[str] = Counter()  # hop ("prefill"/"decode") retried on another server or rank
        self.engine_errors: Counter[tuple[str, str]] = Counter()  # (hop, kind) an engine failed
        self.streams_broken = 0  # streams cut after their first byte (ended with an error event)
        self.decision = Histogram(DECISION_BUCKETS_S)  # reading the routed experts + ExpertRouter.route

    def render(self, stats: dict[str, Any], live_ranks: list[bool]) -> str:
        p = "moetrace_proxy"
        out = [
            f"# HELP {p}_requests_total Requests answered, by endpoint and HTTP status.",
            f"# TYPE {p}_requests_total counter",
        ]
        out += [f'{p}_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())]
        out += [
            f"# HELP {p}_decisions_total Requests sent to each decode DP rank (routed and fallback).",
            f"# TYPE {p}_decisions_total counter",
        ]
        out += [f'{p}_decisions_total{{rank="{a}"}} {n}' for a, n in enumerate(stats["decisions_per_rank"])]
        out += [
            f"# HELP {p}_fallbacks_total Decisions the fallback (least-loaded live rank) took, by reason.",
            f"# TYPE {p}_fallbacks_total counter",
        ]
        out += [f'{p}_fallbacks_total{{reason="{_label(r)}"}} {n}' for r, n in sorted(stats["fallbacks"].items())]
        out += [
            f"# HELP {p}_inflight Requests in flight per decode DP rank.",
            f"# TYPE {p}_inflight gauge",
        ]
        out += [f'{p}_inflight{{rank="{a}"}} {n}' for a, n in enumerate(stats["inflight_per_rank"])]
        out += [
            f"# HELP {p}_rank_up Whether a decode DP rank takes requests (1) or is down (0).",
            f"# TYPE {p}_rank_up gauge",
        ]
        out += [f'{p}_rank_up{{rank="{a}"}} {int(v)}' for a, v in enumerate(live_ranks)]
        out += [
            f"# HELP {p}_retries_total Hops sent again to another server or rank before any byte reached the client.",
            f"# TYPE {p}_retries_total counter",
        ]
        out += [f'{p}_retries_total{{hop="{h}"}} {n}' for h, n in sorted(self.retries.items())]
        out += [
            f"# HELP {p}_engine_errors_total Engine replies that failed, by hop and kind.",
            f"# TYPE {p}_engine_errors_total counter",
        ]
        out += [
            f'{p}_engine_errors_total{{hop="{h}",kind="{_label(k)}"}} {n}'
            for (h, k), n in sorted(self.engine_errors.items())
        ]
        out += [
            f"# HELP {p}_streams_broken_total Streams cut after their first byte (ended with an error event).",
            f"# TYPE {p}_streams_broken_total counter",
            f"{p}_streams_broken_total {self.streams_broken}",
            f"# HELP {p}_decision_seconds Time to read a prefill's routed experts and pick the decode rank.",
            f"# TYPE {p}_decision_seconds histogram",
        ]
        out += self.decision.lines(f"{p}_decision_seconds")
        return "\n".join(out) + "\n"
