"""Bad input gets a clear error before anything changes; failed calls raise their status's class."""

from __future__ import annotations

import copy
import gc
import re
import threading
import types

import numpy
import pytest
import torch
from conftest import CHECKOUT
from training import models, on_ranks

import fsdp_fusion
from fsdp_fusion import FusedFSDP, LocalGroup, LoopbackGroup, _capi
from fsdp_fusion._engine import _EngineCreation
from fsdp_fusion.errors import STATUS_ERRORS


class Two(torch.nn.Module):
    def __init__(self, first: torch.nn.Module, second: torch.nn.Module):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return self.second(self.first(x))


def test_a_module_on_two_devices_is_refused_naming_both():
    module = Two(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, device="meta"))
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match=r"second\.weight is on meta.*cpu"):
        FusedFSDP(module, [module.first, module.second])
    # Nothing was taken from the module.
    assert module.first.weight.untyped_storage().nbytes() == 4 * 4 * 4


def test_a_dtype_the_engine_lacks_is_refused_naming_the_parameter():
    module = Two(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, dtype=torch.float64))
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match=r"second\.weight: dtype torch\.float64"):
        FusedFSDP(module, [module.first, module.second])


def test_units_that_are_not_submodules_or_overlap_are_refused():
    module = Two(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match=r"units\[1\].*not a submodule"):
        FusedFSDP(module, [module.first, torch.nn.Linear(4, 4)])
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match=r"units\[0\].*not a submodule"):
        FusedFSDP(module, [module])
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="units 0 and 1 share a module"):
        FusedFSDP(module, [module.first, module.first])
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="no parameters"):
        FusedFSDP(torch.nn.ReLU(), [])


def test_settings_the_engine_refuses_raise_value_errors():
    _, module = models()
    with pytest.raises(ValueError, match="optimizer 'lamb'"):
        FusedFSDP(module, list(module.blocks), optimizer="lamb")
    with pytest.raises(ValueError, match="grad_reduction 'max'"):
        FusedFSDP(module, list(module.blocks), grad_reduction="max")
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="grad_reduction.*a scale of -1"):
        FusedFSDP(module, list(module.blocks), grad_reduction=-1.0)
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="FSDP_INVALID_ARGUMENT.*timeout"):
        FusedFSDP(module, list(module.blocks), timeout=-1.0)
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="rank 2 is not in a local group"):
        FusedFSDP(module, list(module.blocks), local_group=LocalGroup(2), rank=2)
    with pytest.raises(fsdp_fusion.InvalidArgumentError,
                       match="a LoopbackGroup runs cuda ranks; this module is on cpu"):
        FusedFSDP(module, list(module.blocks), local_group=LoopbackGroup(2), rank=0)
    with pytest.raises(fsdp_fusion.InvalidArgumentError,
                       match="local_group 2 is not a LocalGroup or a LoopbackGroup"):
        FusedFSDP(module, list(module.blocks), local_group=2)
    # ctypes would wrap -1 into the C field's largest value: no limit at all.
    for field in ("double_buffer_limit", "max_reduces_in_flight"):
        for bad in (-1, 0, 1.5, True):
            with pytest.raises(ValueError, match=f"{field} {bad!r} is not a positive integer"):
                FusedFSDP(module, list(module.blocks), **{field: bad})
    # An integer of another type (numpy's, torch's) is a count as Python's is.
    memories = []
    for limit in (1, numpy.int64(1), torch.tensor(1)):
        _, fresh = models()
        memories.append(bytes(FusedFSDP(fresh, list(fresh.blocks),
                                        double_buffer_limit=limit).planned_memory()))
    assert memories[1:] == memories[:1] * 2


def test_a_path_holding_a_nul_byte_is_refused_before_anything_is_written(tmp_path):
    _, module = models()
    fused = FusedFSDP(module, list(module.blocks))
    cut = tmp_path / "checkpoint"
    given = str(cut) + "\0.tmp"
    for call in (fused.save, fused.load, fused.export, fused.import_,
                 lambda p: fsdp_fusion.export_checkpoint(p, tmp_path / "model.safetensors"),
                 lambda p: fsdp_fusion.export_checkpoint(tmp_path, p)):
        with pytest.raises(ValueError, match="holds a NUL byte"):
            call(given)
    # The C API, given the path, would have read it up to the NUL: the checkpoint directory.
    assert not cut.exists() and list(tmp_path.iterdir()) == []
    fused.save(cut)
    assert any(cut.iterdir())


