"""Checks the PyTorch client on the CPU backend against plain PyTorch (fp32, CPU), no GPU needed.

    cargo build --release --lib
    python examples/torch/test_client.py [path/to/libfsdp_fusion.so]

The library is the argument, else $FSDP_FUSION_LIBRARY, else target/release/libfsdp_fusion.so.
A small GPT (embedding tied with the LM head, a frozen root parameter, frozen parameters inside two
blocks) trains through `FusedFSDP` and, beside it, as a plain module with a torch optimizer, on the
same batches (two backward passes per step): at world size 1, and at world size 2 with the ranks
as threads, each on its own batch; then train.py runs small on the CPU. Prints one line per check
and exits non-zero if any fails.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp_fusion_torch  # noqa: E402
from fsdp_fusion_torch import FusedFSDP, LocalGroup  # noqa: E402
from gpt import GPT, loss_of  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 4, 16, 4
STEPS, PASSES = 5, 2
# A frozen root parameter, and frozen parameters inside blocks 0 and 2: those blocks then hold two
# groups, so that at world size 2 the engine gathers them into other slots in backward than in
# forward. (At world size 1 the engine views the shards: nothing moves.)
FROZEN = ("pos", "blocks.0.qkv.bias", "blocks.2.up.bias")


def library() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    root = Path(__file__).resolve().parents[2]
    return os.environ.get(fsdp_fusion_torch.LIBRARY_ENV,
                          str(root / "target" / "release" / "libfsdp_fusion.so"))


def models():
    """The reference GPT and an identical copy for the client."""
    torch.manual_seed(0)
    reference = GPT(VOCAB, DIM, HEADS, LAYERS, SEQ)
    for name, p in reference.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return reference, copy.deepcopy(reference)


def batches(world: int):
    """Per step, per backward pass, one batch per rank."""
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield [[torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(world)]
               for _ in range(PASSES)]


def optimizers(optimizer: str, params):
    """The torch optimizer and the client's settings for it."""
    if optimizer == "adamw":
        settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        return torch.optim.AdamW(params, **settings), settings
    settings = dict(lr=0.5)
    return torch.optim.SGD(params, **settings), settings


