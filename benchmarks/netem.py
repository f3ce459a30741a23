"""A rate-limited network on one machine: one network namespace per rank.

Topology (N = 2..16 ranks)::

    <prefix>-r0  veth0 ─┐                      ┌─ vr0 ┐
    <prefix>-r1  veth0 ─┼──── veth pairs ──────┼─ vr1 ┼─ br0   (<prefix>-br)
    ...                 ┘                      └─ ... ┘

Every rank namespace holds one end of a veth pair (``veth0``, address
``10.231.0.<rank+1>/24``); the other end sits in a bridge namespace, enslaved
to a Linux bridge. A ``tbf`` qdisc limits *both* ends' egress to the same
rate, so each rank's uplink and downlink are each limited to the rate, as on a
switched network with one NIC per host. ``netem`` is not available on these
machines, so there is rate limiting only, no added delay.

Each rank namespace also gets its own ``/etc/hosts`` (``ip netns exec``
bind-mounts ``/etc/netns/<ns>/hosts`` over it) in which the machine's hostname
resolves to the rank's address, as it would on a real host. Libraries that
find their own address through the hostname need this: Horovod 0.28's Gloo
contexts for process sets ignore ``HOROVOD_GLOO_IFACE`` and would otherwise
advertise 127.0.0.1 to their peers.

Nothing else outside the namespaces changes: they are not connected to the
host's namespace and their names start with a per-process prefix
(``dcb<pid>``), so concurrent runs do not collide and teardown deletes only
what this object created. Teardown runs on ``__exit__``, at interpreter exit
and on SIGINT/SIGTERM.

Without root, or where ``ip netns`` fails, :func:`open_network` falls back to
the loopback interface and warns loudly that the network is *not* limited.

``python -m benchmarks.netem`` checks the limit: it times a 40 MB all-reduce
between 2 ranks (about 0.34 s at 1 Gbit/s; about 0.05 s on loopback).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

MAX_RANKS = 16  # one /24, one bridge port each; beyond the cores, ranks only measure contention
SUBNET = "10.231.0"  # private /24; rank r gets .r+1
RANK_IFNAME = "veth0"
BRIDGE_IFNAME = "br0"
# A bucket must hold at least one timer tick's worth of bytes or tbf cannot
# reach its rate (the kernel refills it once per tick, HZ >= 250 => 4 ms).
TBF_TICK_S = 0.004
TBF_MIN_BURST_BYTES = 32 * 1024
# How long a packet may wait in the tbf queue. Too short and the queue drops
# packets, TCP backs off and the link runs well below its rate; 100 ms holds a
# few hundred KB at 10 Gbit/s, which the measured runs never fill.
TBF_LATENCY_MS = 100
CMD_TIMEOUT_S = 20.0
NETNS_ETC = Path("/etc/netns")  # where `ip netns exec` looks for per-namespace files

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(rate: str) -> float:
    """``"1gbit"``, ``"10Gbit"``, ``"500mbit"`` -> bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)bit\s*", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected a number and kbit/mbit/gbit/tbit, e.g. 1gbit")
    bits = float(m.group(1)) * _UNITS[m.group(2)]
    if bits <= 0:
        raise ValueError(f"rate {rate!r} must be positive")
    return bits


def tbf_burst_bytes(rate_bps: float) -> int:
    return max(TBF_MIN_BURST_BYTES, int(rate_bps / 8 * TBF_TICK_S))


