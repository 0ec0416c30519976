"""Fully-sharded data-parallel training of PyTorch modules through fsdp-fusion's engine.

    from fsdp_fusion import FusedFSDP

    model = FusedFSDP(gpt, units=list(gpt.blocks), lr=3e-4, weight_decay=0.1)
    for tokens, targets in batches:
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        model.step()  # gradient sync, optimizer step, end of step

The engine is libfsdp_fusion.so, found as `library_candidates()` lists: a path passed to
`FusedFSDP`, `$FSDP_FUSION_LIBRARY`, beside this package, or `target/release` of the checkout.
"""

from ._capi import LIBRARY_ENV, ROOT, Counters
from ._capi import candidates as library_candidates
from .errors import (
    AbortedError,
    CommError,
    DeviceError,
    FsdpError,
    FsdpTimeoutError,
    InvalidArgumentError,
    InvalidHandleError,
    IoError,
    MisuseError,
    NullPointerError,
    OutOfMemoryError,
    PanicError,
    PoisonedError,
    UnavailableError,
)
from .group import LocalGroup, LoopbackGroup
from ._params import DTYPE_CODES, default_no_weight_decay
from ._state import export_checkpoint
from .module import FusedFSDP, StepReport

__all__ = [
    "DTYPE_CODES",
    "LIBRARY_ENV",
    "ROOT",
    "AbortedError",
    "CommError",
    "Counters",
    "DeviceError",
    "FsdpError",
    "FsdpTimeoutError",
    "FusedFSDP",
    "InvalidArgumentError",
    "InvalidHandleError",
    "IoError",
    "LocalGroup",
    "LoopbackGroup",
    "MisuseError",
    "NullPointerError",
    "OutOfMemoryError",
    "PanicError",
    "PoisonedError",
    "StepReport",
    "UnavailableError",
    "default_no_weight_decay",
    "export_checkpoint",
    "library_candidates",
]
