"""The engine's device memory from PyTorch's caching allocator: the C callbacks on the CPU, with
a stand-in for the allocator, and the accounting on a GPU."""

from __future__ import annotations

import sys
from ctypes import c_uint64

import pytest
import torch

from fsdp_fusion import FusedFSDP
from fsdp_fusion._allocator import TorchAllocator
from fsdp_fusion._dlpack import device_index


class StandInStream:
    cuda_stream = 0x5EED


class StandInAllocator:
    """`torch.cuda.caching_allocator_alloc`/`_delete` as calls recorded, a refusal on demand."""

    def __init__(self):
        self.calls, self.refusal = [], None

    def alloc(self, nbytes, device, stream):
        self.calls.append(("alloc", nbytes, device, stream))
        if self.refusal is not None:
            raise self.refusal
        return 0x1000 + nbytes

    def delete(self, address):
        self.calls.append(("delete", address))
        raise RuntimeError("at interpreter exit PyTorch may be gone")


@pytest.fixture
def stand_in(monkeypatch):
    allocator = StandInAllocator()
    monkeypatch.setattr(torch.cuda, "caching_allocator_alloc", allocator.alloc)
    monkeypatch.setattr(torch.cuda, "caching_allocator_delete", allocator.delete)
    return allocator


def test_blocks_come_from_the_caching_allocator_on_the_engines_stream(stand_in, monkeypatch):
    # ctypes reports an exception that reaches a callback's edge as unraisable (and goes on).
    escaped = []
    monkeypatch.setattr(sys, "unraisablehook", escaped.append)
    allocator = TorchAllocator(3, StandInStream())
    out = c_uint64()
    assert allocator.struct.allocate(None, 4096, out) == 0
    assert out.value == 0x1000 + 4096
    # The release never lets an exception into C, even PyTorch's at interpreter exit.
    allocator.struct.release(None, out.value, 4096)
    assert not escaped, escaped
    assert stand_in.calls == [("alloc", 4096, 3, 0x5EED), ("delete", 0x1000 + 4096)]
    assert allocator.take_failure() is None


def test_a_refused_block_is_reported_to_the_engine_and_its_reason_kept_once(stand_in):
    allocator = TorchAllocator(0, StandInStream())
    stand_in.refusal = torch.OutOfMemoryError("CUDA out of memory")
    out = c_uint64(7)
    assert allocator.struct.allocate(None, 1 << 40, out) == 1
    assert out.value == 7, "a refusal writes no address"
    failure = allocator.take_failure()
    assert isinstance(failure, torch.OutOfMemoryError)
    assert allocator.take_failure() is None


def test_a_bare_cuda_device_is_the_current_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert device_index(torch.device("cuda")) == 5
    assert device_index(torch.device("cuda", 2)) == 2
    assert device_index(torch.device("cpu")) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_engines_buffers_are_counted_by_torch_as_planned():
    module = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
    # The module's parameters become views of the engine's shards: keep their old memory
    # allocated, so that what the allocator gains is the engine's buffers alone.
    old = [p.detach() for p in module.parameters()]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fused = FusedFSDP(module, list(module), lr=1e-3)
    engine, _ = fused.memory()
    assert engine == fused.planned_memory().between_steps
    grown = torch.cuda.memory_allocated() - before
    # Each buffer is rounded up to the caching allocator's 512-byte blocks.
    assert engine <= grown < engine + 64 * 512, (engine, grown)
    x = torch.randn(8, 256, device="cuda")
    fused(x).sum().backward()
    fused.step()
    _, peak = fused.memory()
    assert peak == fused.planned_memory().peak
    fused.close()
    del old