def test_rank_0_failing_to_make_the_nccl_id_fails_every_rank_with_its_error(monkeypatch):
    """Rank 0's failure goes through the broadcast that would carry the id, so that the other
    ranks raise it (its class, naming rank 0) at once rather than wait for an id."""
    sent = []

    def broadcast(objects, src):
        assert src == 0
        if not sent:
            sent.extend(objects)
        objects[:] = sent

    monkeypatch.setattr(torch.distributed, "broadcast_object_list", broadcast)

    class NoNccl:
        def call(self, name, *_args):
            raise fsdp_fusion.UnavailableError(f"{name}: NCCL is missing")

    for rank in (0, 1):
        creation = types.SimpleNamespace(_rank=rank, _world=2, _lib=NoNccl())
        with pytest.raises(fsdp_fusion.UnavailableError, match="NCCL is missing") as raised:
            _EngineCreation._unique_id(creation)
        assert ("rank 0" in str(raised.value)) == (rank == 1)


def test_a_missing_library_names_every_place_tried(tmp_path, monkeypatch):
    monkeypatch.setenv(fsdp_fusion.LIBRARY_ENV, str(tmp_path / "nowhere.so"))
    with pytest.raises(fsdp_fusion.UnavailableError, match="nowhere.so"):
        LocalGroup(1)
    monkeypatch.delenv(fsdp_fusion.LIBRARY_ENV)
    places = fsdp_fusion.library_candidates()
    assert places[0].name == "libfsdp_fusion.abi3.so" and places[0].parent.name == "fsdp_fusion"
    assert any(p.parent.parts[-2:] == ("target", "release") for p in places[1:])


def test_a_library_of_another_c_abi_is_refused(monkeypatch):
    """The package's structs follow the header's ABI; a library of another version is refused
    before any struct crosses, and the header's version is the package's."""
    header = (CHECKOUT / "include" / "fsdp_fusion.h").read_text()
    version = int(re.search(r"#define FSDP_ABI_VERSION (\d+)", header).group(1))
    assert version == _capi.ABI_VERSION
    path = fsdp_fusion.library_candidates()
    path = next(p for p in path if p.exists())
    assert _capi.Library(path).fsdp_abi_version() == version
    monkeypatch.setattr(_capi, "ABI_VERSION", version + 1)
    with pytest.raises(fsdp_fusion.UnavailableError, match=f"C ABI {version}"):
        _capi.Library(path)


def test_status_classes_follow_the_header():
    header = (CHECKOUT / "include" / "fsdp_fusion.h").read_text()
    enum = re.search(r"typedef enum fsdp_status \{(.*?)\}", header, re.S).group(1)
    codes = [(name, int(value)) for name, value in re.findall(r"(FSDP_\w+) = (\d+)", enum)]
    assert codes == [(name, code) for code, (name, _) in enumerate(STATUS_ERRORS)]


def test_hooks_out_of_order_raise_misuse_and_the_engine_goes_on():
    _, module = models()
    fused = FusedFSDP(module, list(module.blocks), optimizer="sgd", lr=0.1)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    fused.step()  # a step with no backward is allowed
    with pytest.raises(fsdp_fusion.MisuseError, match="FSDP_MISUSE"):
        fused._lib.call("fsdp_engine_post_forward", fused._engine, 0)
    loss = fused(tokens).float().pow(2).mean()
    loss.backward()
    fused.step()
    assert fused.counters().steps == 2


def test_an_aborted_engine_refuses_every_later_step():
    _, module = models()
    fused = FusedFSDP(module, list(module.blocks))
    fused.abort()
    for _ in range(2):
        with pytest.raises(fsdp_fusion.PoisonedError, match="FSDP_POISONED.*aborted"):
            fused(torch.zeros(2, 8, dtype=torch.long))


