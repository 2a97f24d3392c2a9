"""SINGA's hostfile: every host runs the same command and finds its own node rank in the file."""
from __future__ import annotations

import pytest

from shoal.launcher.hostfile import HostfileError, node_rank_of, parse_hosts, this_machine

HOSTS = ["node-a.example", "10.0.0.2", "node-c", "fe80::1"]
DNS = {"node-a.example": {"10.0.0.1"}, "node-c": {"10.0.0.3", "fd00::3"}}


def resolve(host: str) -> set[str]:
    return DNS.get(host, set())


@pytest.mark.parametrize(
    "names, addresses, rank",
    [
        ({"node-a.example"}, set(), 0),  # listed by its name
        ({"NODE-A.example"}, set(), 0),  # hostnames are case-insensitive
        ({"elsewhere"}, {"10.0.0.1"}, 0),  # listed by a name that resolves to one of its addresses
        ({"elsewhere"}, {"10.0.0.2", "192.168.1.5"}, 1),  # listed by an address it holds
        ({"elsewhere"}, {"fd00:0:0:0:0:0:0:3"}, 2),  # the same IPv6 address written another way
        ({"elsewhere"}, {"fe80::1%eth0"}, 3),  # a link-local address with its zone
    ],
)
def test_a_host_finds_its_line(names, addresses, rank):
    assert node_rank_of(HOSTS, names, addresses, resolve, "hostfile") == rank


@pytest.mark.parametrize("names, addresses", [({"elsewhere"}, {"10.9.9.9"}), (set(), set())])
def test_a_host_not_listed_is_told_to_pass_its_node_rank(names, addresses):
    with pytest.raises(HostfileError, match=r"^conf/hostfile: this machine .* is not listed; pass --node-rank$"):
        node_rank_of(HOSTS, names, addresses, resolve, "conf/hostfile")


def test_a_host_listed_twice_cannot_tell_which_node_it_is():
    with pytest.raises(HostfileError, match=r"listed more than once \(line 1 \(node-a.example\), line 3 \(10.0.0.1\)\); pass --node-rank$"):
        node_rank_of(["node-a.example", "10.0.0.2", "10.0.0.1"], {"node-a.example"}, {"10.0.0.1"}, resolve, "hostfile")


def test_hostfile_lines_comments_and_blanks():
    assert parse_hosts("# SINGA conf/hostfile\nnode-a\n\n  10.0.0.2  # the second\n", "f") == ["node-a", "10.0.0.2"]


@pytest.mark.parametrize("text, message", [("", "f: no hosts listed"), ("# only\n\n", "f: no hosts listed"), ("a\nb c\n", "f:2: one host per line")])
def test_bad_hostfiles_are_one_line_errors_naming_the_line(text, message):
    with pytest.raises(HostfileError, match="^" + message):
        parse_hosts(text, "f")


def test_this_machine_holds_no_loopback_and_is_found_by_its_own_name():
    names, addresses = this_machine()
    assert not {"127.0.0.1", "::1"} & addresses
    me = sorted(names)[0]
    assert node_rank_of(["other.invalid", me], names, addresses, lambda h: set(), "hostfile") == 1
