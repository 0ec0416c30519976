"""Checks the PyTorch client on the CPU backend against plain PyTorch (fp32, CPU), no GPU needed.

    cargo build --release --lib
    python examples/torch/test_client.py [path/to/libfsdp_fusion.so]

The library is the argument, else $FSDP_FUSION_LIBRARY, else target/release/libfsdp_fusion.so.
A small GPT (embedding tied with the LM head, a frozen root parameter, frozen parameters inside two
blocks) trains through `FusedFSDP` and, beside it, as a plain module with a torch optimizer, on the
same batches (two backward passes per step); then train.py runs small on the CPU. Prints one line
per check and exits non-zero if any fails.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp_fusion_torch  # noqa: E402
from fsdp_fusion_torch import FusedFSDP  # noqa: E402
from gpt import GPT, loss_of  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 4, 16, 4
STEPS, PASSES = 5, 2
# A frozen root parameter, and frozen parameters inside blocks 0 and 2: those blocks then hold two
# groups, so the engine gathers them into other slots in backward than in forward.
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


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(PASSES)]


def train(optimizer: str, spy=None, **engine):
    """Trains both models; returns the per-pass losses of each and both models."""
    reference, module = models()
    trainable = [p for p in reference.parameters() if p.requires_grad]
    if optimizer == "adamw":
        settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        torch_optimizer = torch.optim.AdamW(trainable, **settings)
    else:
        settings = dict(lr=0.5)
        torch_optimizer = torch.optim.SGD(trainable, **settings)
    fused = FusedFSDP(module, list(module.blocks), library(), optimizer=optimizer, **settings,
                      **engine)
    if spy is not None:
        spy(fused)
    losses = ([], [])
    for step in batches():
        for tokens in step:
            for model, out in ((reference, losses[0]), (fused, losses[1])):
                loss = loss_of(model(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
                out.append(loss.item())
        torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)
        fused.step()
    return losses, reference, fused


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
    (reference_losses, fused_losses), reference, fused = train("adamw")
    for i, (r, f) in enumerate(zip(reference_losses, fused_losses)):
        assert abs(r - f) <= 1e-6 * abs(r), f"pass {i}: loss {f} vs torch {r}"
    # AdamW turns the near-zero gradients of biases such as the keys' (softmax ignores them) into
    # steps of about lr whatever their rounding: parameters agree to that noise, losses exactly.
    difference, name = largest_difference(reference, fused)
    assert difference <= 1e-4, f"{name} differs by {difference}"
    return f"{len(fused_losses)} losses within 1e-6, parameters within {difference:.1e} ({name})"


def check_sgd_gradients_match_torch():
    spy = SavedTensorSpy(stale=False)
    _, reference, fused = train("sgd", spy=spy, double_buffer_limit=4)
    difference, name = largest_difference(reference, fused)
    assert difference <= 1e-6, f"{name} differs by {difference}"
    assert spy.moved > 0, "no saved view moved: this check does not exercise the saved-tensor hooks"
    counters = fused.counters()
    return (f"parameters within {difference:.1e}; {spy.moved} saved views read from a new slot; "
            f"{counters.all_gathers} all-gathers, {counters.reduce_scatters} reduce-scatters")


def check_stale_views_would_be_wrong():
    spy = SavedTensorSpy(stale=True)
    _, reference, fused = train("sgd", spy=spy, double_buffer_limit=4)
    difference, name = largest_difference(reference, fused)
    assert difference > 1e-3, f"forward-time views gave the right answer ({difference})"
    return f"without the hooks' remapping {name} would differ by {difference:.1e}"


def check_frozen_and_tied():
    _, reference, fused = train("adamw")
    _, initial = models()
    for name in FROZEN:
        assert torch.equal(fused.full_parameter(name), dict(initial.named_parameters())[name]), (
            f"frozen {name} changed")
    tied = [p for p in fused._params if p.tied]
    assert [p.name for p in tied] == ["embed.weight"], [p.name for p in tied]
    assert fused.module.head.weight is fused.module.embed.weight, "the tie was broken"
    return "frozen parameters unchanged, embed.weight declared tied and still shared"


def check_eval_forward_and_placeholders():
    _, reference, fused = train("adamw")
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
    checks = [check_adamw_matches_torch, check_sgd_gradients_match_torch,
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