def test_a_rank_whose_peer_never_comes_times_out():
    group = LocalGroup(2)
    modules = [models()[1] for _ in range(2)]
    fused = {}

    def make(rank):
        fused[rank] = FusedFSDP(modules[rank], list(modules[rank].blocks), local_group=group,
                                rank=rank, timeout=1.0)

    ranks = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert sorted(fused) == [0, 1]
    # Rank 1 never runs its forward: rank 0's first gather waits for it, then gives up.
    with pytest.raises(fsdp_fusion.FsdpTimeoutError, match="FSDP_TIMEOUT.*timed out"):
        fused[0](torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(fsdp_fusion.PoisonedError, match="FSDP_POISONED"):
        fused[0](torch.zeros(2, 8, dtype=torch.long))


def test_a_construction_that_fails_part_way_releases_what_it_made(monkeypatch):
    """A load interrupted mid-way (a Ctrl-C, say) leaves some placeholders unmade: the wrapper
    still releases its engine, group and plan when it goes."""
    gc.collect()  # the earlier tests' wrappers go first, so that only this one's releases count
    loads, released = [0], []
    call = FusedFSDP._call

    def interrupted(self, name, *args):
        if name == "fsdp_engine_load_param":
            loads[0] += 1
            if loads[0] == 2:
                raise KeyboardInterrupt("while loading")
        return call(self, name, *args)

    library = _capi.library()
    library_call = library.call

    def recorded(name, *args):
        if name.endswith("_destroy"):
            released.append(name)
        return library_call(name, *args)

    monkeypatch.setattr(FusedFSDP, "_call", interrupted)
    monkeypatch.setattr(library, "call", recorded)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(KeyboardInterrupt):
        FusedFSDP(module, [module[0], module[1]])
    gc.collect()
    assert sorted(released) == ["fsdp_engine_destroy", "fsdp_local_group_destroy",
                                "fsdp_plan_destroy"]


def test_a_cpu_model_among_several_processes_is_refused(monkeypatch):
    """Under torch.distributed of several processes a CPU model would train alone in each."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match="of 4 processes"):
        FusedFSDP(module, [module[0]])
    # With its ranks as threads of a local group it is a world of that group.
    fused = FusedFSDP(module, [module[0]], local_group=LocalGroup(1), rank=0)
    assert fused.counters().steps == 0
    fused.close()


def test_a_unit_changing_its_input_in_place_is_refused_where_its_inputs_pass_its_hook():
    """Torch refuses an in-place change of a unit's input that passed the hook ending the unit's
    backward (master storage here), and the wrapper trains on: an alias in place of the view
    would let the change through, with wrong gradients where the input is used after the
    unit."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(
        torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 4)))
    fused = FusedFSDP(module, [module[0], module[1]], optimizer="sgd", lr=0.1,
                      param_storage="master")
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        fused(torch.randn(3, 4))
    module[1][0].inplace = False
    fused(torch.randn(3, 4)).sum().backward()
    fused.step()
    assert fused.counters().steps == 1
    fused.close()


def test_a_move_or_cast_of_the_wrapper_that_changes_a_parameter_is_refused():
    """The engine holds the parameters' memory: `half()`, `to(float64)` or `share_memory()`
    would train a copy. One that changes nothing goes through; a refused one changes nothing,
    and training goes on. A gradient on another device than the engine's memory is refused before the engine
    reads its address."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fused = FusedFSDP(module, [module[0]], optimizer="sgd", lr=0.1)
    assert fused.to("cpu") is fused and fused.float() is fused
    weight = module[0].weight
    for move in (fused.half, lambda: fused.to(torch.float64)):
        with pytest.raises(fsdp_fusion.MisuseError, match="0.weight"):
            move()
        assert module[0].weight is weight and weight.dtype == torch.float32
    fused(torch.ones(2, 4)).sum().backward()
    fused.step()
    assert fused.counters().steps == 1
    # Into shared memory in place: the module would train a copy the engine never updates.
    with pytest.raises(fsdp_fusion.MisuseError, match="share_memory"):
        fused.share_memory()
    fused(torch.ones(2, 4)).sum().backward()
    fused.step()
    with torch.no_grad():
        fused(torch.ones(2, 4))
    assert torch.equal(module[0].weight.detach(), fused.full_parameter("0.weight"))
    unit = fused._unit_of[0]
    with pytest.raises(fsdp_fusion.MisuseError, match="a gradient on meta"):
        fused._batch_of(unit, [torch.zeros(4, 4, device="meta")], torch.device("cpu"))
    fused.close()


def test_close_is_refused_while_a_tensor_outside_holds_the_engine_s_memory():
    """At world size 1 the parameters are views of the shards: a `state_dict()` kept past
    `close` would read freed memory, so `close` refuses (nothing released, training goes on)
    until it is dropped; a copy is the caller's."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fused = FusedFSDP(module, [module[0], module[1]], optimizer="sgd", lr=0.1)
    fused(torch.ones(2, 4)).sum().backward()
    fused.step()
    held = module.state_dict()
    copied = {k: v.clone() for k, v in held.items()}
    with pytest.raises(fsdp_fusion.MisuseError, match=r"0\.weight.*state_dict"):
        fused.close()
    # The refusal changed nothing: the parameters are the engine's values still.
    assert torch.equal(module[0].weight, held["0.weight"])
    out = fused(torch.ones(2, 4))
    assert torch.isfinite(out).all()
    out.sum().backward()
    fused.step()
    assert fused.counters().steps == 2
    assert not torch.equal(held["0.weight"], copied["0.weight"]), "the views follow the engine"
    assert torch.isfinite(held["0.weight"]).all()
    del held
    fused.close()
    assert torch.isnan(module[0].weight).all(), "placeholders once released"


