"""Pool models through the real Envoy with the compiled filter: the workers are the hosts of one
EDS cluster (a file Envoy watches) or of a DNS name; the filter reads them from Envoy's admin
`/clusters`, names the chosen host in the override_host header, follows hosts that come and go,
distrusts a host that left and came back, and credits the host that actually served."""

from __future__ import annotations

import secrets
import socket
import struct
import threading
import time
import uuid
from pathlib import Path

import pytest

from prkit import envoy_config as ec
from prkit.build import wasm_path
from prkit.client import Client
from prkit.eds import write_eds
from prkit.envoy import Envoy
from prkit.fake_workers import Worker
from prkit.ports import free_port
from prkit.wait import wait_until

from . import workload as wl

MODEL = "m"
REBUILDS = "prefix_router_membership_rebuilds"


def gen_args(spec: str, listen: int, admin: int) -> list[str]:
    return ["--model", f"{MODEL}={spec}", "--listen", f"127.0.0.1:{listen}", "--admin", f"127.0.0.1:{admin}",
            "--stats-listen", "none", "--rate-limit", "0", "--hash-key", "k" * 32, "--wasm", str(wasm_path()),
            "--membership-ms", "200", "--health-interval", "1s", "--debug-header", "--fallbacks", "1"]


class EdsPool:
    """Six fake workers, an EDS file listing some of them, and a real Envoy on `envoy/gen`'s
    production shape with the filter."""

    def __init__(self, tmp: Path, extra: tuple[str, ...] = ()):
        self.workers = [Worker(f"p{i}") for i in range(6)]
        self.addr = {f"127.0.0.1:{w.port}": w.name for w in self.workers}
        self.path = tmp / "eds" / "m.yaml"
        self.path.parent.mkdir()
        self.version = 0
        self.listen(["p0", "p1"])
        listen, admin = free_port(), free_port()
        text = ec.run_gen(*gen_args(f"eds:{self.path}", listen, admin), *extra)
        self.envoy = Envoy(text, listener_port=listen, admin_port=admin, workdir=tmp).start()
        self.client = Client(listen)

    def listen(self, names: list[str]):
        """The EDS file lists `names` from now on."""
        self.version += 1
        hosts = [("127.0.0.1", w.port) for w in self.workers if w.name in names]
        write_eds(self.path, MODEL, hosts, self.version)

    def known(self) -> set[str]:
        """The pool's healthy hosts as Envoy's admin lists them: what the filter's membership read
        sees."""
        return {self.addr.get(a, a) for a in self.envoy.healthy_hosts(MODEL)}

    def rebuilds(self) -> float:
        return self.stat(REBUILDS)

    def stat(self, prefix: str, flushed: bool = False) -> float:
        """The filter's metric `prefix` (summed over its labels); `flushed`: after a metric flush."""
        stats = self.envoy.stats() if flushed else self.envoy.stats_now()
        return sum(v for k, v in stats.items() if k.startswith(prefix))

    def settle(self, names: list[str]):
        """Lists `names` and waits until every Envoy worker thread's filter has rebuilt its worker
        list after Envoy's admin shows exactly them healthy."""
        self.listen(names)
        wait_until(lambda: self.known() == set(names), lambda: f"admin shows {names}, has {self.known()}", 30)
        before = self.rebuilds()
        wait_until(lambda: self.rebuilds() >= before + 1 or self.routes_only(names),
                   f"the filter following {names}", 30, 0.2)
        wait_until(lambda: self.routes_only(names), f"fresh decisions naming only {names}", 30, 0.2)

    def routes_only(self, names: list[str]) -> bool:
        """Whether a few new conversations are all sent to `names` and spread over more than one
        when there are several."""
        seen = {self.chat(self.opening())[0] for _ in range(12)}
        return seen <= set(names) and (len(seen) > 1 or len(names) == 1)

    def opening(self) -> list[dict]:
        r = wl.rng(uuid.uuid4().hex)
        return [{"role": "system", "content": f"{uuid.uuid4().hex} " + wl.text(r, 2000)},
                {"role": "user", "content": wl.text(r, 200)}]

    def chat(self, msgs: list[dict]) -> tuple[str, dict]:
        """(the worker that answered, the debug header) of one chat turn."""
        rep = self.client.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
        assert rep.status == 200, rep.body
        d = rep.decision
        d["worker"] = self.addr.get(d.get("worker", ""), d.get("worker"))
        d["holder"] = self.addr.get(d.get("holder", ""), d.get("holder"))
        return rep.worker, d

    def close(self):
        self.envoy.stop()
        for w in self.workers:
            w.close()


