"""Training through FusedFSDP on CPU ranks matches plain PyTorch."""

from __future__ import annotations

import copy
import subprocess
import sys
from ctypes import c_void_p

import pytest
import torch
from gpt import loss_of
from training import BATCH, FROZEN, PASSES, SEQ, VOCAB, batches, models, on_ranks, train

import fsdp_fusion
from fsdp_fusion import FusedFSDP
from fsdp_fusion._hooks import _Saved


def train_steps(fused) -> list[float]:
    """Every step of `batches(1)` through `fused`; the loss of each pass."""
    losses = []
    for step in batches(1):
        for per_rank in step:
            tokens = per_rank[0]
            loss = loss_of(fused(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            losses.append(loss.item())
        fused.step()
    return losses


def test_adamw_at_world_size_1_matches_torch():
    run = train("adamw")
    worst = run.worst_loss_difference()
    assert worst <= 1e-6, f"losses differ by {worst} (relative)"
    # AdamW turns the near-zero gradients of biases such as the keys' (softmax ignores them) into
    # steps of about lr whatever their rounding: parameters agree to that noise, losses exactly.
    difference, name = run.largest_parameter_difference()
    assert difference <= 1e-4, f"{name} differs by {difference}"


class Gated(torch.nn.Module):
    """A block whose `side` weight adds `gate * side(x)`: with the gate 0 it takes part with a
    zero gradient; left out (`gate` None) it gets no gradient at all."""

    def __init__(self):
        super().__init__()
        # First, so that the gradients present follow a missing one in the batch.
        self.side = torch.nn.Linear(8, 8, bias=False)
        self.main = torch.nn.Linear(8, 8)
        self.gate = None

    def forward(self, x):
        x = x + torch.tanh(self.main(x))
        return x if self.gate is None else x + self.gate * self.side(x)


def test_a_gradient_missing_from_a_pass_trains_as_a_zero_gradient():
    """A unit whose parameter got no gradient in a pass hands over the others alone (the batch
    of the gradients present), and the engine counts the missing one as zero: the same
    parameters, bit for bit, as a run where it got a zero gradient (every gradient present)."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(Gated(), Gated())
    runs = {}
    for missing in (True, False):
        module = copy.deepcopy(blocks)
        fused = FusedFSDP(module, list(module), lr=1e-2, weight_decay=0.1)
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            for i in range(2):
                # The first pass of each step leaves the side weights out.
                for block in module:
                    block.gate = None if missing and i == 0 else (0.0 if i == 0 else 0.5)
                x = torch.randn(4, 8, generator=g)
                fused(x).square().mean().backward()
            fused.step()
        runs[missing] = {name: fused.full_parameter(name)
                         for name, _ in blocks.named_parameters()}
        fused.close()
    for name, value in runs[True].items():
        assert torch.equal(value, runs[False][name]), name
    assert not torch.equal(runs[True]["0.side.weight"], blocks[0].side.weight.detach())


class _CallsItself(torch.nn.Module):
    """A module whose forward calls the module once more: the wrapper's forwards nest."""

    def __init__(self):
        super().__init__()
        self.block = torch.nn.Linear(8, 8)

    def forward(self, x, depth=1):
        x = torch.tanh(self.block(x))
        return self(x, depth=depth - 1) if depth else x


def test_a_forward_calling_itself_trains_as_torch_and_leaves_no_saved_tensor_hooks():
    """Each nested forward installs its saved-tensor hooks (master storage moves the views) and
    takes its own off as it ends: none stays installed after the outer one, and the steps
    equal plain PyTorch's."""
    torch.manual_seed(0)
    reference = _CallsItself()
    module = copy.deepcopy(reference)
    fused = FusedFSDP(module, [module.block], optimizer="sgd", lr=0.1, param_storage="master")
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4, 8, generator=g)
        reference(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = fused(x).square().mean()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        loss.backward()
        fused.step()
    state = fused.full_state_dict()
    for name, value in reference.named_parameters():
        assert torch.allclose(state[name], value.detach(), atol=1e-6), name


class _Injected(Exception):
    """A failure a test makes a hook raise."""


class _NestingCatching(torch.nn.Module):
    """A module whose forward first calls the module once more, catching `_Injected`, then uses
    a parameter of its own (the root's) and a unit."""

    def __init__(self):
        super().__init__()
        self.block = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x, nested=True):
        if nested:
            try:
                self(x, nested=False)
            except _Injected:
                pass
        return self.block(x) * self.scale


def test_a_nested_forward_failing_before_it_opens_leaves_the_outer_forward_open(monkeypatch):
    """The post hook that torch runs after a nested forward's pre hook failed ends that forward
    alone: the outer forward's root parameters stay gathered (with master storage they would be
    NaN placeholders once closed), and the step goes on."""
    torch.manual_seed(0)
    module = _NestingCatching()
    expected = module(torch.ones(2, 8), nested=False).detach()
    fused = FusedFSDP(module, [module.block], optimizer="sgd", lr=0.1, param_storage="master")
    forwards = []
    close_backwards = fused._close_backwards

    def failing_in_the_nested_forward():
        forwards.append(None)
        if len(forwards) == 2:
            raise _Injected("the nested forward's pre hook")
        close_backwards()

    monkeypatch.setattr(fused, "_close_backwards", failing_in_the_nested_forward)
    out = fused(torch.ones(2, 8))
    assert torch.equal(out.detach(), expected)
    out.sum().backward()
    fused.step()
    assert fused.counters().steps == 1


class Experts(torch.nn.Module):
    """A block of two experts of which each pass may skip one (`skip`): left out, the skipped
    expert gets no gradient, as an expert no token was routed to; with `zero_gate` it takes
    part through a zero gate instead, with a zero gradient."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(
            torch.nn.Linear(8, 8, bias=False) for _ in range(2))
        self.norm = torch.nn.LayerNorm(8)
        self.skip, self.zero_gate = None, False

    def forward(self, x):
        for i, expert in enumerate(self.experts):
            if i != self.skip:
                x = x + torch.tanh(expert(x))
            elif self.zero_gate:
                x = x + 0.0 * torch.tanh(expert(x))
        return self.norm(x)


@pytest.mark.parametrize("overlap", [True, False])
def test_gradients_missing_on_some_ranks_only_train_as_zero_gradients(overlap):
    """Ranks whose passes leave different parameters without a gradient (experts no token was
    routed to) issue the same collectives (the engine compares them every step) and train as if
    the missing gradients were zeros: bit for bit the parameters of a run where every rank got
    every gradient, a zero one where the other run had none."""
    world = 2
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*(Experts() for _ in range(3)))

    def skip(rank, step, i, b):
        """The expert block `b` of `rank` skips in pass `i` of `step`, if any."""
        return None if (rank + step + i + b) % 3 == 0 else (rank + i + b) % 2

    runs = {}
    for zero_gate in (False, True):
        modules = [copy.deepcopy(blocks) for _ in range(world)]
        group = fsdp_fusion.LocalGroup(world)
        fused = on_ranks(world, lambda rank: FusedFSDP(
            modules[rank], list(modules[rank]), local_group=group, rank=rank, lr=1e-2,
            weight_decay=0.1, overlap=overlap, verify_collectives=True))

        def train(rank):
            module, f = modules[rank], fused[rank]
            g = torch.Generator().manual_seed(1 + rank)
            for step in range(3):
                for i in range(2):
                    for b, block in enumerate(module):
                        block.skip, block.zero_gate = skip(rank, step, i, b), zero_gate
                    f(torch.randn(4, 8, generator=g)).square().mean().backward()
                f.step()
            return f.full_state_dict()

        runs[zero_gate] = on_ranks(world, train)
        for f in fused:
            f.close()
    names = [name for name, _ in blocks.named_parameters()]
    for rank in range(world):
        assert sorted(runs[False][rank]) == sorted(names)
        for name in names:
            assert torch.equal(runs[False][rank][name], runs[True][rank][name]), (rank, name)
    # Every expert trained: a run that left the skipped ones alone would also agree.
    for name in names:
        assert not torch.equal(runs[False][0][name], blocks.state_dict()[name]), name


class Aside(torch.nn.Module):
    """A block that keeps an auxiliary loss aside (`aux`), as a mixture of experts keeps its
    load-balancing loss, from its gate's weight and its input."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.gate = torch.nn.Linear(8, 2)
        self.aux = None

    def forward(self, x):
        self.aux = (torch.softmax(self.gate(x), -1).square().mean()
                    + 0.01 * self.gate.weight.square().sum())
        return x + torch.tanh(self.lin(x))


def test_a_loss_on_a_value_a_unit_kept_aside_trains_as_at_world_size_1():
    """A loss of only the blocks' auxiliary losses: no gradient reaches a block's outputs, and
    its backward begins where autograd first needs its parameters. At world size 2 on the same
    batches the parameters end as at world size 1, bit for bit."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*(Aside() for _ in range(3)))

    def train(fused, module):
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            fused(torch.randn(4, 8, generator=g))
            sum(block.aux for block in module).backward()
            fused.step()

    state = trained_at_sizes_1_and_2(blocks, list, train, lr=1e-2)
    assert not torch.equal(state["0.gate.weight"], blocks[0].gate.weight.detach())


def trained_at_sizes_1_and_2(model, units, train, **settings) -> dict[str, torch.Tensor]:
    """`train(wrapper, module)` on wrappers of copies of `model` (of units `units(copy)`) at
    world sizes 1 and 2, every rank on the same batches: the whole parameters at size 1, once
    every rank's at size 2 are checked equal to them, bit for bit."""
    runs = {}
    for world in (1, 2):
        modules = [copy.deepcopy(model) for _ in range(world)]
        group = fsdp_fusion.LocalGroup(world) if world > 1 else None
        fused = on_ranks(world, lambda rank: FusedFSDP(
            modules[rank], units(modules[rank]), local_group=group, rank=rank, **settings))

        def run(rank):
            train(fused[rank], modules[rank])
            return fused[rank].full_state_dict()

        runs[world] = on_ranks(world, run)
        for f in fused:
            f.close()
    for state in runs[2]:
        for name, value in runs[1][0].items():
            assert torch.equal(state[name], value), name
    return runs[1][0]


@pytest.mark.parametrize("world", [1, 2])
def test_a_step_after_requires_grad_changed_since_wrapping_is_refused_until_it_is_back(world):
    """Which parameters train is fixed when wrapping: a step while a frozen parameter requires
    a gradient, or a trainable one does not, is refused naming it, with nothing changed; with
    `requires_grad` set back the step goes on, and the run ends as one that never changed it."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))
    blocks[1].bias.requires_grad_(False)
    runs = {}
    for toggle in (False, True):
        modules = [copy.deepcopy(blocks) for _ in range(world)]
        group = fsdp_fusion.LocalGroup(world) if world > 1 else None
        fused = on_ranks(world, lambda rank: FusedFSDP(
            modules[rank], list(modules[rank]), local_group=group, rank=rank, lr=1e-2))

        def train(rank):
            module, f = modules[rank], fused[rank]
            g = torch.Generator().manual_seed(1)
            refusals = []
            for step in range(3):
                x = torch.randn(4, 8, generator=g)
                if toggle and step == 1:
                    # Autograd now computes the frozen bias's gradient, which the engine leaves.
                    module[1].bias.requires_grad_(True)
                f(x).square().mean().backward()
                if toggle and step == 1:
                    module[2].weight.requires_grad_(False)
                    with pytest.raises(fsdp_fusion.MisuseError) as refused:
                        f.step()
                    refusals.append(str(refused.value))
                    module[1].bias.requires_grad_(False)
                    module[2].weight.requires_grad_(True)
                f.step()
            return refusals, f.full_state_dict()

        runs[toggle] = on_ranks(world, train)
        for f in fused:
            f.close()
    for (refusals, state), (_, plain) in zip(runs[True], runs[False]):
        assert len(refusals) == 1 and "1.bias, 2.weight" in refusals[0], refusals
        for name, value in plain.items():
            assert torch.equal(state[name], value), name
    assert torch.equal(runs[False][0][1]["1.bias"], blocks[1].bias.detach())


class Recomputed(torch.nn.Module):
    """Blocks under no root parameter, each checkpointed (`reentrant`: True, False, or None for
    no checkpointing)."""

    def __init__(self, reentrant):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            if self.reentrant is None:
                x = torch.tanh(block(x))
            else:
                x = torch.utils.checkpoint.checkpoint(
                    lambda x, block=block: torch.tanh(block(x)), x,
                    use_reentrant=self.reentrant)
        return x


def test_units_recomputed_in_the_backward_under_a_root_without_parameters_reduce_once():
    """A reentrant checkpoint recomputes a unit's forward inside the backward, where no other
    backward is open: the unit's backward opens first, so the recompute stays part of the pass.
    Each group is reduced once a step, as without checkpointing, and the runs end the same."""
    world = 2
    runs = {}
    for reentrant in (None, False, True):
        torch.manual_seed(0)
        modules = [Recomputed(reentrant) for _ in range(world)]
        for m in modules[1:]:
            m.load_state_dict(modules[0].state_dict())
        group = fsdp_fusion.LocalGroup(world)
        fused = on_ranks(world, lambda rank: FusedFSDP(
            modules[rank], list(modules[rank].blocks), local_group=group, rank=rank, lr=1e-2,
            verify_collectives=True))

        def train(rank):
            g = torch.Generator().manual_seed(rank)
            counts = []
            for _ in range(2):
                before = fused[rank].counters().reduce_scatters
                x = torch.randn(4, 8, generator=g, requires_grad=True)
                fused[rank](x).square().mean().backward()
                fused[rank].step()
                counts.append(fused[rank].counters().reduce_scatters - before)
            return counts, fused[rank].full_state_dict()

        runs[reentrant] = on_ranks(world, train)
        for f in fused:
            f.close()
    for reentrant in (False, True):
        for (counts, state), (plain_counts, plain) in zip(runs[reentrant], runs[None]):
            assert counts == plain_counts == [4, 4], (reentrant, counts, plain_counts)
            for name, value in plain.items():
                assert torch.equal(state[name], value), (reentrant, name)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_ranks_match_torch_on_the_mean_of_their_batches(world, optimizer):
    run = train(optimizer, world=world)
    worst = run.worst_loss_difference()
    assert worst <= 1e-5, f"losses differ by {worst} (relative)"
    counters = run.ranks[0].counters()
    assert counters.reduce_scatters > 0 and counters.all_gathers > 0
    assert counters.steps == 4


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_gradient_checkpointing_matches_torch_with_the_same_collectives(world, reentrant):
    run = train("sgd", world=world, checkpoint=True, reentrant=reentrant)
    worst = run.worst_loss_difference()
    assert worst <= 1e-5, f"losses differ by {worst} (relative)"
    # The recomputed forwards belong to their backward: no group is reduced early, or twice.
    plain = train("sgd", world=world).ranks[0].counters()
    checkpointed = run.ranks[0].counters()
    assert checkpointed.reduce_scatters == plain.reduce_scatters


class SavedTensorSpy:
    """Counts saved parameter views that the engine moved to another slot by the backward, and
    can hand autograd the forward-time view instead (what it would read without the client's
    saved-tensor hooks)."""

    def __init__(self, stale: bool):
        self.stale, self.moved = stale, 0

    def __call__(self, fused):
        pack, unpack = fused._pack, fused._unpack

        def spy_pack(t):
            saved = pack(t)
            return (saved, t) if isinstance(saved, _Saved) else saved

        def spy_unpack(saved):
            if not isinstance(saved, tuple):
                return saved
            now = unpack(saved[0])
            self.moved += now.data_ptr() != saved[1].data_ptr()
            return saved[1] if self.stale else now

        fused._pack, fused._unpack = spy_pack, spy_unpack


def test_saved_views_follow_their_parameter_to_its_new_slot():
    spy = SavedTensorSpy(stale=False)
    run = train("sgd", world=2, spy=spy, double_buffer_limit=4)
    assert run.worst_loss_difference() <= 1e-5
    assert spy.moved > 0, "no saved view moved: this test does not exercise the saved-tensor hooks"


def test_forward_time_views_would_be_wrong():
    spy = SavedTensorSpy(stale=True)
    run = train("sgd", world=2, spy=spy, double_buffer_limit=4)
    assert run.worst_loss_difference() > 1e-5, "forward-time views gave the right losses"


def test_frozen_parameters_stay_and_the_tie_holds():
    run = train("adamw")
    fused = run.ranks[0]
    _, initial = models()
    initial = dict(initial.named_parameters())
    for name in FROZEN:
        assert torch.equal(fused.full_parameter(name), initial[name]), f"frozen {name} changed"
    assert [p.name for p in fused._params if p.tied] == ["embed.weight"]
    assert fused.module.head.weight is fused.module.embed.weight, "the tie was broken"
    trained = fused.full_parameter("embed.weight")
    assert not torch.equal(trained, initial["embed.weight"]), "the tied weight never trained"
    difference = (trained - run.reference.embed.weight.detach()).abs().max().item()
    assert difference <= 1e-4


@pytest.mark.parametrize("world", [1, 2])
def test_evaluation_under_no_grad_gives_the_trained_logits_and_training_goes_on(world):
    run = train("adamw", world=world)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = run.reference(tokens)

    def evaluate(rank):
        fused = run.ranks[rank]
        before = fused.counters()
        with torch.no_grad():
            got = fused(tokens)
        after = fused.counters()
        # Training goes on after the evaluation.
        loss = torch.nn.functional.cross_entropy(fused(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        fused.step()
        return got, before, after, fused.counters()

    for got, before, after, stepped in on_ranks(world, evaluate):
        assert (want - got).abs().max().item() <= 1e-4
        assert (after.steps, after.reduce_scatters) == (before.steps, before.reduce_scatters)
        assert stepped.steps == before.steps + 1


def test_parameters_between_hooks_are_placeholders_above_world_size_1_and_shards_at_1():
    single = train("adamw").ranks[0]
    weight = single.module.blocks[1].up.weight
    assert torch.equal(weight.detach(), single.full_parameter("blocks.1.up.weight"))
    single.close()
    assert torch.isnan(weight).all(), "a closed engine's parameter still points at its memory"
    fused = train("sgd", world=2).ranks[0]
    weight = fused.module.blocks[1].up.weight
    assert weight.shape == (4 * 32, 32)
    assert weight.untyped_storage().nbytes() == weight.element_size(), "storage kept"
    assert torch.isnan(weight).all(), "a parameter outside its unit is not the NaN placeholder"


@pytest.mark.parametrize("accumulation", ["no-sync", "keep-gathered"])
def test_accumulation_modes_match_torch_with_fewer_collectives(accumulation):
    every_pass = train("adamw", 2).ranks[0].counters()
    run = train("adamw", 2, accumulation=accumulation)
    worst = run.worst_loss_difference()
    assert worst <= 1e-5, f"losses differ by {worst} (relative)"
    counters = run.ranks[0].counters()
    if accumulation == "no-sync":
        assert counters.reduce_scatters < every_pass.reduce_scatters
        assert counters.all_gathers == every_pass.all_gathers
    else:
        assert counters.all_gathers < every_pass.all_gathers
        assert counters.reduce_scatters == every_pass.reduce_scatters


def test_bf16_gradient_transport_trains_within_bf16_precision():
    exact = train("adamw", 2)
    rounded = train("adamw", 2, reduce_dtype=torch.bfloat16)
    worst = rounded.worst_loss_difference()
    assert worst <= 1e-2, f"losses differ by {worst} (relative)"
    assert worst > exact.worst_loss_difference(), "bf16 transport rounded nothing"


def test_an_unknown_transport_or_accumulation_is_refused():
    _, module = models()
    with pytest.raises(ValueError, match="reduce_dtype torch.float16"):
        FusedFSDP(module, list(module.blocks), reduce_dtype=torch.float16)
    with pytest.raises(ValueError, match="accumulation 'never'"):
        FusedFSDP(module, list(module.blocks), accumulation="never")
    with pytest.raises(ValueError, match="param_storage 'both'"):
        FusedFSDP(module, list(module.blocks), param_storage="both")


@pytest.mark.parametrize("checkpoint", [False, True])
def test_master_storage_trains_a_bf16_model_exactly_as_shard_storage(checkpoint):
    """At world size 1 the master storage casts each group into a slot that moves between
    groups (saved tensors follow it); losses and parameters equal the shard storage's bit for
    bit, placeholders show between the hooks."""
    runs = []
    for storage in ("shard", "master"):
        _, module = models(checkpoint)
        module = module.bfloat16()
        fused = FusedFSDP(module, list(module.blocks), param_storage=storage, lr=1e-2,
                          double_buffer_limit=12)
        losses = train_steps(fused)
        weight = module.blocks[1].up.weight
        between_hooks = bool(torch.isnan(weight.detach()).all())
        assert fused.counters().extra_slots == 0
        runs.append((losses, fused.full_parameter("blocks.1.up.weight"), between_hooks,
                     fused.memory(), fused.planned_memory()))
    shard, master = runs
    (shard_losses, shard_weight, shard_nan, shard_bytes, shard_plan) = shard
    (master_losses, master_weight, master_nan, master_bytes, master_plan) = master
    assert master_losses == shard_losses
    assert torch.equal(master_weight, shard_weight)
    assert not shard_nan and master_nan, "master storage views are slots, not shards"
    # The engine holds what its plan says (a limit with room for the root's groups, the unit's
    # in use and the next's: no slot beyond it), and master storage no bf16 shard of what
    # trains.
    for (current, peak), plan in ((shard_bytes, shard_plan), (master_bytes, master_plan)):
        assert (current, peak) == (plan.between_steps, plan.peak)
        assert plan.between_steps == plan.peak - plan.grad_shards
    assert master_plan.param_shards < shard_plan.param_shards
    assert master_plan.gathered_slots > shard_plan.gathered_slots == 0


def test_per_step_gradient_shards_train_exactly_as_persistent_ones():
    """The engine holds its gradient shards only from a step's backward to its end: between
    steps it holds the plan's `between_steps`; losses and parameters are the persistent
    shards' bit for bit; an unknown choice is refused by name."""
    runs = []
    for grad_shards in ("per-step", "persistent"):
        _, module = models(False)
        fused = FusedFSDP(module, list(module.blocks), grad_shards=grad_shards, lr=1e-2)
        losses, currents = [], []
        for step in batches(1):
            for per_rank in step:
                tokens = per_rank[0]
                loss = loss_of(fused(tokens[:, :-1]), tokens[:, 1:])
                currents.append(fused.memory()[0])
                loss.backward()
                losses.append(loss.item())
            fused.step()
        runs.append((losses, fused.full_parameter("blocks.1.up.weight"), currents,
                     fused.memory(), fused.planned_memory()))
    (step_losses, step_weight, step_currents, step_bytes, step_plan) = runs[0]
    (kept_losses, kept_weight, kept_currents, kept_bytes, kept_plan) = runs[1]
    assert step_losses == kept_losses
    assert torch.equal(step_weight, kept_weight)
    assert step_plan.grad_shards > 0
    assert step_plan.between_steps == step_plan.peak - step_plan.grad_shards
    assert kept_plan.between_steps == kept_plan.peak == step_plan.peak
    # After each forward (the first pass of a step's) no gradient memory yet, or persistent.
    assert set(step_currents[::PASSES]) == {step_plan.between_steps}
    assert max(step_currents) == step_plan.peak, "the later passes add into the shards"
    assert set(kept_currents) == {kept_plan.peak}
    assert step_bytes == (step_plan.between_steps, step_plan.peak)
    assert kept_bytes == (kept_plan.peak, kept_plan.peak)
    _, module = models(False)
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="grad_shards"):
        FusedFSDP(module, list(module.blocks), grad_shards="sometimes")


