"""The driver's stream memory operations (engine/stream_ops.py): work queued behind waits on counters in host memory
runs only once every counter has reached its value."""

from __future__ import annotations

import time

import pytest
import torch

from engine.stream_ops import stream_ops

pytestmark = pytest.mark.gpu

_HOST_REGISTER_MAPPED = 2


@pytest.fixture
def counters():
    """Four 32-bit counters in registered host memory, as the device addresses them."""
    host = torch.zeros(4, dtype=torch.int32)
    torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.nbytes, _HOST_REGISTER_MAPPED)
    ops = stream_ops()
    assert ops is not None
    base = ops.device_address(host.data_ptr())
    yield ops, host, [base + 4 * i for i in range(4)]
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def test_work_behind_waits_on_counters_runs_once_every_counter_has_its_value(counters) -> None:
    ops, host, addresses = counters
    stream = torch.cuda.Stream()
    out = torch.zeros(8, device="cuda")
    waits = list(zip(addresses, [3, 1, 7, 2]))
    with torch.cuda.stream(stream):
        for address, value in waits:
            ops.wait_value(stream.cuda_stream, address, value)
        out.fill_(1.0)
        done = torch.cuda.Event()
        done.record()
    for i, value in enumerate([3, 1, 7]):  # every counter there but the last
        host[i] = value
    time.sleep(0.05)
    assert not done.query(), "the work ran before the last counter had its value"
    host[3] = 2
    done.synchronize()
    assert torch.equal(out.cpu(), torch.ones(8))
