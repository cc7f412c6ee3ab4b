"""Hosts made of Linux network namespaces, for the multi-host tests (docs/design.md, section 7:
hosts the test makes itself, removed afterwards, never an outside address).

Each host is a network namespace with its own address on a private /24, joined to the others
by a veth pair on a bridge in the root namespace, and its own host name: every command runs in
a UTS namespace of its own (`unshare --uts`) with `hostname` set, and `ip netns exec` mounts
/etc/netns/NAME/hosts over /etc/hosts, where every host's name resolves to its address. Names
carry a random tag, so a leftover of a run that died does not collide with the next.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"sdcprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"cannot make a network namespace: {getattr(exc, 'stderr', '') or exc}".strip()
    _ip("netns", "del", probe)
    return None


@dataclass(frozen=True)
class Host:
    name: str  # its host name, and its network namespace's
    address: str
    veth: str  # the root namespace's end of its link


class Hosts:
    """`count` hosts on one bridge; `remove()` takes down all of it, whatever was made."""

    def __init__(self, count: int):
        tag = uuid.uuid4().hex[:6]
        # 10.x.y.0/24 with x in 200-249: private, and off the usual container and VPN ranges.
        subnet = f"10.{random.randrange(200, 250)}.{random.randrange(0, 256)}"
        self.bridge = f"sdcbr{tag}"
        self.hosts = [
            Host(f"sdc{tag}h{i}", f"{subnet}.{i}", f"sdcv{tag}{i}") for i in range(1, count + 1)
        ]
        try:
            self._make()
        except BaseException:
            self.remove()
            raise

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        names = "".join(f"{h.address} {h.name}\n" for h in self.hosts)
        for host in self.hosts:
            folder = Path("/etc/netns", host.name)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
            _ip("netns", "add", host.name)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
                "netns", host.name)  # fmt: skip
            _ip("link", "set", host.veth, "master", self.bridge)
            _ip("link", "set", host.veth, "up")
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.name, "link", "set", "eth0", "up")
            _ip("-n", host.name, "link", "set", "lo", "up")

    def start(
        self, host: Host, command: list[str], log: Path, before: str = "", **kwargs
    ) -> subprocess.Popen:
        """Run `command` on `host`, under its own host name, after the shell command `before`
        (in a mount namespace of its own: a mount there is this host's alone)."""
        inner = f"{before} hostname {host.name} && exec {shlex.join(command)}"
        return subprocess.Popen(
            ["ip", "netns", "exec", host.name, "unshare", "--uts", "--mount", "sh", "-c", inner],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            **kwargs,
        )

    def cut(self, host: Host) -> None:
        _ip("link", "set", host.veth, "down")

    def mend(self, host: Host) -> None:
        _ip("link", "set", host.veth, "up")

    def kill_all(self) -> None:
        """SIGKILL every process left in the hosts' namespaces (all of them started here)."""
        for _ in range(3):
            pids = []
            for host in self.hosts:
                found = subprocess.run(
                    ["ip", "netns", "pids", host.name], capture_output=True, text=True
                )
                pids += [int(p) for p in found.stdout.split()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)

    def remove(self) -> None:
        """Everything `_make` made, each step whether or not the others worked."""
        self.kill_all()
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
            folder = Path("/etc/netns", host.name)
            (folder / "hosts").unlink(missing_ok=True)
            if folder.exists():
                folder.rmdir()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
