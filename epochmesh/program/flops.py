"""FLOPs of one training step of an exported program, per sample: counted by the coordinator in
its program check (`declared_flops_per_sample`, on zeros of the program's declared input
shapes: the count depends on shapes only), which is the figure quotes use; the CLI counts them
too where it exports (`training_flops_per_sample`, on a few real samples) and shows its own.

Counted with ``torch.utils.flop_counter.FlopCounterMode`` over a forward and backward pass of
the program (model + loss) on a few real samples of the job's dataset: matrix products,
convolutions and attention, the operations whose count predicts a step's time; element-wise
work (activations, norms, the optimizer) is not counted. The reference benchmark's model
(node_agent/training/reference_model.py: an MLP 128-256-256-10 trained with SGD) does
REFERENCE_FLOPS_PER_SAMPLE (epochmesh/quote.py) by the same count (tests/unit/test_quote_estimate.py counts it
again), so a node's measured reference samples/s times that is its measured FLOP/s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from epochmesh.program.archive import TrainableProgram


def training_flops_per_sample(
    program: bytes,
    initial_state: bytes,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
) -> float:
    """FLOPs of a forward and backward pass of ``program`` per sample, counted on the batch
    ``inputs`` / ``targets`` (a few samples: the count is linear in the batch). 0.0 when
    nothing countable ran."""
    batch = int(inputs[0].shape[0]) if inputs else 0
    if batch <= 0:
        return 0.0
    prog = TrainableProgram.from_bytes(program, initial_state)
    counter = FlopCounterMode(display=False)
    with counter:
        prog.loss_and_grads(inputs, targets)
    return float(counter.get_total_flops()) / batch


COUNT_BATCH = 4  # the batch size the coordinator counts at (clamped into the declared range)


def declared_flops_per_sample(prog: TrainableProgram, batch: int = COUNT_BATCH) -> float:
    """FLOPs of a forward and backward pass of the loaded ``prog`` per sample, on zeros of its
    declared input shapes at batch size ``batch`` (clamped into the program's declared range;
    the batch is the first input's first dimension). 0.0 when nothing countable ran or the
    program has no batch dimension. Raises what the program raises on such a batch."""
    args = prog.shapes.zero_inputs(batch, prog.device)
    if not args or args[0].dim() == 0 or int(args[0].shape[0]) <= 0:
        return 0.0
    counter = FlopCounterMode(display=False)
    with counter:
        prog.loss_and_grads(args, [])  # the program takes its inputs then targets in a row
    return float(counter.get_total_flops()) / int(args[0].shape[0])
