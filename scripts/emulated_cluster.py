"""An emulated bandwidth-limited cluster on one machine: one network namespace per worker.

Why
    Gradient sparsification pays off when the network is slower than the compute. On one
    machine every worker talks over loopback, which is far faster than any real NIC, so the
    benefit cannot be seen there. This module builds a small "cluster" inside one Linux machine
    whose links have a chosen bandwidth (and, where the kernel has netem, a chosen delay), and
    runs an ``mpirun`` job across it.

The network model: per-worker links behind a switch
    ::

        worker ns w0: eth0 10.213.0.1 ──veth── w0 ┐
        worker ns w1: eth0 10.213.0.2 ──veth── w1 ├─ br0 10.213.0.254 (switch ns: mpirun runs here)
        ...                                       ┘

    Every worker has its own network namespace with one interface, ``eth0``, the end of a veth
    pair whose other end (``w<i>``) is a port of a Linux bridge in a separate "switch"
    namespace. A token bucket (``tc qdisc ... tbf``) limits BOTH directions of every worker's
    link: ``eth0``'s egress (what the worker uploads) and ``w<i>``'s egress (what the switch
    delivers to it). Each worker therefore has a full-duplex NIC of the chosen rate behind a
    non-blocking switch, as in a real cluster: a worker receiving from three others at once
    still gets only its own link's rate, and two pairs of workers do not share bandwidth.
    With ``--delay``, a netem qdisc adds half the delay on each of the two hops, so a packet
    from one worker to another is delayed by ``delay`` one way. Kernels built without netem
    (``CONFIG_NET_SCH_NETEM``, e.g. some VM kernels) cannot add delay: the module then warns
    and shapes the bandwidth only; :meth:`EmulatedCluster.measure_rtt` reports the latency
    the links really have.

How the job is launched
    ``mpirun`` itself runs in the switch namespace and treats every worker namespace as a
    remote host (``-H <ns>:1,...``): its "remote shell" (``plm_rsh_agent``) is a two-line
    script that runs Open MPI's daemon inside that namespace (``ip netns exec``, with its own
    UTS namespace so each "host" has its own hostname). This is how Open MPI starts jobs on a
    real cluster over ssh, so its daemons, the PMIx server of each "node" (which listens on
    loopback only) and the ranks all work unchanged. MPI is forced onto TCP over the emulated
    links: ``--mca btl self,tcp --mca btl_tcp_if_include 10.213.0.0/24``. Every address used
    is inside the namespaces created here; nothing is added to the machine's own network.

Cleanup
    Names carry a prefix, the controlling process's pid and a counter (``shvd<pid>x<n>s``,
    ``shvd<pid>x<n>w<i>``), so parallel runs cannot collide. :meth:`EmulatedCluster.teardown`
    (run by the context manager, in ``finally`` and on SIGINT/SIGTERM through
    :func:`exit_on_signals`) kills every process inside the namespaces and deletes them, which
    also removes the veth pairs and the bridge (they live only inside them). A watchdog
    process (``_reap``) started with each cluster does the same if the controller is killed
    with SIGKILL; and every new cluster first removes leftovers of its prefix whose owner is
    no longer alive (:func:`cleanup_stale`).

Without root (or where namespaces are not allowed) the CLI says so and runs the job unshaped
on loopback (``mpirun -np N --oversubscribe --mca btl self,tcp``).

CLI::

    python scripts/emulated_cluster.py --workers 4 --rate 1gbit --delay 0.1ms -- python train.py
    python scripts/emulated_cluster.py --workers 2 --rate 100mbit --measure   # check the link
    python scripts/emulated_cluster.py --cleanup                              # remove leftovers

Only the standard library is imported, so tests and the benchmark can use it cheaply.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launching  # noqa: E402  (the launcher command lines; standard library only)

PREFIX = "shvd"
SUBNET = "10.213.0"  # the emulated cluster's /24; it exists only inside its own namespaces
SWITCH_ADDRESS = f"{SUBNET}.254"
WORKER_IFACE = "eth0"
IP_TIMEOUT = 20  # seconds for any single ip/tc command
_NAME = re.compile(r"^(?P<prefix>[a-z]+)(?P<pid>\d+)x(?P<serial>\d+)(?P<role>s|w\d+)$")

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_rate(text):
    """Bits per second from tc's spelling (``"100mbit"``, ``"1gbit"``, ``"1.5gbit"``).

    Byte units (tc's ``mbps`` means megaBYTES per second) are refused to avoid a factor 8 error.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _RATE_UNITS:
        raise ValueError(f"rate {text!r}: give a number with bit, kbit, mbit, gbit or tbit (e.g. 1gbit)")
    value = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if value <= 0:
        raise ValueError(f"rate {text!r} must be positive")
    return value


def parse_time(text):
    """Seconds from ``"0.1ms"``, ``"100us"``, ``"1s"``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _TIME_UNITS:
        raise ValueError(f"time {text!r}: give a number with s, ms or us (e.g. 0.1ms)")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def format_rate(bits_per_second):
    """``1e9`` -> ``"1gbit"``: the spelling tc takes and tables show."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g}{unit}"
    return f"{bits_per_second:g}bit"


def _run(command, timeout=IP_TIMEOUT, check=True):
    """Run a short system command (ip, tc) under a timeout; its CompletedProcess."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces_unavailable():
    """Empty string when this process can create network namespaces and shape links, else why not."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "not root: creating network namespaces and tc qdiscs needs root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian: apt-get install iproute2 util-linux)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        result = _run(["ip", "netns", "add", probe], check=False)
        if result.returncode != 0:
            return f"`ip netns add` is not allowed here: {result.stderr.strip()}"
        shaped = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                       "tbf", "rate", "100mbit", "burst", "128kb", "latency", "10ms"], check=False)
        if shaped.returncode != 0:
            return f"tc cannot add a tbf qdisc inside a namespace: {shaped.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"probing network namespaces failed: {error}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return ""