def train(optimizer: str, world: int = 1, spy=None, **engine):
    """Trains the reference on the mean loss over the ranks' batches, and `world` client ranks
    (threads) on one batch each; returns the reference's losses, each rank's, and the models."""
    reference, module = models()
    torch_optimizer, settings = optimizers(
        optimizer, [p for p in reference.parameters() if p.requires_grad])
    group = LocalGroup(world, library()) if world > 1 else None
    modules = [module] + [copy.deepcopy(module) for _ in range(world - 1)]

    def make(rank: int):
        return FusedFSDP(modules[rank], list(modules[rank].blocks), library(),
                         optimizer=optimizer, local_group=group, rank=rank, **settings, **engine)

    # Making an engine compares the ranks' plans: the ranks make theirs together.
    with ThreadPoolExecutor(world) as pool:
        ranks = list(pool.map(make, range(world)))
    if spy is not None:
        for fused in ranks:
            spy(fused)
    data = list(batches(world))
    reference_losses = []
    for step in data:
        for per_rank in step:
            losses = [loss_of(reference(t[:, :-1]), t[:, 1:]) for t in per_rank]
            (sum(losses) / world).backward()
            reference_losses.append([loss.item() for loss in losses])
        torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)

    def run(rank: int):
        fused, out = ranks[rank], []
        for step in data:
            for per_rank in step:
                tokens = per_rank[rank]
                loss = loss_of(fused(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
                out.append(loss.item())
            fused.step()
        return out

    # The ranks meet in every collective: each needs its own thread.
    with ThreadPoolExecutor(world) as pool:
        rank_losses = list(pool.map(run, range(world)))
    return reference_losses, rank_losses, reference, ranks


def worst_loss_difference(reference_losses, rank_losses) -> float:
    return max(abs(mine[i] - want[rank]) / abs(want[rank])
               for rank, mine in enumerate(rank_losses)
               for i, want in enumerate(reference_losses))


def largest_difference(reference, fused) -> tuple[float, str]:
    worst = (0.0, "")
    for name, p in reference.named_parameters():
        difference = (fused.full_parameter(name) - p.detach()).abs().max().item()
        worst = max(worst, (difference, name))
    return worst


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
            return (saved, t) if isinstance(saved, fsdp_fusion_torch._Saved) else saved

        def spy_unpack(saved):
            if not isinstance(saved, tuple):
                return saved
            now = unpack(saved[0])
            self.moved += now.data_ptr() != saved[1].data_ptr()
            return saved[1] if self.stale else now

        fused._pack, fused._unpack = spy_pack, spy_unpack


def check_adamw_matches_torch():
    reference_losses, rank_losses, reference, (fused,) = train("adamw")
    worst = worst_loss_difference(reference_losses, rank_losses)
    assert worst <= 1e-6, f"losses differ by {worst} (relative)"
    # AdamW turns the near-zero gradients of biases such as the keys' (softmax ignores them) into
    # steps of about lr whatever their rounding: parameters agree to that noise, losses exactly.
    difference, name = largest_difference(reference, fused)
    assert difference <= 1e-4, f"{name} differs by {difference}"
    return (f"{len(rank_losses[0])} losses within {worst:.1e}, parameters within "
            f"{difference:.1e} ({name})")


def check_two_ranks_match_torch():
    spy = SavedTensorSpy(stale=False)
    reference_losses, rank_losses, _, ranks = train("sgd", world=2, spy=spy, double_buffer_limit=4)
    worst = worst_loss_difference(reference_losses, rank_losses)
    assert worst <= 1e-6, f"losses differ by {worst} (relative)"
    assert spy.moved > 0, "no saved view moved: this check does not exercise the saved-tensor hooks"
    counters = ranks[0].counters()
    return (f"{len(rank_losses[0])} losses per rank within {worst:.1e}; {spy.moved} saved views "
            f"read from a new slot; rank 0: {counters.all_gathers} all-gathers, "
            f"{counters.reduce_scatters} reduce-scatters")


def check_stale_views_would_be_wrong():
    spy = SavedTensorSpy(stale=True)
    reference_losses, rank_losses, _, _ = train("sgd", world=2, spy=spy, double_buffer_limit=4)
    worst = worst_loss_difference(reference_losses, rank_losses)
    assert worst > 1e-5, f"forward-time views gave the right losses ({worst})"
    return f"reading the forward-time views instead, losses would differ by {worst:.1e}"


def check_frozen_and_tied():
    _, _, _, (fused,) = train("adamw")
    _, initial = models()
    for name in FROZEN:
        assert torch.equal(fused.full_parameter(name), dict(initial.named_parameters())[name]), (
            f"frozen {name} changed")
    tied = [p for p in fused._params if p.tied]
    assert [p.name for p in tied] == ["embed.weight"], [p.name for p in tied]
    assert fused.module.head.weight is fused.module.embed.weight, "the tie was broken"
    return "frozen parameters unchanged, embed.weight declared tied and still shared"


def check_eval_forward_and_placeholders():
    _, _, reference, (fused,) = train("adamw")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = reference(tokens)
        got = fused(tokens)
    difference = (want - got).abs().max().item()
    assert difference <= 1e-4, f"eval logits differ by {difference}"
    weight = fused.module.blocks[1].up.weight
    assert weight.shape == reference.blocks[1].up.weight.shape, weight.shape
    assert weight.untyped_storage().nbytes() == weight.element_size(), "storage kept"
    return f"no-grad logits within {difference:.1e}; outside hooks parameters are placeholders"


def check_train_script_runs_on_the_cpu():
    """train.py's three trainers, small, on the CPU backend and gloo: bf16 end to end."""
    script = Path(__file__).resolve().parent / "train.py"
    small = ["--device", "cpu", "--steps", "4", "--warmup", "1", "--vocab", "128", "--dim", "32",
             "--heads", "2", "--layers", "2", "--seq", "16", "--batch", "2"]
    run = subprocess.run([sys.executable, str(script), "--library", library(), *small],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.findall(r"(\S+): mean step .* plain PyTorch (\S+)", run.stdout)
    assert [name for name, _ in found] == ["fsdp-fusion", "PyTorch", "FSDP2"], run.stdout
    worst = max(float(difference) for _, difference in found)
    assert worst <= 1e-3, run.stdout
    return f"three trainers agree within {worst:.1e} (relative loss)"


def main() -> int:
    checks = [check_adamw_matches_torch, check_two_ranks_match_torch,
              check_stale_views_would_be_wrong, check_frozen_and_tied,
              check_eval_forward_and_placeholders, check_train_script_runs_on_the_cpu]
    failed = 0
    for check in checks:
        try:
            print(f"ok   {check.__name__}: {check()}")
        except Exception as e:  # noqa: BLE001 - report every check, then fail
            failed += 1
            print(f"FAIL {check.__name__}: {type(e).__name__}: {e}")
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