@pytest.mark.parametrize("world,checkpoint", [(1, False), (2, False), (1, True), (2, True)])
def test_stepping_in_the_backward_trains_exactly_as_after_it_with_less_gradient_memory(
        world, checkpoint):
    """Each group updated as soon as its gradient is final, inside the backward (blocks
    recomputing their forward there too, under gradient checkpointing): losses and parameters
    the ordinary step's bit for bit, a step that holds fewer gradient bytes than the ordinary
    one's (per-step shards), as the plan bounds them; what needs the whole gradient is refused
    before anything changes, and training goes on."""
    runs = {}
    for in_backward in (False, True):
        _, module = models(checkpoint)
        modules = [module] + [copy.deepcopy(module) for _ in range(world - 1)]
        group = fsdp_fusion.LocalGroup(world) if world > 1 else None
        fused = on_ranks(world, lambda rank: FusedFSDP(
            modules[rank], list(modules[rank].blocks), local_group=group, rank=rank, lr=1e-2,
            weight_decay=0.1, grad_shards="per-step", step_in_backward=in_backward))

        def train(rank, fused=fused):
            f, losses = fused[rank], []
            for step in batches(world):
                tokens = step[0][rank]
                loss = loss_of(f(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
                losses.append(loss.item())
                f.step()
            current, peak = f.memory()
            plan = f.planned_memory()
            # Gather slots made beyond the limit stay, each counted (the model's frozen
            # parameters give two of its blocks two groups).
            beyond_plan = current - plan.between_steps
            return losses, f.full_state_dict(), peak - beyond_plan, plan

        runs[in_backward] = on_ranks(world, train)
    for (losses, state, peak, plan), (after_losses, after_state, after_peak, after_plan) in zip(
            runs[True], runs[False]):
        assert losses == after_losses
        assert state.keys() == after_state.keys()
        for name, value in state.items():
            assert torch.equal(value, after_state[name]), name
        assert plan.grad_shards < after_plan.grad_shards
        assert peak <= plan.peak < after_plan.peak == after_peak
    # Refused before anything changes: the step still ends, and the next trains.
    _, module = models(False)
    fused = FusedFSDP(module, list(module.blocks), lr=1e-2, step_in_backward=True)
    tokens = batches(1)[0][0][0]
    loss_of(fused(tokens[:, :-1]), tokens[:, 1:]).backward()
    for options in ({"max_grad_norm": 1.0}, {"grad_norm": True}, {"skip_nonfinite": True},
                    {"count_nonfinite": True}):
        with pytest.raises(fsdp_fusion.MisuseError, match="step_in_backward"):
            fused.step(**options)
    with pytest.raises(fsdp_fusion.MisuseError, match="step_in_backward"):
        fused.set_lr(0.5)
    with pytest.raises(fsdp_fusion.MisuseError, match="step_in_backward"):
        fused(tokens[:, :-1])
    fused.step()
    fused.set_lr(0.5)
    loss_of(fused(tokens[:, :-1]), tokens[:, 1:]).backward()
    fused.step()
    assert fused.counters().steps == 2


def test_a_saved_run_continues_exactly_in_a_fresh_wrapper(tmp_path):
    """Two steps, a save (and one written in the background while training goes on), two more
    steps: a fresh wrapper loaded from either save gives the same last two losses and
    parameters bit for bit; a corrupted checkpoint is refused."""
    data = [per_rank[0] for step in batches(1) for per_rank in step]

    def steps(fused, tokens_list):
        losses = []
        for tokens in tokens_list:
            loss = loss_of(fused(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            fused.step()
            losses.append(loss.item())
        return losses

    _, module = models()
    first = FusedFSDP(module, list(module.blocks), lr=1e-2)
    steps(first, data[:2])
    first.save(tmp_path / "ckpt")
    first.save(tmp_path / "background", wait=False)
    with pytest.raises(fsdp_fusion.MisuseError, match="still being written"):
        first.save(tmp_path / "another", wait=False)
    want = steps(first, data[2:4])
    with torch.no_grad():  # an evaluation's step ends before the wait, which is between steps
        first(data[0][:, :-1])
    first.wait_save()
    first.wait_save()
    for saved in ("ckpt", "background"):
        _, fresh = models()
        second = FusedFSDP(fresh, list(fresh.blocks), lr=1e-2)
        second.load(tmp_path / saved)
        assert steps(second, data[2:4]) == want, saved
    name = "blocks.1.up.weight"
    assert torch.equal(second.full_parameter(name), first.full_parameter(name))
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="never overwrites"):
        first.save(tmp_path / "ckpt")
    blob = tmp_path / "ckpt" / "rank-00000.bin"
    corrupted = bytearray(blob.read_bytes())
    corrupted[len(corrupted) // 2] ^= 1
    blob.write_bytes(bytes(corrupted))
    with pytest.raises(fsdp_fusion.IoError, match="corrupted"):
        second.load(tmp_path / "ckpt")


def test_a_bf16_model_saved_before_any_step_loads_as_wrapped(tmp_path):
    """The weights a wrapper loads are what a save right after holds: a fresh wrapper of a
    zeroed model loaded from it has every parameter of the first; an empty path is refused
    before anything is written."""
    _, module = models()
    first = FusedFSDP(module.to(torch.bfloat16), list(module.blocks))
    first.save(tmp_path / "step0")
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="empty path"):
        first.save("")
    _, other = models()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    second = FusedFSDP(other.to(torch.bfloat16), list(other.blocks))
    second.load(tmp_path / "step0")
    names = [name for name, _ in models()[1].named_parameters()]
    assert sum(float(first.full_parameter(n).float().abs().sum()) for n in names) > 0
    for name in names:
        want = first.full_parameter(name)
        assert want.dtype == torch.bfloat16, name
        assert torch.equal(second.full_parameter(name), want), name


def test_an_exported_model_loads_into_plain_pytorch_and_a_fresh_wrapper(tmp_path):
    """After a step the export holds every parameter as `full_parameter` gives it; a plain
    PyTorch copy loaded from it computes the wrapper's loss; a fresh wrapper imports it
    exactly, and a file of another model is refused with the differences."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    plain, module = models(False)
    fused = FusedFSDP(module, list(module.blocks), lr=1e-2)
    data = [per_rank[0] for step in batches(1) for per_rank in step]
    loss_of(fused(data[0][:, :-1]), data[0][:, 1:]).backward()
    fused.step()
    path = tmp_path / "model.safetensors"
    fused.export(path)
    with pytest.raises(fsdp_fusion.InvalidArgumentError):
        fused.export(path)
    tensors = safetensors_torch.load_file(str(path))
    names = [name for name, _ in plain.named_parameters()]
    assert sorted(tensors) == sorted(names)
    for name in names:
        assert torch.equal(tensors[name], fused.full_parameter(name)), name
    missing, unexpected = plain.load_state_dict(tensors, strict=False)
    assert not unexpected and all(name not in names for name in missing)
    with torch.no_grad():
        tokens = data[1]
        assert torch.equal(loss_of(plain(tokens[:, :-1]), tokens[:, 1:]),
                           loss_of(fused(tokens[:, :-1]), tokens[:, 1:]))
    _, other = models(False)
    fresh = FusedFSDP(other, list(other.blocks), lr=1e-2)
    fresh.import_(path)
    for name in names:
        assert torch.equal(fresh.full_parameter(name), fused.full_parameter(name)), name
    # After the evaluation above, a save (between steps of forwards only) is allowed.
    fused.save(tmp_path / "saved")
    fsdp_fusion.export_checkpoint(tmp_path / "saved", tmp_path / "converted.safetensors")
    assert (tmp_path / "converted.safetensors").read_bytes() == path.read_bytes()
    with pytest.raises(fsdp_fusion.IoError, match="nowhere"):
        fsdp_fusion.export_checkpoint(tmp_path / "nowhere", tmp_path / "none.safetensors")
    bf16_path = tmp_path / "bf16.safetensors"
    safetensors_torch.save_file({n: t.bfloat16() for n, t in tensors.items()}, str(bf16_path))
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="BF16 in the file"):
        fresh.import_(bf16_path)


def test_bf16_moments_halve_the_moments_and_train_close_to_f32_ones():
    """bf16 moments take half the moments' bytes in the plan and the engine; the losses stay
    within 1% of f32 moments' over the steps (each moment rounded without bias); f16 is
    refused by name."""
    runs = []
    for moment_dtype in (torch.float32, torch.bfloat16):
        _, module = models(False)
        fused = FusedFSDP(module, list(module.blocks), lr=1e-2, moment_dtype=moment_dtype)
        losses = train_steps(fused)
        runs.append((losses, fused.planned_memory(), fused.memory()))
    (f32_losses, f32_plan, _), (bf16_losses, bf16_plan, bf16_bytes) = runs
    trainable = sum(p.numel() for p in models(False)[1].parameters() if p.requires_grad)
    assert f32_plan.optimizer_state - bf16_plan.optimizer_state >= 4 * trainable
    assert bf16_bytes[1] == bf16_plan.peak
    assert bf16_losses != f32_losses, "bf16 moments change the run"
    for a, b in zip(bf16_losses, f32_losses):
        assert abs(a - b) <= 1e-2 * abs(b), (bf16_losses, f32_losses)
    _, module = models(False)
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="moment_dtype"):
        FusedFSDP(module, list(module.blocks), moment_dtype=torch.float16)


@pytest.mark.parametrize("world", [1, 2])
def test_a_full_state_dict_is_every_parameter_whole_on_every_rank(world):
    """Gathered on every rank, each parameter's value equals the unsharded reference's (as the
    training tests hold them), under every name the plain model's `state_dict()` has (a tied
    parameter's every name, the persistent buffers), and a plain copy loads it strictly."""
    run = train("adamw", world=world)
    states = on_ranks(world, lambda rank: run.ranks[rank].full_state_dict())
    names = [name for name, _ in run.reference.named_parameters()]
    for state in states:
        assert sorted(state) == sorted(run.reference.state_dict())
        for name in state:
            assert torch.equal(state[name], states[0][name]), name
    reference = dict(run.reference.named_parameters())
    for name in names:
        assert (states[0][name] - reference[name].detach()).abs().max().item() <= 1e-4, name
    if world == 1:
        for name in names:
            assert torch.equal(states[0][name], run.ranks[0].full_parameter(name)), name
    _, plain = models(False)
    plain.load_state_dict(states[0])
    for name, value in plain.state_dict().items():
        assert torch.equal(value, states[0][name]), name


_EMPTY_PARAMETERS = """
import sys
import torch
from fsdp_fusion import FusedFSDP

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.frozen = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        self.trained = torch.nn.Parameter(torch.empty(0, 3))

    def forward(self, x):
        return self.second(self.first(x))

for storage in ("shard", "master"):
    torch.manual_seed(0)
    model = Model()
    fused = FusedFSDP(model, [model.first, model.second], param_storage=storage)
    fused(torch.randn(2, 4)).sum().backward()
    fused.step()
    state = fused.full_state_dict()
    assert state["frozen"].shape == (0,) and state["trained"].shape == (0, 3), state
    fused.load_full_state_dict(state)
    assert fused.full_parameter("trained").shape == (0, 3)
print("trained, gathered and loaded")
"""


def test_parameters_of_no_elements_train_gather_load_and_leave_a_clean_exit():
    """Parameters of no elements (a group of 0 bytes where alone) come back empty from every
    copy, and the process ends cleanly with the wrapper alive, as a script's last line leaves
    it: in a process of its own, as torch aborted the interpreter's exit over a cached view of
    an empty tensor."""
    run = subprocess.run([sys.executable, "-c", _EMPTY_PARAMETERS], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "trained, gathered and loaded", run.stdout


def test_each_units_gradients_are_reduced_in_its_own_backward():
    """Autograd accumulates a leaf's gradient before any other node runs, so when a unit's
    backward ends its gradients are in its parameters and go to the engine then: every block's
    reduce-scatter is issued inside `backward`, none is left for `step`."""
    world = 2
    _, module = models(False)
    modules = [module] + [copy.deepcopy(module) for _ in range(world - 1)]
    group = fsdp_fusion.LocalGroup(world)
    fused = on_ranks(world, lambda rank: FusedFSDP(modules[rank], list(modules[rank].blocks),
                                                   local_group=group, rank=rank, lr=1e-2))
    tokens = batches(world)[0][0]

    def backward_then_step(rank):
        f = fused[rank]
        loss_of(f(tokens[rank][:, :-1]), tokens[rank][:, 1:]).backward()
        in_backward = f.counters().reduce_scatters
        f.step()
        return in_backward, f.counters().reduce_scatters

    for in_backward, after_step in on_ranks(world, backward_then_step):
        # Blocks 0 and 2 hold a frozen group; the root's groups are reduced by the step.
        assert in_backward >= len(module.blocks), (in_backward, after_step)
        assert after_step > in_backward


class CallCounter:
    """The wrapper's library with each `fsdp_engine_*` call counted by name."""

    def __init__(self, lib):
        self._lib, self.calls = lib, {}

    def __getattr__(self, name):
        function = getattr(self._lib, name)
        if not name.startswith("fsdp_engine_"):
            return function

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return function(*args)

        counted.__name__ = name
        return counted


@pytest.mark.parametrize("world", [1, 2])
def test_at_world_size_1_a_pass_calls_the_engine_for_the_roots_hooks_and_one_hand_over(world):
    """Where the views are the shards, a unit has nothing to gather, release or reduce after its
    first forward: a pass calls the engine for the root's hooks and one hand-over of the whole
    model's gradients, and the units' hooks are gone. Above world size 1 every unit's four hooks call it, and each unit's
    gradients go over when its backward ends."""
    _, module = models(False)
    modules = [module] + [copy.deepcopy(module) for _ in range(world - 1)]
    group = fsdp_fusion.LocalGroup(world) if world > 1 else None
    fused = on_ranks(world, lambda rank: FusedFSDP(modules[rank], list(modules[rank].blocks),
                                                   local_group=group, rank=rank, lr=1e-2))
    steps = batches(world)[:2]

    def two_steps(rank):
        f = fused[rank]
        for index, step in enumerate(steps):
            if index == 1:
                f._lib = CallCounter(f._lib)
            tokens = step[0][rank]
            loss_of(f(tokens[:, :-1]), tokens[:, 1:]).backward()
            f.step()
        return f._lib.calls

    units = len(module.blocks)
    for calls in on_ranks(world, two_steps):
        hooks = 1 if world == 1 else units + 1
        for name in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
            assert calls.get(f"fsdp_engine_{name}", 0) == hooks, (name, calls)
        assert calls["fsdp_engine_grads"] == (1 if world == 1 else units + 1), calls
    # At world size 1 the units then run as plain modules, their hooks removed.
    for rank in range(world):
        hooked = [bool(b._forward_pre_hooks or b._forward_hooks) for b in modules[rank].blocks]
        assert hooked == [world > 1] * units, hooked


def test_a_unit_whose_gradients_are_refused_still_ends_its_backward():
    """Two backwards of one forward (the graph retained) at world size 2: the second's
    gradients are refused as duplicates, but every unit's backward ends, its views go back, and
    the later steps' forwards read each unit's gathered memory."""
    world = 2
    _, module = models(False)
    modules = [module] + [copy.deepcopy(module) for _ in range(world - 1)]
    group = fsdp_fusion.LocalGroup(world)
    fused = on_ranks(world, lambda rank: FusedFSDP(
        modules[rank], list(modules[rank].blocks), local_group=group, rank=rank,
        optimizer="sgd", lr=0.5))
    steps = batches(world)

    def run(rank):
        f = fused[rank]
        first = steps[0][0][rank]
        loss = loss_of(f(first[:, :-1]), first[:, 1:])
        loss.backward(retain_graph=True)
        with pytest.raises(fsdp_fusion.MisuseError, match="already received a gradient"):
            loss.backward()
        assert [u.opens for u in f._units] == [0] * len(f._units)
        f.step()
        elsewhere = []
        for u, block in zip(f._units, modules[rank].blocks):
            def check(_module, _args, u=u):
                # Runs after the wrapper's own pre-forward hook: the unit is gathered.
                gathered = (c_void_p * len(u.params))()
                f._lib.fsdp_engine_params(f._engine, u.ids, len(u.params), gathered)
                elsewhere.extend(p.tensor.data_ptr() != (at or 0)
                                 for p, at in zip(u.params, gathered))
            block.register_forward_pre_hook(check)
        losses = []
        for step in steps[2:]:
            tokens = step[0][rank]
            loss = loss_of(f(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            losses.append(loss.item())
            f.step()
        return elsewhere, losses

    for elsewhere, losses in on_ranks(world, run):
        assert elsewhere and not any(elsewhere)
        assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("world,storage", [(1, "shard"), (2, "shard"), (1, "master")])
def test_forwards_under_inference_mode_change_nothing_of_training(world, storage):
    """A forward under `torch.inference_mode()` before the first step and between steps: the
    training after it is the same, bit for bit, as without them."""
    runs = []
    for inference in (False, True):
        _, module = models(False)
        modules = [module] + [copy.deepcopy(module) for _ in range(world - 1)]
        group = fsdp_fusion.LocalGroup(world) if world > 1 else None
        fused = on_ranks(world, lambda rank: FusedFSDP(
            modules[rank], list(modules[rank].blocks), local_group=group, rank=rank,
            param_storage=storage, optimizer="sgd", lr=0.5))

        def run(rank, fused=fused, inference=inference):
            f, losses = fused[rank], []
            for step in batches(world):
                tokens = step[0][rank]
                if inference:
                    with torch.inference_mode():
                        f(tokens[:, :-1])
                loss = loss_of(f(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
                losses.append(loss.item())
                f.step()
            return losses, f.full_state_dict()

        runs.append(on_ranks(world, run))
    for (losses, state), (inference_losses, inference_state) in zip(*runs):
        assert losses == inference_losses
        for name, value in state.items():
            assert torch.equal(value, inference_state[name]), name


class WithActivationUnit(torch.nn.Module):
    """Two linear layers around an activation with no parameters, and a root bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.act = torch.nn.GELU()
        self.out = torch.nn.Linear(16, 4)
        self.bias = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return self.out(self.act(self.inp(x))) + self.bias


def test_a_unit_with_no_parameters_leaves_the_world_size_1_path_without_hooks():
    """At world size 1 with shard storage, a unit with no parameters among the units does not
    keep the units' hooks installed, and trains as the same model without that unit does."""
    runs = []
    for with_activation in (True, False):
        model = WithActivationUnit()
        units = [model.inp, model.act, model.out] if with_activation else [model.inp, model.out]
        fused = FusedFSDP(model, units, optimizer="sgd", lr=0.1)
        g = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(3):
            x = torch.randn(5, 8, generator=g)
            loss = fused(x).square().mean()
            loss.backward()
            losses.append(loss.item())
            fused.step()
        assert fused._unit_hooks == []
        runs.append((losses, fused.full_state_dict()))
    (losses, state), (plain_losses, plain_state) = runs
    assert losses == plain_losses
    for name, value in state.items():
        assert torch.equal(value, plain_state[name]), name


def test_a_save_between_backward_and_step_is_refused_as_a_save_and_changes_nothing(tmp_path):
    """At world size 1, where `.grad` holds the gradients until the step: a save after the
    backward is refused by the save itself (not by an end of step it never asked for), and the
    training after it is the same as without it."""
    runs = []
    for attempt in (False, True):
        model = WithActivationUnit()
        fused = FusedFSDP(model, [model.inp, model.out], optimizer="sgd", lr=0.1)
        g = torch.Generator().manual_seed(3)
        losses = []
        for step in range(3):
            loss = fused(torch.randn(5, 8, generator=g)).square().mean()
            loss.backward()
            losses.append(loss.item())
            if attempt and step == 1:
                with pytest.raises(fsdp_fusion.MisuseError,
                                   match="fsdp_engine_save.*a step is under way"):
                    fused.save(tmp_path / "checkpoint")
            fused.step()
        runs.append((losses, fused.full_state_dict()))
    (losses, state), (attempt_losses, attempt_state) = runs
    assert losses == attempt_losses
    for name, value in state.items():
        assert torch.equal(value, attempt_state[name]), name


class CalledTwice(torch.nn.Module):
    """A block run twice in each forward: its weights shared by two places of the model."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.shared = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = torch.tanh(self.first(x))
        return torch.tanh(self.shared(torch.tanh(self.shared(x))))


def test_a_unit_called_twice_and_a_model_run_twice_before_one_backward_train_at_every_size():
    """A unit called twice in a forward, and the whole model run on two batches before one
    backward: the unit's backward ends once both calls' gradients came back, so that every
    gradient of the pass goes over. At world size 2 on the same batches the parameters end as
    at world size 1, bit for bit, and as plain PyTorch's AdamW leaves them."""
    torch.manual_seed(0)
    model = CalledTwice()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)

    def passes():
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))
                for _ in range(3)]

    for a, b in passes():
        (reference(a).square().mean() + reference(b).square().mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    def train(fused, _module):
        for a, b in passes():
            (fused(a).square().mean() + fused(b).square().mean()).backward()
            fused.step()

    state = trained_at_sizes_1_and_2(model, lambda m: [m.first, m.shared], train, lr=1e-2,
                                     weight_decay=0.01)
    for name, value in reference.state_dict().items():
        difference = (state[name] - value).abs().max().item()
        assert difference <= 1e-5, f"{name} differs by {difference}"


@pytest.mark.parametrize("world", [1, 2])
def test_a_full_state_dict_loads_into_the_engine_and_the_module_s_own_load_is_refused(world):
    """bf16 parameters (an fp32 master behind each): values loaded with `load_full_state_dict`
    are what the engine holds and trains from, on every rank, as plain PyTorch would train
    from them; the wrapped module's own `load_state_dict`, which would write the engine's views
    (at world size 1 the bf16 shards without their masters, which the next step rounds back
    from), is refused with nothing changed, and so is a state of other names or shapes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(torch.bfloat16)
    loaded = {name: torch.full_like(p, 0.25) for name, p in model.named_parameters()}
    modules = [copy.deepcopy(model) for _ in range(world)]
    group = fsdp_fusion.LocalGroup(world) if world > 1 else None
    fused = on_ranks(world, lambda rank: FusedFSDP(
        modules[rank], list(modules[rank]), local_group=group, rank=rank, optimizer="sgd",
        lr=0.5))
    x = torch.ones(2, 8, dtype=torch.bfloat16)

    def run(rank):
        f = fused[rank]
        before = f.full_state_dict()
        with pytest.raises(fsdp_fusion.MisuseError, match="load_full_state_dict"):
            modules[rank].load_state_dict(loaded)
        for bad, what in ((dict(loaded, extra=torch.zeros(1)), "neither"),
                          ({k: v for k, v in loaded.items() if k != "0.bias"}, "missing: 0.bias"),
                          (dict(loaded, **{"1.weight": torch.zeros(8, 4)}), "other shapes")):
            with pytest.raises(fsdp_fusion.InvalidArgumentError, match=what):
                f.load_full_state_dict(bad)
        unchanged = all(torch.equal(v, before[k]) for k, v in f.full_state_dict().items())
        f.load_full_state_dict({k: v.float() for k, v in loaded.items()})
        held = f.full_state_dict()
        f(x).float().sum().backward()
        f.step()
        return unchanged, held, f.full_state_dict()

    outcomes = on_ranks(world, run)
    for f in fused:
        f.close()
    plain = copy.deepcopy(model)
    plain.load_state_dict(loaded)
    plain(x).float().sum().backward()
    with torch.no_grad():
        for p in plain.parameters():
            p -= 0.5 * p.grad
    for unchanged, held, trained in outcomes:
        assert unchanged
        for name, value in loaded.items():
            assert torch.equal(held[name], value), name
        for name, value in plain.state_dict().items():
            assert torch.equal(trained[name], value), name


def test_a_forward_never_run_backward_leaves_the_next_backward_unit_by_unit():
    """A forward with gradients whose graph is dropped unused (a loss only logged) is no call
    the next backward waits for: at world size 2 each unit's gradients still go over, and are
    reduced, as its own backward ends, not at the step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    group = fsdp_fusion.LocalGroup(2)
    modules = [copy.deepcopy(model) for _ in range(2)]
    fused = on_ranks(2, lambda rank: FusedFSDP(modules[rank], list(modules[rank]),
                                                local_group=group, rank=rank))

    def run(rank):
        f, x = fused[rank], torch.ones(2, 8)
        during = []
        for logged in (False, True):
            if logged:
                f(x).sum().item()  # the graph goes with the value
            loss = f(x).sum()
            before = f.counters().reduce_scatters
            loss.backward()
            during.append(f.counters().reduce_scatters - before)
            f.step()
        return during

    # The first unit's inputs need no gradient: its backward ends at the step.
    assert on_ranks(2, run) == [[3, 3], [3, 3]]
    for f in fused:
        f.close()


def test_a_tied_model_s_plain_state_dict_loads_under_either_name():
    """A head tied to the embedding: a plain copy's `state_dict()` names the one parameter
    twice, and loads; names of one tied parameter holding different values are refused, and so
    is a buffer of another shape, before anything is loaded."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.ones(8))

        def forward(self, tokens):
            return self.head(self.embed(tokens) * self.scale)

    torch.manual_seed(0)
    model = Tied()
    fused = FusedFSDP(model, [], lr=0.1)
    plain = Tied()
    with torch.no_grad():
        plain.embed.weight.fill_(0.5)
        plain.scale.fill_(2.0)
    before = fused.full_state_dict()
    changed = dict(plain.state_dict(), **{"head.weight": torch.zeros(16, 8)})
    for bad, what in ((changed, "tied names differ: embed.weight, head.weight"),
                      (dict(plain.state_dict(), scale=torch.ones(4)), "other shapes: scale")):
        with pytest.raises(fsdp_fusion.InvalidArgumentError, match=what):
            fused.load_full_state_dict(bad)
        assert torch.equal(fused.full_state_dict()["embed.weight"], before["embed.weight"])
        assert torch.equal(model.scale, torch.ones(8))
    fused.load_full_state_dict(plain.state_dict())
    assert torch.equal(fused.full_state_dict()["embed.weight"], plain.embed.weight)
    assert torch.equal(model.scale, plain.scale)
    fused.close()
