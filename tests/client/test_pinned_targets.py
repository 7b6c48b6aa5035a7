"""A rank's targets in page-locked host memory (``pin_memory=True``, issue 44): pinned where
CUDA is (the replay's copy to the GPU then asynchronous, with no staging copy), refused
with the reason where it is not, never memory that only claims to be pinned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3_client import InvalidRequestError
from r3_client.rank_local import pinned_targets


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process has a CUDA device")
def test_pinned_targets_are_refused_without_cuda() -> None:
    with pytest.raises(InvalidRequestError, match="needs a CUDA device"):
        pinned_targets((2, 8, 4), -1)


@pytest.mark.gpu
def test_pinned_targets_are_page_locked_and_copied_as_they_are() -> None:
    arr = pinned_targets((3, 64, 8), -1)
    assert arr.dtype == np.int64 and arr.shape == (3, 64, 8) and (arr == -1).all()
    arr[1, 5] = np.arange(8)
    layer = torch.from_numpy(arr[1])  # what as_torch hands the replay: a view per layer
    assert layer.is_pinned()
    assert layer.contiguous().pin_memory().data_ptr() == layer.data_ptr()  # no staging copy
    on_gpu = layer.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert on_gpu[5].tolist() == list(range(8))
