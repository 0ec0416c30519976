"""A collective stuck on the device, met through PyTorch's own waits: two ranks share the GPU
(`LoopbackGroup`); rank 0's first collective hangs on its stream, as one whose peer is stuck does
(`fsdp_engine_hang_collective`, in libraries built with the `fault-injection` feature). Every
rank's `loss.item()` returns once the engine's deadline passed, and its next hook raises.
Needs a CUDA GPU."""

from __future__ import annotations

import threading
import time
from ctypes import c_uint64, c_void_p

import pytest
import torch

import fsdp_fusion
from fsdp_fusion import FusedFSDP, LoopbackGroup

TIMEOUT = 2.0
"""The engines' deadline, in seconds."""

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Stack(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def hang_collective(wrapper: FusedFSDP, at: int):
    """Makes the wrapper's collective number `at` from now hang on its stream."""
    try:
        function = getattr(wrapper._lib._lib, "fsdp_engine_hang_collective")
    except AttributeError:
        pytest.skip("the library was built without the fault-injection feature")
    function.argtypes, function.restype = [c_void_p, c_uint64], int
    status = function(wrapper._engine, at)
    if status != 0:
        raise wrapper._lib.error("fsdp_engine_hang_collective", status)


def rank(group: LoopbackGroup, r: int, ready: threading.Barrier, out: dict):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.manual_seed(0)
        module = Stack(256, 8).cuda()
        wrapper = FusedFSDP(module, list(module.blocks), local_group=group, rank=r,
                            timeout=TIMEOUT)
        x = torch.randn(8, 256, device="cuda")
        healthy = wrapper(x).sum().item()
        if r == 0:
            hang_collective(wrapper, 0)
        ready.wait()
        hung = time.monotonic()
        loss = wrapper(x).sum()
        out["forward"] = time.monotonic() - hung
        out["loss"] = loss.item()
        out["item"] = time.monotonic() - hung
        with pytest.raises(fsdp_fusion.FsdpError) as first:
            wrapper(x)
        out["error"] = (type(first.value), str(first.value), time.monotonic() - hung)
        with pytest.raises(fsdp_fusion.PoisonedError):
            wrapper(x)
        out["healthy"] = healthy
        wrapper.close()


def test_every_rank_waits_out_a_collective_stuck_on_the_device_and_then_raises():
    group = LoopbackGroup(2)
    ready = threading.Barrier(2)
    outs = [{}, {}]
    failures = []

    def run(r):
        try:
            rank(group, r, ready, outs[r])
        except BaseException as e:  # noqa: BLE001 - reported below, with the rank
            failures.append((r, e))
            ready.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    group.close()
    assert not any(t.is_alive() for t in threads), "a rank never returned"
    for r, e in failures:
        if isinstance(e, pytest.skip.Exception):
            raise e
    assert not failures, failures
    for r, out in enumerate(outs):
        print(f"rank {r}: forward {out['forward']:.3f} s, loss.item() {out['item']:.3f} s, "
              f"{out['error'][0].__name__} {out['error'][2]:.3f} s after the hang: "
              f"{out['error'][1]}")
        assert out["forward"] < TIMEOUT / 2, out
        assert out["item"] < TIMEOUT + 3.0, out
        assert out["error"][2] < TIMEOUT + 3.0, out
    error_0, message_0 = outs[0]["error"][0], outs[0]["error"][1]
    assert error_0 is fsdp_fusion.FsdpTimeoutError, message_0
    assert "all-gather" in message_0 and "still in flight" in message_0, message_0
    assert outs[0]["item"] >= TIMEOUT, outs[0]
