"""The hooks through which `FusedFSDP` runs a module's forward and backward: they open and
close each unit in the engine, point its parameters at their gathered views, hand its gradients
over, and keep autograd's saved tensors right when the views move."""

from __future__ import annotations

import weakref
from ctypes import byref, c_size_t, c_uint32, c_uint64, c_void_p, sizeof
from dataclasses import dataclass

import torch

from ._capi import ROOT, Grad
from ._dlpack import tensor_at
from ._params import DTYPE_CODES, _holds_placeholders, _Param
from .errors import MisuseError


class _Views:
    """A unit's gathered views at one set of addresses: the tensors, and the position of the
    parameter whose memory starts at an address."""

    def __init__(self, tensors: list[torch.Tensor], addresses: tuple):
        self.tensors = tensors
        self.addresses = addresses
        # A parameter of no elements holds no memory: its address may be another's start.
        self.position = {address: i for i, (address, t) in enumerate(zip(addresses, tensors))
                         if address and t.numel()}


_GRAD_WORDS = sizeof(Grad) // sizeof(c_uint64)
"""64-bit words per `Grad`: its address is the second of an entry's."""
assert _GRAD_WORDS * sizeof(c_uint64) == sizeof(Grad) and Grad.data.offset == sizeof(c_uint64)


@dataclass
class _RootForward:
    """One forward of the module under way: its saved-tensor hooks (where views move), and
    whether it opened the root in the engine."""

    hooks: torch.autograd.graph.saved_tensors_hooks | None = None
    opened: bool = False


def _in_backward() -> bool:
    """Whether this thread runs inside an autograd backward (a recompute's forward does)."""
    return torch._C._current_graph_task_id() != -1


class _Unit:
    """One unit's parameters as the hooks handle them."""

    def __init__(self, index: int, params: list[_Param]):
        self.index = index
        self.params = params
        count = len(params)
        self.ids = (c_size_t * count)(*[p.id for p in params])
        self.addresses = (c_void_p * count)()
        self.cache: dict[tuple, _Views] = {}
        # Hooks of the unit open now (a recomputing forward may open it inside its backward).
        self.opens = 0
        # Of those, the forwards' (their post hook closes them).
        self.forward_opens = 0
        # Of those, the ones opened inside a backward (a recompute); see
        # `_end_interrupted_recomputes`.
        self.recompute_opens = 0
        self.views: _Views | None = None
        self.backward_open = False
        # Calls of the unit since its backward last ended whose inputs' gradients have not
        # come back, by their autograd node: its backward ends when the last one's do. A call
        # whose graph was dropped (a forward never run backward) leaves the set with it.
        self.calls_pending: weakref.WeakSet = weakref.WeakSet()
        # Whether a call since then had no input needing a gradient: no node tells when its
        # backward ends, so the unit's ends with the pass (the next forward, or the step).
        self.untracked_call = False
        trainable = [p for p in params if p.tensor.requires_grad]
        self.trainable = [p.tensor for p in trainable]
        # The hand-over's batch when every trainable parameter has a contiguous gradient of its
        # own dtype (the usual case): made once, the call fills in the addresses alone.
        self.full_batch = (Grad * len(trainable))(
            *[Grad(p.id, None, p.tensor.numel(), DTYPE_CODES[p.tensor.dtype]) for p in trainable])
        self.full_batch_words = (c_uint64 * (len(trainable) * _GRAD_WORDS)).from_buffer(
            self.full_batch)
        self.dtypes = [p.tensor.dtype for p in trainable]
        self.trainable_ids = [p.id for p in trainable]
        self.batch = (Grad * count)()


@dataclass(frozen=True)
class _Saved:
    """A tensor autograd saved that lies in a parameter's gathered memory: which parameter of
    which unit, and where in it, so that backward reads the parameter's memory of that time."""

    unit: _Unit
    position: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple
    byte_offset: int