@pytest.fixture
def pool(tmp_path):
    p = EdsPool(tmp_path)
    try:
        p.settle(["p0", "p1"])
        yield p
    finally:
        p.close()


def next_turn(msgs: list[dict]) -> list[dict]:
    r = wl.rng(str(len(msgs)))
    return msgs + [{"role": "assistant", "content": wl.text(r, 100)}, {"role": "user", "content": wl.text(r, 100)}]


def test_added_workers_get_new_conversations_and_keep_them(pool):
    pool.settle(["p0", "p1", "p2", "p3"])
    on_new: dict[str, list] = {"p2": [], "p3": []}

    def both_new_used():
        msgs = pool.opening()
        worker, d = pool.chat(msgs)
        assert d["worker"] == worker, d  # the debug header names the host that served
        if worker in on_new:
            on_new[worker].append(msgs)
        return all(on_new.values())

    wait_until(both_new_used, lambda: f"conversations on the added workers: {on_new}", 60, 0)
    for name, convs in on_new.items():
        msgs = next_turn(convs[0])
        worker, d = pool.chat(msgs)
        assert worker == name and d["reason"] == "prefix_hit", (name, d)


def test_a_removed_worker_gets_nothing_new_and_no_request_fails(pool):
    pool.settle(["p0", "p1", "p2"])
    failures, served = [], []
    stop = threading.Event()

    def traffic():
        c = Client(pool.envoy.listener_port)
        while not stop.is_set():
            rep = c.post("/v1/chat/completions", {"model": MODEL, "messages": pool.opening(), "max_tokens": 4})
            (served if rep.status == 200 else failures).append((time.monotonic(), rep.status, rep.worker))

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        time.sleep(1)
        removed_at = time.monotonic()
        pool.settle(["p0", "p1"])
        settled_at = time.monotonic()
        time.sleep(2)
    finally:
        stop.set()
        t.join(30)
    assert not failures, failures[:5]
    assert any(w == "p2" for at, _, w in served if at < removed_at), "p2 served before it was removed"
    late = [w for at, _, w in served if at > settled_at]
    assert late and "p2" not in late, late


def test_a_worker_back_at_the_same_address_is_not_sent_stale_prefixes(pool):
    msgs = pool.opening()
    holder, _ = pool.chat(msgs)
    msgs = next_turn(msgs)
    worker, d = pool.chat(msgs)
    assert worker == holder and d["reason"] == "prefix_hit", d
    other = "p1" if holder == "p0" else "p0"
    pool.settle([other])  # the holder leaves (its pod goes away) ...
    pool.settle(["p0", "p1"])  # ... and a new one comes back at the same address, cache empty
    msgs = next_turn(msgs)
    worker, d = pool.chat(msgs)
    assert d["reason"] != "prefix_hit" and d.get("holder") in (None, ""), d


def test_a_request_a_fallback_served_credits_the_fallback(pool):
    msgs = pool.opening()
    holder, _ = pool.chat(msgs)
    other = "p1" if holder == "p0" else "p0"
    w = next(w for w in pool.workers if w.name == holder)
    w.close()  # connection refused; Envoy's health check has not noticed yet
    msgs = next_turn(msgs)
    worker, d = pool.chat(msgs)
    assert worker == other and d["worker"] == other, d  # the retry went to the named fallback
    fallbacks = sum(v for k, v in pool.envoy.stats().items() if k.startswith("prefix_router_served_by_fallback"))
    assert fallbacks >= 1
    # Its records went to the fallback: the next turn is a prefix hit there.
    msgs = next_turn(msgs)
    worker, d = pool.chat(msgs)
    assert worker == other and d["reason"] == "prefix_hit", d