def test_a_state_dict_of_placeholders_is_refused():
    """Above world size 1 (and before a first forward, or once closed) the module's parameters
    are NaN placeholders: its `state_dict()`, the usual way to save weights, is refused rather
    than saving NaN; `full_state_dict()` gives the values."""
    world = 2
    group = LocalGroup(world)
    modules = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
               for _ in range(world)]
    for m in modules[1:]:
        m.load_state_dict(modules[0].state_dict())
    expected = {k: v.clone() for k, v in modules[0].state_dict().items()}

    def run(rank):
        m = modules[rank]
        fused = FusedFSDP(m, [m[0], m[1]], local_group=group, rank=rank)
        with pytest.raises(fsdp_fusion.MisuseError, match=r"NaN placeholders for 0\.weight"):
            m.state_dict()
        values = fused.full_state_dict()
        fused(torch.ones(2, 4)).sum().backward()
        with pytest.raises(fsdp_fusion.MisuseError, match=r"NaN placeholders for .*1\.weight"):
            fused.state_dict()
        fused.step()
        fused.close()
        return values

    for values in on_ranks(world, run):
        assert values.keys() == expected.keys()
        assert all(torch.equal(values[k], expected[k]) for k in expected)


def test_a_closed_wrapper_s_module_refuses_a_forward_and_a_second_wrapper():
    """Once closed, the module's parameters are placeholders: its forward is refused rather
    than computed on NaN, and so is wrapping it again, which would take them as its values; as
    is wrapping a module another wrapper still holds, whose hooks would drive both."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fused = FusedFSDP(module, [module[0], module[1]], optimizer="sgd", lr=0.1)
    values = fused.full_state_dict()
    with pytest.raises(fsdp_fusion.MisuseError, match="placeholders of another FusedFSDP"):
        FusedFSDP(module, [module[0], module[1]])
    fused.close()
    with pytest.raises(fsdp_fusion.MisuseError, match="placeholders of a closed FusedFSDP"):
        module(torch.ones(2, 4))
    with pytest.raises(fsdp_fusion.MisuseError, match="placeholders of another FusedFSDP"):
        FusedFSDP(module, [module[0], module[1]])
    # A part of it, or a model holding it, holds the same placeholders.
    with pytest.raises(fsdp_fusion.MisuseError, match="placeholders of another FusedFSDP"):
        FusedFSDP(module[0], [])
    parent = torch.nn.Sequential(module, torch.nn.Linear(4, 4))
    with pytest.raises(fsdp_fusion.MisuseError, match="placeholders of another FusedFSDP"):
        FusedFSDP(parent, [parent[1]])
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fresh.load_state_dict(values)
    again = FusedFSDP(fresh, [fresh[0], fresh[1]], optimizer="sgd", lr=0.1)
    assert torch.isfinite(again(torch.ones(2, 4))).all()
    again.close()


def test_a_full_state_dict_holds_the_persistent_buffers_and_loads_strictly():
    """A model with buffers (BatchNorm's running statistics, one of them not persistent): the
    full state holds what the plain model's `state_dict()` holds, this rank's buffers as they
    are after a training forward, and a plain copy loads it strictly."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    module[1].register_buffer("scratch", torch.ones(2), persistent=False)
    fused = FusedFSDP(module, [module[0], module[1]], optimizer="sgd", lr=0.1)
    fused(torch.randn(8, 4)).sum().backward()
    fused.step()
    state = fused.full_state_dict()
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    assert sorted(state) == sorted(plain.state_dict())
    assert torch.equal(state["1.running_mean"], module[1].running_mean)
    assert not torch.equal(state["1.running_mean"], torch.zeros(4)), "updated by the forward"
    plain.load_state_dict(state)
    assert torch.equal(plain[1].running_var, module[1].running_var)
    fused.close()


def test_a_full_state_that_cannot_be_copied_is_refused_before_anything_loads():
    """Values that are no tensors, or that cannot be copied to the host (a meta tensor), are
    refused with the other problems, before the first parameter loads: the parameters and
    buffers stay as they were."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    fused = FusedFSDP(module, [module[0], module[1]], optimizer="sgd", lr=0.1)
    fused(torch.randn(8, 4)).sum().backward()
    fused.step()
    before = fused.full_state_dict()
    zeros = {k: torch.zeros_like(v) for k, v in before.items()}
    for name, value, words in [("1.weight", torch.zeros(4, device="meta"), r"not copied: 1\.weight"),
                               ("1.bias", [0.0] * 4, r"not tensors: 1\.bias"),
                               ("1.running_mean", torch.zeros(4, device="meta"),
                                r"not copied: 1\.running_mean")]:
        with pytest.raises(fsdp_fusion.InvalidArgumentError, match=words):
            fused.load_full_state_dict({**zeros, name: value})
        after = fused.full_state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items()), name
    fused.load_full_state_dict(zeros)
    assert all(not v.any() for v in fused.full_state_dict().values())
    fused.close()


class _Counted(torch.nn.Linear):
    """A layer that keeps extra state: how many forwards it ran."""

    def __init__(self):
        super().__init__(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state):
        if not isinstance(state.get("calls"), int):
            raise ValueError(f"not a count of calls: {state}")
        self.calls = state["calls"]


def test_a_full_state_dict_holds_extra_states_and_loads_them_back():
    """A module's extra state (`get_extra_state`) is in the full state under the key
    `state_dict()` gives it, a plain copy loads it strictly, `load_full_state_dict` gives it to
    `set_extra_state`, and a full state without it, or one that `set_extra_state` refuses, is
    refused before any parameter or buffer loads."""
    module = torch.nn.Sequential(_Counted(), torch.nn.ReLU(), _Counted())
    fused = FusedFSDP(module, [module[0], module[2]], optimizer="sgd", lr=0.1)
    for _ in range(3):
        fused(torch.randn(8, 4)).sum().backward()
        fused.step()
    state = fused.full_state_dict()
    plain = torch.nn.Sequential(_Counted(), torch.nn.ReLU(), _Counted())
    assert sorted(state) == sorted(plain.state_dict())
    assert state["0._extra_state"] == {"calls": 3}
    plain.load_state_dict(state)
    assert plain[2].calls == 3
    module[0].calls = module[2].calls = 0
    before = {name: value.clone() for name, value in fused.full_state_dict().items()
              if isinstance(value, torch.Tensor)}
    zeros = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
             for k, v in state.items()}
    without = {k: v for k, v in zeros.items() if k != "2._extra_state"}
    with pytest.raises(fsdp_fusion.InvalidArgumentError, match=r"missing: 2\._extra_state"):
        fused.load_full_state_dict(without)
    with pytest.raises(ValueError, match="not a count of calls"):
        fused.load_full_state_dict({**zeros, "2._extra_state": {"calls": None}})
    assert module[2].calls == 0, "refused"
    after = fused.full_state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())
    fused.load_full_state_dict(state)
    assert (module[0].calls, module[2].calls) == (3, 3)
    # Mid-step (gradients not yet stepped) the load is refused before any extra state changes.
    fused(torch.randn(8, 4)).sum().backward()
    with pytest.raises(fsdp_fusion.MisuseError):
        fused.load_full_state_dict({**state, "0._extra_state": {"calls": 42}})
    assert module[0].calls == 4
    fused.step()
    fused.close()


def test_a_unit_called_twice_once_on_inputs_needing_no_gradient_ends_its_backward_once():
    """Above world size 1, a block applied twice where the first call's input needs no
    gradient (a frozen layer's output): its backward ends after both calls' gradients, not when
    the one call the package can follow is done, and training equals plain PyTorch's."""
    world = 2

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = torch.nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.block = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.block(self.block(self.frozen(x)))

    torch.manual_seed(0)
    reference = Twice()
    modules = [copy.deepcopy(reference) for _ in range(world)]
    group = LocalGroup(world)
    inputs = [torch.randn(3, 4) for _ in range(world)]
    sgd = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):
        # The engine averages the ranks' gradients: the mean of their losses.
        sum(reference(x).square().sum() for x in inputs).div(world).backward()
        sgd.step()
        sgd.zero_grad()

    def run(rank):
        m = modules[rank]
        fused = FusedFSDP(m, [m.block], local_group=group, rank=rank, optimizer="sgd", lr=0.1)
        for _ in range(2):
            fused(inputs[rank]).square().sum().backward()
            fused.step()
        state = fused.full_state_dict()
        fused.close()
        return state

    for state in on_ranks(world, run):
        for name, value in reference.state_dict().items():
            assert torch.allclose(state[name], value, atol=1e-6), name


class _Interruptible(torch.nn.Linear):
    """A layer whose forward raises a Ctrl-C while `interrupt` is set."""

    interrupt = False

    def forward(self, x):
        if self.interrupt:
            raise KeyboardInterrupt("Ctrl-C")
        return super().forward(x)


def _as_if_never_interrupted(wrap, interrupt, x):
    """Two training steps on `x` of a fresh `wrap()`, once as they are and once after
    `interrupt(fused)`: the states end equal."""
    states = []
    for interrupted in (False, True):
        fused = wrap()
        if interrupted:
            interrupt(fused)
        for _ in range(2):
            fused(x).square().sum().backward()
            fused.step()
        states.append(fused.full_state_dict())
        fused.close()
    for name, value in states[0].items():
        assert torch.equal(states[1][name], value), name


def _interruptible() -> FusedFSDP:
    """A fresh wrapper of a layer and an `_Interruptible` one, with master storage at world
    size 1, where views move."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), _Interruptible(4, 4))
    return FusedFSDP(module, [module[0], module[1]], optimizer="sgd", lr=0.1,
                     param_storage="master")


def _interrupted(fused, call, x):
    """`call(x)` (the wrapper, or its module) with a Ctrl-C inside its second layer."""
    fused.module[1].interrupt = True
    with pytest.raises(KeyboardInterrupt):
        call(x)
    fused.module[1].interrupt = False


def test_a_forward_interrupted_by_a_ctrl_c_is_ended_as_it_leaves_the_wrapper():
    """A KeyboardInterrupt inside a unit's forward, which torch's always-call hooks do not see
    (they run on `Exception`): the wrapper ends the forward as the interrupt leaves it, so a
    copy of the state, and training, go on as if the interrupted forward had never run."""
    x = torch.randn(3, 4)

    def interrupt(fused):
        _interrupted(fused, fused, x)
        fused.full_state_dict()

    _as_if_never_interrupted(_interruptible, interrupt, x)


@pytest.mark.parametrize("then", ["the wrapper", "a copy", "the module"])
def test_a_forward_of_the_module_itself_interrupted_is_ended_by_the_next_call(then):
    """A KeyboardInterrupt inside a direct call of the module, which no hook sees: the next call
    of the wrapper (or a copy of the state) ends the forward left open, and training goes on
    as if it had never run; a direct call of the module first fails once."""
    x = torch.randn(3, 4)

    def interrupt(fused):
        _interrupted(fused, fused.module, x)
        if then == "a copy":
            fused.full_state_dict()
        elif then == "the module":
            with pytest.raises(fsdp_fusion.MisuseError):
                fused.module(x)

    _as_if_never_interrupted(_interruptible, interrupt, x)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("then", ["forward", "step"])
def test_a_recompute_interrupted_by_a_ctrl_c_in_the_backward_is_ended_by_the_next_call(
        reentrant, then):
    """A KeyboardInterrupt inside a checkpointed unit's recompute, which runs in the backward,
    outside every forward of the wrapper: the next forward, or the step, ends that unit's
    forward, and training goes on as if the interrupted pass had never run (it had handed over
    no gradient yet)."""

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), _Interruptible(4, 4)])

        def forward(self, x):
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
            return x

    x = torch.randn(3, 4, requires_grad=True)

    def wrap():
        module = Checkpointed()
        return FusedFSDP(module, list(module.blocks), optimizer="sgd", lr=0.1)

    def interrupt(fused):
        loss = fused(x).square().sum()
        fused.module.blocks[1].interrupt = True
        with pytest.raises(KeyboardInterrupt):
            loss.backward()
        fused.module.blocks[1].interrupt = False
        if then == "step":
            fused.step()

    _as_if_never_interrupted(wrap, interrupt, x)
