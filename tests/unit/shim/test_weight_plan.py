"""Weight sender and protocol units: bucket planning, validation before any collective, tensor metadata."""

from __future__ import annotations

import pytest

from inference_shim.backends.common import ContractError, validate_update
from inference_shim.protocol import BUCKET_ALIGN_BYTES, TensorMeta, WeightUpdateRequest, plan_buckets


def test_plan_buckets_packs_in_order_aligned_and_bounded():
    metas = [_meta("a", [10]), _meta("b", [100]), _meta("c", [3]), _meta("big", [1000]), _meta("d", [1])]
    buckets = plan_buckets(metas, bucket_bytes=512)
    placed = [slot.index for bucket in buckets for slot in bucket.slots]
    assert placed == [0, 1, 2, 3, 4]  # every tensor once, in order
    for bucket in buckets:
        for slot in bucket.slots:
            assert slot.offset % BUCKET_ALIGN_BYTES == 0
            assert slot.nbytes == metas[slot.index].nbytes
        assert bucket.nbytes == bucket.slots[-1].offset + bucket.slots[-1].nbytes
        assert bucket.nbytes <= 512 or len(bucket.slots) == 1  # only an oversized tensor exceeds the size
    # a: 40 B at 0; b: 400 B at 64 (ends 464); c would start at the next aligned offset 512 and end
    # past 512 -> new bucket; big (4000 B) gets its own; d cannot follow big inside 512 B -> own bucket.
    assert [[(s.index, s.offset) for s in b.slots] for b in buckets] == [
        [(0, 0), (1, 64)],
        [(2, 0)],
        [(3, 0)],
        [(4, 0)],
    ]


def test_validate_update_rejects_every_bad_request_with_4xx():
    table = {"w": ("float32", [2, 3]), "b": ("float32", [3])}
    good = [_meta("w", [2, 3]), _meta("b", [3])]

    def check(tensors, version=2, current=1, pending=None, joined=True):
        req = WeightUpdateRequest(version=version, tensors=tensors)
        validate_update(req, table, current, pending, joined)

    check(good)  # accepted
    cases = {
        "no_process_group": dict(tensors=good, joined=False),
        "update_in_progress": dict(tensors=good, pending=2),
        "stale_version": dict(tensors=good, version=1),
    }
    for error, kwargs in cases.items():
        with pytest.raises(ContractError) as e:
            check(**kwargs)
        assert e.value.error == error and 400 <= e.value.status < 500
    for tensors, words in [
        ([_meta("w", [2, 3]), _meta("x", [3]), _meta("b", [3])], "unknown tensor name"),
        ([_meta("w", [3, 2]), _meta("b", [3])], "shape [3, 2] != expected [2, 3]"),
        ([_meta("w", [2, 3], "bfloat16"), _meta("b", [3])], "dtype bfloat16"),
        ([_meta("w", [2, 3])], "missing 1 tensor"),
        ([_meta("w", [2, 3]), _meta("w", [2, 3]), _meta("b", [3])], "sent twice"),
    ]:
        with pytest.raises(ContractError) as e:
            check(tensors)
        assert e.value.status == 422 and words in e.value.detail


def test_tensor_meta_rejects_unknown_dtype_and_negative_shape():
    with pytest.raises(ValueError, match="not supported"):
        _meta("w", [1], "int4")
    with pytest.raises(ValueError, match="negative"):
        _meta("w", [-1])


def _meta(name: str, shape: list[int], dtype: str = "float32") -> TensorMeta:
    return TensorMeta(name=name, dtype=dtype, shape=shape)