def test_peer_records_are_accepted_across_ten_membership_changes(tmp_path):
    """One replica that is its own peer (a config may list itself): every membership change
    rebuilds each thread's router, and the batches after it must still be accepted, not taken
    for replays of the batches before it (issue 36 #3)."""
    peer = free_port()
    extra = ("--peers", f"http://127.0.0.1:{peer}", "--peer-listen", f"127.0.0.1:{peer}",
             "--peer-secret", secrets.token_hex(16))
    pool = EdsPool(tmp_path, extra)
    rx, replayed, rejected = ("prefix_router_peers_records_received", "prefix_router_peers_batches_replayed",
                              "prefix_router_peers_requests_rejected")
    try:
        pool.settle(["p0", "p1"])
        sets = (["p0", "p1", "p2"], ["p0", "p1"])
        for change in range(10):
            rebuilt = pool.rebuilds()
            pool.settle(sets[change % 2])
            wait_until(lambda: pool.rebuilds() > rebuilt, f"change {change}: a rebuild", 30, 0.1)
            base = pool.stat(rx)
            for _ in range(4):
                pool.chat(pool.opening())
            wait_until(lambda: pool.stat(rx) > base, f"change {change}: records received after the change", 30, 0.1)
            assert pool.stat(replayed) == 0 and pool.stat(rejected) == 0, (change, pool.stat(replayed))
        assert pool.stat(replayed, flushed=True) == 0
        assert pool.stat(rejected) == 0
    finally:
        pool.close()


def test_conversations_started_before_the_first_membership_read_keep_their_worker(tmp_path):
    """Turns sent the moment Envoy is ready, before the filter has read the pool's membership
    (its reads every 2 s here; the first one finds the hosts still in their first health check):
    the pool's own load balancer places them, and the filter records each prompt under the host
    that served it, so each conversation's next turn goes back there (issue 36 #6)."""
    pool = EdsPool(tmp_path, ("--membership-ms", "2000"))
    try:
        convs = [pool.opening() for _ in range(24)]
        first = []
        for msgs in convs:
            worker, d = pool.chat(msgs)
            first.append((worker, d))
        unplaced = sum(1 for _, d in first if not d.get("worker"))
        assert unplaced >= 1, f"every turn was placed: the test saw no start-up window ({first[:3]})"
        pool.settle(["p0", "p1"])
        wait_until(lambda: all(pool.chat(pool.opening())[1].get("worker") for _ in range(5)),
                   "decisions naming a host (membership read)", 30, 0.1)
        lost = []
        for msgs, (worker, d) in zip(convs, first):
            again, d2 = pool.chat(next_turn(msgs))
            if again != worker:
                lost.append((worker, d, again, d2))
        assert not lost, f"{len(lost)} of {len(convs)} conversations ({unplaced} unplaced) lost their worker: {lost[:3]}"
    finally:
        pool.close()


def test_a_load_poll_is_answered_only_by_the_host_it_names(tmp_path):
    """`<pool>_load` resolves its membership on its own (a DNS pool: two resolutions): a host the
    pool has and the load cluster does not have yet. A poll naming it must fail (counted), never
    be answered by another host whose load would then be published as its own (issue 36 #9a).
    Here the pool lists p0 only and its load cluster p1 only."""
    w0, w1 = Worker("p0"), Worker("p1")
    pool_file, load_file = tmp_path / "eds" / "m.yaml", tmp_path / "eds-load" / "m.yaml"
    pool_file.parent.mkdir()
    load_file.parent.mkdir()
    write_eds(pool_file, MODEL, [("127.0.0.1", w0.port)], 1)
    write_eds(load_file, MODEL, [("127.0.0.1", w1.port)], 1)
    listen, admin = free_port(), free_port()
    cfg = ec.config(ec.options_from_args(gen_args(f"eds:{pool_file}", listen, admin) + ["--load-poll-ms", "100"]))
    for c in cfg["static_resources"]["clusters"]:
        if c["name"] == f"{MODEL}_load":
            src = c["eds_cluster_config"]["eds_config"]["path_config_source"]
            src["path"], src["watched_directory"]["path"] = str(load_file), str(load_file.parent)
    envoy = Envoy(ec.dump(cfg), listener_port=listen, admin_port=admin, workdir=tmp_path).start()
    try:
        fail = "prefix_router_load_poll_failures"
        wait_until(lambda: sum(v for k, v in envoy.stats_now().items() if k.startswith(fail)) >= 3,
                   "polls of p0 failing (p0 is not in the load cluster)", 30, 0.1)
        polls_at_p1 = [r for r in w1.stats.requests if r["path"].split("?")[0] in ("/v1/loads", "/get_load")]
        assert not polls_at_p1, f"p1 answered {len(polls_at_p1)} polls naming p0"
        # Once the load cluster has p0 too, its polls reach it (the named host, not a fallback).
        write_eds(load_file, MODEL, [("127.0.0.1", w0.port), ("127.0.0.1", w1.port)], 2)
        wait_until(lambda: any(r["path"].split("?")[0] in ("/v1/loads", "/get_load") for r in w0.stats.requests),
                   "p0 polled once its load cluster has it", 30, 0.1)
        assert not [r for r in w1.stats.requests if r["path"].split("?")[0] in ("/v1/loads", "/get_load")]
    finally:
        envoy.stop()
        w0.close()
        w1.close()


