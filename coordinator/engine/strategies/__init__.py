"""Round strategies, one module per plug-in; STRATEGIES maps a job's aggregation to its strategy. May import: coordinator.engine.ports and below.

Each strategy is an `coordinator.engine.strategy.Aggregation` made for one `JobRunner`, which
it sees as a `coordinator.engine.ports.JobPort`. The engine looks a job's ``spec.aggregation``
up here; a value not listed runs on the parameter server (epochmesh.spec admits "ps" and "ring"
only).
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.engine.ports import JobPort
from coordinator.engine.strategies.parameter_server import ParameterServerRounds
from coordinator.engine.strategies.ring import RingRounds
from coordinator.engine.strategy import Aggregation

STRATEGIES: dict[str, Callable[[JobPort], Aggregation]] = {
    "ps": ParameterServerRounds,
    "ring": RingRounds,
}

__all__ = ["STRATEGIES", "ParameterServerRounds", "RingRounds"]
