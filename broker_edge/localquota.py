"""Local quota enforcement: an edge stops a tenant at its daily limit by itself (issue 14).

Theory of operation
-------------------
The pipeline is the one authority on a tenant's day totals across all edges, but it learns of
a publish one reaction time late (the next counter record, then a micro-batch): at 1,000
msgs/s a tenant got ~2,300 messages past a 2,000 limit before the pipeline's ``blocked``
decision reached the edge. So each edge also counts for itself, and refuses the tenant's
publishes (the refusals of a ``blocked`` decision) as soon as its estimate of the day total
reaches a limit.

**Confirmed totals.** With every batch that moved a tenant, with every decision, and between
batches for a tenant past half a limit, the pipeline sends each edge the tenant's day totals as
it has counted them (``usage`` plus the journaled counter records it does not hold yet), *split
by node* (``schemas.control.ConfirmedUsage`` on ``$control/usage/{tenant}``, retained): a node's
part is the sum of that node's counter deltas counted for the day. The split is what makes adding
the edge's own count sound: the edge replaces its own part by what it counted itself, and
adds only the other nodes' confirmed parts::

    estimate = others + max(own_count, own_confirmed)

``others`` = the day total minus this node's part; ``own_count`` = what this edge process
accepted for the tenant since the start of the UTC day (or since it started); ``own_confirmed``
= this node's part. Every message this node counted for the day is in ``own_count`` unless the
process restarted during the day, and the lake never holds more of this node than it accepted,
so ``max`` is exact without a restart and never counts a message twice with one (after a
restart the lake's part covers what the previous process accepted; what the new one accepted
and the lake does not hold yet is missing until it does, at most one reaction time's worth).
So ``estimate`` is never more than the true day total: the edge never stops a tenant that the
pipeline would not block (the pipeline decides on the same totals, later).

No per-node seq is needed: a counter record belongs to one node and the lake adds it once
(its ``(node, seq)`` and the usage merge's batch transaction), so "the node's part" and "what
the node counted up to its last committed record" are the same number.

**Multi-edge bound.** Each edge sees the others' traffic only through the confirmed totals, one
reaction time late; the tenant can overshoot by what the *other* edges accept during that
time, while the local traffic is stopped within a message. The reaction time starts with the
counter record that carries a node's count to the pipeline, so a node does not wait for its
counter interval (2 s by default) when a tenant's day moves fast: each time its own count of
the day passes another 1/:data:`REPORT_STEPS` of a limit, it reports the tenant's counters at
once (:func:`report_points`; at most ``REPORT_STEPS`` extra records per tenant, metric and day).

**Limits.** The edge reads them from its own tenants file (``--tenants``, the file the pipeline
reads) and from the confirmed totals, and uses the larger of the two (no limit is the largest):
a raised limit lifts a local block as soon as either side has it (SIGHUP on the edge, or the
pipeline's next message); a lowered one applies locally once both have it (the pipeline's
``blocked`` decision enforces it meanwhile, as before).

**Day.** UTC, as the pipeline's: at midnight the edge starts a new day count and forgets the old
day's confirmed totals (a confirmed total of another day is ignored). The pipeline files a
counter interval under the day its end falls in, so the first interval after midnight may carry
a few seconds of the old day into the new one; ``max`` then picks the lake's figure, which is
the one the pipeline decides with.

**Hot path.** For each tenant the edge keeps, in its :class:`~broker_edge.plim.TenantUsage`,
the running totals at which it looks again (``check_messages_in``, ``check_bytes_in``: the
stop, or the next report point if that comes first; the largest int when there is nothing to
stop at); a publish costs the counter adds it always had and a compare each. The thresholds are
recomputed when a publish reaches one, and when a confirmed total, a limit or the day changes.

The pipeline's decisions still rule: a ``blocked`` decision blocks whatever the local count, and
a local block ends only with a new day, a raised limit or confirmed totals under the limit.
Pure: values in, values out; :class:`~broker_edge.tenancy.Tenancy` keeps the state.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from broker_edge.plim import TenantUsage
from broker_edge.tenants import Limits
from schemas.control import ConfirmedUsage
from schemas.names import QUOTA_METRICS

NEVER = sys.maxsize
"""A stop no running total reaches: nothing to stop at."""

REPORT_STEPS = 20
"""A node reports a tenant's counters at once each time its own count of the day passes
another 1/REPORT_STEPS of a limit (every 5 %), besides every counter interval."""


def until_midnight(now_us: int) -> float:
    """Seconds from ``now_us`` (wall clock, µs since the epoch) to the next UTC midnight."""
    now = datetime.fromtimestamp(now_us / 1e6, UTC)
    midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC)
    return (midnight - now).total_seconds()


@dataclass(slots=True)
class DayCount:
    """One tenant's day on this edge: where its running totals stood when the day (or the
    process) started, and the pipeline's confirmed totals of that day, if any."""

    day: date
    base: dict[str, int]  # counter metric -> the running total at the day's start
    confirmed: ConfirmedUsage | None = None

    @classmethod
    def starting(cls, day: date, usage: TenantUsage) -> DayCount:
        return cls(day, {counter: getattr(usage, counter) for counter in QUOTA_METRICS.values()})


