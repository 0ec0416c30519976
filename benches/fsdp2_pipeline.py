"""The peer of `benches/pipeline.rs`: PyTorch FSDP2 on the same shapes, and one table beside ours.

A stack of L bias-free dense layers (each an FSDP unit, `fully_shard` per layer and on the root),
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, NCCL at world size 1. A step is the
forward, the backward of a fixed random output gradient, and the gradient sync; the AdamW step
(`fused=True`) is timed on its own. "Unsharded" is the same model in bf16 with no FSDP: the GEMMs
alone. Times come from CUDA events over many steps after a warm-up; host time is the wall time the
Python thread spends issuing a step.

    python3 benches/fsdp2_pipeline.py [--ours ours.json] [--shapes 32x1024x64,...] [--json]

With `--ours`, the JSON lines the Rust bench printed are read and one table shows both.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

SHAPES = [(32, 1024, 64), (32, 4096, 1024), (16, 8192, 2048), (64, 2048, 512)]


def build(layers, width, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]
    )
    return model.to(device="cuda", dtype=dtype)


def timed(fn, warmup, iters):
    """Mean ms per step over `iters` back-to-back steps by CUDA events, and host ms per step."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = (time.perf_counter() - host) * 1e3 / iters
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, host


def measure(layers, width, batch, warmup, iters):
    x = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)

    plain = build(layers, width, torch.bfloat16)

    def plain_step():
        plain(x).backward(dy)

    unsharded_ms, _ = timed(plain_step, warmup, iters)
    del plain
    torch.cuda.empty_cache()

    model = build(layers, width, torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        model(x).backward(dy)

    def optimizer_step():
        optimizer.step()

    torch.cuda.reset_peak_memory_stats()
    step_ms, host_ms = timed(step, warmup, iters)
    optimizer_ms, _ = timed(optimizer_step, warmup, iters)
    optimizer.zero_grad(set_to_none=False)
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer
    torch.cuda.empty_cache()
    return {
        "who": "fsdp2",
        "layers": layers,
        "width": width,
        "batch": batch,
        "world_size": 1,
        "step_ms": step_ms,
        "unsharded_ms": unsharded_ms,
        "per_unit_overhead_us": (step_ms - unsharded_ms) * 1e3 / layers,
        "host_ms_per_step": host_ms,
        "optimizer_ms": optimizer_ms,
        "peak_bytes": peak,
    }


def table(rows):
    ours = {(r["layers"], r["width"], r["batch"], r["world_size"]): r for r in rows if r["who"] == "fsdp-fusion"}
    peers = {(r["layers"], r["width"], r["batch"]): r for r in rows if r["who"] == "fsdp2"}
    head = (
        f"{'shape (L,width,batch)':<22} {'who':<12} {'W':>2} {'step ms':>9} {'unshard ms':>10} "
        f"{'+%':>6} {'unit ovh us':>11} {'host us/hook':>12} {'gather wait ms':>14} "
        f"{'optim ms':>9} {'peak GiB':>9} {'plan GiB':>9}"
    )
    print(head)
    print("-" * len(head))
    for key in sorted({(r["layers"], r["width"], r["batch"]) for r in rows}):
        shape = f"({key[0]}, {key[1]}, {key[2]})"
        entries = [peers.get(key)] + [ours[k] for k in sorted(ours) if k[:3] == key]
        for r in [e for e in entries if e]:
            extra = 100.0 * (r["step_ms"] / r["unsharded_ms"] - 1.0)
            print(
                f"{shape:<22} {r['who']:<12} {r['world_size']:>2} {r['step_ms']:>9.3f} "
                f"{r['unsharded_ms']:>10.3f} {extra:>6.1f} {r['per_unit_overhead_us']:>11.1f} "
                f"{r.get('host_us_per_hook', float('nan')):>12.2f} {r.get('gather_wait_ms', float('nan')):>14.3f} "
                f"{r['optimizer_ms']:>9.3f} {r['peak_bytes'] / 2**30:>9.3f} "
                f"{r.get('plan_bytes', float('nan')) / 2**30:>9.3f}"
            )
        peer = peers.get(key)
        mine = ours.get(key + (1,))
        if peer and mine:
            ratio = peer["per_unit_overhead_us"] / max(mine["per_unit_overhead_us"], 1e-3)
            print(
                f"{'':<22} ratio at W=1: FSDP2 per-unit overhead / ours = {ratio:.1f}x; "
                f"step time FSDP2 / ours = {peer['step_ms'] / mine['step_ms']:.2f}x"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ours", help="JSON lines printed by the Rust pipeline bench")
    parser.add_argument("--shapes", help="comma-separated LxWIDTHxBATCH")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print JSON lines only")
    args = parser.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
    torch.cuda.set_device(0)
    rows = []
    if args.ours:
        with open(args.ours) as f:
            rows += [json.loads(line) for line in f if line.startswith("{")]
    for layers, width, batch in shapes:
        row = measure(layers, width, batch, args.warmup, args.iters)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    if not args.json:
        table(rows)


if __name__ == "__main__":
    main()
