"""SINGA's conf/hostfile: one host per line, node i on line i; node 0 is the master.

`shoal run JOB --hostfile FILE` is started on every listed host; each finds
its own node rank by looking for itself in the file (its hostnames, or an
address one of its interfaces holds), so the same command line runs
everywhere. The matching is pure (`node_rank_of`); what this machine is
called and holds comes from `this_machine`.
"""
from __future__ import annotations

import ipaddress
import socket
import subprocess
from pathlib import Path
from typing import Callable

from shoal.errors import ShoalError


class HostfileError(ShoalError, ValueError):
    """The hostfile cannot be read or does not say which node this is (one line, naming the file)."""


def parse_hosts(text: str, source: str) -> list[str]:
    """Hosts in order; `#` starts a comment; one host (name or address) per line."""
    hosts = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if len(words) > 1:
            raise HostfileError(f"{source}:{number}: one host per line, got {' '.join(words)!r}")
        hosts.extend(words)
    if not hosts:
        raise HostfileError(f"{source}: no hosts listed")
    return hosts


def read_hosts(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except OSError as err:
        raise HostfileError(f"{path}: {err.strerror}") from None
    return parse_hosts(text, str(path))


def node_rank_of(hosts: list[str], names: set[str], addresses: set[str], resolve: Callable[[str], set[str]], source: str) -> int:
    """The line of `hosts` that is this machine: listed by one of its `names` or one of its `addresses`.

    `resolve(host)` gives a host's addresses (empty when it cannot be resolved). A machine
    listed twice (two nodes on one host) cannot tell which it is: that needs --node-rank.
    """
    names = {n.lower() for n in names}
    addresses = {_canonical(a) for a in addresses}

    def is_me(host: str) -> bool:
        if host.lower() in names or _canonical(host) in addresses:
            return True
        return bool({_canonical(a) for a in resolve(host)} & addresses)

    mine = [i for i, host in enumerate(hosts) if is_me(host)]
    if len(mine) == 1:
        return mine[0]
    if not mine:
        known = ", ".join(sorted(names | addresses))
        raise HostfileError(f"{source}: this machine ({known}) is not listed; pass --node-rank")
    lines = ", ".join(f"line {i + 1} ({hosts[i]})" for i in mine)
    raise HostfileError(f"{source}: this machine is listed more than once ({lines}); pass --node-rank")


def _canonical(address: str) -> str:
    try:
        return str(ipaddress.ip_address(address.split("%", 1)[0]))
    except ValueError:
        return address.lower()


def resolve(host: str) -> set[str]:
    """The addresses `host` resolves to here (empty if it does not resolve)."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return set()


def this_machine() -> tuple[set[str], set[str]]:
    """(hostnames, addresses held by this machine's interfaces, loopback excluded)."""
    names = {socket.gethostname(), socket.getfqdn()} - {"localhost", "localhost.localdomain"}
    addresses: set[str] = set()
    try:  # iproute2 lists every interface's addresses, also in a network namespace
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=5, check=False).stdout
        for line in out.splitlines():
            words = line.split()
            for family in ("inet", "inet6"):
                if family in words:
                    addresses.add(words[words.index(family) + 1].split("/")[0])
    except (OSError, subprocess.TimeoutExpired):
        pass
    if not addresses:
        addresses = resolve(socket.gethostname())
    return names, {a for a in addresses if not ipaddress.ip_address(a.split("%", 1)[0]).is_loopback}