@dataclass(frozen=True, slots=True)
class Reached:
    """A limit the estimate reached: the quota metric, its limit and the estimate."""

    metric: str
    limit: int
    value: int
    confirmed: int | None  # the day total the pipeline confirmed (None: none yet)


def effective_limit(own: int | None, confirmed: ConfirmedUsage | None, metric: str) -> int | None:
    """The larger of the tenants file's limit and the pipeline's (None, no limit, is larger)."""
    if confirmed is None or metric not in confirmed.limits:
        return own
    theirs = confirmed.limits[metric]
    return None if own is None or theirs is None else max(own, theirs)


def stops(
    node: str, usage: TenantUsage, count: DayCount, limits: Limits
) -> tuple[dict[str, int], Reached | None]:
    """The running totals at which the tenant is stopped (counter metric -> total; ``NEVER``:
    not stopped), and the first limit its estimate has reached already (None: none)."""
    confirmed = count.confirmed
    out: dict[str, int] = {}
    reached: Reached | None = None
    for metric, counter in QUOTA_METRICS.items():
        limit = effective_limit(getattr(limits, metric), confirmed, metric)
        if limit is None:
            out[counter] = NEVER
            continue
        own, others = confirmed.own_and_others(counter, node) if confirmed else (0, 0)
        room = limit - others  # what this node may count today
        base = count.base[counter]
        # max(counted, own) >= room: counted >= room, or the lake's part of this node fills it.
        stop = base + room if own < room else -1
        out[counter] = stop
        current = getattr(usage, counter)
        if reached is None and current >= stop:
            value = others + max(current - base, own)
            total = (
                confirmed.totals[counter][0] if confirmed and counter in confirmed.totals else None
            )
            reached = Reached(metric, limit, value, total)
    return out, reached


def report_points(usage: TenantUsage, count: DayCount, limits: Limits) -> dict[str, int]:
    """The running totals at which the tenant's counters are next reported early (counter
    metric -> total; ``NEVER``: no limit, nothing to hurry for): the next multiple of
    1/:data:`REPORT_STEPS` of the limit in this node's count of the day."""
    out: dict[str, int] = {}
    for metric, counter in QUOTA_METRICS.items():
        limit = effective_limit(getattr(limits, metric), count.confirmed, metric)
        if not limit:  # none, or 0 (which blocks at once)
            out[counter] = NEVER
            continue
        step = -(-limit // REPORT_STEPS)
        base = count.base[counter]
        out[counter] = base + ((getattr(usage, counter) - base) // step + 1) * step
    return out
