"""The training recipe through FusedFSDP against torch's own: weight-decay groups, learning-rate
scales, a schedule set step by step, clipping of the whole gradient's norm, skipped steps."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from gpt import loss_of
from training import batches, models, on_ranks, optimizer_settings

import fsdp_fusion
from fsdp_fusion import FusedFSDP, LocalGroup, default_no_weight_decay

LR, WARMUP, TOTAL = 1e-2, 2, 4


def lr_factor(step: int) -> float:
    """The engine's warmup-cosine (see `LrSchedule::WarmupCosine`), minimum 0."""
    if step < WARMUP:
        start = 1 / WARMUP
        return start + (1 - start) * step / WARMUP
    progress = min(step - WARMUP, TOTAL - WARMUP) / (TOTAL - WARMUP)
    return 0.5 * (1 + math.cos(math.pi * progress))


def test_the_default_exemptions_are_one_dimensional_parameters_and_embeddings():
    reference, _ = models()
    exempt = default_no_weight_decay(reference)
    assert "embed.weight" in exempt and "head.weight" in exempt, "the tied embedding"
    assert "blocks.0.norm1.weight" in exempt and "blocks.3.qkv.bias" in exempt
    assert "blocks.0.qkv.weight" not in exempt and "pos" not in exempt


@pytest.mark.parametrize("world", [1, 2])
def test_a_schedule_clipping_and_scales_match_torch(world):
    """AdamW with torch's param groups (decay off for the default exemptions, the blocks' MLP
    weights at twice the rate), a warmup-cosine schedule (torch's SequentialLR), and the gradient
    clipped to a norm it always exceeds (torch.nn.utils.clip_grad_norm_)."""
    reference, module = models()
    settings = optimizer_settings("adamw")
    exempt = default_no_weight_decay(reference)
    doubled = {n for n, _ in reference.named_parameters() if n.endswith(("up.weight", "down.weight"))}
    trainable = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in trainable if (n in exempt) == e and (n in doubled) == d],
               "weight_decay": 0.0 if e else settings["weight_decay"],
               "lr": LR * (2 if d else 1)}
              for e in (False, True) for d in (False, True)]
    torch_optimizer = torch.optim.AdamW(groups, **settings)
    schedule = torch.optim.lr_scheduler.SequentialLR(torch_optimizer, [
        torch.optim.lr_scheduler.LinearLR(torch_optimizer, start_factor=1 / WARMUP,
                                          total_iters=WARMUP),
        torch.optim.lr_scheduler.CosineAnnealingLR(torch_optimizer, T_max=TOTAL - WARMUP),
    ], milestones=[WARMUP])
    max_norm = 0.05
    data = batches(world)
    want_losses, want_norms = [], []
    for step in data:
        for per_rank in step:
            losses = [loss_of(reference(t[:, :-1]), t[:, 1:]) for t in per_rank]
            (sum(losses) / world).backward()
            want_losses.append([loss.item() for loss in losses])
        want_norms.append(torch.nn.utils.clip_grad_norm_(
            [p for _, p in trainable], max_norm).item())
        torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)
        schedule.step()
    assert min(want_norms) > max_norm, "the clip must scale every step"

    group = LocalGroup(world) if world > 1 else None
    modules = [module] + [copy.deepcopy(module) for _ in range(world - 1)]

    def make(rank):
        return FusedFSDP(modules[rank], list(modules[rank].blocks), optimizer="adamw",
                         local_group=group, rank=rank, lr_scales={n: 2.0 for n in doubled},
                         # The exemptions as the function that names them, and as the names.
                         no_weight_decay=default_no_weight_decay if world == 1 else exempt,
                         **settings)

    ranks = on_ranks(world, make)

    def run(rank):
        fused, losses, norms = ranks[rank], [], []
        for index, step in enumerate(data):
            fused.set_lr(LR * lr_factor(index))
            for per_rank in step:
                tokens = per_rank[rank]
                loss = loss_of(fused(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
                losses.append(loss.item())
            norms.append(fused.step(max_grad_norm=max_norm).grad_norm)
        return losses, norms

    for rank, (losses, norms) in enumerate(on_ranks(world, run)):
        for got, want in zip(norms, want_norms):
            assert abs(got - want) <= 1e-5 * want, (norms, want_norms)
        worst = max(abs(got - want[rank]) / abs(want[rank])
                    for got, want in zip(losses, want_losses))
        assert worst <= 1e-5, f"rank {rank}: losses differ by {worst} (relative)"


@pytest.mark.parametrize("world", [1, 2])
def test_clipping_on_the_device_equals_clipping_by_the_norm_the_host_read(world):
    _, module = models()
    data = batches(world)
    runs = []
    for on_device in (False, True):
        modules = [copy.deepcopy(module) for _ in range(world)]
        group = LocalGroup(world) if world > 1 else None

        def make(rank, modules=modules, group=group):
            return FusedFSDP(modules[rank], list(modules[rank].blocks), optimizer="adamw",
                             local_group=group, rank=rank)

        ranks = on_ranks(world, make)

        def run(rank, ranks=ranks, on_device=on_device):
            fused = ranks[rank]
            for step in data:
                for per_rank in step:
                    tokens = per_rank[rank]
                    loss_of(fused(tokens[:, :-1]), tokens[:, 1:]).backward()
                report = fused.step(max_grad_norm=0.05, clip_on_device=on_device)
                assert (report.grad_norm is None) == on_device
                # The bound clips: the norm the host reads is above it.
                assert on_device or report.grad_norm > 0.05
            return fused.full_state_dict()

        runs.append(on_ranks(world, run))
    for host, device in zip(*runs):
        for name, value in host.items():
            assert torch.equal(value, device[name]), name
    wrapped = copy.deepcopy(module)
    fused = FusedFSDP(wrapped, list(wrapped.blocks))
    for options in ({}, {"max_grad_norm": 1.0, "grad_norm": True},
                    {"skip_nonfinite": True, "grad_norm": True}):
        with pytest.raises(fsdp_fusion.MisuseError, match="clip_on_device"):
            fused.step(clip_on_device=True, **options)


def test_a_non_finite_gradient_skips_the_step_and_is_reported():
    _, module = models()
    fused = FusedFSDP(module, list(module.blocks), optimizer="sgd", lr=0.1)
    before = fused.full_parameter("blocks.1.up.weight")
    tokens = batches(1)[0][0][0]
    loss = loss_of(fused(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    # A second micro-batch whose gradients are all NaN.
    loss = loss_of(fused(tokens[:, :-1]), tokens[:, 1:]) * float("nan")
    loss.backward()
    report = fused.step(skip_nonfinite=True, count_nonfinite=True)
    assert report.skipped and not math.isfinite(report.grad_norm) and report.nonfinite > 0
    assert torch.equal(fused.full_parameter("blocks.1.up.weight"), before)
    assert fused.counters().skipped_steps == 1
    loss = loss_of(fused(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    report = fused.step(skip_nonfinite=True)
    assert not report.skipped and math.isfinite(report.grad_norm)
    assert not torch.equal(fused.full_parameter("blocks.1.up.weight"), before)


def test_a_non_finite_step_skipped_on_the_device_trains_as_one_the_host_skips():
    # AdamW, whose bias correction leaves the skipped step out either way: the parameters after
    # the step that follows the skip are equal bit for bit.
    _, module = models()
    tokens = batches(1)[0][0][0]
    states = []
    for on_device in (False, True):
        wrapped = copy.deepcopy(module)
        fused = FusedFSDP(wrapped, list(wrapped.blocks), optimizer="adamw")
        for nan in (False, True, False):
            loss = loss_of(fused(tokens[:, :-1]), tokens[:, 1:])
            (loss * float("nan") if nan else loss).backward()
            report = fused.step(skip_nonfinite=True, clip_on_device=on_device)
            assert report.skipped is (None if on_device else nan)
        assert fused.read_device_skips() == (1 if on_device else 0)
        assert fused.read_device_skips() == 0
        assert fused.counters().skipped_steps == 1
        states.append(fused.full_state_dict())
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name


def test_bad_recipes_are_refused_before_anything_changes():
    _, module = models()
    units = list(module.blocks)
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="no_weight_decay names no "):
        FusedFSDP(module, units, no_weight_decay={"blocks.0.nothing"})
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="lr_scales names no parameter"):
        FusedFSDP(module, units, lr_scales={"nothing": 2.0})
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="not finite and > 0"):
        FusedFSDP(module, units, lr_scales={"pos": -1.0})
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="several scales"):
        FusedFSDP(module, units, lr_scales={"embed.weight": 1.0, "head.weight": 2.0})
    fused = FusedFSDP(module, units)
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="lr"):
        fused.set_lr(float("nan"))
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="max_norm"):
        fused.step(max_grad_norm=0.0)


def test_a_scaled_reduction_multiplies_every_gradient_by_its_factor():
    """SGD on gradients scaled by 0.25 by the engine equals SGD on a loss scaled by 0.25."""
    tokens = batches(1)[0][0][0]
    shards = []
    for factor, reduction in ((0.25, "sum"), (1.0, 0.25)):
        _, module = models()
        fused = FusedFSDP(module, list(module.blocks), optimizer="sgd", lr=0.5,
                          grad_reduction=reduction)
        for _ in range(2):
            (loss_of(fused(tokens[:, :-1]), tokens[:, 1:]) * factor).backward()
            fused.step()
        shards.append(fused.full_parameter("blocks.1.up.weight"))
    assert torch.equal(shards[0], shards[1])
    _, module = models()
    assert not torch.equal(shards[0], module.blocks[1].up.weight.detach())
