"""Units compiled with torch.compile (inductor, on the CPU) before wrapping train as the eager
units do; a compiled wrapped model, or a unit compiled in place, is refused at once."""

from __future__ import annotations

import copy

import pytest
import torch
from training import batches, models, on_ranks, optimizer_settings, rank_losses

import fsdp_fusion
from fsdp_fusion import FusedFSDP, LocalGroup


def wrapped(world: int, compile_units: bool) -> list[FusedFSDP]:
    """The test GPT wrapped on each of `world` ranks, its blocks compiled or not."""
    _, module = models()
    modules = [module] + [copy.deepcopy(module) for _ in range(world - 1)]
    if compile_units:
        for m in modules:
            for i, block in enumerate(m.blocks):
                m.blocks[i] = torch.compile(block)
    group = LocalGroup(world) if world > 1 else None
    return on_ranks(world, lambda rank: FusedFSDP(
        modules[rank], list(modules[rank].blocks), optimizer="adamw", local_group=group,
        rank=rank, **optimizer_settings("adamw")))


def losses(ranks: list[FusedFSDP]) -> list[list[float]]:
    """Per rank, the loss of every pass of `batches`."""
    return rank_losses(ranks, batches(len(ranks)))


@pytest.mark.parametrize("world", [1, 2])
def test_compiled_units_train_as_the_eager_units(world):
    """At world size 2 the views move between slots in backward: the compiled forward's saved
    tensors go through the wrapper's saved-tensor hooks as the eager ones do."""
    eager, compiled = losses(wrapped(world, False)), losses(wrapped(world, True))
    worst = max(abs(a - b) / abs(a) for mine, theirs in zip(eager, compiled)
                for a, b in zip(mine, theirs))
    # Inductor fuses the float32 arithmetic differently: rounding, not a different step.
    assert worst <= 1e-6, f"compiled losses differ by {worst} (relative)"
    assert len(compiled[0]) == 8


def test_a_compiled_wrapped_model_is_refused_before_any_hook_and_the_wrapper_still_trains():
    [fused] = wrapped(1, False)
    tokens = batches(1)[0][0][0]
    with pytest.raises(fsdp_fusion.MisuseError, match="compile the units"):
        torch.compile(fused)(tokens[:, :-1])
    assert fused.counters().all_gathers == 0
    [fresh] = wrapped(1, False)
    assert losses([fused]) == losses([fresh])


def test_a_unit_compiled_in_place_is_refused():
    _, module = models()
    module.blocks[1].compile()
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="unit 1 was compiled in place"):
        FusedFSDP(module, list(module.blocks))
