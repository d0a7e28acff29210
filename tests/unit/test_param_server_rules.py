"""The parameter server's [train] aggregation_rule: mean keeps the plain-replay arithmetic, the
robust rules bound what one bad update does to the step."""

from __future__ import annotations

import pytest
import torch

from coordinator.aggregation.param_server import ParameterServer
from epochmesh.v1 import common_pb2

pytestmark = pytest.mark.timeout(60)


def server(rule: str) -> ParameterServer:
    spec = common_pb2.JobSpec(optimizer="sgd", lr=1.0, aggregation_rule=rule)
    return ParameterServer(spec, {"w": torch.zeros(4)})


def parts(bad_scale: float) -> list[tuple[int, dict[str, torch.Tensor]]]:
    honest = [(8, {"w": torch.tensor([1.0, 1.0, 1.0, 1.0]) + 0.01 * i}) for i in range(4)]
    return [*honest, (8, {"w": torch.full((4,), bad_scale)})]


def test_mean_is_the_sample_weighted_mean() -> None:
    ps = server("")
    ps.apply(parts(1.0))
    assert torch.allclose(ps.params["w"].detach(), -torch.full((4,), 1.012), atol=1e-6)


@pytest.mark.parametrize("rule", ["trimmed_mean", "centered_clip"])
def test_a_robust_rule_bounds_one_update_scaled_by_100(rule: str) -> None:
    mean, robust = server(""), server(rule)
    mean.apply(parts(100.0))
    robust.apply(parts(100.0))
    assert mean.params["w"].detach().abs().max() > 20  # the mean follows the bad update
    assert robust.params["w"].detach().abs().max() < 2.5  # the robust rule does not