def netem_available():
    """Whether the kernel has the netem qdisc (needed to add delay). Needs root."""
    probe = f"{PREFIX}{os.getpid()}netem"
    try:
        if _run(["ip", "netns", "add", probe], check=False).returncode != 0:
            return False
        return _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                     "netem", "delay", "1ms"], check=False).returncode == 0
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def list_namespaces(prefix=PREFIX):
    """Names of the network namespaces this module created with ``prefix`` (any owner)."""
    result = _run(["ip", "netns", "list"], check=False)
    names = []
    for line in result.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match and match.group("prefix") == prefix:
            names.append(name)
    return sorted(names)


def _kill_namespace_processes(names, grace=3.0):
    """SIGTERM then SIGKILL every process inside the named namespaces."""
    def pids():
        found = set()
        for name in names:
            result = _run(["ip", "netns", "pids", name], check=False)
            found.update(int(p) for p in result.stdout.split() if p.isdigit())
        found.discard(os.getpid())
        return found

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        alive = pids()
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pids():
            time.sleep(0.1)


def delete_namespaces(names):
    """Kill what runs inside ``names`` and delete them (their veths and bridge go with them)."""
    names = list(names)
    if not names:
        return
    _kill_namespace_processes(names)
    for name in names:
        _run(["ip", "netns", "del", name], check=False)


def cleanup_stale(prefix=PREFIX):
    """Delete namespaces of ``prefix`` whose owning process is gone; the names deleted."""
    stale = [n for n in list_namespaces(prefix) if not _pid_alive(int(_NAME.match(n).group("pid")))]
    delete_namespaces(stale)
    return stale


_AGENT = """#!/bin/sh
# Open MPI's "remote shell" for an emulated cluster: host $1 is a network namespace. The
# command runs inside it, with its own UTS namespace and the namespace's name as hostname.
host="$1"; shift
case "$host" in {prefix}*) ;; *) echo "emulated cluster agent: unknown host $host" >&2; exit 1;; esac
exec ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
"""


