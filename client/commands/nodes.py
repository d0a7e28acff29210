"""Operator commands on nodes: ``nodes``, ``cordon``, ``uncordon`` (alias ``undrain``),
``drain [--stop]``.

Drained or cordoned, a node gets no new work and its agent stays up and idle, heartbeating,
until uncordoned (as in Slurm and Kubernetes). Only ``drain --stop`` makes the agent go: it
finishes its current task, leaves the coordinator and exits."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from client.commands.context import Context
from client.commands.output import node_state_name, node_status, parse_node_states, to_dict
from client.render import fmt_age, fmt_bytes, fmt_rate
from client.rpc import ExitCode
from epochmesh.money import format_credits
from epochmesh.timeutil import now_ms
from epochmesh.v1 import common_pb2, scheduler_pb2

# Checks in a row before a node's check rate starts to fall (coordinator/verification/reputation.py N0).
NEW_UNTIL = 10
# A job id's prefix shown in the table ("j-" and 6 hex: `status` accepts unique prefixes).
JOB_ID_SHOWN = 8


def device_summary(node: common_pb2.NodeInfo) -> str:
    """A short description of a node's devices, e.g. ``2x NVIDIA H100 80GB`` or ``cpu 16c``."""
    gpus = [d for d in node.devices if d.kind == "cuda"]
    if gpus:
        first = gpus[0]
        name = first.name.replace("NVIDIA ", "") or "cuda"
        mem = f" {first.total_memory_bytes / 2**30:.0f}G" if first.total_memory_bytes else ""
        count = f"{len(gpus)}x " if len(gpus) > 1 else ""
        return f"{count}{name}{mem}"
    cpus = [d for d in node.devices if d.kind == "cpu"]
    if cpus:
        cores = sum(d.cores for d in cpus)
        mem = cpus[0].total_memory_bytes
        return f"cpu {cores}c" + (f" {fmt_bytes(mem).replace(' ', '')}" if mem else "")
    return "-"


def node_rate(node: common_pb2.NodeInfo) -> float:
    """Observed samples/s when known, else the benchmark's."""
    if node.observed_samples_per_second > 0:
        return node.observed_samples_per_second
    return node.benchmark.samples_per_second


def node_price(node: common_pb2.NodeInfo) -> str:
    """The donor's asking price in credits per hour (``2.5/h``), or ``free`` for a donation."""
    if node.price_micro_per_hour <= 0:
        return "free"
    return f"{format_credits(node.price_micro_per_hour)}/h"


def fmt_verified(node: common_pb2.NodeInfo) -> str:
    """The node's verification record in at most 8 characters, without spaces: ``new:3/10``
    (checked every round until 10 checks in a row pass), ``42@0.24`` (checks passed in a row,
    the chance its next round is checked), ``fail:r17`` (its check of round 17 failed)."""
    r = node.reputation
    if r.failed_total and r.last_failure_round and r.verified_in_a_row == 0:
        return f"fail:r{r.last_failure_round}"
    if r.check_probability >= 1.0 or r.verified_in_a_row < NEW_UNTIL:
        return f"new:{r.verified_in_a_row}/{NEW_UNTIL}"
    return f"{r.verified_in_a_row}@{r.check_probability:.2f}"


def cmd_nodes(ctx: Context) -> int:
    states = parse_node_states(ctx.args.state) if ctx.args.state else []
    coord = ctx.coordinator
    reply = coord.call(
        "ListNodes",
        coord.scheduler.ListNodes,
        scheduler_pb2.ListNodesRequest(states=states),
    )
    nodes = sorted(reply.nodes, key=lambda n: (n.name, n.node_id))
    if ctx.json:
        ctx.emit_json({"nodes": [to_dict(n) for n in nodes]})
        return ExitCode.OK
    if not nodes:
        which = f" in state {ctx.args.state}" if ctx.args.state else ""
        ctx.note(f"no nodes{which}; start one with `epochmesh-agent --coordinator ADDRESS`")
        return ExitCode.OK
    now = now_ms()
    rows = [
        [
            n.node_id,
            n.name or "-",
            node_status(n),
            device_summary(n),
            fmt_rate(node_rate(n)),
            node_price(n),
            fmt_verified(n),
            n.current_job_id[:JOB_ID_SHOWN] or "-",
            fmt_age(n.last_heartbeat_ms, now),
        ]
        for n in nodes
    ]
    style = ctx.out_style
    ctx.emit_table(
        ["NODE", "NAME", "STATE", "DEVICE", "SAMPLES/S*", "PRICE", "CHECKS", "JOB", "SEEN"],
        rows,
        right=(4, 5),
        flex=3,  # the device summary gives way first in a narrow terminal
        paint={2: style.state},
    )
    return ExitCode.OK


