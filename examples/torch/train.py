"""Trains a small GPT (examples/torch/gpt.py) three ways in one process, on the same synthetic
batches from the same initial weights, and prints each one's loss and step time per step:

- fsdp-fusion: the model wrapped in `FusedFSDP` (bf16 parameter shards with fp32 master weights,
  gradients reduced and accumulated in fp32, AdamW on the shards), CUDA backend with NCCL.
- plain PyTorch: bf16 parameters for compute, an fp32 master copy that AdamW steps (the bf16
  gradients widened to fp32), the bf16 copy refreshed from it before each step.
- FSDP2: `fully_shard` on every block and the root with `MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`: fp32 sharded parameters gathered as bf16, fp32 gradient reduction.

All three compute the forward and backward in bf16 with bf16 weights equal to their fp32 masters
rounded, and update fp32 masters from fp32 gradients with the same AdamW: the same arithmetic up to
the order of floating-point operations. The plain reference is "bf16 parameters with fp32 master"
rather than "fp32 parameters under bf16 autocast" for that reason: autocast would keep layer norms,
softmax and the loss in fp32 and cast weights per op, which neither FSDP run does. The initial
weights are rounded to bf16 first, so that every master starts from the same values.

    NCCL_NVLS_ENABLE=0 python examples/torch/train.py --library .gpu/lib/libfsdp_fusion.so

World size 1: torch.distributed is initialized with NCCL over tcp://127.0.0.1 for FSDP2, and the
fsdp-fusion engine joins its own NCCL group of one rank. `--device cpu` runs the same on the CPU
backend (gloo for FSDP2, host timers), small, as a smoke test without a GPU. Step times are CUDA
events around forward, backward and optimizer (the loss is read on the host after each step, so
every step starts on an idle machine); the trainers take turns step by step, so that all three
see the same host and GPU conditions; the summary leaves out the first `--warmup` steps. `--lr-schedule warmup-cosine
--warmup-steps N` and `--clip NORM` run the same recipe in all three (torch's schedulers and
`clip_grad_norm_` for the other two) and print the gradient norms side by side. All three exempt
1-D parameters and embeddings from weight decay (fsdp-fusion's default; AdamW parameter groups for
the others).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

# The package from this checkout when it is not installed.
sys.path.append(str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_fusion import FusedFSDP, default_no_weight_decay  # noqa: E402
from gpt import GPT, loss_of  # noqa: E402


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", help="libfsdp_fusion.so (default: as fsdp_fusion finds it)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the mean times")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--lr-schedule", default="constant", choices=["constant", "warmup-cosine"],
                        help="warmup-cosine: linear warmup, then a cosine decay to 0 at the last step")
    parser.add_argument("--warmup-steps", type=int, default=5, help="of the warmup-cosine schedule")
    parser.add_argument("--clip", type=float, help="clip the whole gradient's 2-norm to this")
    parser.add_argument("--checkpoint", action="store_true",
                        help="recompute each block's forward in backward (activation checkpointing)")
    parser.add_argument("--compile", action="store_true",
                        help="compile each block with torch.compile before wrapping (every trainer)")
    parser.add_argument("--param-storage", default="shard", choices=["shard", "master"],
                        help="fsdp-fusion: a bf16 shard beside each fp32 master, or the master only")
    parser.add_argument("--grad-shards", default="per-step", choices=["per-step", "persistent"],
                        help="fsdp-fusion: gradient shards made each step, or kept")
    parser.add_argument("--moment-dtype", default="f32", choices=["f32", "bf16"],
                        help="fsdp-fusion: AdamW's moments in f32, or bf16 (rounded stochastically)")
    parser.add_argument("--export", metavar="FILE",
                        help="fsdp-fusion: after training, export the model as safetensors to "
                             "FILE, load it into a plain PyTorch copy and compare their losses")
    parser.add_argument("--double-buffer-limit", type=int, default=4,
                        help="fsdp-fusion's gathered groups: 2 root groups, the unit, a prefetch")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batches(args, device):
    """Synthetic sequences that a model can learn: each token follows from the one before by a
    fixed random map, except one in ten drawn at random. The same for every trainer."""
    g = torch.Generator().manual_seed(args.seed + 1)
    follow = torch.randperm(args.vocab, generator=g)
    for _ in range(args.steps):
        tokens = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
        for t in range(1, args.seq + 1):
            noise = torch.randint(0, args.vocab, (args.batch,), generator=g)
            keep = torch.rand(args.batch, generator=g) < 0.9
            tokens[:, t] = torch.where(keep, follow[tokens[:, t - 1]], noise)
        yield tokens.to(device)


def compiled_blocks(args, model: GPT) -> GPT:
    """`model` with each block compiled (`--compile`), as torchtitan compiles each layer before
    sharding it: the wrappers' hooks stay between the compiled regions."""
    if args.compile:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    return model


