"""Bucket plans, the flattened wire format and checkpoint manifests for SGLang cells."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from cells.engine.records import EngineError
from cells.engine.sglang.weights import (
    BucketSpec,
    TensorMeta,
    bucket_crc32,
    check_against_manifest,
    dtype_name,
    flatten_bucket,
    plan_buckets,
    read_checkpoint_manifest,
    unflatten_bucket,
)


def test_plan_respects_size_order_and_alignment():
    metas = [TensorMeta("a", "float32", (4,)), TensorMeta("b", "float32", (4,)), TensorMeta("big", "bfloat16", (100,)),
             TensorMeta("odd", "int8", (3,)), TensorMeta("f", "float32", (1,)), TensorMeta("g", "int8", (1,))]
    buckets = plan_buckets(metas, bucket_bytes=40)
    assert [b.names for b in buckets] == [("a", "b"), ("big",), ("odd",), ("f", "g")]
    assert [m.name for b in buckets for m in b.metas()] == [m.name for m in metas]
    assert buckets[1].nbytes == 200  # a tensor over the limit travels alone
    with pytest.raises(EngineError):
        plan_buckets(metas, 0)


def test_flatten_roundtrip_and_crc():
    g = torch.Generator().manual_seed(0)
    ts = {"x": torch.randn(3, 4, generator=g).to(torch.bfloat16), "y": torch.randn(5, generator=g)}
    spec = BucketSpec(tuple(ts), tuple(dtype_name(t.dtype) for t in ts.values()), tuple(tuple(t.shape) for t in ts.values()))
    flat = flatten_bucket(list(ts.values()))
    assert flat.dtype == torch.uint8 and flat.numel() == spec.nbytes == 24 + 20
    back = unflatten_bucket(flat, spec)
    assert all(torch.equal(back[n], t) for n, t in ts.items())
    crc = bucket_crc32(flat)
    flat[0] ^= 1
    assert bucket_crc32(flat) != crc
    with pytest.raises(EngineError):
        unflatten_bucket(flat[:-1], spec)


def test_bucket_spec_validation_and_json():
    b = BucketSpec(("w",), ("bfloat16",), ((2, 3),), crc32=7)
    assert BucketSpec.from_dict(b.to_dict()) == b
    for bad in (dict(names=(), dtypes=(), shapes=()), dict(names=("a",), dtypes=("float32",), shapes=((-1,),)),
                dict(names=("a", "b"), dtypes=("int8", "float32"), shapes=((1,), (1,))),
                dict(names=("a",), dtypes=("complex64",), shapes=((1,),))):
        with pytest.raises(EngineError):
            BucketSpec(**bad)
    with pytest.raises(EngineError, match="malformed"):
        BucketSpec.from_dict({"names": ["a"]})
    with pytest.raises(EngineError):
        dtype_name(torch.complex64)


def test_manifest_from_safetensors_headers(tmp_path):
    save_file({"w": torch.zeros(2, 3, dtype=torch.bfloat16)}, str(tmp_path / "a.safetensors"))
    save_file({"b": torch.zeros(4)}, str(tmp_path / "b.safetensors"))
    m = read_checkpoint_manifest(tmp_path)
    assert m == {"w": TensorMeta("w", "bfloat16", (2, 3)), "b": TensorMeta("b", "float32", (4,))}
    assert read_checkpoint_manifest(tmp_path / "missing") is None
    check_against_manifest([TensorMeta("w", "float32", (2, 3))], m, require_all=False)  # SGLang casts dtypes
    with pytest.raises(EngineError, match="missing"):
        check_against_manifest([TensorMeta("w", "bfloat16", (2, 3))], m, require_all=True)
    with pytest.raises(EngineError, match="unknown"):
        check_against_manifest([TensorMeta("z", "bfloat16", (2, 3))], m, require_all=False)
    check_against_manifest([TensorMeta("z", "bfloat16", (2, 3))], None, require_all=True)
