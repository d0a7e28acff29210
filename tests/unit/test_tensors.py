"""Tensor bundles on the wire and state dicts at rest: round trips and every rejection."""

from __future__ import annotations

import hashlib
import time
import warnings

import pytest
import torch

from epochmesh.errors import CodecError
from epochmesh.limits import MAX_CHUNK_BYTES
from epochmesh.v1 import common_pb2
from epochmesh.wire.compression import ErrorFeedback, decode
from epochmesh.wire.tensors import (
    BundleAssembler,
    BundleLimits,
    decode_bundle,
    encode_bundle,
    expected_from,
    from_safetensors,
    iter_chunks,
    params_checksum,
    safetensors_metadata,
    to_safetensors,
    validate_header,
)

pytestmark = pytest.mark.timeout(60)


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fc.weight": torch.randn(8, 5, generator=g),
        "fc.bias": torch.randn(8, generator=g),
        "bn.num_batches_tracked": torch.tensor(7),
        "emb.weight": torch.randn(300, 3, generator=g).to(torch.bfloat16),
        "half": torch.randn(4, generator=g).half(),
        "double": torch.randn(2, 2, generator=g).double(),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(5, dtype=torch.int32),
        "bytes": torch.arange(3, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }


def assemble(header: common_pb2.TensorBundle, payload: bytes, **kw) -> dict[str, torch.Tensor]:
    asm = BundleAssembler(header, **kw)
    for chunk in iter_chunks(payload, 64):
        asm.add(chunk)
    assert asm.complete and asm.received == header.total_bytes
    return asm.finish()


def test_round_trip_raw_is_bit_exact_and_ordered() -> None:
    ts = sample()
    header, payload = encode_bundle(ts)
    assert [s.name for s in header.tensors] == list(ts)
    assert header.total_bytes == len(payload)
    assert header.sha256 == hashlib.sha256(payload).hexdigest()
    for out in (decode_bundle(header, payload, expected_from(ts)), assemble(header, payload)):
        assert list(out) == list(ts)
        for k, v in ts.items():
            assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "topk"])
def test_lossy_codecs_apply_to_floating_tensors_only(codec: str) -> None:
    ts = sample()
    header, payload = encode_bundle(ts, codec, topk_ratio=0.5)
    codecs = {s.name: s.codec for s in header.tensors}
    assert codecs["bn.num_batches_tracked"] == "none" and codecs["mask"] == "none"
    assert codecs["fc.weight"] == codec
    out = assemble(header, payload, expected=expected_from(ts))
    for k, v in ts.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        if not v.is_floating_point():
            assert torch.equal(out[k], v)
    w = ts["fc.weight"]
    if codec != "topk":
        assert torch.allclose(out["fc.weight"], w, rtol=0.01, atol=0.05)


def test_per_tensor_codecs_and_error_feedback() -> None:
    ts = sample()
    header, _ = encode_bundle(ts, "none", codecs={"fc.weight": "int8"})
    assert {s.name: s.codec for s in header.tensors}["fc.weight"] == "int8"
    assert {s.name: s.codec for s in header.tensors}["fc.bias"] == "none"
    ef = ErrorFeedback("topk", 0.25)
    header, payload = encode_bundle(ts, "topk", topk_ratio=0.25, error_feedback=ef)
    out = decode_bundle(header, payload)
    resid = ef.residual("fc.weight")
    assert resid is not None
    assert torch.allclose(out["fc.weight"] + resid, ts["fc.weight"], atol=1e-6)
    with pytest.raises(ValueError, match="error feedback uses codec"):
        encode_bundle(ts, "int8", error_feedback=ef)


def test_iter_chunks() -> None:
    data = bytes(range(256)) * 10000
    chunks = list(iter_chunks(data))
    assert all(len(c.data) <= MAX_CHUNK_BYTES for c in chunks)
    assert [c.offset for c in chunks] == list(range(0, len(data), MAX_CHUNK_BYTES))
    assert b"".join(c.data for c in chunks) == data
    resumed = list(iter_chunks(data, 1000, start=2_500_000))
    assert resumed[0].offset == 2_500_000 and b"".join(c.data for c in resumed) == data[2_500_000:]
    assert list(iter_chunks(b"")) == []
    with pytest.raises(ValueError):
        list(iter_chunks(data, MAX_CHUNK_BYTES + 1))
    with pytest.raises(ValueError):
        list(iter_chunks(data, start=len(data) + 1))


