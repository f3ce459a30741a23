import os
import sys

import pytest

from benchmarks import netem


@pytest.mark.parametrize("text,bps", [
    ("1gbit", 1e9), ("10Gbit", 1e10), ("500mbit", 5e8), ("2.5gbit", 2.5e9), ("64kbit", 64e3),
])
def test_parse_rate(text, bps):
    assert netem.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["1gb", "fast", "", "0gbit", "-1gbit", "1 gbps"])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError):
        netem.parse_rate(text)


def test_tbf_burst_covers_a_timer_tick():
    assert netem.tbf_burst_bytes(1e9) == int(1e9 / 8 * netem.TBF_TICK_S)
    assert netem.tbf_burst_bytes(1e6) == netem.TBF_MIN_BURST_BYTES


def test_rank_env_and_wrap():
    ep = netem.RankEndpoint(1, "dcb1-r1", "10.231.0.2", "veth0")
    env = netem.rank_env(ep, 2, "10.231.0.1", 29501)
    assert env == {
        "MASTER_ADDR": "10.231.0.1", "MASTER_PORT": "29501", "GLOO_SOCKET_IFNAME": "veth0",
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
    }
    assert ep.wrap(["python", "x.py"]) == ["ip", "netns", "exec", "dcb1-r1", "python", "x.py"]
    lo = netem.RankEndpoint(1, None, "127.0.0.1", "lo")
    assert lo.wrap(["a"]) == ["a"]
    lo_env = netem.rank_env(lo, 2, "127.0.0.1", 29501)
    assert (lo_env["LOCAL_RANK"], lo_env["LOCAL_WORLD_SIZE"]) == ("1", "2")


def test_loopback_network():
    with netem.open_network(3, "1gbit", mode="loopback") as net:
        assert not net.limited
        assert [ep.rank for ep in net.endpoints] == [0, 1, 2]
        assert net.master_addr == "127.0.0.1"
        assert all(ep.ifname == "lo" and ep.netns is None for ep in net.endpoints)
        assert 0 < net.next_port() < 65536
        assert net.describe()["kind"] == "LoopbackNetwork"


def test_falls_back_to_loopback_with_a_warning_when_not_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.warns(RuntimeWarning, match="NOT RATE-LIMITED"):
        net = netem.open_network(2, "1gbit", mode="auto")
    assert isinstance(net, netem.LoopbackNetwork) and not net.limited
    assert "NOT RATE-LIMITED" in capsys.readouterr().err


def test_netns_mode_refuses_to_fall_back(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match="not running as root"):
        netem.open_network(2, "1gbit", mode="netns")


def test_bad_rate_rejected_before_building():
    with pytest.raises(ValueError):
        netem.open_network(2, "quick", mode="netns")


def test_too_many_ranks_rejected():
    with pytest.raises(ValueError):
        netem.NamespaceNetwork(netem.MAX_RANKS + 1, "1gbit")


@pytest.mark.skipif(sys.platform != "linux", reason="network namespaces are Linux-only")
@pytest.mark.timeout(60)
def test_namespaces_are_created_and_removed():
    ok, why = netem.namespaces_available()
    if not ok:
        pytest.skip(f"cannot create network namespaces: {why}")
    with netem.open_network(2, "1gbit", mode="netns") as net:
        names = [ep.netns for ep in net.endpoints] + [net.bridge_ns]
        listed = netem._run(["ip", "netns", "list"]).stdout
        assert all(n in listed for n in names)
        qdisc = netem._run(["tc", "-n", names[0], "qdisc", "show", "dev", "veth0"]).stdout
        assert "tbf" in qdisc and "1Gbit" in qdisc
        assert net.limited
        # The rank's hostname resolves to its own veth address inside its namespace.
        hosts = (netem.NETNS_ETC / names[1] / "hosts").read_text()
        assert f"{netem.SUBNET}.2 rank1 " in hosts
    listed = netem._run(["ip", "netns", "list"]).stdout
    assert not any(n in listed for n in names)
    assert not any((netem.NETNS_ETC / n).exists() for n in names)