@dataclass
class RankEndpoint:
    """What a rank process needs to join the job."""

    rank: int
    netns: str | None  # None: run in the current namespace (loopback)
    addr: str
    ifname: str

    def wrap(self, argv: list[str]) -> list[str]:
        """The command line that runs ``argv`` inside this rank's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)


def rank_env(ep: RankEndpoint, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """Environment for one rank, as torchrun would set it.

    Each namespace plays a separate host with one process on it; on loopback
    all ranks share one host.
    """
    own_host = ep.netns is not None
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "GLOO_SOCKET_IFNAME": ep.ifname,
        "RANK": str(ep.rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0" if own_host else str(ep.rank),
        "LOCAL_WORLD_SIZE": "1" if own_host else str(world_size),
    }


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass
class Network:
    """Base class: a set of rank endpoints and a fresh port per launch."""

    ranks: int
    rate: str | None
    endpoints: list[RankEndpoint] = field(default_factory=list)
    limited: bool = False
    _port: int = 29400

    @property
    def master_addr(self) -> str:
        return self.endpoints[0].addr

    def next_port(self) -> int:
        # A new port per launch: the previous launch's sockets may linger in
        # TIME_WAIT, and reusing the port could then fail to bind.
        self._port += 1
        return self._port

    def describe(self) -> dict:
        return {
            "kind": type(self).__name__,
            "limited": self.limited,
            "rate": self.rate,
            "ranks": self.ranks,
            "endpoints": [vars(ep) for ep in self.endpoints],
        }

    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LoopbackNetwork(Network):
    """All ranks on 127.0.0.1: no rate limit."""

    def __init__(self, ranks: int, rate: str | None = None):
        super().__init__(ranks, rate)
        self.endpoints = [RankEndpoint(r, None, "127.0.0.1", "lo") for r in range(ranks)]

    def next_port(self) -> int:
        # Shared with every other process on the host: ask the kernel.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


class NamespaceNetwork(Network):
    """Namespaces, a bridge and tbf-limited veth pairs; see the module docstring."""

    def __init__(self, ranks: int, rate: str | None, prefix: str | None = None):
        if not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"ranks must be 1..{MAX_RANKS}, got {ranks}")
        super().__init__(ranks, rate)
        self.prefix = prefix or f"dcb{os.getpid()}"
        self.bridge_ns = f"{self.prefix}-br"
        self._created: list[str] = []
        self._created_files: list[Path] = []  # files, then directories, to remove
        self._closed = False
        self._old_handlers: dict[int, object] = {}
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.limited = rate is not None

    # -- construction ------------------------------------------------------

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        _run(["ip", "-n", self.bridge_ns, "link", "add", BRIDGE_IFNAME, "type", "bridge"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", BRIDGE_IFNAME, "up"])
        for r in range(self.ranks):
            ns = f"{self.prefix}-r{r}"
            self._add_ns(ns)
            peer = f"vr{r}"
            # Created inside the bridge namespace with the peer moved straight
            # into the rank namespace: no interface ever appears on the host.
            _run(["ip", "-n", self.bridge_ns, "link", "add", peer, "type", "veth",
                  "peer", "name", RANK_IFNAME, "netns", ns])
            _run(["ip", "-n", self.bridge_ns, "link", "set", peer, "master", BRIDGE_IFNAME])
            _run(["ip", "-n", self.bridge_ns, "link", "set", peer, "up"])
            addr = f"{SUBNET}.{r + 1}"
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", RANK_IFNAME])
            self._write_hosts(ns, r)
            _run(["ip", "-n", ns, "link", "set", RANK_IFNAME, "up"])
            if self.rate is not None:
                self._limit(ns, RANK_IFNAME)  # rank -> bridge
                self._limit(self.bridge_ns, peer)  # bridge -> rank
            self.endpoints.append(RankEndpoint(r, ns, addr, RANK_IFNAME))

    def _write_hosts(self, ns: str, rank: int) -> None:
        # Peers get names too, so that reverse look-ups of their addresses
        # (c10d logs a warning when they fail) find something.
        lines = ["127.0.0.1 localhost"]
        for r in range(self.ranks):
            own = f" {socket.gethostname()}" if r == rank else ""
            lines.append(f"{SUBNET}.{r + 1} rank{r}{own}")
        hosts = "\n".join(lines) + "\n"
        for d in (NETNS_ETC, NETNS_ETC / ns):
            if not d.exists():
                d.mkdir()
                self._created_files.insert(0, d)  # removed after what is inside it
        path = NETNS_ETC / ns / "hosts"
        path.write_text(hosts)
        self._created_files.insert(0, path)

    def _limit(self, ns: str, dev: str, verb: str = "add") -> None:
        bps = parse_rate(self.rate)
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", dev, "root", "tbf",
              "rate", f"{int(bps)}bit", "burst", str(tbf_burst_bytes(bps)),
              "latency", f"{TBF_LATENCY_MS}ms"])

    def set_rate(self, rate: str) -> None:
        """Every link's rate, both directions, changed in place (``tc qdisc change``): transfers in flight
        go on at the new rate. For a network built with a rate."""
        if self.rate is None:
            raise ValueError("set_rate needs a network built with a rate (its qdiscs)")
        parse_rate(rate)
        self.rate = rate
        for r, ep in enumerate(self.endpoints):
            self._limit(ep.netns, RANK_IFNAME, "change")
            self._limit(self.bridge_ns, f"vr{r}", "change")

    # -- teardown ----------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):
            self.close()
            old = self._old_handlers.get(signum)
            if callable(old):
                old(signum, frame)
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: rely on atexit/__exit__
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Deleting a namespace deletes the veth ends inside it (and with them
        # their peers and qdiscs); rank namespaces first, then the bridge.
        for name in reversed(self._created):
            proc = _run(["ip", "netns", "del", name], check=False)
            if proc.returncode != 0:
                print(f"warning: could not delete namespace {name}: {proc.stderr.strip()}",
                      file=sys.stderr)
        self._created.clear()
        for path in self._created_files:
            try:
                path.rmdir() if path.is_dir() else path.unlink()
            except OSError as exc:  # e.g. another run's namespace files share /etc/netns
                if path != NETNS_ETC:
                    print(f"warning: could not remove {path}: {exc}", file=sys.stderr)
        self._created_files.clear()
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)
        self._old_handlers.clear()
        atexit.unregister(self.close)


def namespaces_available() -> tuple[bool, str]:
    """Whether this process can create namespaces; the reason when not."""
    if os.geteuid() != 0:
        return False, "not running as root"
    probe = f"dcb{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return False, f"`ip netns add` failed: {exc}"
    _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def open_network(ranks: int, rate: str | None, mode: str = "auto") -> Network:
    """A namespace network when possible (``mode`` ``auto`` or ``netns``), else loopback.

    ``mode="netns"`` fails instead of falling back; ``mode="loopback"`` never
    touches namespaces.
    """
    if rate is not None:
        parse_rate(rate)  # reject a bad rate before building anything
    if mode == "loopback":
        return LoopbackNetwork(ranks, rate)
    ok, why = namespaces_available()
    if ok:
        return NamespaceNetwork(ranks, rate)
    if mode == "netns":
        raise RuntimeError(f"network namespaces unavailable: {why}")
    msg = (f"network namespaces unavailable ({why}); falling back to loopback: "
           f"THE NETWORK IS NOT RATE-LIMITED, rate {rate} is ignored")
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    print(f"WARNING: {msg}", file=sys.stderr)
    return LoopbackNetwork(ranks, rate)


# --------------------------------------------------------------------------
# Self-check: time an all-reduce across the ranks.
# --------------------------------------------------------------------------

_CHECK_SCRIPT = """
import os, time, json, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(int(os.environ["DCB_CHECK_BYTES"]) // 4)
times = []
for _ in range(int(os.environ["DCB_CHECK_REPS"]) + 1):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(t)
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print(json.dumps(times[1:]))
dist.destroy_process_group()
"""


def time_allreduce(net: Network, nbytes: int, reps: int, timeout_s: float = 120.0) -> list[float]:
    """Seconds per all-reduce of ``nbytes`` over ``net`` (first call not counted)."""
    port = net.next_port()
    procs = []
    for ep in net.endpoints:
        env = dict(os.environ, **rank_env(ep, net.ranks, net.master_addr, port),
                   DCB_CHECK_BYTES=str(nbytes), DCB_CHECK_REPS=str(reps))
        procs.append(subprocess.Popen(ep.wrap([sys.executable, "-c", _CHECK_SCRIPT]),
                                      env=env, stdout=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout_s
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"all-reduce check rank exited with {p.returncode}")
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return json.loads(outs[0].strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--mb", type=float, default=40.0, help="all-reduce size, MB (1e6 bytes)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto")
    args = parser.parse_args(argv)
    with open_network(args.ranks, args.rate, args.mode) as net:
        times = time_allreduce(net, int(args.mb * 1e6), args.reps)
        kind = f"namespaces, {args.rate}" if net.limited else "loopback, NOT limited"
        med = sorted(times)[len(times) // 2]
        print(f"{args.mb:g} MB all-reduce, {args.ranks} ranks ({kind}): "
              f"median {med * 1e3:.0f} ms  all {[round(t * 1e3) for t in times]} ms")


if __name__ == "__main__":
    main()
