"""The emulated cluster of scripts/emulated_cluster.py: set-up, shaping, teardown, interruption.

Needs root and network namespaces (a container without CAP_NET_ADMIN has neither); every test
that builds a cluster is skipped with the reason otherwise. Every subprocess runs under a
timeout, and every cluster is built with this process's pid in its names, so nothing here can
touch a cluster another process (another test run, a benchmark) is using at the same time.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "emulated_cluster.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import emulated_cluster as ec  # noqa: E402

# one test at a time, in one process, when the suite runs on several (scripts/test.sh): two
# tests count the root namespace's links around their own cluster's set-up and teardown
pytestmark = pytest.mark.xdist_group("emulated_cluster")

# Probed once at collection: creates and deletes one namespace of this process's own.
_REASON = ec.namespaces_unavailable()
needs_namespaces = pytest.mark.skipif(bool(_REASON), reason=f"emulated cluster unavailable here: {_REASON}")


def _names_of(pid):
    return [n for n in ec.list_namespaces() if n.startswith(f"{ec.PREFIX}{pid}x")]


def _root_links():
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                          timeout=10).stdout.count("\n")


def _wait_until(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


# ---- no root needed ----------------------------------------------------------------------------


def test_parse_rate_and_time():
    assert ec.parse_rate("1gbit") == 1e9
    assert ec.parse_rate("100mbit") == 1e8
    assert ec.parse_rate("2.5Gbit") == 2.5e9
    assert ec.parse_time("0.1ms") == pytest.approx(1e-4)
    assert ec.parse_time("100us") == pytest.approx(1e-4)
    assert ec.format_rate(1e10) == "10gbit"
    for bad in ("1gbps", "fast", "-1gbit", "0mbit"):
        with pytest.raises(ValueError):
            ec.parse_rate(bad)
    with pytest.raises(ValueError):
        ec.parse_time("1 hour")


# ---- with namespaces ---------------------------------------------------------------------------


@needs_namespaces
def test_setup_and_teardown_leave_nothing_behind():
    links_before = _root_links()
    with ec.EmulatedCluster(2, rate="100mbit") as cluster:
        names = set(ec.list_namespaces())
        assert {cluster.switch, *cluster.hosts} <= names
        # Both directions of every worker link are shaped, and nothing in the root namespace.
        for host in cluster.hosts:
            qdisc = subprocess.run(["ip", "netns", "exec", host, "tc", "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True, timeout=10).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc
        ports = subprocess.run(["ip", "netns", "exec", cluster.switch, "tc", "qdisc", "show"],
                               capture_output=True, text=True, timeout=10).stdout
        assert ports.count("tbf") == 2, ports
        assert _root_links() == links_before
        assert cluster.measure_rtt(count=20) > 0
        agent = cluster.agent
        assert os.path.exists(agent)
    assert not (set(ec.list_namespaces()) & {cluster.switch, *cluster.hosts})
    assert _root_links() == links_before
    assert not os.path.exists(agent)
    assert _wait_until(lambda: cluster._reaper is None, 1)


@needs_namespaces
def test_shaped_link_is_measurably_slower_than_unshaped():
    nbytes = 4 << 20  # 0.34 s at 100 Mbit/s
    with ec.EmulatedCluster(2, rate="100mbit") as shaped:
        slow = shaped.measure_throughput(nbytes=nbytes, timeout=30)
    with ec.EmulatedCluster(2) as unshaped:
        fast = unshaped.measure_throughput(nbytes=nbytes, timeout=30)
    assert 70e6 <= slow <= 115e6, f"100mbit link measured {slow / 1e6:.0f} Mbit/s"
    assert fast >= 3 * slow, f"unshaped {fast / 1e6:.0f} vs shaped {slow / 1e6:.0f} Mbit/s"


@needs_namespaces
def test_cluster_counts_the_bytes_each_link_carries():
    with ec.EmulatedCluster(2, rate="1gbit") as cluster:
        before = cluster.counters()
        cluster.measure_throughput(sender=1, receiver=0, nbytes=2 << 20, timeout=30)
        after = cluster.counters()
    sent = after[1]["tx_bytes"] - before[1]["tx_bytes"]
    assert 2 << 20 <= sent <= 1.1 * (2 << 20)  # the payload plus TCP/IP headers
    assert after[0]["rx_bytes"] - before[0]["rx_bytes"] >= 2 << 20


@needs_namespaces
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_interrupted_run_cleans_up(sig):
    """A job interrupted while it runs leaves no namespace and no process behind; after SIGKILL,
    which no handler can catch, the watchdog removes them."""
    links_before = _root_links()
    process = subprocess.Popen(
        [sys.executable, SCRIPT, "--workers", "2", "--rate", "100mbit", "--", "sleep", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=ec.mpi_environment(), start_new_session=True,
    )
    try:
        assert _wait_until(lambda: len(_names_of(process.pid)) == 3, 30), "cluster never came up"
        names = _names_of(process.pid)
        # Wait until the job runs inside the worker namespaces (ranks started).
        assert _wait_until(
            lambda: all(subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True,
                                       timeout=10).stdout.strip() for n in names), 30)
        os.kill(process.pid, sig)
        process.wait(timeout=30)
        assert _wait_until(lambda: not _names_of(process.pid), 15), _names_of(process.pid)
        assert _root_links() == links_before
        leftovers = subprocess.run(["pgrep", "-f", f"{ec.PREFIX}{process.pid}x"],
                                   capture_output=True, text=True, timeout=10).stdout.split()
        assert _wait_until(lambda: not subprocess.run(
            ["pgrep", "-f", f"{ec.PREFIX}{process.pid}x"], capture_output=True, text=True,
            timeout=10).stdout.split(), 10), leftovers
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        ec.delete_namespaces(_names_of(process.pid))


@needs_namespaces
def test_stale_namespaces_of_dead_runs_are_removed_and_live_ones_kept():
    dead = 4_000_000  # above any pid this machine hands out (pid_max is 4194304 at most)
    while ec._pid_alive(dead):
        dead += 1
    stale = f"{ec.PREFIX}{dead}x1s"
    live = f"{ec.PREFIX}{os.getpid()}x999s"
    try:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
        removed = ec.cleanup_stale()
        assert stale in removed and live not in removed
        assert live in ec.list_namespaces() and stale not in ec.list_namespaces()
    finally:
        ec.delete_namespaces([n for n in (stale, live) if n in ec.list_namespaces()])


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("mpirun") is None,
                    reason="needs root (to drop it), setpriv and mpirun")
def test_without_root_it_says_so_and_runs_unshaped():
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, SCRIPT, "--workers", "2", "--rate", "1gbit", "--", "true"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, HOME="/tmp"),
    )
    assert "not root" in result.stderr and "UNSHAPED" in result.stderr, result.stderr
    assert result.returncode == 0, result.stdout + result.stderr
