"""The whole training step as one CUDA graph: fsdp-fusion and plain PyTorch, each eager and
captured with `torch.cuda.graph`, on the same model, batches and recipe (AdamW, a warmup-cosine
schedule, the gradient's 2-norm clipped), at world size 1 on NCCL.

- fsdp-fusion: `FusedFSDP` with persistent gradient shards; the captured trainer runs its first
  step eagerly (the warm-up), captures the second with `FusedFSDP.capture` and replays it for
  every later step (`FusedFSDP.replay`), the learning rate set before each; both clip on the
  device (`step(max_grad_norm=..., clip_on_device=True)`), and with `--skip-nonfinite` skip a
  step whose gradient is not finite there too.
- plain PyTorch: bf16 parameters for compute and an fp32 master copy that `torch.optim.AdamW`
  (foreach; `capturable=True` with the learning rate a device tensor when captured) steps, the
  gradients clipped by `clip_grad_norm_`; the captured trainer captures its whole step (the bf16
  refresh, forward, backward, clipping, update) after an eager warm-up step.

Every trainer reads its batch from one input tensor that each step's tokens are copied into.
Each trainer runs alone: its first `--warmup` steps, then the rest between two CUDA events on
its stream with no host wait between steps (the host runs ahead as in training), so the mean
step time counts whatever keeps the GPU waiting. Losses stay on the device until the end. The
captured engine's losses are compared with the eager engine's, and a second eager run's with the
first (the run-to-run floor: the model's own GPU kernels need not be deterministic); plain
PyTorch's are printed beside them (the same arithmetic up to the order of operations). Plain
PyTorch widens each bf16 gradient into its fp32 master's gradient every step.

    NCCL_NVLS_ENABLE=0 python examples/torch/captured_step.py --model gpt|gpt2
        [--library .gpu/lib/libfsdp_fusion.so] [--steps 100]

`--model gpt` is examples/torch/gpt.py's GPT (12 layers, 768, vocab 512); `gpt2` transformers'
`GPT2LMHeadModel` (12 layers, 768, tied, vocab 4096). Sequence 512, batch 8.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[2] / "python"))
sys.path.append(str(Path(__file__).resolve().parent))
from fsdp_fusion import FusedFSDP, default_no_weight_decay  # noqa: E402
from gpt import GPT, loss_of  # noqa: E402
from world_of_one import nccl_world_of_one  # noqa: E402

LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=["gpt", "gpt2"])
    parser.add_argument("--library", help="libfsdp_fusion.so (default: as fsdp_fusion finds it)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the times")
    parser.add_argument("--warmup-steps", type=int, default=10, help="of the schedule")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--skip-nonfinite", action="store_true",
                        help="fsdp-fusion also skips a step whose gradient is not finite, "
                             "decided on the device (plain PyTorch does not check)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms (warn only) and a cuBLAS "
                             "workspace that makes its GEMMs deterministic")
    args = parser.parse_args()
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and below --steps")
    return args


class Model(torch.nn.Module):
    """The model and its loss: `forward(tokens)` is the mean next-token loss."""

    def __init__(self, args):
        super().__init__()
        torch.manual_seed(0)
        if args.model == "gpt":
            self.vocab = 512
            self.net = GPT(self.vocab, 768, 12, 12, args.seq)
        else:
            from transformers import GPT2Config, GPT2LMHeadModel

            self.vocab = 4096
            self.net = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12,
                                                  vocab_size=self.vocab, n_positions=args.seq))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(p.to(torch.bfloat16).float())

    def layers(self) -> list[torch.nn.Module]:
        return list(self.net.blocks if hasattr(self.net, "blocks") else self.net.transformer.h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if isinstance(self.net, GPT):
            return loss_of(self.net(inputs), targets)
        logits = self.net(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def lr_at(args, step: int) -> float:
    """Linear warm-up from LR / warmup_steps, then a cosine to 0 at the last step."""
    if step < args.warmup_steps:
        start = 1 / args.warmup_steps
        return LR * (start + (1 - start) * step / args.warmup_steps)
    span = max(args.steps - args.warmup_steps, 1)
    return LR * 0.5 * (1 + math.cos(math.pi * min(step - args.warmup_steps, span) / span))


def param_groups(module: torch.nn.Module, lr) -> list[dict]:
    exempt = default_no_weight_decay(module)
    named = list(module.named_parameters())
    return [{"params": [p for n, p in named if n not in exempt], "lr": lr},
            {"params": [p for n, p in named if n in exempt], "weight_decay": 0.0, "lr": lr}]


class Fusion:
    """fsdp-fusion's trainer, eager or captured."""

    def __init__(self, args, model: Model, captured: bool):
        self.args, self.captured, self.graph = args, captured, None
        model = model.to(device="cuda", dtype=torch.bfloat16)
        self.model = model
        self.fused = FusedFSDP(model, model.layers(), args.library, lr=LR, betas=BETAS,
                               weight_decay=WEIGHT_DECAY, no_weight_decay=default_no_weight_decay,
                               grad_shards="persistent")
        self.loss = None

    def eager_step(self, tokens: torch.Tensor) -> torch.Tensor:
        loss = self.fused(tokens)
        loss.backward()
        self.fused.step(max_grad_norm=self.args.clip, clip_on_device=True,
                        skip_nonfinite=self.args.skip_nonfinite)
        return loss

    def step(self, s: int, tokens: torch.Tensor) -> torch.Tensor:
        self.fused.set_lr(lr_at(self.args, s))
        if not self.captured or s == 0:
            return self.eager_step(tokens)
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with self.fused.capture(self.graph):
                self.loss = self.eager_step(tokens)
        self.fused.replay(self.graph)
        return self.loss


