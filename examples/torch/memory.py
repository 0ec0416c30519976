"""Device memory and step time of one training setup at a time, each in a fresh process so that
each peak is its own: fsdp-fusion with a bf16 shard beside each fp32 master ("fusion-shard") or
the master only ("fusion-master"), each with per-step gradient shards, and the master only with
persistent ones ("fusion-master-persistent") or with bf16 AdamW moments
("fusion-master-bf16moments"), a setup's name ending in "-inbackward" with the optimizer
stepping in the backward; plain PyTorch (bf16 compute copy, fp32 master,
AdamW) and FSDP2 (`fully_shard` per layer and the root, bf16 parameters, fp32 reduction), all at
world size 1, on the GPT example or transformers' Llama (`--checkpointing`: with transformers'
gradient checkpointing in every setup, so that the backward's gradients, not the forward's
activations, make the peak).

    NCCL_NVLS_ENABLE=0 python examples/torch/memory.py --library .gpu/lib/libfsdp_fusion.so \\
        --model llama

The step's device peak is what PyTorch's allocator held at most during the measured steps
(`torch.cuda.max_memory_allocated`): the engine takes its buffers from that allocator, so they
are in it (the "engine" column is the engine's own peak, a part of it). Step times are CUDA
events around forward, backward and the optimizer step, medians after the warm-up steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_fusion import FusedFSDP, default_no_weight_decay  # noqa: E402
from gpt import GPT, loss_of  # noqa: E402
from world_of_one import nccl_world_of_one  # noqa: E402

SETUPS = ("fusion-shard", "fusion-master", "fusion-master-persistent", "fusion-master-bf16moments",
          "fusion-master-inbackward",
          "fusion-shard-inbackward", "fusion-master-bf16moments-inbackward", "plain", "fsdp2")
GIB = 1 << 30


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", help="libfsdp_fusion.so (default: as fsdp_fusion finds it)")
    parser.add_argument("--model", default="gpt", choices=["gpt", "llama"])
    parser.add_argument("--setups", default=",".join(SETUPS),
                        help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch", type=int, help="default: 8 (gpt), 4 (llama)")
    parser.add_argument("--seq", type=int, help="default: 512 (gpt), 2048 (llama)")
    parser.add_argument("--checkpointing", action="store_true",
                        help="transformers' gradient checkpointing in every setup (llama only)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: this setup only
    return parser.parse_args()


def build(args) -> tuple[torch.nn.Module, list[torch.nn.Module], callable]:
    """The fp32 model, its layers (the FSDP units) and its loss of a batch of tokens."""
    torch.manual_seed(0)
    if args.model == "gpt":
        model = GPT(512, 768, 12, 12, args.seq)
        return model, list(model.blocks), lambda m, t: loss_of(m(t[:, :-1]), t[:, 1:])
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=args.seq, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, list(model.model.layers), lambda m, t: m(input_ids=t, labels=t).loss


def adamw(module):
    exempt = default_no_weight_decay(module)
    named = list(module.named_parameters())
    groups = [{"params": [p for n, p in named if n not in exempt]},
              {"params": [p for n, p in named if n in exempt], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)


def trainer(setup: str, args, device):
    """A step function of the setup, and a function of the engine's bytes (0 outside it)."""
    model, layers, loss_fn = build(args)
    if setup.startswith("fusion"):
        module = model.to(device=device, dtype=torch.bfloat16)
        storage, *variants = setup.removeprefix("fusion-").split("-")
        fused = FusedFSDP(module, layers, args.library, lr=3e-4, betas=(0.9, 0.95),
                          weight_decay=0.1, no_weight_decay=default_no_weight_decay,
                          param_storage=storage,
                          grad_shards="persistent" if "persistent" in variants else "per-step",
                          moment_dtype=torch.bfloat16 if "bf16moments" in variants
                          else torch.float32,
                          step_in_backward="inbackward" in variants)

        def step(tokens):
            loss = loss_fn(fused, tokens)
            loss.backward()
            fused.step()
            return loss

        return step, lambda: fused.memory()[1], fused
    if setup == "plain":
        master = model.to(device)
        compute = copy.deepcopy(master).to(torch.bfloat16)
        pairs = list(zip(master.parameters(), compute.parameters()))
        optimizer = adamw(master)

        def step(tokens):
            with torch.no_grad():
                for m, c in pairs:
                    c.copy_(m)
            loss = loss_fn(compute, tokens)
            loss.backward()
            for m, c in pairs:
                m.grad = c.grad.float()
                c.grad = None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        return step, lambda: 0, None
    model = model.to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = adamw(model)

    def step(tokens):
        loss = loss_fn(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step, lambda: 0, None


def measure(setup: str, args) -> dict:
    device = nccl_world_of_one()
    step, engine_bytes, fused = trainer(setup, args, device)
    vocab = 512 if args.model == "gpt" else 32000
    g = torch.Generator(device=device).manual_seed(1)
    extra = 1 if args.model == "gpt" else 0
    times, losses = [], []
    for i in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.seq + extra), device=device,
                               generator=g)
        if i == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step(tokens)
        end.record()
        losses.append(loss.item())
        times.append(start.elapsed_time(end))
    torch.cuda.synchronize()
    torch_peak = torch.cuda.max_memory_allocated()
    free, total = torch.cuda.mem_get_info()
    report = dict(setup=setup, model=args.model, step_ms=statistics.median(times[args.warmup:]),
                  torch_peak=torch_peak, engine=engine_bytes(),
                  peak=torch_peak, device_used=total - free,
                  last_loss=losses[-1])
    if fused is not None:
        m = fused.planned_memory()
        report["plan"] = {name: getattr(m, name) for name, _ in m._fields_}
        fused.close()
    dist.destroy_process_group()
    return report


def main() -> int:
    args = arguments()
    args.batch = args.batch or (8 if args.model == "gpt" else 4)
    args.seq = args.seq or (512 if args.model == "gpt" else 2048)
    if args.checkpointing and args.model != "llama":
        print("--checkpointing is transformers' own: --model llama", file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(measure(args.one, args)))
        return 0
    reports = []
    for setup in args.setups.split(","):
        if setup not in SETUPS:
            print(f"unknown setup {setup!r}: one of {', '.join(SETUPS)}", file=sys.stderr)
            return 2
        child = [sys.executable, __file__, "--one", setup, "--model", args.model,
                 "--steps", str(args.steps), "--warmup", str(args.warmup),
                 "--batch", str(args.batch), "--seq", str(args.seq)]
        if args.library:
            child += ["--library", args.library]
        if args.checkpointing:
            child.append("--checkpointing")
        out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
        reports.append(json.loads(out.strip().splitlines()[-1]))
    fsdp2 = next((r for r in reports if r["setup"] == "fsdp2"), None)
    print(f"{args.model}, batch {args.batch} x {args.seq}, bf16, AdamW, world size 1"
          f"{', gradient checkpointing' if args.checkpointing else ''}")
    print(f"{'setup':<26} {'step ms':>8} {'engine':>8} {'peak GiB':>9} {'vs FSDP2':>9} "
          f"{'last loss':>10}")
    for r in reports:
        ratio = r["peak"] / fsdp2["peak"] if fsdp2 else float("nan")
        print(f"{r['setup']:<26} {r['step_ms']:8.2f} {r['engine'] / GIB:8.2f} "
              f"{r['peak'] / GIB:9.2f} {ratio:9.3f} {r['last_loss']:10.4f}")
    for r in reports:
        if "plan" in r:
            print(f"{r['setup']} plan: " + ", ".join(f"{k} {v / GIB:.3f} GiB"
                                                      for k, v in r["plan"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
