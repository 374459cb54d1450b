"""Real network partitions for tests: a network namespace joined to this host by links that
can be cut without a reset.

Each link is a veth pair whose host end is the only port of a bridge of its own that carries
the host's address on that link. Cutting it puts the bridge port in the STP "listening"
state: every frame is dropped, both ways, while both interfaces stay up and every socket
stays open, so nothing is reset and nothing is refused; TCP on each side sees only silence,
as behind a failed switch. (The kernel moves such a port on to forwarding after two forward
delays, 30 s, so a cut is asserted again every second until it is healed; netem, nftables
and VLAN filtering are not available on every test machine, this is.) A process runs inside
with :meth:`NetworkNamespace.wrapper`; servers it should reach listen on :meth:`host_ip`.
Needs root and iproute2 (``ip netns``).
"""

from __future__ import annotations

import random
import subprocess
import threading
import uuid

#: STP port states of the bridge port: frames forwarded, or dropped ("listening").
FORWARDING, LISTENING = 3, 1


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


class NetworkNamespace:
    """A namespace with ``links`` cuttable links to this host (10.<n>.<i>.1 <-> .2)."""

    def __init__(self, links: int = 2) -> None:
        self.name = f"rs{uuid.uuid4().hex[:6]}"
        self.links = links
        self.net = random.randrange(200, 250)
        self._made: list[str] = []
        self._cuts: dict[int, threading.Event] = {}

    def host_ip(self, link: int) -> str:
        """This host's address on ``link``: what the namespace reaches it by."""
        return f"10.{self.net}.{link}.1"

    def inner_ip(self, link: int) -> str:
        return f"10.{self.net}.{link}.2"

    def _names(self, link: int) -> tuple[str, str, str]:
        return f"{self.name}b{link}", f"{self.name}h{link}", f"{self.name}n{link}"

    def create(self) -> NetworkNamespace:
        _ip("netns", "add", self.name)
        inside = ["netns", "exec", self.name, "ip"]
        _ip(*inside, "link", "set", "lo", "up")
        for link in range(self.links):
            bridge, host_end, inner_end = self._names(link)
            _ip("link", "add", bridge, "type", "bridge")
            self._made.append(bridge)
            _ip("addr", "add", f"{self.host_ip(link)}/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
            _ip("link", "add", host_end, "type", "veth", "peer", "name", inner_end)
            self._made.append(host_end)
            _ip("link", "set", host_end, "master", bridge)
            _ip("link", "set", host_end, "up")
            _ip("link", "set", inner_end, "netns", self.name)
            _ip(*inside, "addr", "add", f"{self.inner_ip(link)}/24", "dev", inner_end)
            _ip(*inside, "link", "set", inner_end, "up")
        return self

    def wrapper(self) -> list[str]:
        """A command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def _port_state(self, link: int, state: int) -> None:
        _ip("link", "set", "dev", self._names(link)[1], "type", "bridge_slave", "state",
            str(state))

    def cut(self, link: int) -> None:
        """Drop every frame on ``link``, both ways, without a reset, until :meth:`heal`."""
        if link in self._cuts:
            return
        self._port_state(link, LISTENING)
        healed = self._cuts[link] = threading.Event()

        def keep_cut() -> None:
            while not healed.wait(1.0):
                self._port_state(link, LISTENING)

        threading.Thread(target=keep_cut, name=f"cut-{self.name}-{link}", daemon=True).start()

    def heal(self, link: int) -> None:
        healed = self._cuts.pop(link, None)
        if healed is not None:
            healed.set()
        self._port_state(link, FORWARDING)

    def destroy(self) -> None:
        for healed in self._cuts.values():
            healed.set()
        self._cuts.clear()
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)
        for dev in reversed(self._made):
            subprocess.run(["ip", "link", "del", dev], check=False, capture_output=True)
        self._made.clear()



__all__ = ["NetworkNamespace"]
