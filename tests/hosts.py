"""Hosts for multi-host tests: network namespaces joined by veth pairs to a bridge in a
namespace of their own, each with an address in a private range, traffic only between
them. Every command runs in its host's namespace with ``GLOO_SOCKET_IFNAME`` set to its
end of the link. Needs root (CI runs as root)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class Host:
    namespace: str
    interface: str
    address: str

    def start(self, args: Sequence[str], log: Path, env: dict[str, str] | None = None):
        """``args`` run in this host, output to ``log``, in a process group of its own."""
        variables = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": self.interface}
        command = ["ip", "netns", "exec", self.namespace, *args]
        with log.open("ab") as out:
            return subprocess.Popen(
                command, env=variables, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def signal_ranks(self, sig: int) -> None:
        """Send ``sig`` to the host's training processes (not its torchrun agent)."""
        for pid in self._pids():
            with contextlib.suppress(OSError):
                if "embshard.app.train" in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(int(pid), sig)

    def _pids(self) -> list[str]:
        found = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True)
        return found.stdout.decode().split()

    def kill_everything(self) -> None:
        """SIGKILL every process in the host: its agent and its workers."""
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


@contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """``count`` hosts on one private link (10.X.0.0/24, X from the process id)."""
    tag = f"es{os.getpid() % 100000}"
    subnet = f"10.{200 + os.getpid() % 50}.0"
    made: list[str] = []
    try:
        bridge = f"{tag}br"
        _ip("netns", "add", bridge)
        made.append(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        found = []
        for i in range(count):
            namespace, interface = f"{tag}h{i}", f"eth{i}"
            _ip("netns", "add", namespace)
            made.append(namespace)
            _ip("link", "add", f"{tag}a{i}", "type", "veth", "peer", "name", f"{tag}b{i}")
            _ip("link", "set", f"{tag}a{i}", "netns", namespace)
            _ip("link", "set", f"{tag}b{i}", "netns", bridge)
            _ip("-n", namespace, "link", "set", f"{tag}a{i}", "name", interface)
            address = f"{subnet}.{i + 1}"
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", bridge, "link", "set", f"{tag}b{i}", "master", "br0")
            _ip("-n", bridge, "link", "set", f"{tag}b{i}", "up")
            found.append(Host(namespace, interface, address))
        yield found
    finally:
        for namespace in reversed(made):
            Host(namespace, "", "").kill_everything()
        time.sleep(0.2)
        for namespace in reversed(made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
