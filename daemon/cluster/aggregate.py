"""The cluster's engine views made from every replica's own: totals plus a per-replica list (no Ray here).

Each function takes what the replicas' daemons answered, keyed by replica id,
and returns what the ingress answers.
"""

from __future__ import annotations

import re
from collections import Counter

from minibatch.daemon.monitor import COMPACT, EVENT_SUMMED, MEANS, STATS_SUMMED

# what adds up over replicas, and each replica's compact line: the monitor's definitions, derived from the
# engine's stats dataclasses
SUMMED = STATS_SUMMED


def common_mode(modes: list[str | None]) -> str | None:
    """The mode most replicas run (all of them, but for a moment during a switch)."""
    known = [m for m in modes if m]
    return Counter(known).most_common(1)[0][0] if known else None


def _percent(used: int, total: int) -> float:
    return round(100 * used / total, 2) if total else 0.0


def worst_wait(reps: list[dict]) -> float | None:
    """The replica whose engine waited most for a core (None when none counts it)."""
    shares = [e["cpu_wait_share"] for e in reps if e.get("cpu_wait_share") is not None]
    return max(shares) if shares else None


def mean_of(reps: list[dict], key: str) -> float | None:
    """The mean of the replicas' own figure (None when none has one): acceptance over each one's window."""
    values = [e[key] for e in reps if e.get(key) is not None]
    return sum(values) / len(values) if values else None


def stats(per_replica: dict[str, dict]) -> dict:
    """/v1/engine/stats over the cluster: the sums, the hit rate over every replica's prompt tokens, and each
    replica's own answer under `replicas` (its recent steps there, not in the totals)."""
    reps = [per_replica[r] for r in sorted(per_replica)]
    out: dict = {k: sum(s.get(k) or 0 for s in reps) for k in SUMMED}
    out["mode"] = common_mode([s.get("mode") for s in reps])
    out["pending_mode"] = common_mode([s.get("pending_mode") for s in reps])
    out["block_size"] = reps[0].get("block_size") if reps else None
    out["kv_window"] = reps[0].get("kv_window") if reps else None
    out["kv_usage_percent"] = _percent(out["kv_blocks_used"], out["kv_blocks_total"])
    out["prefix_cache_hit_rate"] = out["cached_prompt_tokens"] / out["prompt_tokens"] if out["prompt_tokens"] else 0.0
    out["last_error"] = next((s["last_error"] for s in reps if s.get("last_error")), None)
    out["cpu_wait_share"] = worst_wait(reps)
    out["speculative"] = common_mode([s.get("speculative") for s in reps]) or "off"
    out |= {k: mean_of(reps, k) for k in MEANS}
    out["recent_steps"] = []
    out["replicas"] = [{"replica": r, **per_replica[r]} for r in sorted(per_replica)]
    return out


def event(latest: dict[str, dict], timestamp: float) -> dict:
    """One /v1/engine/events event over the cluster from each replica's latest: sums, the slowest step, and
    a compact line per replica."""
    reps = [latest[r] for r in sorted(latest)]
    out: dict = {k: sum(e.get(k) or 0 for e in reps) for k in EVENT_SUMMED}
    out["step"] = max((e.get("step") or 0 for e in reps), default=0)
    out["timestamp"] = timestamp
    out["mode"] = common_mode([e.get("mode") for e in reps])
    out["pending_mode"] = common_mode([e.get("pending_mode") for e in reps])
    out["step_time"] = max((e.get("step_time") or 0.0 for e in reps), default=0.0)
    out["cpu_wait_share"] = worst_wait(reps)
    out |= {k: mean_of(reps, k) for k in MEANS}
    out["kv_usage_percent"] = _percent(out["kv_blocks_used"], out["kv_blocks_total"])
    out["replicas"] = [{"replica": r, **{k: latest[r].get(k) for k in COMPACT}} for r in sorted(latest)]
    return out


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*?\})?(\s.*)$")


def metrics(per_replica: dict[str, str], own: str = "") -> str:
    """Every replica's Prometheus text with a `replica` label on each sample, a family's HELP and TYPE once,
    then the ingress's own text (`own`)."""
    meta: dict[str, list[str]] = {}  # family -> its HELP/TYPE lines (families in first-seen order)
    samples: dict[str, list[str]] = {}
    for rid in sorted(per_replica):
        family = ""
        for line in per_replica[rid].splitlines():
            parts = line.split(None, 3)
            if line.startswith("#"):
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    lines = meta.setdefault(family, [])
                    if line not in lines:
                        lines.append(line)
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, rest = m.groups()
            inner = labels[1:-1] if labels else ""
            meta.setdefault(family, [])
            samples.setdefault(family, []).append(f'{name}{{replica="{rid}"{"," + inner if inner else ""}}}{rest}')
    out = [line for fam in meta for line in meta[fam] + samples.get(fam, [])]
    return "\n".join(out) + ("\n" if out else "") + own