def initial_model(args) -> GPT:
    """The fp32 initial weights, rounded to bf16 so that every trainer's master starts equal."""
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.dim, args.heads, args.layers, args.seq, args.checkpoint)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def adamw(args, module):
    """AdamW with weight decay off for the parameters `default_no_weight_decay` names (1-D
    parameters and embeddings), as fsdp-fusion's default."""
    exempt = default_no_weight_decay(module)
    named = list(module.named_parameters())
    groups = [{"params": [p for n, p in named if n not in exempt]},
              {"params": [p for n, p in named if n in exempt], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=tuple(args.betas), eps=args.eps,
                             weight_decay=args.weight_decay)


def lr_factor(args, step: int) -> float:
    """The learning rate of `step` over the base rate: fsdp-fusion's side of the schedule."""
    if args.lr_schedule == "constant":
        return 1.0
    if step < args.warmup_steps:
        start = 1 / args.warmup_steps
        return start + (1 - start) * step / args.warmup_steps
    span = max(args.steps - args.warmup_steps, 1)
    return 0.5 * (1 + math.cos(math.pi * min(step - args.warmup_steps, span) / span))


def torch_schedule(args, optimizer):
    """The same schedule for a torch optimizer (its own schedulers), or None."""
    if args.lr_schedule == "constant":
        return None
    lr = torch.optim.lr_scheduler
    return lr.SequentialLR(optimizer, [
        lr.LinearLR(optimizer, start_factor=1 / args.warmup_steps, total_iters=args.warmup_steps),
        lr.CosineAnnealingLR(optimizer, T_max=max(args.steps - args.warmup_steps, 1)),
    ], milestones=[args.warmup_steps])


class TorchRecipe:
    """Clipping and the schedule of a torch trainer's step."""

    def __init__(self, args, optimizer, params):
        self.clip, self.params = args.clip, list(params)
        self.optimizer, self.schedule = optimizer, torch_schedule(args, optimizer)

    def step(self):
        """Clips, steps and advances the schedule; the norm (a tensor) when clipping."""
        norm = None
        if self.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.schedule is not None:
            self.schedule.step()
        return norm


class Timer:
    """Step times: CUDA events on a GPU (read after the run), the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def start(self):
        self.marks.append([self._mark(), None])

    def stop(self):
        self.marks[-1][1] = self._mark()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def milliseconds(self) -> list[float]:
        if not self.cuda:
            return [(end - start) * 1e3 for start, end in self.marks]
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in self.marks]


class FusionTrainer:
    name = "fsdp-fusion"

    def __init__(self, args, model, device):
        module = compiled_blocks(args, copy.deepcopy(model).to(device=device, dtype=torch.bfloat16))
        self.model = FusedFSDP(module, list(module.blocks), args.library, lr=args.lr,
                               betas=tuple(args.betas), eps=args.eps,
                               weight_decay=args.weight_decay,
                               no_weight_decay=default_no_weight_decay,
                               double_buffer_limit=args.double_buffer_limit,
                               param_storage=args.param_storage,
                               grad_shards=args.grad_shards,
                               moment_dtype=torch.bfloat16 if args.moment_dtype == "bf16"
                               else torch.float32)
        self.args, self.steps = args, 0

    def step(self, tokens):
        self.model.set_lr(self.args.lr * lr_factor(self.args, self.steps))
        self.steps += 1
        loss = loss_of(self.model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        return loss, self.model.step(max_grad_norm=self.args.clip).grad_norm


class PlainTrainer:
    name = "plain PyTorch"

    def __init__(self, args, model, device):
        self.master = copy.deepcopy(model).to(device)
        self.compute = compiled_blocks(args, copy.deepcopy(self.master).to(torch.bfloat16))
        self.pairs = list(zip(self.master.parameters(), self.compute.parameters()))
        self.recipe = TorchRecipe(args, adamw(args, self.master), self.master.parameters())

    def step(self, tokens):
        with torch.no_grad():
            for master, compute in self.pairs:
                compute.copy_(master)
        loss = loss_of(self.compute(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        for master, compute in self.pairs:
            master.grad = compute.grad.float()
            compute.grad = None
        return loss, self.recipe.step()


class Fsdp2Trainer:
    name = "FSDP2"

    def __init__(self, args, model, device):
        self.model = compiled_blocks(args, copy.deepcopy(model).to(device))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # Without a mesh FSDP2 takes the GPU whenever one is present, --device cpu or not.
        mesh = init_device_mesh(device.type, (1,))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)
        self.recipe = TorchRecipe(args, adamw(args, self.model), self.model.parameters())

    def step(self, tokens):
        loss = loss_of(self.model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        return loss, self.recipe.step()


def run(trainers, data, device):
    """Trains every trainer on every batch, the trainers taking turns step by step so that all
    see the same machine; returns each one's losses and gradient norms (read after each step)
    and step times."""
    timers = [Timer(device) for _ in trainers]
    records = [([], []) for _ in trainers]
    for tokens in data:
        for trainer, timer, (losses, norms) in zip(trainers, timers, records):
            timer.start()
            loss, norm = trainer.step(tokens)
            timer.stop()
            losses.append(loss.item())
            norms.append(float(norm) if norm is not None else math.nan)
    return {t.name: (losses, norms, timer.milliseconds())
            for t, timer, (losses, norms) in zip(trainers, timers, records)}


def exported_losses(fused, model, tokens, path, device):
    """Exports the trained model, loads the file into a plain bf16 copy of `model` and prints
    both models' loss on `tokens`."""
    from safetensors.torch import load_file

    fused.export(path)
    plain = copy.deepcopy(model).to(device=device, dtype=torch.bfloat16)
    tensors = load_file(path, device=str(device))
    missing, unexpected = plain.load_state_dict(tensors, strict=False)
    names = {name for name, _ in plain.named_parameters()}
    if unexpected or names & set(missing):
        raise SystemExit(f"the export does not fit the model: missing {missing}, "
                         f"unexpected {unexpected}")
    with torch.no_grad():
        ours = loss_of(fused(tokens[:, :-1]), tokens[:, 1:]).item()
        theirs = loss_of(plain(tokens[:, :-1]), tokens[:, 1:]).item()
    print(f"exported to {path} ({len(tensors)} tensors): loss on batch 0 {ours:.6f} through "
          f"fsdp-fusion, {theirs:.6f} through plain PyTorch loaded from the file "
          f"(difference {abs(ours - theirs):.2e})")


def main() -> int:
    args = arguments()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    init = dict(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **init)
    else:
        dist.init_process_group("gloo", **init)
    model = initial_model(args)
    data = list(batches(args, device))
    trainers = [make(args, model, device) for make in (FusionTrainer, PlainTrainer, Fsdp2Trainer)]
    results = run(trainers, data, device)
    if args.export:
        exported_losses(trainers[0].model, model, data[0], args.export, device)
    trainers[0].model.close()  # the engine's memory and NCCL group, now rather than at exit
    names = [t.name for t in trainers]
    recipe = f"{args.lr_schedule} schedule" + (f", clip {args.clip}" if args.clip else "")
    recipe += ", blocks compiled" if args.compile else ""
    print(f"{args.layers} blocks, dim {args.dim}, vocab {args.vocab}, batch {args.batch} x "
          f"{args.seq} tokens, bf16, AdamW lr {args.lr} ({recipe}), {args.device}, world size 1")
    norm = " grad norm" if args.clip else ""
    print("step " + " ".join(f"{n + ' loss':>19}{norm:>10} {'ms':>8}" for n in names))
    for step in range(args.steps):
        cells = []
        for n in names:
            losses, norms, times = results[n]
            shown = f"{norms[step]:10.4f}" if args.clip else ""
            cells.append(f"{losses[step]:19.6f}{shown} {times[step]:8.2f}")
        print(f"{step:4d} " + " ".join(cells))
    plain_losses, plain_norms, _ = results["plain PyTorch"]
    medians = {}
    for name in names:
        losses, norms, times = results[name]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, plain_losses))
        timed = times[args.warmup:] or times
        medians[name] = statistics.median(timed)
        print(f"{name:>14}: mean step {statistics.mean(timed):8.2f} ms, median "
              f"{medians[name]:8.2f} ms (steps {args.warmup}..{args.steps - 1}), "
              f"max relative loss difference vs plain PyTorch {worst:.2e}")
        if args.clip:
            gap = max(abs(a - b) / b for a, b in zip(norms, plain_norms))
            print(f"{name:>14}: max relative gradient-norm difference vs plain PyTorch {gap:.2e}")
    for name in names[0], names[2]:
        print(f"{name} / plain PyTorch, median step: {medians[name] / medians['plain PyTorch']:.3f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
