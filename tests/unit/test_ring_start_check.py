"""coordinator.verification.snapshot_check.ring_start_problem: a ring member's upload of the parameters its
checked part started from is taken only when they are the job's parameters and hash to the
checksum its ring agreed on (pure)."""

from __future__ import annotations

import pytest
import torch

from coordinator.verification.snapshot_check import ring_start_problem
from epochmesh.verification import split_round_start, state_digest, with_round_start
from epochmesh.wire.tensors import params_checksum

pytestmark = pytest.mark.timeout(30)


def job_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "0.weight": torch.randn(4, 3, generator=g),
        "0.bias": torch.randn(4, generator=g),
        "2.weight": torch.randn(2, 4, generator=g),
    }


def expected_of(params: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {n: (t.dtype, tuple(t.shape)) for n, t in params.items()}


def upload(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"param/{n}": t.clone() for n, t in params.items()}


def test_the_agreed_parameters_are_taken_in_program_order() -> None:
    params = job_params()
    agreed = params_checksum(params)
    # The upload's order does not matter: the checksum is taken in the job's order.
    shuffled = dict(reversed(list(upload(params).items())))
    problem, evidence, got = ring_start_problem(shuffled, expected_of(params), agreed)
    assert (problem, evidence) == ("", {})
    assert list(got) == list(params)
    assert all(torch.equal(got[n], params[n]) for n in params)


def test_parameters_off_by_one_ulp_are_refused_with_both_checksums() -> None:
    params = job_params()
    agreed = params_checksum(params)
    moved = upload(params)
    moved["param/0.bias"][1] = torch.nextafter(moved["param/0.bias"][1], torch.tensor(9.0))
    problem, evidence, got = ring_start_problem(moved, expected_of(params), agreed)
    assert "checksum differs" in problem
    assert evidence["agreed_checksum"] == agreed
    assert evidence["uploaded_checksum"] != agreed
    assert got == {}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda u: u.pop("param/2.weight"), "lacks parameter '2.weight'"),
        (lambda u: u.update({"param/0.bias": torch.zeros(5)}), "holds parameter '0.bias'"),
        (
            lambda u: u.update({"param/0.bias": u["param/0.bias"].double()}),
            "holds parameter '0.bias' as torch.float64",
        ),
        (lambda u: u.update({"optim/momentum_buffer/0.bias": torch.zeros(4)}), "not the job's"),
        (lambda u: u.update({"param/extra": torch.zeros(1)}), "not the job's"),
    ],
)
def test_an_upload_that_is_not_the_jobs_parameters_is_refused(change, says) -> None:
    params = job_params()
    bad = upload(params)
    change(bad)
    problem, _, got = ring_start_problem(bad, expected_of(params), params_checksum(params))
    assert says in problem
    assert got == {}


def test_a_local_sgd_upload_carries_the_round_start_beside_the_chunk_state() -> None:
    """A ring job's local SGD upload: the chunk's start state (parameters and optimizer state)
    and the round's start parameters under their own prefix, split apart unchanged; the round
    start part is what ring_start_problem checks, the state part what the digest covers."""
    params = job_params()
    moved = {n: t + 0.5 for n, t in params.items()}
    state = {**upload(moved), "optim/momentum_buffer/0.bias": torch.ones(4)}
    joined = with_round_start(
        state, {**upload(params), "optim/momentum_buffer/0.bias": torch.ones(4)}
    )
    assert len(joined) == len(state) + len(params)  # the round start's optimizer state: not sent
    got_state, start = split_round_start(joined)
    assert list(got_state) == list(state)
    assert all(torch.equal(got_state[k], state[k]) for k in state)
    assert state_digest(got_state) == state_digest(state)
    problem, _, got = ring_start_problem(start, expected_of(params), params_checksum(params))
    assert problem == ""
    assert all(torch.equal(got[n], params[n]) for n in params)
    # The chunk's start state (moved parameters) sent as the round's start: refused.
    _, as_start = split_round_start(with_round_start(state, upload(moved)))
    assert ring_start_problem(as_start, expected_of(params), params_checksum(params))[0]
