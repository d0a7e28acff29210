"""Per-tensor codecs: sizes, error bounds, validation, and error feedback."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from epochmesh.errors import CodecError
from epochmesh.wire.compression import (
    CODECS,
    FP16_MAX,
    INT8_BLOCK,
    LOSSY_CODECS,
    ErrorFeedback,
    decode,
    encode,
    encoded_size,
    topk_count,
)

pytestmark = pytest.mark.timeout(60)


def gen(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 1000])
def test_encoded_size_matches(codec: str, n: int) -> None:
    t = gen(n)
    data = encode(t, codec, ratio=0.1)
    assert len(data) == encoded_size(codec, n, torch.float32, ratio=0.1)
    out = decode(data, codec, (n,), torch.float32)
    assert out.shape == (n,) and out.dtype == torch.float32


def test_none_is_exact_for_every_dtype() -> None:
    for t in (
        gen(3, 5),
        gen(7).double(),
        gen(4).half(),
        gen(4).bfloat16(),
        torch.arange(-3, 3),
        torch.tensor([True, False]),
        torch.tensor(5, dtype=torch.int8),
    ):
        back = decode(encode(t, "none"), "none", t.shape, t.dtype)
        assert back.dtype == t.dtype and torch.equal(back, t)


def test_int8_error_is_at_most_half_a_step_per_block() -> None:
    t = torch.cat([gen(1000, scale=1e-3), gen(1000, seed=1, scale=50.0), torch.zeros(300)])
    back = decode(encode(t, "int8"), "int8", t.shape)
    n = t.numel()
    blocks = math.ceil(n / INT8_BLOCK)
    padded = torch.zeros(blocks * INT8_BLOCK)
    padded[:n] = t
    scale = padded.view(blocks, INT8_BLOCK).abs().amax(1) / 127
    bound = (scale / 2).repeat_interleave(INT8_BLOCK)[:n]
    err = (back - t).abs()
    assert bool((err <= bound * (1 + 1e-6) + 1e-12).all())
    assert torch.equal(back[-300:], torch.zeros(300))  # an all-zero block stays exact


def test_fp16_and_bf16_relative_bounds() -> None:
    t = gen(5000, scale=10.0)
    fp16 = decode(encode(t, "fp16"), "fp16", t.shape)
    bf16 = decode(encode(t, "bf16"), "bf16", t.shape)
    normal = t.abs() >= 2.0**-14
    assert bool(((fp16 - t).abs() <= t.abs() * 2.0**-11)[normal].all())
    assert bool(((fp16 - t).abs() <= 2.0**-25)[~normal].all())
    assert bool(((bf16 - t).abs() <= t.abs() * 2.0**-8).all())


def test_fp16_saturates_finite_values_and_keeps_nonfinite() -> None:
    t = torch.tensor([1e6, -1e6, 1.0, float("inf"), float("nan")])
    back = decode(encode(t, "fp16"), "fp16", t.shape)
    assert back[0] == FP16_MAX and back[1] == -FP16_MAX and back[2] == 1.0
    assert math.isinf(back[3]) and math.isnan(back[4])


def test_topk_keeps_the_largest_exactly() -> None:
    t = gen(1000)
    ratio = 0.05
    k = topk_count(t.numel(), ratio)
    assert k == 50
    back = decode(encode(t, "topk", ratio), "topk", t.shape)
    kept = back != 0
    assert int(kept.sum()) == k
    assert torch.equal(back[kept], t[kept])
    assert float(t[~kept].abs().max()) <= float(t[kept].abs().min())


def test_topk_count() -> None:
    assert topk_count(0, 0.5) == 0
    assert topk_count(10, 0.01) == 1
    assert topk_count(10, 0.25) == 3
    assert topk_count(10, 1.0) == 10
    assert topk_count(100, 0.07) == 7  # 0.07 * 100 is 7.000000000000001 in floats
    assert topk_count(1000, 0.0071) == 8
    with pytest.raises(ValueError):
        topk_count(10, 0.0)


def test_lossy_codecs_refuse_integer_tensors() -> None:
    for codec in LOSSY_CODECS:
        with pytest.raises(CodecError, match="floating"):
            encode(torch.arange(4), codec)


def test_decode_rejects_malformed_payloads() -> None:
    t = gen(300)
    good = bytearray(encode(t, "int8"))
    with pytest.raises(CodecError, match="takes"):
        decode(bytes(good[:-1]), "int8", t.shape)
    bad = bytearray(good)
    bad[-1] = 0x80  # -128
    with pytest.raises(CodecError, match="-128"):
        decode(bytes(bad), "int8", t.shape)
    bad = bytearray(good)
    bad[0:4] = np.float32(-1.0).tobytes()
    with pytest.raises(CodecError, match="scale"):
        decode(bytes(bad), "int8", t.shape)
    bad[0:4] = np.float32(np.nan).tobytes()
    with pytest.raises(CodecError, match="scale"):
        decode(bytes(bad), "int8", t.shape)

    topk = bytearray(encode(t, "topk", 0.1))
    k = len(topk) // 8
    unsorted = bytearray(topk)
    unsorted[0:4], unsorted[4:8] = topk[4:8], topk[0:4]
    with pytest.raises(CodecError, match="strictly increasing"):
        decode(bytes(unsorted), "topk", t.shape)
    out_of_range = bytearray(topk)
    out_of_range[4 * (k - 1) : 4 * k] = np.int32(300).tobytes()
    with pytest.raises(CodecError, match="strictly increasing"):
        decode(bytes(out_of_range), "topk", t.shape)
    with pytest.raises(CodecError, match="8\\*k"):
        decode(bytes(topk[:-1]), "topk", t.shape)
    with pytest.raises(CodecError, match="unknown codec"):
        decode(bytes(topk), "zstd", t.shape)
    with pytest.raises(CodecError, match="takes 8 bytes"):
        decode(b"\x00" * 4, "none", (2,), torch.float32)


def test_decode_of_read_only_bytes_gives_writable_tensor() -> None:
    t = gen(10)
    back = decode(encode(t, "none"), "none", t.shape)
    back += 1  # would be undefined behaviour on a view of immutable bytes
    assert torch.allclose(back, t + 1)


@settings(max_examples=60, deadline=None)
@given(
    arrays(
        np.float32,
        st.integers(min_value=1, max_value=700),
        elements=st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=False),
    )
)
def test_int8_bound_property(x: np.ndarray) -> None:
    t = torch.from_numpy(x.copy())
    back = decode(encode(t, "int8"), "int8", t.shape)
    n = t.numel()
    blocks = math.ceil(n / INT8_BLOCK)
    padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float64)
    padded[:n] = t.double()
    scale = (padded.view(blocks, INT8_BLOCK).abs().amax(1) / 127).repeat_interleave(INT8_BLOCK)
    err = (back.double() - t.double()).abs()
    assert bool((err <= scale[:n] * (0.5 + 1e-5)).all())


@pytest.mark.parametrize(
    ("codec", "ratio"), [("fp16", 0.0), ("bf16", 0.0), ("int8", 0.0), ("topk", 0.05)]
)
def test_error_feedback_delivers_everything_eventually(codec: str, ratio: float) -> None:
    ef = ErrorFeedback(codec, ratio or 0.01)
    shape = (40, 25)
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(shape, generator=g) * 0.1
    sum_in = torch.zeros(shape, dtype=torch.float64)
    sum_out = torch.zeros(shape, dtype=torch.float64)
    residual_norms = []
    steps = 300
    for _ in range(steps):
        grad = mean + torch.randn(shape, generator=g)
        data = ef.compress("w", grad)
        sum_in += grad.double()
        sum_out += decode(data, codec, shape).double()
        residual = ef.residual("w")
        assert residual is not None
        residual_norms.append(float(residual.norm()))
    # What was sent plus what is still owed is exactly what came in.
    assert torch.allclose(sum_out + ef.residual("w").double(), sum_in, atol=1e-3)
    # The residual stays bounded (it does not grow with the number of steps) ...
    late = max(residual_norms[steps // 2 :])
    early = max(residual_norms[: steps // 2])
    assert late <= 2 * early + 1e-6
    # ... so the relative error of the running sum vanishes.
    rel = float((sum_in - sum_out).norm() / sum_in.norm())
    assert rel < (0.2 if codec == "topk" else 1e-3)
    # Without error feedback, top-k drops most of the mass for good.
    if codec == "topk":
        plain = sum(
            decode(encode(mean + torch.randn(shape, generator=g), "topk", ratio), "topk", shape)
            for _ in range(steps)
        )
        assert float((sum_in - plain).norm() / sum_in.norm()) > 2 * rel


def test_error_feedback_bookkeeping() -> None:
    ef = ErrorFeedback("int8")
    ef.compress("a", gen(10))
    ef.compress("b", gen(5))
    assert set(ef.state_tensors()) == {"a", "b"}
    assert ef.residual_norm() > 0
    with pytest.raises(ValueError, match="changed shape"):
        ef.compress("a", gen(11))
    ef.reset("a")
    assert ef.residual("a") is None
    ef.compress("a", gen(11))
    saved = ef.state_tensors()
    other = ErrorFeedback("int8")
    other.load_state_tensors(saved)
    x = gen(11, seed=9)
    assert ef.compress("a", x) == other.compress("a", x)
    ef.reset()
    assert ef.state_tensors() == {}
    # Integer tensors pass through raw.
    assert ErrorFeedback("topk", 0.1).compress("n", torch.arange(4)) == encode(
        torch.arange(4), "none"
    )


def test_topk_ranks_by_magnitude_and_keeps_exactly_k_with_ties() -> None:
    t = torch.tensor([0.5, -3.0, 2.0, -0.1, 3.0, 1.0, -2.5, 0.0])
    back = decode(encode(t, "topk", 0.375), "topk", t.shape)  # k = 3
    assert torch.equal(back, torch.tensor([0.0, -3.0, 0.0, 0.0, 3.0, 0.0, -2.5, 0.0]))
    flat = torch.full((100,), -1.5)  # all magnitudes tie: still exactly k entries, exact values
    back = decode(encode(flat, "topk", 0.07), "topk", flat.shape)
    assert int((back != 0).sum()) == 7 and bool((back[back != 0] == -1.5).all())


def test_topk_error_feedback_is_exact_per_step() -> None:
    # Top-k sends the kept entries of (grad + residual) exactly and keeps all the others: what
    # was sent plus the new residual is exactly what was owed, bit for bit, at every step; so
    # over any number of steps sent + final residual equals the sum of the inputs up to the
    # float32 rounding of the additions.
    ef = ErrorFeedback("topk", 0.02)
    shape = (30, 20)
    g = torch.Generator().manual_seed(11)
    sum_in = torch.zeros(shape, dtype=torch.float64)
    sum_out = torch.zeros(shape, dtype=torch.float64)
    for _ in range(100):
        grad = torch.randn(shape, generator=g)
        prev = ef.residual("w")
        owed = grad + prev if prev is not None else grad
        sent = decode(ef.compress("w", grad), "topk", shape)
        residual = ef.residual("w")
        assert residual is not None
        assert int((sent != 0).sum()) == topk_count(grad.numel(), 0.02)
        assert torch.equal(sent + residual, owed)
        assert bool((residual[sent != 0] == 0).all())
        sum_in += grad.double()
        sum_out += sent.double()
    final = ef.residual("w")
    assert final is not None
    torch.testing.assert_close(sum_out + final.double(), sum_in, rtol=0, atol=1e-4)


def test_topk_error_feedback_sends_every_coordinate_eventually() -> None:
    # A constant gradient with magnitudes within 2x of each other: coordinates that are not
    # sent grow in the residual until they are; none is starved.
    n, ratio = 200, 0.05
    g = torch.Generator().manual_seed(5)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    grad = sign * (0.5 + 0.5 * torch.rand(n, generator=g))
    ef = ErrorFeedback("topk", ratio)
    sent_once = torch.zeros(n, dtype=torch.bool)
    total = torch.zeros(n, dtype=torch.float64)
    steps = 120
    for _ in range(steps):
        sent = decode(ef.compress("w", grad), "topk", (n,))
        sent_once |= sent != 0
        total += sent.double()
    assert bool(sent_once.all())
    # Every coordinate got about steps * grad through (within what the residual still owes).
    residual = ef.residual("w")
    assert residual is not None
    torch.testing.assert_close(total + residual.double(), steps * grad.double(), atol=1e-3, rtol=0)
    # ... and what it owes stays bounded by about n/k steps' worth, however many steps ran.
    k = topk_count(n, ratio)
    assert float(residual.abs().max()) < 2 * (n / k) * float(grad.abs().max()) < steps * 0.5
