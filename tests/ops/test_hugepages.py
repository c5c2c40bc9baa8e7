import sys

import pytest
import torch

from specserve.ops import hugepages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5), (800, 16, 3, 64)])  # under and over MIN_BYTES
def test_zeros_is_a_zeroed_contiguous_tensor(shape, dtype):
    t = hugepages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t.fill_(1)  # writable over its whole extent
    assert int(t.float().sum()) == t.numel()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux-only here")
def test_large_tensor_starts_on_a_huge_page_boundary():
    t = hugepages.zeros((800, 16, 3, 64), torch.float32)  # 9.8 MB
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0


def test_without_madvise_it_is_an_ordinary_tensor(monkeypatch):
    monkeypatch.setattr(hugepages, "_madvise_fn", lambda: None)
    t = hugepages.zeros((800, 16, 3, 64), torch.float32)
    assert t.shape == (800, 16, 3, 64) and not t.any()
    assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * 4