def _node_action(verb: str, method_name: str, done: str) -> Callable[[Context], int]:
    def run(ctx: Context) -> int:
        node = ctx.get_node(ctx.args.node)
        stop = bool(getattr(ctx.args, "stop", False))
        coord = ctx.coordinator
        method = getattr(coord.scheduler, method_name)
        request = scheduler_pb2.NodeRequest(node_id=node.node_id, stop=stop)
        updated = coord.call(method_name, method, request)
        if ctx.json:
            ctx.emit_json(to_dict(updated))
        else:
            label = f"{updated.node_id} ({updated.name})" if updated.name else updated.node_id
            what = "asked to leave" if stop else done
            ctx.emit(f"node {label} {what}: now {node_state_name(updated.state)}")
        return ExitCode.OK

    run.__doc__ = f"{verb} a node"
    return run


cmd_cordon = _node_action("cordon", "Cordon", "cordoned")
cmd_uncordon = _node_action("uncordon", "Uncordon", "uncordoned")
cmd_drain = _node_action("drain", "Drain", "draining")

# (the command list's line, the command's own description)
CORDON_HELP = (
    "give a node no new work; the agent stays up and idle",
    "Give a node no new work. It finishes the round it is in and its agent stays up and idle, "
    "heartbeating, until `epochmesh uncordon`.",
)
UNCORDON_HELP = (
    "give a cordoned or drained node work again",
    "Give a cordoned or drained node work again (`undrain` is the same command). A `drain "
    "--stop` that its agent has not acted on yet is withdrawn: the agent stays.",
)
DRAIN_HELP = (
    "finish its task, then no work; the agent stays up and idle (--stop: it exits)",
    "Let a node finish its current task, then give it no work: the agent stays up and idle, "
    "heartbeating, until `epochmesh uncordon`. With --stop the agent finishes its task, "
    "leaves the coordinator and exits.",
)


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: list[argparse.ArgumentParser]
) -> None:
    p = sub.add_parser(
        "nodes",
        parents=common,
        help="list nodes",
        description="List the nodes known to the coordinator: state, device, SAMPLES/S* "
        "(the node's measured speed on the job it trains now, else its reference "
        "benchmark's: a small built-in MLP, not your job's speed; `epochmesh quote` "
        "predicts that), price, CHECKS (the spot-check record: "
        "new:3/10 while new and checked every round, 42@0.24 for 42 checks passed in a row "
        "and a 0.24 chance its next round is checked, fail:r17 after a failed check), its job "
        "(an id prefix) and when its last heartbeat was SEEN. --output json gives every "
        "field, the record under reputation.",
    )
    p.add_argument(
        "--state",
        metavar="S",
        help="only nodes in these states (comma-separated): online, busy, draining, "
        "cordoned, offline, quarantined",
    )
    p.set_defaults(func=cmd_nodes)

    for name, aliases, func, (text, description) in (
        ("cordon", [], cmd_cordon, CORDON_HELP),
        ("uncordon", ["undrain"], cmd_uncordon, UNCORDON_HELP),
        ("drain", [], cmd_drain, DRAIN_HELP),
    ):
        p = sub.add_parser(
            name, aliases=aliases, parents=common, help=text, description=description
        )
        p.add_argument("node", metavar="NODE", help="node id, unique id prefix or unique name")
        if name == "drain":
            p.add_argument(
                "--stop",
                action="store_true",
                help="make the agent leave too: it finishes its current task, leaves the "
                "coordinator and exits 0 (the node shows as offline; started again, it comes "
                "back cordoned)",
            )
        p.set_defaults(func=func)