class Plain:
    """Plain PyTorch's trainer, eager or captured."""

    def __init__(self, args, model: Model, captured: bool):
        self.args, self.captured, self.graph, self.loss = args, captured, None, None
        self.master = model.cuda()
        self.compute = copy.deepcopy(self.master).to(torch.bfloat16)
        self.pairs = list(zip(self.master.parameters(), self.compute.parameters()))
        # Captured, the rate is a device tensor that each replay reads.
        self.lr = torch.tensor(LR, device="cuda") if captured else LR
        self.optimizer = torch.optim.AdamW(param_groups(self.master, self.lr), betas=BETAS,
                                           weight_decay=WEIGHT_DECAY, foreach=True,
                                           capturable=captured)

    def eager_step(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            torch._foreach_copy_([c for _, c in self.pairs], [m for m, _ in self.pairs])
        loss = self.compute(tokens)
        loss.backward()
        for m, c in self.pairs:
            m.grad = c.grad.float()
            c.grad = None
        torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.args.clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def step(self, s: int, tokens: torch.Tensor) -> torch.Tensor:
        lr = lr_at(self.args, s)
        if not self.captured:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            return self.eager_step(tokens)
        self.lr.fill_(lr)
        if s == 0:
            return self.eager_step(tokens)
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=torch.cuda.current_stream()):
                self.loss = self.eager_step(tokens)
        self.graph.replay()
        return self.loss


def run(args, trainer_class, captured: bool, batches: list[torch.Tensor]):
    """The trainer's losses (floats) and mean step time (ms) over the steps after the warm-up."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        trainer = trainer_class(args, Model(args), captured)
        tokens = torch.empty_like(batches[0])
        losses = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for s, batch in enumerate(batches):
            if s == args.warmup:
                start.record()
            tokens.copy_(batch)
            losses.append(trainer.step(s, tokens).detach().clone())
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / (len(batches) - args.warmup)
        if isinstance(trainer, Fusion):
            trainer.fused.close()
    return [loss.item() for loss in losses], ms


def agreement(losses: list[float], others: list[float]) -> str:
    """Whether two runs' losses are equal, else the first step that differs and the largest
    difference."""
    differ = [s for s, (a, b) in enumerate(zip(losses, others)) if a != b]
    if not differ:
        return f"equal at all {len(losses)} steps"
    worst = max(abs(a - b) for a, b in zip(losses, others))
    return f"first differs at step {differ[0]}, {len(differ)} steps differ, largest by {worst:.3g}"


def main() -> int:
    args = arguments()
    if args.deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=True)
    nccl_world_of_one()
    vocab = 512 if args.model == "gpt" else 4096
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).cuda()
               for _ in range(args.steps)]
    results = {}
    for name, trainer_class, captured in (("plain eager", Plain, False),
                                          ("plain captured", Plain, True),
                                          ("fsdp-fusion eager", Fusion, False),
                                          ("fsdp-fusion captured", Fusion, True),
                                          ("fsdp-fusion eager again", Fusion, False)):
        results[name] = run(args, trainer_class, captured, batches)
        print(f"{name:<22} {results[name][1]:8.3f} ms/step, last loss {results[name][0][-1]:.4f}",
              flush=True)
    plain = results["plain eager"][1]
    graph = results["plain captured"][1]
    for name, (losses, ms) in results.items():
        print(f"{name:<22} {ms / plain:6.3f} of plain eager, {ms / graph:6.3f} of plain captured")
    eager = results["fsdp-fusion eager"][0]
    for other in ("fsdp-fusion captured", "fsdp-fusion eager again"):
        print(f"{other} against fsdp-fusion eager: {agreement(eager, results[other][0])}")
    equal = eager == results["fsdp-fusion captured"][0]
    worst = max(abs(a - b) for a, b in zip(eager, results["plain eager"][0]))
    print(f"largest loss difference, fsdp-fusion eager vs plain eager: {worst:.3g}; median "
          f"loss {statistics.median(eager):.4f}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