def test_assembler_rejects_bad_chunks() -> None:
    header, payload = encode_bundle(sample())
    asm = BundleAssembler(header)
    with pytest.raises(CodecError, match="expected offset 0"):
        asm.add(common_pb2.DataChunk(offset=5, data=payload[5:10]))
    asm.add(common_pb2.DataChunk(offset=0, data=payload[:10]))
    with pytest.raises(CodecError, match="expected offset 10"):
        asm.add(common_pb2.DataChunk(offset=0, data=payload[:10]))
    with pytest.raises(CodecError, match="incomplete: received 10"):
        asm.finish()
    with pytest.raises(CodecError, match="runs past the end"):
        asm.add(common_pb2.DataChunk(offset=10, data=payload[10:] + b"x"))
    with pytest.raises(CodecError, match="empty chunk"):
        asm.add(common_pb2.DataChunk(offset=10, data=b""))
    small = BundleAssembler(header, BundleLimits(max_chunk_bytes=8))
    with pytest.raises(CodecError, match="exceeds the limit of 8"):
        small.add(common_pb2.DataChunk(offset=0, data=payload[:9]))


def test_sha_mismatch_is_detected() -> None:
    header, payload = encode_bundle(sample())
    corrupt = bytearray(payload)
    corrupt[3] ^= 1
    with pytest.raises(CodecError, match="sha256 mismatch"):
        decode_bundle(header, bytes(corrupt))
    asm = BundleAssembler(header)
    asm.add_bytes(0, bytes(corrupt))
    with pytest.raises(CodecError, match="sha256 mismatch"):
        asm.finish()


def tampered(mutate) -> tuple[common_pb2.TensorBundle, bytes]:
    header, payload = encode_bundle(sample())
    mutate(header)
    return header, payload


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda h: setattr(h.tensors[0], "dtype", "float8"), "unknown dtype 'float8'"),
        (lambda h: setattr(h.tensors[0], "codec", "zstd"), "unknown codec 'zstd'"),
        (lambda h: setattr(h.tensors[0], "nbytes", 12), "takes 160 bytes, header says 12"),
        (lambda h: h.tensors[0].shape.append(-1), "non-negative"),
        (lambda h: setattr(h.tensors[1], "name", "fc.weight"), "appears twice"),
        (lambda h: setattr(h.tensors[1], "name", ""), "name must have"),
        (lambda h: setattr(h, "total_bytes", h.total_bytes + 1), "add up to"),
        (lambda h: setattr(h, "sha256", "xyz"), "64 lowercase hex"),
        (lambda h: setattr(h.tensors[2], "codec", "int8"), "floating tensors only"),
        (lambda h: setattr(h.tensors[-1], "codec", "topk"), "8*k bytes"),
    ],
)
def test_header_inconsistencies(mutate, needle: str) -> None:
    header, payload = tampered(mutate)
    with pytest.raises(CodecError) as e:
        decode_bundle(header, payload)
    assert needle in str(e.value)
    with pytest.raises(CodecError):
        BundleAssembler(header)


def test_expected_names_order_dtypes_shapes() -> None:
    ts = sample()
    header, payload = encode_bundle(ts)
    exp = expected_from(ts)

    def fails(expected, needle: str) -> None:
        with pytest.raises(CodecError) as e:
            decode_bundle(header, payload, expected)
        assert needle in str(e.value)

    fails({**exp, "extra.weight": (torch.float32, (1,))}, "missing tensor 'extra.weight'")
    fails({k: v for k, v in exp.items() if k != "fc.bias"}, "unexpected tensor 'fc.bias'")
    swapped = dict(exp)
    swapped = {"fc.bias": exp["fc.bias"], "fc.weight": exp["fc.weight"]} | {
        k: v for k, v in exp.items() if k not in ("fc.bias", "fc.weight")
    }
    fails(swapped, "order differs at position 0: expected 'fc.bias', got 'fc.weight'")
    fails({**exp, "fc.weight": (torch.float16, (8, 5))}, "dtype float32, expected float16")
    fails({**exp, "fc.weight": ("float32", (5, 8))}, "shape [8, 5], expected [5, 8]")


def test_nonfinite_values_are_rejected_unless_allowed() -> None:
    ts = {"a": torch.tensor([1.0, float("nan"), float("inf")]), "b": torch.ones(2)}
    header, payload = encode_bundle(ts)
    with pytest.raises(CodecError, match="'a' has 2 NaN/Inf"):
        decode_bundle(header, payload)
    with pytest.raises(CodecError, match="NaN/Inf"):
        assemble(header, payload)
    out = decode_bundle(header, payload, allow_nonfinite=True)
    assert torch.isnan(out["a"][1])
    # A sum that overflows is not mistaken for a non-finite value.
    big = {"c": torch.full((4,), 3e38)}
    h, p = encode_bundle(big)
    assert torch.equal(decode_bundle(h, p)["c"], big["c"])
    # Lossy payloads are checked after decoding too.
    h, p = encode_bundle({"d": torch.tensor([1.0, float("inf")])}, "int8")
    with pytest.raises(CodecError, match="scale"):
        decode_bundle(h, p)


def test_bool_bytes_must_be_zero_or_one() -> None:
    header, payload = encode_bundle({"m": torch.tensor([True, False])})
    bad = bytes([1, 2])
    header.sha256 = hashlib.sha256(bad).hexdigest()
    with pytest.raises(CodecError, match="bool"):
        decode_bundle(header, bad)


