"""A small GPT trained through `FusedFSDP` beside the same GPT with a torch optimizer, on the same
batches: the reference takes the mean loss over the ranks' batches, each client rank (a thread
of one local group) its own batch; two backward passes per step."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from gpt import GPT, loss_of

from fsdp_fusion import FusedFSDP, LocalGroup

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 4, 16, 4
STEPS, PASSES = 4, 2
# A frozen root parameter, and frozen parameters inside blocks 0 and 2: those blocks then hold two
# groups, so that above world size 1 the engine gathers them into other slots in backward than in
# forward. (At world size 1 the engine views the shards: nothing moves.)
FROZEN = ("pos", "blocks.0.qkv.bias", "blocks.2.up.bias")


def models(checkpoint: bool = False, reentrant: bool = False):
    """The reference GPT and an identical copy for the client."""
    torch.manual_seed(0)
    reference = GPT(VOCAB, DIM, HEADS, LAYERS, SEQ, checkpoint=checkpoint, reentrant=reentrant)
    for name, p in reference.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return reference, copy.deepcopy(reference)


def batches(world: int):
    """Per step, per backward pass, one batch per rank."""
    g = torch.Generator().manual_seed(1)
    return [[[torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(world)]
             for _ in range(PASSES)] for _ in range(STEPS)]


def optimizer_settings(optimizer: str) -> dict:
    if optimizer == "adamw":
        return dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return dict(lr=0.5)


def torch_optimizer(optimizer: str, module: torch.nn.Module):
    """The torch optimizer a user replaces with the client: given the trainable parameters, so
    that weight decay applies to all of them, as the client's default."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    if optimizer == "adamw":
        return torch.optim.AdamW(trainable, **optimizer_settings(optimizer))
    return torch.optim.SGD(trainable, **optimizer_settings(optimizer))


@dataclass
class Run:
    reference_losses: list = field(default_factory=list)  # per pass: one loss per rank
    rank_losses: list = field(default_factory=list)  # per rank: one loss per pass
    reference: torch.nn.Module | None = None
    ranks: list = field(default_factory=list)

    def worst_loss_difference(self) -> float:
        return max(abs(mine[i] - want[rank]) / abs(want[rank])
                   for rank, mine in enumerate(self.rank_losses)
                   for i, want in enumerate(self.reference_losses))

    def largest_parameter_difference(self) -> tuple[float, str]:
        fused = self.ranks[0]
        worst = (0.0, "")
        for name, p in self.reference.named_parameters():
            difference = (fused.full_parameter(name) - p.detach()).abs().max().item()
            worst = max(worst, (difference, name))
        return worst


def on_ranks(world: int, f):
    """`f(rank)` on a thread per rank: the ranks meet in every collective."""
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(f, range(world)))


def train(optimizer: str, world: int = 1, checkpoint: bool = False, reentrant: bool = False,
          spy=None, **engine) -> Run:
    reference, module = models(checkpoint, reentrant)
    reference_optimizer = torch_optimizer(optimizer, reference)
    group = LocalGroup(world) if world > 1 else None
    modules = [module] + [copy.deepcopy(module) for _ in range(world - 1)]

    def make(rank: int):
        return FusedFSDP(modules[rank], list(modules[rank].blocks), optimizer=optimizer,
                         local_group=group, rank=rank, **optimizer_settings(optimizer), **engine)

    # Making an engine compares the ranks' plans: the ranks make theirs together.
    run = Run(reference=reference, ranks=on_ranks(world, make))
    if spy is not None:
        for fused in run.ranks:
            spy(fused)
    data = batches(world)
    for step in data:
        for per_rank in step:
            losses = [loss_of(reference(t[:, :-1]), t[:, 1:]) for t in per_rank]
            (sum(losses) / world).backward()
            run.reference_losses.append([loss.item() for loss in losses])
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)

    run.rank_losses = rank_losses(run.ranks, data)
    return run


def rank_losses(ranks: list[FusedFSDP], data) -> list[list[float]]:
    """Per rank, the loss of every pass of `data` (`batches(len(ranks))`) through the rank's
    wrapper, stepping after each step's passes."""

    def rank_run(rank: int):
        fused, out = ranks[rank], []
        for step in data:
            for per_rank in step:
                tokens = per_rank[rank]
                loss = loss_of(fused(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
                out.append(loss.item())
            fused.step()
        return out

    return on_ranks(len(ranks), rank_run)
