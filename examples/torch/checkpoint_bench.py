"""Sharded checkpoint save and load throughput at world size 1 on a GPU: fsdp-fusion's
`save`/`load` beside `torch.distributed.checkpoint` with FSDP2, on transformers' Llama of about
1 B parameters (bf16 compute, fp32 masters, AdamW after one step), in one process.

    NCCL_NVLS_ENABLE=0 python examples/torch/checkpoint_bench.py \\
        --library .gpu/lib/libfsdp_fusion.so --dir /tmp/ckpt-bench

Then fsdp-fusion's asynchronous save (`save(wait=False)`, the wrapper made with
`save_staging=True`): the time its call blocks the training loop, the time until its files are
written, and the training steps while they are, beside steps without a save.

Each save is timed from the call to the files on disk (fsdp-fusion flushes every file; DCP's
save returns once written, then `os.sync()` is included), each load to the state on the GPU.
The load follows its save, so both read from the page cache: what is compared is the
checkpoint code, not the disk. GB/s are of the bytes the checkpoint holds on disk. The limits,
measured in the same run on the same bytes: `dd` writing them with `conv=fsync` (the disk's
flushed write), `dd` reading the saved files from the page cache, and device-to-host and
host-to-device copies of them between the GPU and page-locked memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[2] / "python"))
from fsdp_fusion import FusedFSDP  # noqa: E402
from world_of_one import nccl_world_of_one  # noqa: E402


def llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=512, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def one_step(model, step):
    tokens = torch.randint(0, 32000, (2, 512), device="cuda")
    model(input_ids=tokens, labels=tokens).loss.backward()
    step()


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed(f) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def dd_seconds(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - start


def limits(root: Path, path: Path, bytes_: int) -> dict:
    """The limits on the same bytes: the disk's flushed write, a page-cache read of the saved
    files, and copies between the GPU and page-locked host memory."""
    block = 64 << 20
    target = root / "dd"
    write = dd_seconds("if=/dev/zero", f"of={target}", f"bs={block}",
                       f"count={-(-bytes_ // block)}", "conv=fsync")
    target.unlink()
    start = time.perf_counter()
    for f in sorted(path.glob("rank-*.bin")):
        dd_seconds(f"if={f}", "of=/dev/null", f"bs={block}")
    read = time.perf_counter() - start
    piece = 1 << 30
    device = torch.empty(piece, dtype=torch.uint8, device="cuda")
    host = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    rounds = max(1, bytes_ // piece)
    d2h = timed(lambda: [host.copy_(device) for _ in range(rounds)]) * bytes_ / (rounds * piece)
    h2d = timed(lambda: [device.copy_(host) for _ in range(rounds)]) * bytes_ / (rounds * piece)
    return dict(write=write, read=read, d2h=d2h, h2d=h2d)


def fusion(args, root: Path) -> dict:
    model = llama(args.layers).to(device="cuda", dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    fused = FusedFSDP(model, list(model.model.layers), args.library, lr=3e-4)
    one_step(fused, fused.step)
    path = root / "fusion"
    save = timed(lambda: fused.save(path))
    bytes_ = size_of(path)
    limit = limits(root, path, bytes_)
    load = timed(lambda: fused.load(path))
    fused.close()
    del fused, model
    torch.cuda.empty_cache()
    # A wrapper that makes the asynchronous saves' page-locked memory when it is made
    # (save_staging): the call then only copies, and a load reads into that memory.
    model = llama(args.layers).to(device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    fused = FusedFSDP(model, list(model.model.layers), args.library, lr=3e-4, save_staging=True)
    made = time.perf_counter() - start
    one_step(fused, fused.step)
    staged_load = timed(lambda: fused.load(path))
    shutil.rmtree(path)
    # The asynchronous save: what its call costs the training loop, and the steps while the
    # files are written, beside steps without.
    quiet = [timed(lambda: one_step(fused, fused.step)) for _ in range(args.steps)]
    background = root / "fusion-async"
    call = timed(lambda: fused.save(background, wait=False))
    start = time.perf_counter()
    during = [timed(lambda: one_step(fused, fused.step)) for _ in range(args.steps)]
    wait = timed(fused.wait_save)
    written = time.perf_counter() - start + call
    shutil.rmtree(background)
    again = timed(lambda: fused.save(background, wait=False))
    fused.wait_save()
    fused.close()
    shutil.rmtree(background)
    return dict(who="fsdp-fusion", params=params, bytes=bytes_, save=save, load=load,
                staged_load=staged_load, async_call=call, async_written=written,
                async_wait=wait, async_again=again, quiet=quiet, during=during, made=made,
                limits=limit)


def fsdp2(args, root: Path) -> dict:
    model = llama(args.layers).cuda()
    params = sum(p.numel() for p in model.parameters())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    one_step(model, step)
    path = root / "dcp"

    def save():
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
        os.sync()

    def load():
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    saved, loaded = timed(save), timed(load)
    bytes_ = size_of(path)
    shutil.rmtree(path)
    return dict(who="FSDP2 + DCP", params=params, bytes=bytes_, save=saved, load=loaded)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", help="libfsdp_fusion.so")
    parser.add_argument("--dir", default="/tmp/fsdp-fusion-checkpoint-bench")
    parser.add_argument("--layers", type=int, default=20, help="20: 1.03 B parameters")
    parser.add_argument("--steps", type=int, default=8,
                        help="steps timed without and during an asynchronous save")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    nccl_world_of_one()
    rows = [fusion(args, root)]
    torch.cuda.empty_cache()
    rows.append(fsdp2(args, root))
    print(f"Llama, {rows[0]['params'] / 1e9:.2f} B parameters, world size 1, AdamW state")
    print(f"{'':<14} {'GB':>7} {'save s':>8} {'GB/s':>7} {'load s':>8} {'GB/s':>7}")
    for r in rows:
        gb = r["bytes"] / 1e9
        print(f"{r['who']:<14} {gb:7.2f} {r['save']:8.2f} {gb / r['save']:7.2f} "
              f"{r['load']:8.2f} {gb / r['load']:7.2f}")
    f = rows[0]
    lim = f["limits"]
    gb = f["bytes"] / 1e9
    print(f"limits on {gb:.2f} GB: dd write + fsync {gb / lim['write']:.2f} GB/s, dd read from the "
          f"page cache {gb / lim['read']:.2f} GB/s, GPU to page-locked host {gb / lim['d2h']:.2f} "
          f"GB/s, back {gb / lim['h2d']:.2f} GB/s")
    print(f"fsdp-fusion save: {lim['write'] / f['save']:.2f} of dd's flushed write; load: "
          f"{lim['read'] / f['load']:.2f} of dd's page-cache read, {rows[1]['load'] / f['load']:.2f}x "
          f"DCP's load; save {rows[1]['save'] / f['save']:.2f}x DCP's")
    print(f"fsdp-fusion load into the page-locked memory of save_staging=True: "
          f"{f['staged_load']:.2f} s, {gb / f['staged_load']:.2f} GB/s, "
          f"{rows[1]['load'] / f['staged_load']:.2f}x DCP's load")
    print(f"fsdp-fusion save(wait=False): the call {f['async_call']:.2f} s (the wrapper made its "
          f"page-locked host memory in its {f['made']:.2f} s of construction; "
          f"{f['async_again']:.2f} s the next time), files written {f['async_written']:.2f} s after "
          f"it began ({f['async_wait']:.2f} s of wait_save after {args.steps} steps); median step "
          f"{statistics.median(f['quiet']) * 1e3:.1f} ms without a save, "
          f"{statistics.median(f['during']) * 1e3:.1f} ms while the files are written "
          f"(steps: {', '.join(f'{t * 1e3:.0f}' for t in f['during'])} ms)")
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
