"""Live pool membership (load/compare --membership A:B:C): the EDS schedule that grows and
shrinks the pool during a run, and what the run's records say about it."""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from pathlib import Path

from load.runner import log
from prkit.eds import write_local_eds
from prkit.envoy import Envoy
from prkit.fleet import SimFleet
from prkit.replay import percentile


# Seconds of load per --membership run (full / --quick): phases of equal length.
MEMBERSHIP_DURATION = 150
MEMBERSHIP_DURATION_QUICK = 30


def parse_membership(spec: str, workers: int) -> list[int]:
    """`A:B:C...`: the pool's worker count per phase (the fleet's first N workers), 1..workers."""
    try:
        phases = [int(x) for x in spec.split(":")]
    except ValueError:
        raise ValueError(f"--membership: expected worker counts like 4:8:4, got {spec!r}") from None
    if not phases or any(n < 1 or n > workers for n in phases):
        raise ValueError(f"--membership: each phase needs 1 to {workers} workers, got {spec!r}")
    return phases


def membership_label(label: str, phases: list[int]) -> str:
    if len(set(phases)) == 1:
        return f"{label}, static pool of {phases[0]}"
    return f"{label}, pool {':'.join(map(str, phases))}"


class MembershipSchedule:
    """The pool's membership over a run: the EDS file lists the fleet's first phases[0] workers
    from the start; `start()` (when k6 starts) begins phase 0, and phase k begins k/len(phases) of
    `duration` later, when the file is rewritten with the first phases[k] workers (not rewritten
    when the list stays the same: a static pool). The workers' metrics are read at every half
    phase and by `finish()` (after k6), so a phase's hit rate, and its second (stable) half's, are
    differences of the workers' counters. Removed workers keep running (a drain: Envoy sends
    them nothing new, what runs there finishes). Times are Unix ms, as k6's records'."""

    def __init__(self, fleet: SimFleet, eds: Path, phases: list[int], duration: float, cluster: str = "llama"):
        self.fleet, self.eds, self.phases, self.duration, self.cluster = fleet, eds, phases, duration, cluster
        self.changes: list[dict] = []  # {"at", "phase", "added", "removed"}
        self.snapshots: list[tuple[float, dict]] = []  # (Unix ms, fleet.metrics())
        self.members = fleet.names[:phases[0]]
        self.version = 1
        write_local_eds(eds, cluster, [fleet.ports[n] for n in self.members], self.version)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self._thread.start()

    def _snapshot(self) -> None:
        self.snapshots.append((time.time() * 1000, self.fleet.metrics()))

    def _run(self) -> None:
        try:
            t0 = time.monotonic()
            self._snapshot()
            halves = 2 * len(self.phases)
            for j in range(1, halves):
                if self._stop.wait(max(0.0, t0 + self.duration * j / halves - time.monotonic())):
                    return
                if j % 2 == 0:
                    self._change(j // 2)
                self._snapshot()
        except BaseException as e:  # reported by finish()
            self.error = e

    def _change(self, k: int) -> None:
        new = self.fleet.names[:self.phases[k]]
        if new == self.members:
            return
        self.version += 1
        write_local_eds(self.eds, self.cluster, [self.fleet.ports[n] for n in new], self.version)
        at = time.time() * 1000
        self.changes.append({"at": at, "phase": k, "added": [n for n in new if n not in self.members],
                             "removed": [n for n in self.members if n not in new]})
        log(f"membership: phase {k}: EDS file now lists {len(new)} workers "
            f"(+{len(self.changes[-1]['added'])} / -{len(self.changes[-1]['removed'])})")
        self.members = new

    def finish(self) -> None:
        """Stops the schedule (k6 ended) and takes the last snapshot."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"membership schedule failed: {self.error!r}")
        self._snapshot()


POOL_STAT_RE = re.compile(r"^\S*prefix_router\.(membership\.\w+|served_by_fallback|pool\.unplaced): (\d+)$")


def envoy_pool_stats(procs: list) -> dict:
    """The filter's pool counters (membership reads, rebuilds, requests served by another worker,
    pool requests without a worker), summed over the Envoys (saved by envoy_peer_stats' /stats)."""
    out: Counter = Counter()
    for p in procs:
        f = getattr(p, "workdir", None)
        if not isinstance(p, Envoy) or f is None or not (f / "stats.txt").exists():
            continue
        for line in (f / "stats.txt").read_text().splitlines():
            m = POOL_STAT_RE.match(line)
            if m:
                out[m.group(1)] += int(m.group(2))
    return dict(out)


def _decided_worker(header: str | None) -> str | None:
    m = re.search(r"worker=([^;\s]+)", header or "")
    return m.group(1) if m else None


def _hit(snapshots: list, a: int, b: int) -> float | None:
    """The fleet's hit rate between snapshots a and b (cached / prompt token deltas)."""
    if b >= len(snapshots):
        return None
    def tot(k, name):
        return sum(v.get(name, 0) for v in snapshots[k][1].values())
    prompt = tot(b, "sglang:prompt_tokens_total") - tot(a, "sglang:prompt_tokens_total")
    cached = tot(b, "sglang:cached_tokens_total") - tot(a, "sglang:cached_tokens_total")
    return cached / prompt if prompt else None


def membership_stats(records: list[dict], sched: MembershipSchedule, fleet: SimFleet, pool_stats: dict | None) -> dict:
    """What the run's records (load/multi_turn.js RECORDS=1) say about the membership changes:
    failed requests, and those in flight on a worker a change removed (sent before, ended after,
    served by or decided for a removed worker); per added worker the seconds from its change to
    the first request sent that it served; per removed worker the requests it served that were
    sent after its removal; requests served by another worker than the decision named (Envoy's
    fallback); per phase (and its second, stable half) requests, hit rate, TTFT."""
    addr = {f"127.0.0.1:{fleet.ports[n]}": n for n in fleet.names}
    n = len(sched.phases)
    t_start = sched.snapshots[0][0]
    bounds = [sched.snapshots[2 * k][0] if 2 * k < len(sched.snapshots) else math.inf for k in range(n)] + [math.inf]
    failed = [r for r in records if r["s"] != 200]
    on_removed = []
    for r in failed:
        who = {r.get("w"), addr.get(_decided_worker(r.get("d")) or "")}
        if any(c["removed"] and r["t0"] <= c["at"] <= r["t1"] and who & set(c["removed"]) for c in sched.changes):
            on_removed.append(r)
    added, removed = [], []
    for c in sched.changes:
        for w in c["added"]:
            sent = [r["t0"] for r in records if r.get("w") == w and r["s"] == 200 and r["t0"] >= c["at"]]
            added.append({"worker": w, "phase": c["phase"],
                          "first_request_s": (min(sent) - c["at"]) / 1000 if sent else None,
                          "requests": len(sent)})
        for w in c["removed"]:
            after = [r["t0"] for r in records if r.get("w") == w and r["t0"] > c["at"]]
            removed.append({"worker": w, "phase": c["phase"], "requests_sent_after": len(after),
                            "last_sent_after_s": (max(after) - c["at"]) / 1000 if after else None})
    elsewhere = sum(1 for r in records if r["s"] == 200 and r.get("w") and _decided_worker(r.get("d"))
                    and addr.get(_decided_worker(r.get("d"))) != r["w"])
    phases = []
    for k in range(n):
        lo, hi = bounds[k], bounds[k + 1]
        mid = sched.snapshots[2 * k + 1][0] if 2 * k + 1 < len(sched.snapshots) else math.inf
        rs = [r for r in records if lo <= r["t0"] < hi]
        stable = [r for r in rs if r["t0"] >= mid]
        tt = [r["ttft"] for r in stable if r["s"] == 200 and r.get("ttft") is not None]
        tt_all = [r["ttft"] for r in rs if r["s"] == 200 and r.get("ttft") is not None]
        per = Counter(r.get("w") for r in rs if r["s"] == 200)
        phases.append({
            "workers": sched.phases[k], "requests": len(rs), "failed": sum(1 for r in rs if r["s"] != 200),
            "hit_rate": _hit(sched.snapshots, 2 * k, 2 * k + 2),
            "hit_rate_stable": _hit(sched.snapshots, 2 * k + 1, 2 * k + 2),
            "ttft_p50": percentile(tt_all, 50), "ttft_p99": percentile(tt_all, 99),
            "ttft_p50_stable": percentile(tt, 50), "ttft_p99_stable": percentile(tt, 99),
            "worker_requests": [per.get(w, 0) for w in fleet.names],
        })
    return {
        "phases_spec": sched.phases, "duration_s": sched.duration, "start_ms": t_start,
        "changes": [{**c, "at_s": (c["at"] - t_start) / 1000} for c in sched.changes],
        "records": len(records), "failed": len(failed), "failed_on_removed": len(on_removed),
        "failed_elsewhere": len(failed) - len(on_removed),
        "failed_detail": [{k: r.get(k) for k in ("i", "w", "d", "s")} for r in failed[:20]],
        "added": added, "removed": removed, "served_elsewhere": elsewhere, "phases": phases,
        "envoy": pool_stats or {},
    }


def membership_table(rows: list[dict]) -> str:
    """Per run and phase: workers, requests, hit rate (whole phase / second half), TTFT."""
    lines = ["| run | phase | pool workers | requests (failed) | hit rate: phase / stable half "
             "| TTFT p50 / p99: phase | TTFT p50 / p99: stable half | requests per worker |",
             "|---|---|---|---|---|---|---|---|"]
    def pct(x):
        return "-" if x is None else f"{x:.1%}"
    for r in rows:
        for k, ph in enumerate(r["membership"]["phases"]):
            lines.append(
                f"| {r['label']} | {k + 1} | {ph['workers']} | {ph['requests']} ({ph['failed']}) "
                f"| {pct(ph['hit_rate'])} / {pct(ph['hit_rate_stable'])} "
                f"| {ph['ttft_p50']:.0f} / {ph['ttft_p99']:.0f} ms | {ph['ttft_p50_stable']:.0f} / "
                f"{ph['ttft_p99_stable']:.0f} ms | {' / '.join(map(str, ph['worker_requests']))} |")
    return "\n".join(lines)


def membership_notes(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        ms = r["membership"]
        ch = ", ".join(f"{c['at_s']:.1f} s (phase {c['phase'] + 1}: added {','.join(c['added']) or 'none'}, "
                       f"removed {','.join(c['removed']) or 'none'})" for c in ms["changes"]) or "none (static)"
        add = ", ".join(f"{a['worker']} {a['first_request_s']:.1f} s ({a['requests']} requests)"
                        if a["first_request_s"] is not None else f"{a['worker']} never"
                        for a in ms["added"])
        rem = ", ".join(f"{x['worker']} {x['requests_sent_after']}"
                        + (f" (last {x['last_sent_after_s']:.1f} s after)" if x["last_sent_after_s"] is not None else "")
                        for x in ms["removed"])
        env = ", ".join(f"{k} {v}" for k, v in sorted(ms["envoy"].items()))
        out.append(f"- {r['label']}: {ms['records']} requests recorded; EDS changes at {ch}; failed "
                   f"{ms['failed']} ({ms['failed_on_removed']} in flight on a removed worker, "
                   f"{ms['failed_elsewhere']} others)"
                   + (f"; first request of each added worker after its change: {add}" if add else "")
                   + (f"; requests served by each removed worker that were sent after its removal: {rem}" if rem else "")
                   + f"; served by another worker than the decision named: {ms['served_elsewhere']}"
                   + (f"; Envoy: {env}" if env else "") + ".")
    return out
