"""`epochmesh-agent`: the node agent's entry point.

The arguments are parsed before anything heavy is imported: ``--help`` and a usage error
answer at once, without torch or grpc (about 2 s of imports), and gRPC's own C-core log lines
are silenced (unless ``--debug``) by the environment it reads when it is imported
(epochmesh/grpc_logs.py). Those imports therefore live inside the functions below.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time

from epochmesh.grpc_logs import quiet_grpc_core
from node_agent.core.config import AgentConfig, parse_args
from node_agent.core.devices import DeviceError, select_device
from node_agent.link.backoff import RetrySchedule, UnreachableReport

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


def _enroll_unreachable(
    address: str, why: str, schedule: RetrySchedule, report: UnreachableReport
) -> None:
    """An enrollment attempt found no coordinator: say so (a warning the first time and every
    few minutes, else a debug line) and wait for the next attempt, 1 s doubling to 60 s."""
    delay = schedule.next_delay()
    now = time.monotonic()
    if report.failures == 0:
        report.failed(now)
        log.warning(
            "coordinator %s unreachable (Enroll: %s): retrying in %.1f s, then at growing "
            "intervals up to %.0f s; said again every %.0f min while it lasts",
            address,
            why,
            delay,
            schedule.cap,
            report.remind_every_s / 60,
        )
    elif report.failed(now):
        log.warning(
            "coordinator %s still unreachable after %d attempts over %.0f s (Enroll: %s); "
            "next attempt in %.1f s",
            address,
            report.failures,
            report.down_for(now),
            why,
            delay,
        )
    else:
        log.debug(
            "Enroll attempt %d failed (%s); next attempt in %.1f s", report.failures, why, delay
        )
    time.sleep(delay)


def prepare_identity(config: AgentConfig) -> int:
    """TLS set-up before the agent starts: enroll on the first start, or --insecure. Returns
    an exit code (0: go on)."""
    import grpc
    import torch

    from epochmesh.identity import IdentityError
    from node_agent.core.identity import CertificateRenewer, ensure_identity

    try:  # a bad --device is a usage error before anything is asked of the coordinator
        select_device(config.device, torch.cuda.device_count())
    except DeviceError as exc:
        log.error("%s", exc)
        return 2
    if config.insecure:
        log.warning("--insecure: talking plaintext to the coordinator, without a certificate")
        return 0
    schedule = RetrySchedule()
    report = UnreachableReport()
    retry_s = 5.0
    # Several addresses (an active coordinator and standbys): each attempt asks the next one.
    addresses = config.coordinators or (config.coordinator,)
    attempt = -1
    while True:
        attempt += 1
        address = addresses[attempt % len(addresses)]
        try:
            identity = ensure_identity(config.data_dir, address, config.token, config.name)
        except IdentityError as exc:
            log.error("%s", exc)
            return 2
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                _enroll_unreachable(address, f"{code.name}: {details}", schedule, report)
                continue
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the coordinator's rate limit
                log.warning("enrollment deferred: %s; retrying in %.0f s", details, retry_s)
                time.sleep(retry_s)
                retry_s = min(retry_s * 2, 60.0)
                continue
            log.error("enrollment refused: %s", details)
            return 2
        except ConnectionError as exc:
            _enroll_unreachable(address, str(exc), schedule, report)
            continue
        if report.succeeded():
            log.info("coordinator %s reachable again", address)
        log.info("node %s: TLS with a certificate from the coordinator's CA", identity.principal.id)
        CertificateRenewer(config.data_dir, addresses).start()
        return 0


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    # Before grpc is imported (below, and by everything the agent runs): gRPC's C core reads
    # its log settings once, at import.
    quiet_grpc_core(config.debug)
    configure_logging("DEBUG" if config.debug else config.log_level)
    from node_agent.link.metrics import AgentMetrics
    from node_agent.runtime.worker import Agent
    from node_agent.testing.cheat import CHEAT_ENV, cheat_from_environment
    from node_agent.training.tamper import HONEST

    log.info(
        "epochmesh-agent starting: coordinator %s, data dir %s",
        ",".join(config.coordinators or (config.coordinator,)),
        config.data_dir,
    )
    try:  # tests only (fault injection, node_agent.testing.cheat): not an option, never in --help
        cheat = cheat_from_environment()
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if cheat is not None:
        log.warning("%s is set: this agent CHEATS (%s)", CHEAT_ENV, cheat.describe())
    code = prepare_identity(config)
    if code:
        return code
    metrics = None
    if config.metrics_listen:
        metrics = AgentMetrics()
        try:
            address = metrics.serve(config.metrics_listen)
        except (OSError, ValueError) as exc:
            log.error("cannot serve metrics on --metrics-listen %s: %s", config.metrics_listen, exc)
            return 2
        config.data_dir.mkdir(parents=True, exist_ok=True)
        (config.data_dir / "metrics.addr").write_text(address + "\n")
        log.info("metrics on http://%s/metrics", address)
    agent = Agent(config, metrics, tamper=HONEST if cheat is None else cheat)
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
