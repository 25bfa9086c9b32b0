"""Two "nodes" on one machine: network namespaces joined by a veth pair, made and removed by the test.

Each node is a namespace with its own loopback, its own port space and one address on the pair
(``10.231.0.1`` and ``10.231.0.2``); a process started in node 1 cannot reach node 0's loopback,
only its address. The namespaces share the filesystem (as nodes share a network filesystem) unless
a command hides a folder from its node (an empty tmpfs over it, in a private mount namespace).
Everything here needs root and iproute2; :func:`unavailable` says why not, for a skip.
"""

import os
import shutil
import subprocess

ADDRESSES = ("10.231.0.1", "10.231.0.2")


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no '{tool}' command (iproute2 / util-linux)"
    return None


class TwoNodes:
    """``with TwoNodes() as nodes:`` two namespaces named after this process, removed on exit."""

    def __init__(self):
        tag = f"frl{os.getpid()}"
        self.names = (f"{tag}n0", f"{tag}n1")
        # The veth ends' names (at most 15 characters): gloo binds to them by name (GLOO_SOCKET_IFNAME).
        self.ifnames = (f"{tag}v0", f"{tag}v1")
        self.addresses = ADDRESSES

    def __enter__(self):
        try:
            for name in self.names:
                _ip("netns", "add", name)
            _ip("link", "add", self.ifnames[0], "type", "veth", "peer", "name", self.ifnames[1])
            for name, ifname, address in zip(self.names, self.ifnames, self.addresses, strict=True):
                _ip("link", "set", ifname, "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", ifname)
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "link", "set", ifname, "up")
        except subprocess.CalledProcessError as exc:
            self.__exit__(None, None, None)
            raise RuntimeError(f"could not make two network namespaces: {' '.join(exc.cmd)}: "
                               f"{exc.stderr.strip()}") from None
        return self

    def __exit__(self, *exc):
        # Removing a namespace removes the veth end inside it, and with it the peer.
        for name in self.names:
            _ip("netns", "delete", name, check=False)
        _ip("link", "delete", self.ifnames[0], check=False)  # only if it never moved into a namespace

    def command(self, node: int, argv: list, hide=()) -> list:
        """``argv`` run in ``node``'s namespace; each folder in ``hide`` is an empty tmpfs there (a path
        only the other node has)."""
        argv = [str(a) for a in argv]
        if hide:
            mounts = " && ".join(f"mount -t tmpfs fastrlhf-test '{path}'" for path in hide)
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh",
                    *argv]
        return ["ip", "netns", "exec", self.names[node], *argv]

    def unplug(self, node: int) -> None:
        """Take ``node`` off the network: nothing it sends (not even a connection's close) arrives."""
        _ip("-n", self.names[node], "link", "set", self.ifnames[node], "down")

    def plug(self, node: int) -> None:
        _ip("-n", self.names[node], "link", "set", self.ifnames[node], "up")

    def mine(self) -> list[str]:
        """The namespaces of this object that exist now (for the test that they are all gone)."""
        listed = _ip("netns", "list", check=False).stdout.split()
        return [name for name in self.names if name in listed]
