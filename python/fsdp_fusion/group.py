"""Ranks as threads of one process: CPU ranks, and GPU ranks sharing one device."""

from __future__ import annotations

import os
from ctypes import byref, c_void_p

from ._capi import Releasing, library
from .errors import InvalidArgumentError


class _Group(Releasing):
    """The communicators of `world_size` ranks of this process, made by the library's `create`
    function and released by its `destroy`."""

    _create: str
    _destroy: str

    def __init__(self, world_size: int, library_path: str | os.PathLike | None = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise InvalidArgumentError(f"world_size {world_size!r} is not a positive integer")
        self.world_size = world_size
        self._lib = library(library_path)
        self.handle = c_void_p()
        self._lib.call(self._create, world_size, byref(self.handle))

    def close(self):
        """Releases the group; the engines made from it keep their communicators."""
        if self.handle is not None and self.handle.value:
            self._lib.call(self._destroy, self.handle)
            self.handle = None


class LocalGroup(_Group):
    """The communicators of `world_size` CPU ranks that run as threads of this process: give it,
    with its rank, to each rank's `FusedFSDP` of a CPU module, and drive each rank from its own
    thread (every collective needs all of them)."""

    _create, _destroy = "fsdp_local_group_create", "fsdp_local_group_destroy"


class LoopbackGroup(_Group):
    """The communicators of `world_size` ranks that share one GPU, as threads of this process
    (NCCL refuses two ranks on one device; this group's collectives are device copies): give it,
    with its rank, to each rank's `FusedFSDP` of a module on that GPU, and drive each rank from
    its own thread on a stream of its own, current when its wrapper is made. Forward passes
    only: PyTorch runs every backward pass of a device on one thread, where the ranks' hooks
    would wait for each other. For tests of several ranks on one GPU."""

    _create, _destroy = "fsdp_loopback_group_create", "fsdp_loopback_group_destroy"