def test_limits_apply_before_allocation() -> None:
    header, payload = encode_bundle(sample())
    with pytest.raises(CodecError, match="exceeds the limit"):
        BundleAssembler(header, BundleLimits(max_total_bytes=100))
    with pytest.raises(CodecError, match="at most 3 are accepted"):
        validate_header(header, limits=BundleLimits(max_tensors=3))
    # A header claiming a huge sparse tensor is refused before anything is allocated.
    huge = common_pb2.TensorBundle(
        tensors=[
            common_pb2.TensorSpec(
                name="w", dtype="float32", shape=[1 << 40], codec="topk", nbytes=8
            )
        ],
        total_bytes=8,
        sha256="0" * 64,
    )
    with pytest.raises(CodecError, match="decoded tensors would exceed"):
        BundleAssembler(huge)
    with pytest.raises(CodecError, match="payload has 3 bytes"):
        decode_bundle(header, payload[:3])


def test_decoded_tensors_are_writable_without_warnings() -> None:
    header, payload = encode_bundle(sample())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = decode_bundle(header, payload)
        out["fc.weight"] += 1
        out2 = assemble(header, payload)
        out2["fc.weight"] += 1


def test_assembler_decodes_without_copying() -> None:
    t = torch.randn(1000)
    header, payload = encode_bundle({"w": t})
    asm = BundleAssembler(header)
    asm.add_bytes(0, payload)
    out = asm.finish()["w"]
    buf = asm.payload()
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert out.data_ptr() == base
    assert torch.equal(out, t)


def test_large_bundle_streams_in_one_mib_chunks() -> None:
    t = torch.randn(4 * 1024 * 1024)  # 16 MiB
    start = time.process_time()  # CPU time: the cost, not the host's load
    header, payload = encode_bundle({"w": t, "b": torch.ones(3)})
    asm = BundleAssembler(header, expected={"w": (torch.float32, t.shape), "b": ("float32", [3])})
    n = 0
    for chunk in iter_chunks(payload):
        asm.add(chunk)
        n += 1
    out = asm.finish()
    elapsed = time.process_time() - start
    assert n == 17 and torch.equal(out["w"], t)
    assert elapsed < 10


def test_compressed_payload_round_trip_through_assembler() -> None:
    t = torch.randn(70_000)
    header, payload = encode_bundle({"w": t}, "topk", topk_ratio=0.01)
    assert header.tensors[0].nbytes == 8 * 700
    out = assemble(header, payload)["w"]
    kept = out != 0
    assert int(kept.sum()) == 700 and torch.equal(out[kept], t[kept])
    assert torch.equal(out, decode(payload, "topk", t.shape))


def test_safetensors_keep_order_and_metadata() -> None:
    ts = sample()
    ts = {k: v for k, v in ts.items() if k != "empty"} | {"a_last": torch.ones(2)}
    data = to_safetensors(ts, metadata={"job": "x"})
    assert safetensors_metadata(data)["job"] == "x"
    back = from_safetensors(data)
    assert list(back) == list(ts)
    for k in ts:
        assert torch.equal(back[k], ts[k])


def test_safetensors_tied_and_strided_tensors() -> None:
    w = torch.randn(4, 3)
    data = to_safetensors({"enc.weight": w, "dec.weight": w, "t": w.t(), "row": w[1]})
    back = from_safetensors(data)
    assert torch.equal(back["dec.weight"], w) and torch.equal(back["t"], w.t())
    assert torch.equal(back["row"], w[1])


def test_safetensors_rejects_garbage() -> None:
    with pytest.raises(CodecError, match="safetensors"):
        from_safetensors(b"\x01\x02")
    with pytest.raises(CodecError, match="safetensors"):
        from_safetensors(b"\xff" * 64)
    nan = to_safetensors({"a": torch.tensor([float("nan")])})
    assert torch.isnan(from_safetensors(nan)["a"]).all()
    with pytest.raises(CodecError, match="NaN/Inf"):
        from_safetensors(nan, allow_nonfinite=False)


def test_params_checksum_sees_every_bit_name_and_shape() -> None:
    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)}
    same = {k: v.clone() for k, v in a.items()}
    assert params_checksum(a) == params_checksum(same)
    flipped = {k: v.clone() for k, v in a.items()}
    flipped["w"].view(torch.int32)[0, 0] ^= 1  # one bit of one element
    assert params_checksum(flipped) != params_checksum(a)
    assert params_checksum({"w2": a["w"], "b": a["b"]}) != params_checksum(a)
    assert params_checksum({"w": a["w"].reshape(3, 2), "b": a["b"]}) != params_checksum(a)
    assert params_checksum({"b": a["b"], "w": a["w"]}) != params_checksum(a)
