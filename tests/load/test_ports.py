"""prkit.ports: free ports outside the ephemeral range, never shared between processes."""

from __future__ import annotations

import socket
import subprocess
import sys

from prkit import ports
from prkit.paths import REPO_ROOT


def test_range_sits_below_or_above_the_ephemeral_range():
    assert ports.candidate_range((32768, 60999)) == range(ports.FLOOR, 32768)
    assert ports.candidate_range((10000, 40000)) == range(40001, 65536)
    assert ports.candidate_range((1024, 65000)) == range(1024, 65536)  # no room either side
    assert ports.candidate_range(None) == range(1024, 65536)


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    eph = ports._ephemeral()
    got = [ports.free_port() for _ in range(200)] + [ports.port_pair() for _ in range(20)]
    assert len(set(got)) == len(got)
    for p in got:
        if eph is not None and ports.candidate_range(eph) != range(1024, 65536):
            assert not eph[0] <= p <= eph[1], p
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_pair_is_two_consecutive_ports_both_handed_out():
    base = ports.port_pair()
    assert {base, base + 1} <= ports._HANDED_OUT
    assert base + 1 not in [ports.free_port() for _ in range(50)]


def test_another_process_never_gets_a_port_this_one_holds():
    mine = sorted(ports.free_port() for _ in range(50))
    # The child asks for exactly these ports (they are free: nothing here bound them) and for
    # 2000 more of its own choosing.
    code = ("import sys\nfrom prkit import ports\n"
            "wanted = [int(x) for x in sys.stdin.read().split()]\n"
            "print(sum(ports._take('127.0.0.1', p) for p in wanted))\n"
            "print(' '.join(str(ports.free_port()) for _ in range(2000)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, input=" ".join(map(str, mine)),
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert out[0] == "0"
    theirs = {int(x) for x in out[1].split()}
    assert len(theirs) == 2000
    assert not set(mine) & theirs


def test_a_port_another_process_claimed_is_free_again_when_it_exits():
    code = "from prkit import ports\nprint(ports.free_port())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    port = int(out)
    assert ports._claim(port)  # the child's lock went with it
    ports._release(port)
