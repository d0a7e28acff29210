"""`epochmesh-agent`: the node agent's entry point."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time

from node_agent.config import parse_args
from node_agent.worker import Agent

log = logging.getLogger("node_agent")


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Library chatter stays out of the agent's debug log.
    for name in ("asyncio", "grpc", "torch"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def _join_threads(timeout: float) -> bool:
    """Wait up to `timeout` seconds for the other non-daemon threads; True if none is left."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(
        t.is_alive() and not t.daemon and t is not threading.main_thread()
        for t in threading.enumerate()
    )


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    configure_logging(config.log_level)
    log.info(
        "epochmesh-agent starting: coordinator %s, data dir %s", config.coordinator, config.data_dir
    )
    agent = Agent(config)
    try:
        code = asyncio.run(agent.run())
    except Exception:
        log.exception("agent crashed")
        code = 1
    if not _join_threads(timeout=2.0):
        log.warning("a compute thread is still busy with an abandoned task: not waiting for it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
