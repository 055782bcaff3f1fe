"""prkit.replay, the open-loop client of load/compare's trace replay: against a real sglang-sim
worker (every request answered and recorded, in plan order, with its worker, tokens and
lateness) and against a tiny HTTP server that closes kept-alive connections and answers errors
(every send still gets a record)."""

from __future__ import annotations

import asyncio
import json

from prkit import replay as rp
from prkit import trace as tr
from prkit.fleet import SimWorker


def _plan(n: int, gap_ms: float) -> dict:
    reqs = [tr.TraceRequest(timestamp_ms=i * gap_ms, input_length=1024, output_length=128,
                            hash_ids=(1, 100 + i // 3)) for i in range(n)]
    return tr.replay_plan(reqs, 16, speed=1.0)


def test_replay_against_a_simulated_worker_records_every_request():
    w = SimWorker("w-replay", ["--time-scale", "0.05"], model="llama").start(timeout_s=30)
    try:
        plan = _plan(40, 25.0)
        for api in ("completions", "chat"):
            sends = tr.plan_sends(plan, api, "llama")
            res = rp.run(sends, [w.url], lead_ms=100)
            assert [r.i for r in res.records] == list(range(40))
            assert all(r.ok for r in res.records), [r.err for r in res.records if not r.ok]
            assert {r.worker for r in res.records} == {"w-replay"}
            assert all(r.out_tokens == 4 for r in res.records)  # ceil(128 * 16 / 512)
            assert all(0 < r.ttft_ms <= r.e2e_ms for r in res.records)
            # sent in plan order, at the plan's spacing: each send time = due + lateness, so
            # every send's offset from the first is its due offset plus the difference of their
            # lateness (5 ms: the send time and the lateness are two clock reads). The first send
            # may be late too: it once was by 5.01 ms, which a bare span >= 39 x 25 - 5 failed.
            t0 = [r.sent_unix_ms for r in res.records]
            assert t0 == sorted(t0)
            first = res.records[0]
            for r, s in zip(res.records, sends):
                want = (s.t_ms - sends[0].t_ms) + (r.late_ms - first.late_ms)
                assert abs((r.sent_unix_ms - first.sent_unix_ms) - want) <= 5.0, (r.i, r.late_ms, first.late_ms)
            assert sends[-1].t_ms - sends[0].t_ms == 39 * 25.0
            s = res.summary()
            assert s["requests"] == 40 and s["errors"] == 0 and s["out_tokens"] == 160
            assert set(s["lateness_ms"]) == {"avg", "min", "med", "p(90)", "p(99)", "max"}
            assert s["lateness_ms"]["min"] >= 0
        # the worker saw exactly the planned prompts: its cache hits follow the shared blocks
        m = w.metrics()
        assert m["sglang:num_requests_total"] == 80
    finally:
        w.stop()


def test_targets_pin_by_key_and_spread_at_random():
    sends = [rp.Send(0.0, "/", b"", key=f"c{i % 5}") for i in range(50)]
    keys = [rp.fnv1a(s.key) % 3 for s in sends]
    assert len(set(keys)) > 1
    assert rp.fnv1a("") == 0x811C9DC5 and rp.fnv1a("a") == 0xE40C292C  # FNV-1a test vectors


async def _server(handler) -> tuple[asyncio.AbstractServer, str]:
    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    return srv, f"http://127.0.0.1:{port}"


def test_closed_keepalive_connections_are_retried_and_errors_recorded():
    async def main():
        served = []

        async def handler(r, w):
            # answers one request per connection, then closes it without saying so
            head = await r.readuntil(b"\r\n\r\n")
            n = int([ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0].split(b":")[1])
            body = json.loads(await r.readexactly(n))
            served.append(body)
            if body.get("fail"):
                w.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
            else:
                chunks = [b'data: {"choices":[{"text":"a"}]}\n\n',
                          b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\n', b"data: [DONE]\n\n"]
                w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nx-worker-id: w9\r\n\r\n"
                        + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")
            await w.drain()
            await asyncio.sleep(0.05)
            w.close()

        srv, url = await _server(handler)
        sends = [rp.Send(i * 100.0, "/v1/completions", json.dumps({"fail": i == 2}).encode(), "m")
                 for i in range(4)]
        res = await rp.replay(sends, [url], lead_ms=10, timeout_s=5)
        srv.close()
        await srv.wait_closed()
        return res, served

    res, served = asyncio.run(main())
    assert len(served) == 4, "each request reached the server once (a closed connection is retried)"
    st = [(r.status, r.ok, r.out_tokens, r.worker) for r in res.records]
    assert st == [(200, True, 2, "w9"), (200, True, 2, "w9"), (503, False, 0, None), (200, True, 2, "w9")]
    assert res.summary()["errors"] == 1


def test_unreachable_target_gives_a_record_with_the_error():
    res = rp.run([rp.Send(0.0, "/", b"{}", "m")], ["http://127.0.0.1:9"], lead_ms=0, timeout_s=5)
    (r,) = res.records
    assert not r.ok and r.err and r.status == 0
