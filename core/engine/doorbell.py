"""A doorbell for idle workers: one TCP connection from each worker rank to rank 0, on
which rank 0 writes one byte before every message it broadcasts (docs/DESIGN.md §19).

MLX's ring backend waits for data by polling its sockets, so a worker that waits for rank
0's next message inside the ``all_sum`` of :meth:`~.distributed.Ranks.broadcast` burns a
core while rank 0 is idle (measured: 79 % of a core, 2 ranks on this machine's CPU). With
the bell a worker blocks in ``recv`` (no CPU) until a message comes, then enters the
collective. Rank 0 opens the bell with its first message (its address travels in it); every
rank then agrees, in one ``all_min``, whether every worker is connected, so either all
ranks use the bell or none does. Ranks without a ring hostfile (other backends) go without.
"""

from __future__ import annotations

import json
import os
import socket

CONNECT_TIMEOUT_S = 10.0


def rank0_host() -> str | None:
    """Rank 0's address from the ring hostfile ``mlx.launch`` writes (``MLX_HOSTFILE``:
    a JSON list per rank of ``"ip:port"``); None without one."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return None
    try:
        with open(path) as f:
            ring = json.load(f)
        host = str(ring[0][0]).rsplit(":", 1)[0]
    except (OSError, ValueError, LookupError, TypeError):
        return None
    return host or None


class Doorbell:
    """Rank 0's side (:meth:`listen`, :meth:`accept`, :meth:`ring`) or a worker's
    (:meth:`connect`, :meth:`wait`) of the bell. Not thread-safe: the engine thread only."""

    def __init__(self) -> None:
        self.listener: socket.socket | None = None
        self.peers: list[socket.socket] = []

    # ---------------------------------------------------------------- rank 0
    def listen(self, host: str) -> tuple[str, int] | None:
        """Open the listening socket; its ``(host, port)``, or None when it cannot."""
        try:
            s = socket.create_server((host, 0))
        except OSError:
            return None
        self.listener = s
        return host, s.getsockname()[1]

    def accept(self, n: int, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
        """Take ``n`` workers' connections (they connect once the first message
        reached them). False when one did not come within ``timeout_s`` seconds."""
        assert self.listener is not None
        self.listener.settimeout(timeout_s)
        try:
            while len(self.peers) < n:
                conn, _ = self.listener.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.peers.append(conn)
        except OSError:
            return False
        finally:
            self.listener.close()
            self.listener = None
        return True

    def ring(self) -> None:
        """Wake every worker for the next message (a worker that is gone is skipped: the
        collective that follows reports it)."""
        for peer in self.peers:
            try:
                peer.sendall(b"\x01")
            except OSError:
                pass

    # ---------------------------------------------------------------- a worker
    def connect(self, address: tuple[str, int]) -> bool:
        try:
            s = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            return False
        s.settimeout(None)  # from now on, block until rank 0 rings
        self.peers = [s]
        return True

    def wait(self) -> bool:
        """Block until rank 0 rings (True) or its end of the bell closed (False: rank 0
        is gone)."""
        try:
            return self.peers[0].recv(1) != b""
        except OSError:
            return False

    def close(self) -> None:
        for s in [*self.peers, *([self.listener] if self.listener else [])]:
            try:
                s.close()
            except OSError:
                pass
        self.peers, self.listener = [], None