class TinyDns:
    """A UDP DNS server on loopback answering every A query for `name` with `addresses` (and
    NXDOMAIN otherwise): a name resolving to several addresses, without touching /etc/hosts."""

    def __init__(self, name: str, addresses: list[str]):
        self.name, self.addresses = name.lower().rstrip("."), addresses
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                q, peer = self.sock.recvfrom(512)
            except OSError:
                return
            if len(q) < 12:
                continue
            i, labels = 12, []
            while i < len(q) and q[i]:
                labels.append(q[i + 1:i + 1 + q[i]].decode("ascii", "replace"))
                i += 1 + q[i]
            qtype = struct.unpack("!H", q[i + 1:i + 3])[0] if i + 3 <= len(q) else 0
            question = q[12:i + 5]
            ok = ".".join(labels).lower() == self.name
            answers = self.addresses if ok and qtype == 1 else []
            flags = 0x8180 if ok else 0x8183
            out = q[:2] + struct.pack("!HHHHH", flags, 1, len(answers), 0, 0) + question
            for a in answers:
                out += struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(a)
            self.sock.sendto(out, peer)

    def close(self):
        self.sock.close()


def test_a_dns_pool_routes_to_every_address_of_its_name(tmp_path):
    first = Worker("d0", host="127.0.0.1")
    second = Worker("d1", host="127.0.0.2", port=first.port)
    dns = TinyDns("workers.prefix-router.test", ["127.0.0.1", "127.0.0.2"])
    listen, admin = free_port(), free_port()
    cfg = ec.config(ec.options_from_args(gen_args(f"dns:workers.prefix-router.test:{first.port}", listen, admin)))
    resolver = {"name": "envoy.network.dns_resolver.cares", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig",
        "resolvers": [{"socket_address": {"address": "127.0.0.1", "port_value": dns.port}}],
        "dns_resolver_options": {"no_default_search_domain": True}}}
    for c in cfg["static_resources"]["clusters"]:
        if c["name"] in (MODEL, f"{MODEL}_load"):
            c["typed_dns_resolver_config"] = resolver  # the test's name server, not the system's
    envoy = Envoy(ec.dump(cfg), listener_port=listen, admin_port=admin, workdir=tmp_path).start()
    try:
        c = Client(listen)
        seen = set()

        def both_served():
            r = wl.rng(uuid.uuid4().hex)
            msgs = [{"role": "system", "content": f"{uuid.uuid4().hex} " + wl.text(r, 500)},
                    {"role": "user", "content": "hi"}]
            rep = c.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
            assert rep.status == 200, rep.body
            if rep.decision.get("worker", "").startswith("127.0.0."):
                assert rep.decision["worker"] == f"{'127.0.0.1' if rep.worker == 'd0' else '127.0.0.2'}:{first.port}"
                seen.add(rep.worker)
            return seen == {"d0", "d1"}

        wait_until(both_served, lambda: f"both addresses of the name routed to (seen {seen})", 60, 0.05)
    finally:
        envoy.stop()
        dns.close()
        first.close()
        second.close()
