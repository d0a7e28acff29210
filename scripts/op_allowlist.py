#!/usr/bin/env python3
"""Review aid for epochmesh/program/op_allowlist.py (issue 17); it changes nothing.

    .venv/bin/python scripts/op_allowlist.py core
        torch's core ATen overloads (torch.Tag.core) of the installed torch that are not on the
        list: after a torch upgrade, the new ones to review (the header of op_allowlist.py lists
        the ones trimmed on purpose);
    .venv/bin/python scripts/op_allowlist.py path/to/job.toml
        exports the job's model and loss as packaging does (dynamic batch dimension, without the
        archive check) and prints every ATen operator of the program, those off the list marked
        with "refused".

Exporting runs make_model() and traces forward with fake tensors: only for models you trust.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from epochmesh.program.op_allowlist import ALLOWED_ATEN_OPS


def core_overloads() -> Iterator[str]:
    for name in dir(torch.ops.aten):
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            continue
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            if torch.Tag.core in getattr(packet, overload).tags:
                yield f"aten.{name}.{overload}"


def job_program(job_toml: Path) -> bytes:
    from epochmesh import packaging
    from epochmesh.spec import load_spec

    loaded = load_spec(job_toml)
    spec = loaded.spec
    data = packaging.load_dataset(loaded.data_path, list(spec.inputs), list(spec.targets))
    with packaging.importable(loaded.model_path.parent):
        module = packaging.import_model_file(loaded.model_path)
        loss_fn = packaging._pick_loss(module, spec, loaded.model_path.name)
        model = packaging._make_model(module, spec.seed, loaded.model_path)
        example = packaging._example_batch(data, [*spec.inputs, *spec.targets])
        wrapper = packaging.LossWrapper(model, loss_fn, len(spec.inputs))
        batch = torch.export.Dim("batch", min=1)
        dynamic = (tuple({0: batch} for _ in example),)
        ep = torch.export.export(wrapper, example, dynamic_shapes=dynamic)
    ep.example_inputs = None
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return buf.getvalue()


def graph_targets(graph: dict) -> Iterator[str]:
    for node in graph["nodes"]:
        yield node["target"]
        for inp in node["inputs"]:
            sub = (inp.get("arg") or {}).get("as_graph")
            if sub:
                yield from graph_targets(sub["graph"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", help='"core", or the path of a job.toml')
    args = parser.parse_args()
    if args.what == "core":
        missing = sorted(set(core_overloads()) - ALLOWED_ATEN_OPS)
        print("\n".join(missing))
        print(f"{len(missing)} core overloads are not on the list", file=sys.stderr)
        return 0
    archive = zipfile.ZipFile(io.BytesIO(job_program(Path(args.what))))
    name = next(n for n in archive.namelist() if n.endswith("models/model.json"))
    graph = json.loads(archive.read(name))["graph_module"]["graph"]
    aten = sorted({t.removeprefix("torch.ops.") for t in graph_targets(graph) if ".aten." in t})
    for op in aten:
        print(op if op in ALLOWED_ATEN_OPS else f"{op}  refused")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
