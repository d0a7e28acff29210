#!/usr/bin/env python3
"""Where the test suite's CPU goes, by kind of process.

Runs ``python -m pytest ARGS`` (default: the whole suite) while sampling /proc every 0.2 s, and
prints, per kind of process (its command line with addresses, paths and numbers blurred; a
forked child that kept its parent's command line counted apart as "fork of ..."), how many
ran and the CPU seconds (user + system) they used. Every process that starts during the run
is counted, to its last sample (a process killed with -9 too), whoever started it: run it on
an otherwise idle machine. A process shorter than a sample may be missed.

    scripts/profile_suite_cpu.py                      # the whole suite
    scripts/profile_suite_cpu.py -- tests/system -x   # arguments after -- go to pytest
    scripts/profile_suite_cpu.py --json -- tests/integration

Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Seen:
    pid: int
    ppid: int
    command: str
    cpu_s: float
    base_s: float  # CPU it had used when first seen (processes older than the run)


def _stat(pid: str) -> tuple[int, int, float] | None:
    """(ppid, start time in ticks, CPU seconds) of a process, or None once it has gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / TICKS


def _command(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return ""


class Sampler(threading.Thread):
    def __init__(self, interval_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.seen: dict[tuple[int, int], Seen] = {}
        self.stopped = threading.Event()
        self._first = True

    def run(self) -> None:
        me = str(os.getpid())
        while not self.stopped.is_set():
            self.sweep(me)
            self._first = False
            self.stopped.wait(self.interval_s)
        self.sweep(me)

    def sweep(self, me: str) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == me:
                continue
            stat = _stat(pid)
            if stat is None:
                continue
            ppid, start, cpu = stat
            key = (int(pid), start)
            seen = self.seen.get(key)
            if seen is None:
                base = cpu if self._first else 0.0
                self.seen[key] = Seen(int(pid), ppid, _command(pid), cpu, base)
            else:
                seen.cpu_s = cpu


def kind_of(command: str) -> str:
    """A command line with what differs between runs of one kind blurred."""
    text = re.sub(r"\S*/(?=[\w.-]+(\s|$))", "", command)  # directories
    text = re.sub(r"\[?[\d.]+\]?:\d+", "ADDR", text)  # addresses
    text = re.sub(r"\b\d+\b", "N", text)
    words = text.split()
    return " ".join(words[:5])


def summarise(seen: list[Seen]) -> list[dict[str, object]]:
    by_pid = {s.pid: s for s in seen}
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for s in seen:
        used = s.cpu_s - s.base_s
        if used <= 0 and s.base_s > 0:
            continue
        kind = kind_of(s.command) or "(no command line)"
        parent = by_pid.get(s.ppid)
        if parent is not None and parent.command == s.command:
            kind = "fork of " + kind
        totals[kind][0] += 1
        totals[kind][1] += used
    rows = [{"kind": k, "processes": int(n), "cpu_s": round(c, 1)} for k, (n, c) in totals.items()]
    return sorted(rows, key=lambda r: -float(str(r["cpu_s"])))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--top", type=int, default=30, help="kinds listed (default 30)")
    parser.add_argument("pytest_args", nargs="*", help="pytest's arguments (after --)")
    args = parser.parse_args()
    sampler = Sampler()
    sampler.start()
    started = time.monotonic()
    cmd = [str(ROOT / ".venv/bin/python"), "-m", "pytest", "-q", *(args.pytest_args or ["tests"])]
    code = subprocess.call(cmd, cwd=ROOT)
    wall = time.monotonic() - started
    sampler.stopped.set()
    sampler.join()
    rows = summarise(list(sampler.seen.values()))
    total = sum(float(str(r["cpu_s"])) for r in rows)
    if args.json:
        for row in rows:
            sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.write(json.dumps({"total_cpu_s": round(total, 1), "wall_s": round(wall, 1)}))
        sys.stdout.write("\n")
    else:
        sys.stdout.write(f"{total:9.1f} CPU-s in {wall:.0f} s ({total / wall:.2f} cores)\n")
        for row in rows[: args.top]:
            sys.stdout.write(f"{row['cpu_s']:9} {row['processes']:6}  {row['kind']}\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