class EmulatedCluster:
    """``workers`` network namespaces joined by shaped veth links to one bridge.

    Use as a context manager (``with EmulatedCluster(4, rate="1gbit") as cluster:``): the
    namespaces exist inside the block and are deleted at its end, whatever happens. ``rate``
    None leaves the links unshaped (the veth pairs' own speed), ``delay`` None adds none.
    """

    _serial = 0

    def __init__(self, workers, rate=None, delay=None, prefix=PREFIX, mtu=1500, queue_seconds=0.01):
        if not 1 <= int(workers) <= 250:
            raise ValueError(f"workers must be in 1..250, got {workers!r}")
        if not re.fullmatch(r"[a-z]{1,6}", prefix):
            raise ValueError(f"prefix must be 1-6 lowercase letters, got {prefix!r}")
        self.workers = int(workers)
        self.rate = parse_rate(rate) if isinstance(rate, str) else (float(rate) if rate else None)
        self.delay = parse_time(delay) if isinstance(delay, str) else (float(delay) if delay else None)
        self.prefix = prefix
        self.mtu = int(mtu)
        self.queue_seconds = float(queue_seconds)
        EmulatedCluster._serial += 1
        self.base = f"{prefix}{os.getpid()}x{EmulatedCluster._serial}"
        self.switch = f"{self.base}s"
        self.hosts = [f"{self.base}w{i}" for i in range(self.workers)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(self.workers)]
        self.delay_applied = False
        self.notes = []
        self._tmpdir = None
        self._reaper = None
        self._up = False

    # ---- life cycle ----------------------------------------------------------------------------

    def __enter__(self):
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc):
        self.teardown()
        return False

    def setup(self):
        """Create the namespaces, the links and the shaping; start the watchdog."""
        reason = namespaces_unavailable()
        if reason:
            raise RuntimeError(reason)
        cleanup_stale(self.prefix)
        self._tmpdir = tempfile.mkdtemp(prefix="emulated_cluster_")
        self._up = True
        # The watchdog first: from here on a SIGKILL of this process still cleans up.
        self._reaper = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "_reap", str(os.getpid()), self.base],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        sw = ["ip", "netns", "exec", self.switch]
        _run(["ip", "netns", "add", self.switch])
        _run(sw + ["ip", "link", "set", "lo", "up"])
        _run(sw + ["ip", "link", "add", "br0", "type", "bridge"])
        _run(sw + ["ip", "addr", "add", f"{SWITCH_ADDRESS}/24", "dev", "br0"])
        _run(sw + ["ip", "link", "set", "br0", "mtu", str(self.mtu), "up"])
        use_netem = bool(self.delay) and netem_available()
        if self.delay and not use_netem:
            self.notes.append(
                f"delay {self.delay * 1e3:g} ms NOT applied: this kernel has no netem qdisc "
                "(CONFIG_NET_SCH_NETEM); the links keep their own latency (see measure_rtt)"
            )
            print(f"[emulated_cluster] WARNING: {self.notes[-1]}", file=sys.stderr, flush=True)
        for i, (host, address) in enumerate(zip(self.hosts, self.addresses)):
            ns = ["ip", "netns", "exec", host]
            port = f"w{i}"
            _run(["ip", "netns", "add", host])
            _run(ns + ["ip", "link", "set", "lo", "up"])
            _run(sw + ["ip", "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                       "peer", "name", WORKER_IFACE, "mtu", str(self.mtu), "netns", host])
            _run(sw + ["ip", "link", "set", port, "master", "br0", "up"])
            _run(ns + ["ip", "addr", "add", f"{address}/24", "dev", WORKER_IFACE])
            _run(ns + ["ip", "link", "set", WORKER_IFACE, "up"])
            # Both directions of the worker's link: its upload and what the switch sends it.
            self._shape(ns, WORKER_IFACE, use_netem)
            self._shape(sw, port, use_netem)
        self.delay_applied = use_netem
        agent = os.path.join(self._tmpdir, "rsh_agent.sh")
        with open(agent, "w") as f:
            f.write(_AGENT.format(prefix=self.base))
        os.chmod(agent, stat.S_IRWXU)
        self.agent = agent
        self._wait_for_links()

    def _shape(self, ns, dev, use_netem):
        """tbf (and netem) on ``dev``'s egress inside the namespace ``ns`` (an exec prefix)."""
        if not self.rate and not use_netem:
            return
        tc = ns + ["tc", "qdisc", "add", "dev", dev]
        parent = ["root"]
        if use_netem:
            # Half the one-way delay on each of the two hops between two workers.
            _run(tc + ["root", "handle", "1:", "netem", "delay", f"{self.delay / 2 * 1e6:.0f}us",
                       "limit", "100000"])
            parent = ["parent", "1:1"]
        if self.rate:
            rate_bytes = self.rate / 8
            # The bucket must hold a whole GSO packet (64 KiB) or tbf would segment them; at high
            # rates it holds 1 ms of traffic. The queue holds queue_seconds at the rate.
            burst = max(int(rate_bytes * 1e-3), 128 * 1024)
            limit = burst + int(rate_bytes * self.queue_seconds)
            _run(tc + parent + ["handle", "10:", "tbf", "rate", f"{self.rate:.0f}bit",
                                "burst", str(burst), "limit", str(limit)])

    def _wait_for_links(self, timeout=10.0):
        """Until every worker reaches the switch address (veths take a moment to come up)."""
        deadline = time.monotonic() + timeout
        pending = list(self.hosts)
        while pending and time.monotonic() < deadline:
            pending = [h for h in pending if not _can_connect(self, h)]
            if pending:
                time.sleep(0.1)
        if pending:
            raise RuntimeError(f"links of {', '.join(pending)} did not come up in {timeout:.0f} s")

    def teardown(self):
        """Kill everything inside the namespaces, delete them, stop the watchdog. Idempotent."""
        if self._up:
            delete_namespaces([self.switch, *self.hosts])
            self._up = False
        if self._reaper is not None:
            with contextlib.suppress(ProcessLookupError):
                self._reaper.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=5)
            self._reaper = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # ---- running things ------------------------------------------------------------------------

    def exec_prefix(self, worker):
        """The command prefix that runs a program inside worker ``worker``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[worker]]

    def mpirun_command(self, argv, mca=()):
        """``mpirun`` starting ``argv`` on every worker, one rank per namespace, MPI over TCP."""
        # Every "host" has one slot, so Open MPI would busy-poll; but all ranks share this
        # machine's cores, and a spinning rank steals them from the others' compute: yield.
        return ["ip", "netns", "exec", self.switch] + launching.mpirun_command(
            self.workers, argv, hosts=self.hosts, yield_when_idle=True,
            tcp_include=f"{SUBNET}.0/24", oob_include=f"{SUBNET}.0/24",
            export=[f"EMULATED_CLUSTER_IFACE={WORKER_IFACE}"],
            mca=[("plm_rsh_agent", self.agent), ("plm_rsh_no_tree_spawn", "1"), *mca],
        )

    def counters(self):
        """Per worker, the bytes its link carried so far: ``[{"tx_bytes", "rx_bytes"}, ...]``."""
        out = []
        for host in self.hosts:
            result = _run(["ip", "-n", host, "-s", "-j", "link", "show", "dev", WORKER_IFACE])
            stats = json.loads(result.stdout)[0]["stats64"]
            out.append({"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"]})
        return out

    def measure_throughput(self, sender=0, receiver=1, nbytes=8 << 20, timeout=60):
        """Bits per second of one TCP stream of ``nbytes`` from worker ``sender`` to ``receiver``."""
        return _measure_throughput(
            self.exec_prefix(receiver), self.exec_prefix(sender), self.addresses[receiver],
            nbytes, timeout,
        )

    def measure_rtt(self, a=0, b=1, count=200, timeout=30):
        """Median round-trip seconds of a 1-byte TCP ping-pong between workers ``a`` and ``b``."""
        return _measure_rtt(self.exec_prefix(b), self.exec_prefix(a), self.addresses[b], count, timeout)

    def measured_link(self):
        """:meth:`describe` plus the link as measured: one TCP stream's throughput (Mbit/s, over
        a quarter second's worth of the configured rate, at least 8 MiB) and the median RTT."""
        nbytes = max(8 << 20, int((self.rate or 0) / 8 * 0.25))
        return {**self.describe(), "throughput_mbit": self.measure_throughput(nbytes=nbytes) / 1e6,
                "rtt_us": self.measure_rtt() * 1e6}

    def describe(self):
        """A dict for JSON outputs: the model, the settings and what was really applied."""
        return {
            "model": "one network namespace per worker; veth pair into a bridge in a switch "
                     "namespace; tbf on both directions of every worker link (full-duplex NIC "
                     "per worker behind a non-blocking switch)",
            "workers": self.workers,
            "rate_bits_per_second": self.rate,
            "delay_seconds": self.delay,
            "delay_applied": self.delay_applied,
            "mtu": self.mtu,
            "notes": list(self.notes),
        }


def _can_connect(cluster, host):
    """Whether ``host`` (a worker namespace) answers on a ping through the bridge (TCP connect)."""
    code = ("import socket,sys\ns=socket.socket();s.settimeout(0.5)\n"
            "try:\n s.connect((sys.argv[1],9));ok=True\n"
            "except ConnectionRefusedError:\n ok=True\nexcept OSError:\n ok=False\n"
            "sys.exit(0 if ok else 1)")
    result = subprocess.run(["ip", "netns", "exec", host, sys.executable, "-c", code, SWITCH_ADDRESS],
                            capture_output=True, timeout=10)
    return result.returncode == 0


# ---- link measurements (iperf-like, standard library only) -------------------------------------


def _probe_command(prefix, *args):
    return [*prefix, sys.executable, os.path.abspath(__file__), "_probe", *map(str, args)]


def _start_server(prefix, mode, address, timeout, *extra):
    """Start a probe server; (process, port) once it listens."""
    server = subprocess.Popen(_probe_command(prefix, mode, address, 0, *extra),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    line = _readline_with_timeout(server, timeout)
    if not line.startswith("listening"):
        server.kill()
        raise RuntimeError(f"probe server failed to start: {line!r} {server.stderr.read()}")
    return server, int(line.split()[1])


def _readline_with_timeout(process, timeout):
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            process.kill()
            raise RuntimeError(f"no answer from {process.args!r} within {timeout} s")
    return process.stdout.readline().strip()


def _finish(processes, timeout):
    outputs = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            raise RuntimeError(f"probe {process.args!r} timed out after {timeout} s")
        if process.returncode != 0:
            raise RuntimeError(f"probe {process.args!r} failed: {err.strip()}")
        outputs.append(out)
    return outputs


def _probe_pair(server_prefix, server_mode, client_prefix, client_mode, address, amount, timeout):
    """Run a probe server and its client; the last JSON line each printed, (server, client)."""
    server, port = _start_server(server_prefix, server_mode, address, timeout, amount)
    try:
        client = subprocess.Popen(_probe_command(client_prefix, client_mode, address, port, amount),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
        outputs = _finish([server, client], timeout)
    finally:
        if server.poll() is None:
            server.kill()
    return [json.loads(out.strip().splitlines()[-1]) if out.strip() else None for out in outputs]


def _measure_throughput(receiver_prefix, sender_prefix, address, nbytes, timeout):
    received, _ = _probe_pair(receiver_prefix, "recv", sender_prefix, "send", address, nbytes, timeout)
    return 8 * received["bytes"] / received["seconds"]


def _measure_rtt(server_prefix, client_prefix, address, count, timeout):
    _, pinged = _probe_pair(server_prefix, "pong", client_prefix, "ping", address, count, timeout)
    return pinged["median_rtt_seconds"]


def measure_loopback(nbytes=8 << 20, timeout=60):
    """Throughput (bits/s) and median RTT (s) over this machine's loopback, without namespaces."""
    return (_measure_throughput([], [], "127.0.0.1", nbytes, timeout),
            _measure_rtt([], [], "127.0.0.1", 200, timeout))


def _probe_main(argv):
    """``_probe recv|send|pong|ping ADDRESS PORT N``: one end of a link measurement."""
    mode, address, port, count = argv[0], argv[1], int(argv[2]), int(argv[3])
    if mode in ("recv", "pong"):
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(1)
        print("listening", listener.getsockname()[1], flush=True)
        listener.settimeout(30)
        conn, _ = listener.accept()
        conn.settimeout(60)
        if mode == "recv":
            got, first = 0, None
            buffer = bytearray(1 << 20)
            while got < count:
                n = conn.recv_into(buffer)
                if not n:
                    break
                if first is None:
                    first = time.perf_counter()
                got += n
            end = time.perf_counter()
            # The first chunk's bytes arrived before the clock started: leave them out.
            print(json.dumps({"bytes": got, "seconds": max(end - first, 1e-9)}), flush=True)
        else:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(count):
                data = conn.recv(1)
                if not data:
                    break
                conn.sendall(data)
        conn.close()
        return 0
    conn = socket.create_connection((address, port), timeout=30)
    conn.settimeout(60)
    if mode == "send":
        chunk = b"\0" * (1 << 20)
        left = count
        while left > 0:
            conn.sendall(chunk[: min(left, len(chunk))])
            left -= min(left, len(chunk))
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # wait until the receiver closes: everything has arrived
    else:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(count):
            start = time.perf_counter()
            conn.sendall(b"x")
            conn.recv(1)
            times.append(time.perf_counter() - start)
        times.sort()
        print(json.dumps({"median_rtt_seconds": times[len(times) // 2]}), flush=True)
    conn.close()
    return 0


def _reap_main(argv):
    """``_reap PID BASE``: wait until process PID is gone, then delete namespaces named BASE*."""
    pid, base = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal is the owner's to handle
    while _pid_alive(pid):
        time.sleep(0.5)
    names = [n for n in list_namespaces(_NAME.match(base + "s").group("prefix"))
             if n.startswith(base) and _NAME.match(n) and n[len(base):] in
             {"s"} | {f"w{i}" for i in range(256)}]
    delete_namespaces(names)
    return 0


# ---- signals and the CLI ----------------------------------------------------------------------


def exit_on_signals():
    """Turn SIGTERM and SIGHUP into SystemExit (SIGINT already raises KeyboardInterrupt), so
    ``finally`` blocks and context managers tear the cluster down. Call from the main thread."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def run_command(command, timeout, env=None, stdout=None):
    """Run ``command`` in its own process group under ``timeout``; kill the group on the way out.

    Returns ``(returncode, timed_out)``. An exception (KeyboardInterrupt, SystemExit from a
    signal) kills the job's process group before propagating.
    """
    process = subprocess.Popen(command, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                               start_new_session=True)
    try:
        process.wait(timeout=timeout)
        return process.returncode, False
    except subprocess.TimeoutExpired:
        return None, True
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


mpi_environment = launching.mpi_environment


def unshaped_mpirun_command(workers, argv):
    """Plain mpirun on this machine's loopback, MPI over TCP (the fallback without root)."""
    return launching.mpirun_command(workers, argv, yield_when_idle=True,
                                    tcp_include="127.0.0.1/8", oob_include="lo")


def _print_measurement(cluster):
    rtt = cluster.measure_rtt()
    rate = cluster.measure_throughput()
    configured = format_rate(cluster.rate) if cluster.rate else "unshaped"
    print(f"[emulated_cluster] link w0 -> w1: {rate / 1e6:,.0f} Mbit/s measured "
          f"(configured: {configured}), median RTT {rtt * 1e6:,.0f} us", flush=True)
    return rate, rtt


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "_probe":
        return _probe_main(argv[1:])
    if argv and argv[0] == "_reap":
        return _reap_main(argv[1:])
    command = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(
        description="Run an mpirun job across N network namespaces whose links are shaped with tc.",
        epilog="example: %(prog)s --workers 4 --rate 1gbit --delay 0.1ms -- python train.py",
    )
    parser.add_argument("--workers", "-n", type=int, default=2)
    parser.add_argument("--rate", default=None, help="per-worker link rate, e.g. 1gbit (default: unshaped)")
    parser.add_argument("--delay", default=None, help="one-way delay between workers, e.g. 0.1ms (needs netem)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the job is killed")
    parser.add_argument("--measure", action="store_true", help="measure the link (throughput, RTT) first")
    parser.add_argument("--cleanup", action="store_true", help="delete leftover namespaces of dead runs and exit")
    args = parser.parse_args(argv)
    if args.rate:
        parse_rate(args.rate)
    if args.delay:
        parse_time(args.delay)
    if not command and not args.measure and not args.cleanup:
        parser.error("give a command after `--`, or --measure, or --cleanup")
    exit_on_signals()

    reason = namespaces_unavailable()
    if args.cleanup:
        if reason:
            print(f"[emulated_cluster] nothing to clean: {reason}")
            return 0
        removed = cleanup_stale()
        print(f"[emulated_cluster] removed {len(removed)} stale namespace(s): {' '.join(removed)}")
        return 0
    env = mpi_environment()
    if reason:
        print(f"[emulated_cluster] {reason}. Running UNSHAPED on loopback: no namespaces, no rate "
              "limit, no delay.", file=sys.stderr, flush=True)
        if args.measure:
            rate, rtt = measure_loopback()
            print(f"[emulated_cluster] loopback: {rate / 1e6:,.0f} Mbit/s, median RTT {rtt * 1e6:,.0f} us")
        if not command:
            return 0
        rc, timed_out = run_command(unshaped_mpirun_command(args.workers, command), args.timeout, env)
        return 124 if timed_out else rc

    with EmulatedCluster(args.workers, rate=args.rate, delay=args.delay) as cluster:
        print(f"[emulated_cluster] {args.workers} workers in namespaces {cluster.base}w*, link "
              f"{format_rate(cluster.rate) if cluster.rate else 'unshaped'}"
              f"{', delay %g ms' % (cluster.delay * 1e3) if cluster.delay_applied else ''}", flush=True)
        if args.measure:
            _print_measurement(cluster)
        if not command:
            return 0
        rc, timed_out = run_command(cluster.mpirun_command(command), args.timeout, env)
        if timed_out:
            print(f"[emulated_cluster] job killed after {args.timeout:g} s", file=sys.stderr)
            return 124
        return rc


if __name__ == "__main__":
    sys.exit(main())