def _tensors(obj):
    """The tensors in an output: a tensor, or tuples, lists and dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, wrapper, unit, *inputs):
        ctx.wrapper, ctx.unit = wrapper, unit
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.wrapper._call_backward_done(ctx.unit, ctx)
        return (None, None, *grads)


def _refuse_loading_parameters(module, state_dict, prefix, *_):
    """A wrapped module's `load_state_dict` would write its parameters' views (at world size
    1 the bf16 shards without their fp32 masters, which the next step rounds back from) or
    placeholders: refused, for `FusedFSDP.load_full_state_dict`."""
    names = [prefix + name for name, _ in module.named_parameters(recurse=False)]
    if any(name in state_dict for name in names):
        raise MisuseError("load_state_dict of a module wrapped by FusedFSDP would write the "
                          "engine's views, not its state: load with "
                          "FusedFSDP.load_full_state_dict (whole values, every rank)")


def _refuse_closed_forward(_module, _args):
    raise MisuseError("the module's parameters are placeholders of a closed FusedFSDP: wrap a "
                      "fresh copy of the model, or load its values into one")


def _refusing_placeholders(param_of: dict):
    """A hook refusing a module's `state_dict()` where one of its own parameters is a
    placeholder: the copy would hold NaN where the caller saves weights (above world size 1,
    with master storage, before a first forward, or once closed)."""

    def refuse(module, prefix, _keep_vars):
        names = [prefix + name for name, t in module.named_parameters(recurse=False)
                 if (p := param_of.get(id(t))) is not None and p.placeholder is not None
                 and t.data_ptr() == p.placeholder.data_ptr()]
        if names:
            raise MisuseError(f"state_dict() of a module wrapped by FusedFSDP would hold NaN "
                              f"placeholders for {', '.join(names)}, which the engine holds "
                              "sharded: copy with FusedFSDP.full_state_dict(), or save()")

    return refuse


class _Hooks:
    """`FusedFSDP`'s hooks on the module, its units and their parameters."""

    def _install_hooks(self, units):
        self._unit_hooks = []
        for index, unit in enumerate(units):
            self._unit_hooks += [
                unit.register_forward_pre_hook(self._pre_forward_hook(index), with_kwargs=True),
                unit.register_forward_hook(self._post_forward_hook(index), always_call=True)]
        self._root_hooks = [
            self.module.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True),
            self.module.register_forward_hook(self._root_post_forward, always_call=True)]
        placeholder_of = {id(p.tensor): p for p in self._params}
        for module in self.module.modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_load_state_dict_pre_hook(_refuse_loading_parameters)
                module.register_state_dict_pre_hook(_refusing_placeholders(placeholder_of))

    def _close_hooks(self):
        """The module's and its units' hooks go with the engine; a forward of the module, whose
        parameters are placeholders, is then refused."""
        for handle in getattr(self, "_unit_hooks", []) + getattr(self, "_root_hooks", []):
            handle.remove()
        self._unit_hooks, self._root_hooks = [], []
        module = getattr(self, "module", None)
        if (module is not None and _holds_placeholders(module)
                and getattr(self, "_closed_forward", None) is None):
            self._closed_forward = module.register_forward_pre_hook(_refuse_closed_forward)

    def _drop_unit_hooks_once_mapped(self):
        """Removes the units' hooks once they have nothing left to do: where the views do not
        move, every unit's views are mapped (a unit with no parameters has none to map), and
        the root's hooks (it has parameters) tell the engine where each pass begins, and no
        unit's gradients go over on their own. The units then run as plain modules."""
        if (self._unit_hooks and not self._per_unit and self._root.params
                and all(u.views is not None or not u.params for u in self._units)):
            for handle in self._unit_hooks:
                handle.remove()
            self._unit_hooks = []

    # -- hooks -----------------------------------------------------------------------------

    # Where the views never move (world size 1, parameters stored as shards), a unit's views
    # are mapped in its first forward and the engine has nothing to gather, release or reduce
    # for it: inside the root's forward (whose hooks tell the engine where a pass begins), later
    # passes make no engine call for the unit, and the whole model's gradients go to the engine
    # in one call when the next forward or the step begins (`_close_backwards`), as plain
    # PyTorch's optimizer takes them at the step. Where the views move, each unit's hooks call
    # the engine, and its gradients go over when its backward ends (`_per_unit`), so that their
    # reduction overlaps the rest of the backward; so they do where the optimizer steps in the
    # backward, which updates each unit's groups as their gradients arrive.

    def _pre_forward_hook(self, unit: int):
        def hook(_module, args, kwargs):
            u = self._units[unit]
            # A forward of a unit after the backward began is its recompute (reentrant
            # checkpointing, whose first forward took no gradient): its backward opens first, so
            # that the engine takes the forward as part of it, not as the end of the pass.
            if self._backward_began and torch.is_grad_enabled() and not u.backward_open:
                self._pre_backward(unit)
            # Outside the root's forward (a root with no parameters of its own, a recompute in
            # backward) the unit's hooks tell the engine where a pass begins.
            if self._views_move or u.views is None or self._root.opens == 0:
                self._open(u, self._lib.fsdp_engine_pre_forward)
                u.forward_opens += 1
                u.recompute_opens += _in_backward()
            if not self._per_unit:
                return None
            return self._wrap_inputs(unit, args, kwargs)

        return hook

    def _post_forward_hook(self, unit: int):
        def hook(_module, _args, output):
            u = self._units[unit]
            if u.forward_opens:
                u.forward_opens -= 1
                if u.recompute_opens and _in_backward():
                    u.recompute_opens -= 1
                self._close(u, self._lib.fsdp_engine_post_forward)
                self._hook_outputs(unit, output)

        return hook

    def _root_pre_forward(self, _module, args, kwargs):
        # First, so that the post hook, which torch runs after a failure here too, ends this
        # forward and no outer one, and so that an interrupt from here on is seen.
        forward = _RootForward()
        self._root_forwards.append(forward)
        if self._views_move:
            forward.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            forward.hooks.__enter__()
        if self._stream is not None and torch.cuda.current_stream(self._device) != self._stream:
            raise MisuseError("run forward and backward on the stream current when the wrapper "
                              "was made: the engine's compute stream")
        self._end_interrupted_recomputes()
        # A backward left open (the root's, or a unit's whose inputs needed no gradient) ends
        # when the next forward starts: every gradient of that pass has arrived by then.
        self._close_backwards()
        self._backward_began = False
        self._forwards = True
        self._open(self._root, self._lib.fsdp_engine_pre_forward)
        forward.opened = True
        return self._wrap_inputs(ROOT, args, kwargs)

    def _end_interrupted_forward(self):
        """Ends a forward of the wrapper that a `BaseException` (a Ctrl-C) interrupted, which
        torch's always-call hooks do not see: its saved-tensor hooks go, and the forwards of its
        units and of the root end in the engine, as their post hooks would have ended them."""
        forwards, self._root_forwards = self._root_forwards, []
        for forward in reversed(forwards):
            if forward.hooks is not None:
                forward.hooks.__exit__(None, None, None)
        for u in self._units:
            while u.forward_opens:
                u.forward_opens -= 1
                self._close(u, self._lib.fsdp_engine_post_forward)
            u.recompute_opens = 0
        for forward in reversed(forwards):
            if forward.opened:
                self._close(self._root, self._lib.fsdp_engine_post_forward)

    def _end_interrupted_recomputes(self):
        """Ends the units' forwards that a recompute in a backward (activation checkpointing)
        opened and a `BaseException` (a Ctrl-C) interrupted, which torch's post hooks do not
        see: once no backward runs, a forward opened inside one is over."""
        if _in_backward():
            return
        for u in self._units:
            while u.recompute_opens:
                u.recompute_opens -= 1
                u.forward_opens -= 1
                self._close(u, self._lib.fsdp_engine_post_forward)

    def _root_post_forward(self, _module, _args, output):
        forward = self._root_forwards.pop() if self._root_forwards else _RootForward()
        if forward.hooks is not None:
            forward.hooks.__exit__(None, None, None)
        # Not where the pre hook failed before it opened the root (torch runs this all the same).
        if forward.opened:
            self._close(self._root, self._lib.fsdp_engine_post_forward)
        self._hook_outputs(ROOT, output)
        self._drop_unit_hooks_once_mapped()

    def _wrap_inputs(self, unit, args, kwargs):
        """Passes the unit's tensor inputs (top-level args and kwargs) through `_PostBackward`."""
        if not torch.is_grad_enabled():
            return args, kwargs
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not keys and not slots:
            if not self._backward_began:
                self._unit_of[unit].untracked_call = True
            return args, kwargs
        outs = _PostBackward.apply(self, unit, *[args[i] for i in slots],
                                   *[kwargs[k] for k in keys])
        # A recompute in the backward (checkpointing) is not a call of its own: its inputs'
        # gradients come back for the call it recomputes, or never (non-reentrant).
        if not self._backward_began:
            self._unit_of[unit].calls_pending.add(outs[0].grad_fn)
        args = list(args)
        for i, out in zip(slots, outs):
            args[i] = out
        kwargs = dict(kwargs, **dict(zip(keys, outs[len(slots):])))
        return tuple(args), kwargs

    def _hook_outputs(self, unit, output):
        if not torch.is_grad_enabled():
            return

        def on_grad(_grad):
            self._pre_backward(unit)

        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(on_grad)

    def _pre_backward(self, unit: int):
        self._backward_began = True
        u = self._unit_of[unit]
        if not u.backward_open:
            self._open(u, self._lib.fsdp_engine_pre_backward)
            u.backward_open = True

    def _call_backward_done(self, unit: int, call):
        """The gradients of one call's inputs came back (`call`, its autograd node): the unit's
        backward ends once every pending call's did (a unit called twice, a model run twice
        before one backward)."""
        u = self._unit_of[unit]
        u.calls_pending.discard(call)
        if not u.calls_pending and not u.untracked_call:
            self._post_backward(unit)

    def _post_backward(self, unit: int):
        u = self._unit_of[unit]
        u.untracked_call = False
        if u.backward_open:
            u.backward_open = False
            # The unit's backward ends even where its gradients are refused (a duplicate): its
            # views go back, and the next pass finds the unit closed.
            try:
                if self._per_unit:
                    self._hand_over(u)
            finally:
                self._close(u, self._lib.fsdp_engine_post_backward)
        elif self._per_unit and unit != ROOT:
            # A unit whose forward made no engine call (see `_pre_forward_hook`).
            self._hand_over(u)

    def _close_backwards(self):
        """Ends every backward left open, then hands over the gradients still in `.grad`, before
        the next forward or the step: where the views move, those of a unit whose outputs needed
        none, unit by unit (one that arrived after its unit's backward ended is refused above
        world size 1, where that end reduced the unit's gradients of the pass); where they
        do not, the whole model's, in one call (unless the optimizer steps in the backward,
        which takes each unit's gradients as its backward ends). Two backward passes with no
        forward between them (`retain_graph`) are one pass to the engine: where units hand
        their gradients over, a unit's gradient handed over in both is refused as a duplicate
        (where gradients travel, any gradient of a unit whose backward ended is refused), and a
        late one at world size 1 is their sum in the parameter's dtype, as every gradient is
        where the whole model's go over at once."""
        for u in self._unit_of.values():
            if u.backward_open:
                # Calls whose inputs' gradients never came back (an output left unused).
                u.calls_pending.clear()
                self._post_backward(u.index)
        if not self._per_unit:
            self._hand_over(self._whole_model)
            return
        for u in self._unit_of.values():
            self._hand_over(u)

    def _hand_over(self, u: _Unit):
        """Hands the unit's gradients (in its parameters' `.grad`, where autograd accumulated
        them) to the engine in one call, and clears `.grad`. Autograd runs a leaf's gradient
        accumulation as soon as the gradient is ready, ahead of any other node, so by the end
        of a unit's backward every gradient of the unit is there. On the CPU the engine reads
        them before returning; on a GPU it reads them on the compute stream, where the caching
        allocator reuses their memory only afterwards."""
        # Held until the call returned.
        grads = [t.grad for t in u.trainable]
        if all(g is None for g in grads):
            return
        self._gradients = True
        device = self._device
        if all(g is not None and g.dtype == dtype and g.is_contiguous() and g.device == device
               for g, dtype in zip(grads, u.dtypes)):
            words = u.full_batch_words
            for i, grad in enumerate(grads):
                words[i * _GRAD_WORDS + 1] = grad.data_ptr()
            batch, count = u.full_batch, len(grads)
        else:
            batch, count = self._batch_of(u, grads, device)
        for t in u.trainable:
            t.grad = None
        self._check(self._lib.fsdp_engine_grads(self._engine, batch, count), "fsdp_engine_grads")

    @staticmethod
    def _batch_of(u: _Unit, grads: list, device: torch.device) -> tuple:
        """The batch of the gradients present, each made contiguous (in place in `grads`, which
        holds them through the call), in its own dtype; one on another device than the engine's
        memory is refused (the engine would read its address as its own device's)."""
        batch, count = u.batch, 0
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            if grad.device != device:
                raise MisuseError(f"a gradient on {grad.device}, the engine's memory on {device}: "
                                  "the wrapped module's parameters were moved (a `to()` of the "
                                  "module), which the engine does not follow")
            if not grad.is_contiguous():
                grads[i] = grad = grad.contiguous()
            entry = batch[count]
            entry.param, entry.data = u.trainable_ids[i], grad.data_ptr()
            entry.numel, entry.dtype = grad.numel(), DTYPE_CODES.get(grad.dtype, 99)
            count += 1
        return batch, count

    # -- gathered views --------------------------------------------------------------------

    def _open(self, u: _Unit, hook):
        """Runs the engine's pre hook for the unit and points its parameters at their views."""
        if not u.params:
            return
        self._check(hook(self._engine, u.index), hook.__name__)
        u.opens += 1
        if u.views is None:
            self._map_views(u)

    def _map_views(self, u: _Unit):
        """Points the unit's parameters at their gathered views (made once per slot)."""
        if self._capturing:
            self._stream_addresses(u)
        else:
            self._check(self._lib.fsdp_engine_params(self._engine, u.ids, len(u.params),
                                                     u.addresses), "fsdp_engine_params")
        self._point_at(u, tuple(u.addresses))

    def _point_at(self, u: _Unit, key: tuple):
        """Points the unit's parameters at views of the gathered addresses `key`."""
        views = u.cache.get(key)
        if views is None:
            # Cached for every later forward: made as ordinary tensors even inside
            # `torch.inference_mode()`, whose tensors autograd cannot save for a backward.
            with torch.inference_mode(False):
                views = _Views([self._view(p, address) for p, address in zip(u.params, key)],
                               key)
            u.cache[key] = views
        u.views = views
        for p, view in zip(u.params, views.tensors):
            p.tensor.data = view
        if self._views_move:
            self._open_units.append(u)

    def _stream_addresses(self, u: _Unit):
        """The unit's gathered addresses during a capture, where `fsdp_engine_params` is refused
        (on a CPU engine it waits for the stream): a CUDA engine's, for its compute stream's
        work, are the same."""
        data, numel, dtype = c_void_p(), c_size_t(), c_uint32()
        for i, param in enumerate(u.ids):
            self._check(self._lib.fsdp_engine_param_device(self._engine, param, byref(data),
                                                          byref(numel), byref(dtype)),
                        "fsdp_engine_param_device")
            u.addresses[i] = data.value

    def _close(self, u: _Unit, hook):
        """Runs the engine's post hook for the unit; its parameters go back to placeholders once
        none of its hooks is open. At world size 1 they stay views: the views are the shards,
        which never move, so they always hold the current values."""
        if not u.params or u.opens == 0:
            # Nothing to close: the pre hook failed (torch runs post hooks all the same).
            return
        u.opens -= 1
        if u.opens == 0 and self._views_move:
            self._unmap_views(u)
        self._check(hook(self._engine, u.index), hook.__name__)

    def _unmap_views(self, u: _Unit):
        for p in u.params:
            # None where the construction failed before the placeholders were made.
            if p.placeholder is not None:
                p.tensor.data = p.placeholder
        u.views = None
        if u in self._open_units:
            self._open_units.remove(u)

    def _view(self, p: _Param, address: int | None) -> torch.Tensor:
        numel = p.tensor.numel()
        if numel == 0:
            # No memory to view. (A view of an empty tensor, kept in the cache, makes torch abort
            # the interpreter's exit while the wrapper lives.)
            return torch.empty(p.tensor.shape, dtype=p.tensor.dtype, device=self._device)
        view = tensor_at(address or 0, numel, p.tensor.dtype, self._device)
        if address:
            # Kept to see, at `close`, whether a tensor outside still holds the memory.
            self._storages.append((p.name, view.untyped_storage()))
        return view.view(p.tensor.shape)

    def _views_held_elsewhere(self) -> list[str]:
        """The parameters whose engine memory a tensor outside the wrapper still holds (a
        `state_dict()`'s tensor, a detached parameter, an autograd graph not run backward):
        releasing the engine would leave it reading freed memory. Counts the uses of each view's
        storage: the one left is the wrapper's own record."""
        held = {name for name, storage in getattr(self, "_storages", ())
                if torch._C._storage_Use_Count(storage._cdata) > 1}
        return sorted(held)

    # -- saved tensors ---------------------------------------------------------------------
    # Autograd keeps tensors of the forward for backward, among them parameters and views of
    # them (a weight's transpose): memory of the slot the unit was gathered into then. By the
    # backward the engine may have gathered the unit into another slot, and given the old one
    # to another group. So a saved tensor in a parameter's gathered memory is saved as where it
    # lies in that parameter, and read back from the parameter's memory at backward time (its
    # unit's pre_backward ran before any node of the unit executes).

    def _pack(self, t: torch.Tensor):
        if t.layout != torch.strided:
            return t
        address = t.untyped_storage().data_ptr()
        for u in self._open_units:
            position = u.views.position.get(address)
            if position is not None:
                return _Saved(u, position, t.dtype, t.size(), t.stride(),
                              t.storage_offset() * t.element_size())
        return t

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        u = saved.unit
        if u.views is None:
            # A node of the unit runs before any gradient reached the unit's outputs (a loss on
            # a value the unit kept aside, such as an auxiliary loss): its backward begins here.
            self._pre_backward(u.index)
        flat = u.views.tensors[saved.position].reshape(-1)
        if flat.dtype != saved.dtype:
            flat = flat.view(saved.dtype)
        offset = saved.byte_offset // flat.element_size()
        return flat.as_strided(saved.size, saved.stride, offset)
