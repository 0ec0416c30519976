"""The process group of the single-GPU examples: one rank on GPU 0 over NCCL, met on a free
local port."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist


def nccl_world_of_one() -> torch.device:
    """Makes GPU 0 the current device and initializes a one-rank NCCL process group on it;
    returns the device."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", device_id=device, init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    return device
