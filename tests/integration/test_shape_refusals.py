"""The red team's two programs (a batch norm with a short running mean, an LSTM with a short
hidden weight: hand-edited archives that pass the archive check) are refused at each of the three
places a program is checked before it runs, by the one shape check (TrainableProgram.from_bytes
runs epochmesh.program.shape_check) each of them calls:

- the CLI's check before upload: packaging's load-back in a confined inspection child
  (`inspect_program`, what `epochmesh submit` runs);
- the coordinator's program check: SubmitJob refuses with INVALID_ARGUMENT and stores nothing;
- the agent's load: the program child (`load_confined`) refuses on the node.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from coordinator.engine.engine import Engine
from epochmesh.export_cache import ExportCache
from epochmesh.packaging import PackedJob, build_job
from epochmesh.program.inspection import Verdict, inspect_program
from epochmesh.spec import load_spec
from epochmesh.v1 import common_pb2, job_pb2, job_pb2_grpc
from node_agent.sandbox.host import REFUSED, ChildLimits, ProgramFault, load_confined
from tests.fixtures import write_mlp_job
from tests.fixtures.shape_programs import cell_program, with_weight
from tests.integration.test_program_check import no_jobs, refusal, upload
from tests.procs import aio_channel_for, in_process_coordinator

pytestmark = pytest.mark.timeout(240)

CASES = {
    "short_running_mean": (
        "bn.running_mean",
        lambda: torch.zeros(2),
        r"aten\.batch_norm\.default\): running_mean \(for 32 channels\) has shape \[2\]",
    ),
    "short_hidden_weight": (
        "lstm.weight_hh_l0",
        lambda: torch.randn(64, 2),
        r"aten\.lstm\.input\): the hidden weight of layer 0 has shape \[64, 2\]",
    ),
}


@pytest.fixture(scope="module")
def cell() -> tuple[bytes, bytes]:
    return cell_program()


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> PackedJob:
    """The MLP job: the same batch as the cell (x [n, 16], y classes of 4), for its shards."""
    job = write_mlp_job(tmp_path_factory.mktemp("mlp"), num_samples=64)
    return build_job(load_spec(job), verify=False, cache=ExportCache.default())


def hostile(cell: tuple[bytes, bytes], case: str) -> tuple[bytes, bytes]:
    fqn, make, _ = CASES[case]
    return with_weight(*cell, fqn, make())


@pytest.mark.parametrize("case", list(CASES))
def test_the_clis_check_refuses(cell: tuple[bytes, bytes], case: str) -> None:
    result = inspect_program(*hostile(cell, case))
    assert result.verdict is Verdict.REFUSED, result
    assert re.search(CASES[case][2], result.reason), result.reason


@pytest.mark.parametrize("case", list(CASES))
async def test_the_coordinators_check_refuses(
    tmp_path: Path, cell: tuple[bytes, bytes], packed: PackedJob, case: str
) -> None:
    program, state = hostile(cell, case)
    async with (
        in_process_coordinator(tmp_path / "data", engine_factory=Engine) as coord,
        aio_channel_for(coord.address) as channel,
    ):
        jobs = job_pb2_grpc.JobServiceStub(channel)
        shards = [
            common_pb2.Shard(blob=await upload(jobs, data), start=s, count=c)
            for s, c, data in packed.shards
        ]
        request = job_pb2.SubmitJobRequest(
            spec=packed.spec,
            program=await upload(jobs, program),
            initial_state=await upload(jobs, state),
            shards=shards,
        )
        details = await refusal(jobs.SubmitJob(request, timeout=60))
        assert details.startswith("program refused: "), details
        assert re.search(CASES[case][2], details), details
        await no_jobs(jobs, coord)


@pytest.mark.parametrize("case", list(CASES))
def test_the_agents_load_refuses(cell: tuple[bytes, bytes], case: str) -> None:
    program, state = hostile(cell, case)
    with pytest.raises(ProgramFault, match=CASES[case][2]) as e:
        load_confined(program, state, ChildLimits(256 << 20, threads=1))
    assert e.value.kind == REFUSED


def test_the_unedited_cell_passes_all_three(cell: tuple[bytes, bytes]) -> None:
    assert inspect_program(*cell).ok
    prog = load_confined(*cell, ChildLimits(256 << 20, threads=1))
    try:
        loss, _ = prog.loss_and_grads([torch.randn(3, 16)], [torch.randint(0, 4, (3,))])
        assert loss == loss
    finally:
        prog.close()
