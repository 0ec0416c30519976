"""Expert parameters: a process group of fewer ranks than the world, each group of its ranks
training its own copy, through FusedFSDP on CPU ranks against torch."""

from __future__ import annotations

import copy

import pytest
import torch
from training import on_ranks

from fsdp_fusion import FusedFSDP, LocalGroup
from fsdp_fusion.errors import InvalidArgumentError

EXPERTS = ("blocks.1.weight", "blocks.1.bias")
WORLD, SIZE, LR = 4, 2, 0.5


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def wrap(module, rank, group, **groups):
    return FusedFSDP(module, list(module.blocks), optimizer="sgd", lr=LR, local_group=group,
                     rank=rank, **groups)


def test_each_group_of_ranks_trains_its_own_copy_of_the_experts():
    base = Stack()
    modules = []
    for rank in range(WORLD):
        module = copy.deepcopy(base)
        with torch.no_grad():
            # The copies of the experts differ from the start: one per group of SIZE ranks.
            module.blocks[1].weight.add_(0.1 * (rank // SIZE))
        modules.append(module)
    inputs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)]
    grads = []
    for module, x in zip(modules, inputs):
        reference = copy.deepcopy(module)
        reference(x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})
    # One SGD step of the mean over the world: the dense parameters' gradients summed over every
    # rank, the experts' over the ranks of their copy.
    expected = []
    for rank, module in enumerate(modules):
        first = rank // SIZE * SIZE
        expected.append({
            n: p.detach() - LR * sum(
                grads[q][n] for q in (range(first, first + SIZE) if n in EXPERTS else
                                      range(WORLD))) / WORLD
            for n, p in module.named_parameters()})
    group = LocalGroup(WORLD)

    def run(rank):
        fused = wrap(modules[rank], rank, group, process_groups={"experts": SIZE},
                     param_groups={n: "experts" for n in EXPERTS})
        fused(inputs[rank]).square().mean().backward()
        fused.step()
        return fused.full_state_dict()

    states = on_ranks(WORLD, run)
    for rank, state in enumerate(states):
        for name, want in expected[rank].items():
            torch.testing.assert_close(state[name], want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(states[0]["blocks.1.weight"], states[SIZE]["blocks.1.weight"])
    torch.testing.assert_close(states[0]["blocks.0.weight"], states[SIZE]["blocks.0.weight"])


def test_undeclared_or_unknown_groups_and_sizes_that_do_not_divide_are_refused():
    with pytest.raises(InvalidArgumentError, match="no parameter"):
        wrap(Stack(), 0, None, process_groups={"experts": 1},
             param_groups={"blocks.9.weight": "experts"})
    with pytest.raises(InvalidArgumentError, match="does not declare"):
        wrap(Stack(), 0, None, param_groups={"blocks.1.weight": "experts"})
    with pytest.raises(InvalidArgumentError, match="do not divide"):
        wrap(Stack(), 0, None, process_groups={"experts": 2},
             param_groups={"blocks.1.weight": "experts"})
