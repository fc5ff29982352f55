"""``python -m tools.shard_sim``: children sharded by parent conversation across N
PostgreSQL clusters, simulated (design §25, docs/sharding.md).

A parent conversation is placed on one cluster by a hash of its id; every child of
its tree (its authority, leases, follow-ups, admission scope ``parent:C``) lives there,
so nothing crosses clusters. Each cluster has ``hosts`` hosts and a capacity in starts
per second measured on one cluster (``tools/bench_hosts.py``: the rate grows with hosts
until the server saturates). Parents arrive at random, each starting a number of
children drawn from a heavy-tailed (Zipf-like) distribution; for each second of
simulated time, every cluster starts what it can of what it was asked (the rest waits
in its queue, as admission would hold it). Hosts fail at random: a failed host's
share of its cluster is lost until a live host takes it over (``takeover_s``, measured:
the heartbeat notices, the takeover resumes); a whole cluster fails over (its server,
``failover_s``) more rarely, and nothing of it starts meanwhile. Nothing acknowledged
is lost in either case (the engine's guarantee, not simulated): what the simulation
measures is capacity, the skew a hash leaves, and the delay failures add.

The model is deterministic for a seed. Figures per N: the fleet's capacity, the
starts asked and done, the busiest cluster's share against the mean, the 99th
percentile and the worst of a start's wait in its cluster's queue, and how many
parents a failure touched.
"""

from __future__ import annotations

import argparse
import hashlib
import random
from dataclasses import dataclass

# Measured on one PostgreSQL 15 cluster on this 2-core machine (docs/benchmarks.md,
# 2026-12-04/05): concurrent starts a second by 1, 2 and 3 hosts, and takeover seconds.
STARTS_PER_S_BY_HOSTS = {1: 2285.0, 2: 4499.0, 3: 4071.0}
TAKEOVER_S = 3.4  # the median from a SIGKILL to every child running on a live host
FAILOVER_S = 10.0  # a server's failover: pg_auto_failover's, with the hosts' reconnects


@dataclass(frozen=True)
class Settings:
    clusters: int
    hosts: int = 3
    seconds: int = 600
    parents_per_s: float = 400.0
    mean_children: float = 8.0
    host_failures_per_hour: float = 2.0  # per host
    cluster_failovers_per_hour: float = 0.5  # per cluster
    seed: int = 7


@dataclass
class Report:
    clusters: int
    capacity_per_s: float
    asked: int
    started: int
    busiest_share: float  # the busiest cluster's starts asked over the mean cluster's
    wait_p99_s: float
    wait_max_s: float
    parents_touched: float  # the fraction of parents that had a child delayed by a failure


def shard(conversation: str, clusters: int) -> int:
    """The cluster of a parent conversation: stable, and the same on every host."""
    digest = hashlib.blake2b(conversation.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % clusters


def _children(rng: random.Random, mean: float) -> int:
    # Heavy-tailed: most parents start a few children, some start hundreds.
    return max(1, min(1000, int(rng.paretovariate(1.5) * mean / 3)))


def simulate(s: Settings) -> Report:
    rng = random.Random(s.seed)
    capacity = STARTS_PER_S_BY_HOSTS[min(s.hosts, 3)]
    queue: list[list[tuple[int, int, int]]] = [[] for _ in range(s.clusters)]  # (t, parent, n)
    down_until = [0.0] * s.clusters  # a cluster failing over
    hosts_down: list[list[float]] = [[0.0] * s.hosts for _ in range(s.clusters)]
    asked = started = 0
    per_cluster = [0] * s.clusters
    waits: list[float] = []
    touched: set[int] = set()
    parents = 0
    host_p = s.host_failures_per_hour / 3600.0
    cluster_p = s.cluster_failovers_per_hour / 3600.0
    for t in range(s.seconds):
        for _ in range(_poisson(rng, s.parents_per_s)):
            c = shard(f"c-{parents}", s.clusters)
            n = _children(rng, s.mean_children)
            queue[c].append((t, parents, n))
            per_cluster[c] += n
            asked += n
            parents += 1
        for c in range(s.clusters):
            if rng.random() < cluster_p:
                down_until[c] = t + FAILOVER_S
            for h in range(s.hosts):
                if rng.random() < host_p:
                    hosts_down[c][h] = t + TAKEOVER_S
            if t < down_until[c]:
                touched.update(p for _, p, _ in queue[c])
                continue
            live = sum(1 for until in hosts_down[c] if until <= t)
            budget = capacity * live / s.hosts
            if live < s.hosts:
                touched.update(p for _, p, _ in queue[c][:50])
            while queue[c] and budget >= 1:
                at, parent, n = queue[c][0]
                take = min(n, int(budget))
                budget -= take
                started += take
                waits.extend([float(t - at)] * take)
                if take == n:
                    queue[c].pop(0)
                else:
                    queue[c][0] = (at, parent, n - take)
    waits.sort()
    mean = sum(per_cluster) / s.clusters
    return Report(
        clusters=s.clusters,
        capacity_per_s=capacity * s.clusters,
        asked=asked,
        started=started,
        busiest_share=round(max(per_cluster) / mean, 3) if mean else 0.0,
        wait_p99_s=waits[int(len(waits) * 0.99)] if waits else 0.0,
        wait_max_s=waits[-1] if waits else 0.0,
        parents_touched=round(len(touched) / max(parents, 1), 4),
    )


def _poisson(rng: random.Random, mean: float) -> int:
    # Normal approximation (the mean is in the hundreds); never negative.
    return max(0, int(rng.gauss(mean, mean**0.5) + 0.5))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.shard_sim", description=__doc__)
    parser.add_argument("--clusters", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--seconds", type=int, default=600)
    parser.add_argument("--parents-per-s", type=float, default=400.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    print(
        f"{'clusters':>8} {'capacity/s':>11} {'asked':>9} {'started':>9} {'busiest':>8}"
        f" {'wait p99':>9} {'wait max':>9} {'parents touched':>16}"
    )
    for n in args.clusters:
        r = simulate(Settings(n, seconds=args.seconds, parents_per_s=args.parents_per_s,
                              seed=args.seed))  # fmt: skip
        print(
            f"{r.clusters:>8} {r.capacity_per_s:>11.0f} {r.asked:>9} {r.started:>9}"
            f" {r.busiest_share:>8} {r.wait_p99_s:>8.0f}s {r.wait_max_s:>8.0f}s"
            f" {r.parents_touched:>16.2%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
