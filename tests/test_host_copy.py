"""``to_device``: the one host-to-device copy helper (numpy or tensor in; into ``out`` or a new tensor). The
CUDA branch (pinned, non-blocking) is exercised by the GPU tests, which run every plan under
``torch.cuda.set_sync_debug_mode("error")``; here the CPU branch's contract."""

import numpy as np
import torch

from omniloop.gpu.host_copy import to_device


def test_to_device_on_cpu_copies_arrays_and_tensors_into_out_or_new() -> None:
    cpu = torch.device("cpu")
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    t = to_device(a, cpu)
    assert t.dtype == torch.int64 and t.tolist() == a.tolist()
    out = torch.full((2, 3), -1, dtype=torch.int64)
    got = to_device(a, cpu, out)
    assert got is out and out.tolist() == a.tolist()
    src = torch.tensor([1.5, 2.5])
    assert to_device(src, cpu) is src  # already there: no copy
    out2 = torch.zeros(2)
    assert to_device(src, cpu, out2) is out2 and out2.tolist() == [1.5, 2.5]
