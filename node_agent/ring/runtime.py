"""The agent's side of the ring data plane: its PeerServer, identity and ring transport.

`PeerRuntime` is what the worker builds once at start-up and hands to every task (in
`TaskContext.peer`); a ring TRAIN task asks it for the transport of the node id the
coordinator gave this agent. A transport replaced (the node id changed) is closed in the
background; `_closing` holds those close tasks until they finish, so that none is
garbage-collected half-way.
"""

from __future__ import annotations

import asyncio

from epochmesh.identity import Identity
from node_agent.ring.links import PeerLinks
from node_agent.ring.service import PeerServer
from node_agent.ring.transport import RingTransport


class PeerRuntime:
    """This agent's PeerServer, its identity for dialing peers, and the ring transport."""

    def __init__(self, server: PeerServer | None, identity: Identity | None) -> None:
        self.server = server
        self.identity = identity
        self._transport: RingTransport | None = None
        self.links = PeerLinks()  # measured links to ring peers, reported to the coordinator

    def transport(self, node_id: str) -> RingTransport:
        """The ring transport for this node id (made again if the coordinator assigned
        another id since)."""
        if self.server is None:
            raise ValueError(
                "this agent runs no PeerService (--no-peer) and cannot take part in a ring"
            )
        t = self._transport
        if t is None or t.node_id != node_id:
            if t is not None:
                _spawn_close(t)
            t = self._transport = RingTransport.for_server(
                node_id, self.server, identity=self.identity
            )
        return t

    async def close(self) -> None:
        await self.links.close()
        if self._transport is not None:
            await self._transport.close()
            self._transport = None


_closing: set[asyncio.Task[None]] = set()


def _spawn_close(transport: RingTransport) -> None:
    task = asyncio.get_running_loop().create_task(transport.close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)
