"""torch's own grad tools over the params a DistributedFusedAdam manages: true values, or an error.

A DistributedFusedAdam reduce-scatters each grad during backward and keeps only its shard, so
``param.grad`` stays None in autograd. Left alone, every tool that reads ``param.grad`` is
silently wrong: ``torch.nn.utils.clip_grad_norm_`` returns 0 and clips nothing,
``get_total_norm([p.grad ...])`` is 0, ``torch.amp.GradScaler.unscale_`` finds nothing,
Lightning's ``grad_norm(module)`` is ``{}``. Here those tools give the true values (the grads
torch would hold in the same unsharded loop) or raise naming the fix.

THE CHOICE. Two routes were weighed:

(a) Grads torch's tools understand, in ``param.grad``: FSDP2 puts DTensor grads there; here it
    would be a tensor subclass viewing the reduced shard. Every reader of ``param.grad`` sees it
    (also Lightning's ``grad_norm``, GradScaler, user logging), but putting it in autograd's own
    grad field has traps: the next backward accumulates INTO it (``grad += new`` runs on the
    subclass; the staging hooks would meet a tensor without storage), so it would have to be
    taken out before every backward (a hook per param per backward: the host time the native
    staging hooks exist to save) and at ``zero_grad``, and put back after every reduction (a
    setattr per param per step). torch's ``GradScaler.unscale_`` would walk it (one op per
    dtype group: fine), ``model.zero_grad(set_to_none=False)`` would ``zero_()`` it.
(b) torch's functions wrapped for managed params only: exact and cheap where a function
    receives the PARAMS (``clip_grads_with_norm_``: the clip folds into the step kernel, no
    collective), but blind where it receives grads (``get_total_norm([p.grad ...])`` gets a list
    without them: a silent 0) or reads ``param.grad`` itself (GradScaler.unscale_, Lightning's
    ``grad_norm``: nothing to wrap), and it misses callers that bound the function before it was
    wrapped.

Taken: (a) for what ``param.grad`` shows, delivered without the traps, plus (b) where it is
exact and cheaper.

* While the optimizer holds grads (from the end of a backward that delivered them after
  ``zero_grad`` to the ``zero_grad(set_to_none=True)`` that drops them), each managed param's
  class is a subclass of its own class whose PYTHON-level ``grad`` property returns autograd's
  field when set, else, while no backward is running, a :class:`ShardedGrad`: a storage-less
  tensor subclass with the param's shape, dtype and strides viewing the optimizer's grads
  (``grads_view.py``). Autograd
  (C++) never sees it: backward still accumulates into the empty C field and the hooks take it,
  so nothing changes on the backward and step paths (no host sync); ``p.grad = None`` still
  writes the C field (it does not drop the optimizer's grads: ``opt.zero_grad()`` does). The
  rest of the time (the forward after ``zero_grad``, in particular) the param has its own class
  back (:class:`GradClasses`, switched by the step cycle): there its ``.grad`` would show
  autograd's field anyway, and every op a Parameter SUBCLASS enters pays a ``__torch_function__``
  lookup that torch skips for its own class (docs/performance.md, BA, has its cost).
  A ``torch.compile``'d forward may guard on its params' classes (torch 2.13 does, 2.11 does
  not): in a gradient-accumulation loop the forwards after a backward see the other class, and
  dynamo then compiles a second graph, once (a compiled forward gains nothing from the switch);
  ``SHARDAMP_SWITCH_PARAM_CLASS=0`` (config.py) keeps the showing class from construction on, one
  graph.
* ``ShardedGrad`` supports what torch's tools do with grads, exactly: norms
  (``torch.linalg.vector_norm``, ``Tensor.norm``, ``.data``, ``torch._foreach_norm``: every
  param's norm in one all-reduce per step and norm order, see grads_view.py) and
  ``torch._amp_foreach_non_finite_check_and_unscale_`` (GradScaler.unscale_: the optimizer's
  ``unscale_grads``, the global found-inf written back), and ``.to()``: onto its own device the
  same view, onto another device or dtype the values there (``full_grad``'s, a collective with
  peers; ``model.cpu()`` after training moves each grad with its param). Any other op raises, naming
  ``opt.full_grad(p)`` and ``opt.local_grad(p)``: no silent zeros, no accidental materialisation
  of the whole model's grads.
* torch's ``get_total_norm`` and ``clip_grads_with_norm_`` are wrapped (both their
  ``torch.nn.utils`` names and the ``torch.nn.utils.clip_grad`` globals that
  ``clip_grad_norm_`` composes at each call, so ``clip_grad_norm_`` is covered even where a caller
  bound it earlier): over ALL of an optimizer's grads the norm is ``opt.grad_norm()`` (the
  step's one stats all-reduce, shared with unscale_ and step: a loop with torch's GradScaler +
  ``unscale_`` + ``clip_grad_norm_`` still issues exactly one small all-reduce per step), and the
  clip is recorded in the step cycle (``GradsView.clip``; the coefficient is resolved in the step kernel, as
  ``shardamp.optim.clip_grad_norm_`` does). A subset of an optimizer's params cannot be clipped
  by one kernel coefficient: it raises. ``clip_grad_value_`` over managed params raises (clip
  by norm). Everything else goes to torch's original, unchanged. A caller that bound
  ``get_total_norm`` before the first optimizer was built runs torch's own on the views: the
  per-param norms, true, one all-reduce more; one that bound ``clip_grads_with_norm_`` meets the
  view's ``mul_``, which raises naming the fix.

COLLECTIVES. ``torch.nn.utils.clip_grad_norm_`` is a local function in torch; over managed params
it is global-norm-correct, so it is a collective: every rank must call it (frameworks do), as
every rank must read ``p.grad``'s norms (Lightning's ``grad_norm`` in ``on_before_optimizer_step``
runs on every rank). A rank that reads norms or ``full_grad`` alone raises after the grad reads'
bounded arrival (comm/order.py ``arrive``: half ``SHARDAMP_COLLECTIVE_TIMEOUT``, 30 s unset), having
issued no collective; one that clips alone waits in the stats all-reduce, which the others' step
completes (the clips are compared at the next step).

BEFORE ``unscale_`` these functions act as torch's on the scaled grads: the norm handed out is
the scaled one (a value that stays, not the optimizer's norm tensor, which unscaling divides in
place) and ``max_norm`` is compared with it (grads_view.py). A rank whose backward produced no grad for any of the
optimizer's params sees ``p.grad`` None until a collective of the optimizer has run.

WHERE AND HOW LONG. :func:`install` runs at optimizer construction: it wraps torch's functions
once (idempotent: a second optimizer reuses the wrappers) and returns the optimizer's
:class:`GradClasses`, which its step cycle calls at the end of a backward that delivered grads
and at ``zero_grad`` (a loop over the params each time). The wrappers cost one check when no
DistributedFusedAdam is alive, and hand a call with no managed param to torch's original
untouched. When the last DistributedFusedAdam is garbage-collected, :func:`uninstall` restores
torch's functions (where nobody replaced them since) and the params' classes; it can also be
called directly.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _compat, config, norms, param_tags
from .grads_view import owner, owners
from .step.cycle import Action


# ====================================================================== the grad a managed param shows
_tag_of = param_tags.by_id  # read per param by torch's clip
_graph_task_id = _compat.graph_task_id  # -1 outside a backward (_compat.in_backward, without its frame)


def _grad_of_managed(p: Tensor) -> Optional[Tensor]:
    """The Python-level ``.grad`` of a managed param (see the module docstring). Read per param
    by torch's clip and GradScaler: kept to a few attribute reads (grads_view.owner, inlined)."""
    g = _compat.raw_grad(p)
    if g is not None:
        return g  # autograd's own (a stray grad, or one not taken by the hooks yet)
    tag = _tag_of(id(p))
    opt = tag.optimizer() if tag is not None else None
    if opt is None:
        return None  # not managed by a live optimizer (any more)
    view = opt._grads_view  # the optimizer's one seam for reading its grads (grads_view.py)
    if tag.owner is not view.owner_token:
        return None  # a newer optimizer took it over
    if not view.has_grads() or _graph_task_id() != -1:
        return None  # no grads; or inside a backward, where hooks read autograd's field as before
    i = view.index_of[id(p)]  # p is opt's (checked above), which keeps it alive: ids are unique
    handle = view.handles[i]
    if handle is None:
        handle = view.handles[i] = ShardedGrad(p, opt, i)
    return handle


def _set_grad_of_managed(p: Tensor, value: Optional[Tensor]) -> None:
    """``p.grad = value`` on a managed param: to autograd's field, except a ShardedGrad (what
    ``Module._apply`` assigns back after ``model.to(...)`` of a model holding grads), which changes
    nothing: the grads stay where they are, in the optimizer."""
    if type(value) is not ShardedGrad:
        _compat.set_raw_grad(p, value)


_UNSUPPORTED = (
    "{op} on p.grad of a param a DistributedFusedAdam manages: that grad is a read-only view of the "
    "optimizer's reduce-scattered shards (no storage of its own). Supported on it: norms "
    "(torch.linalg.vector_norm, Tensor.norm, torch.nn.utils.get_total_norm / clip_grad_norm_ / "
    "clip_grads_with_norm_ over all the optimizer's params) and torch.amp.GradScaler.unscale_. For its "
    "values call opt.full_grad(p) (a collective: every rank calls it) or opt.local_grad(p) (this rank's "
    "slice); clear grads with opt.zero_grad()."
)


class ShardedGrad(torch.Tensor):
    """``param.grad`` of a param a live DistributedFusedAdam manages, while it holds grads.

    Shape, dtype, device and strides are the param's; its values are those torch's
    ``param.grad`` would hold in the same unsharded loop (grads_view.py: averaged as configured,
    scaled before ``unscale_``, clipped after a clip). Only norms, GradScaler's unscale and
    ``.to()`` run on it; see the module docstring. It reads the optimizer's grads when an op runs. Every
    param of an optimizer holding grads shows one: a param no rank produced a grad for shows
    zeros where torch has None (telling them apart takes a collective; ``opt.full_grad(p)``
    returns None for it).
    """

    __torch_function__ = _compat.disabled_torch_function

    @staticmethod
    def __new__(cls, param: Tensor, opt: Any, index: int) -> "ShardedGrad":
        t = _compat.make_wrapper_subclass(cls, param)
        t._opt, t._index = weakref.ref(opt), index
        return t

    def optimizer(self) -> Any:
        """The DistributedFusedAdam whose grads this views (raises if it is gone)."""
        opt = self._opt()
        if opt is None:
            raise RuntimeError("p.grad was read from a DistributedFusedAdam that is gone; read grads while their "
                               "optimizer is alive")
        return opt

    def _view(self) -> Any:
        return self.optimizer()._grads_view

    def __repr__(self) -> str:
        return (f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, param {self._index} of a "
                "DistributedFusedAdam; values: opt.full_grad(p))")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(_UNSUPPORTED.format(op="pickling"))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Tuple = (), kwargs: Optional[Dict] = None) -> Any:
        handler = _HANDLERS.get(func)
        if handler is None:
            raise RuntimeError(_UNSUPPORTED.format(op=f"torch op {func}"))
        return handler(func, args, kwargs or {})


def _arg(args: Tuple, kwargs: Dict, i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _detach(func: Any, args: Tuple, kwargs: Dict) -> ShardedGrad:
    g = args[0]
    return ShardedGrad(g, g._opt(), g._index) if g._opt() is not None else g  # ``.data``, ``.detach()``


def _to_copy(func: Any, args: Tuple, kwargs: Dict) -> Tensor:
    """``.to()`` (``model.to(...)`` applies it to every ``p.grad`` and assigns the result back): to
    where the grad already is, the same view; to another device or dtype (a model moved once
    training is over: Lightning's teardown under ``strategy="auto"`` calls ``module.cpu()``) the
    grad's values, moved as torch moves a plain grad. Those are whole grads: with peers a
    collective per param, as ``opt.full_grad(p)`` (every rank moves its model, as frameworks do).
    The params themselves leave the optimizer's buffers then: its next step raises."""
    g = args[0]
    device = kwargs.get("device")
    device = g.device if device is None else torch.device(device)
    same_device = device.type == g.device.type and (device.index is None or g.device.index is None
                                                    or device.index == g.device.index)
    if device.type == "cuda" and device.index is None:
        same_device = g.device.index == torch.cuda.current_device()
    if same_device and kwargs.get("dtype", g.dtype) in (None, g.dtype) \
            and kwargs.get("layout", torch.strided) in (None, torch.strided) \
            and kwargs.get("memory_format", torch.preserve_format) in (None, torch.preserve_format):
        return _detach(func, args, kwargs)
    what = f"p.grad.to({device}, {kwargs.get('dtype') or g.dtype}) (a model moved or cast while its optimizer holds grads)"
    view = g._view()
    values = view.full_grad_at(g._index, what)
    if values is None:  # no rank produced one: the zeros the view showed
        values = torch.empty_strided(g.shape, g.stride(), dtype=g.dtype, device=g.device).zero_()
    out = func(values, **kwargs)
    p = view.source().params[g._index]
    if (p.device, p.dtype) == (out.device, out.dtype):  # its param went there first: Module._apply
        view.moved(g._index, out)
    return out


def _norm_of(g: ShardedGrad, ord: Any, dtype: Optional[torch.dtype]) -> Tensor:
    return g._view().param_norms(float(ord), "the norm of p.grad")[g._index].to(dtype or g.dtype)


def _vector_norm(func: Any, args: Tuple, kwargs: Dict) -> Tensor:
    g = args[0]
    ord, dim = _arg(args, kwargs, 1, "ord", 2), _arg(args, kwargs, 2, "dim", None)
    keepdim = _arg(args, kwargs, 3, "keepdim", False)
    if dim is not None and sorted(d % max(g.dim(), 1) for d in dim) != list(range(g.dim())):
        raise RuntimeError(_UNSUPPORTED.format(op=f"a norm over dims {list(dim)}"))
    out = _norm_of(g, ord, kwargs.get("dtype"))
    return out.reshape([1] * g.dim()) if keepdim else out


def _foreach_norm(func: Any, args: Tuple, kwargs: Dict) -> List[Tensor]:
    tensors, ord, dtype = list(args[0]), _arg(args, kwargs, 1, "ord", 2), kwargs.get("dtype")
    plain = [t for t in tensors if type(t) is not ShardedGrad]
    theirs = iter(func(plain, ord, dtype=dtype) if plain else [])
    return [_norm_of(t, ord, dtype) if type(t) is ShardedGrad else next(theirs) for t in tensors]


def _unscale(func: Any, args: Tuple, kwargs: Dict) -> None:
    # torch's GradScaler.unscale_ (once per dtype group of the optimizer's grads). Its other caller,
    # GradScaler._check_inf_per_device (inv_scale 1: a found-inf check), runs only for optimizers
    # whose step takes no ``grad_scaler``; DistributedFusedAdam's takes it (torch_scaler.py).
    grads, found_inf, inv_scale = args
    plain = [t for t in grads if type(t) is not ShardedGrad]
    views = {}
    for g in grads:
        if type(g) is ShardedGrad:
            view = g._view()
            views[id(view)] = view
    for view in views.values():  # the optimizer's global found-inf (exactly 0 or 1)
        found = view.unscale(inv_scale)
        found_inf.copy_(torch.maximum(found_inf, found.to(device=found_inf.device, dtype=found_inf.dtype)))
    if plain:
        func(plain, found_inf, inv_scale)


_HANDLERS: Dict[Any, Callable] = {
    _compat.aten_op("detach.default"): _detach,
    _compat.aten_op("alias.default"): _detach,
    _compat.aten_op("_to_copy.default"): _to_copy,
    _compat.aten_op("linalg_vector_norm.default"): _vector_norm,
    _compat.aten_op("_foreach_norm.Scalar"): _foreach_norm,
    _compat.aten_op("_amp_foreach_non_finite_check_and_unscale_.default"): _unscale,
}


# ====================================================================== torch's functions, wrapped
_originals: Dict[str, Callable] = {}  # torch's functions, by name (_compat.torch_clip_functions); kept
_replaced: Dict[Tuple[Any, str], Callable] = {}  # (module, attribute) -> what it held before the wrapper
_live: set = set()  # one token per DistributedFusedAdam alive (removed by its finalizer)
# params whose class a GradClasses may switch, by id (a WeakSet would compare tensors with ==)
_switched: Dict[int, "weakref.ref[Tensor]"] = {}
_epoch = 0  # uninstall() calls so far


def _by_optimizer(opts: List[Any], items: List[Any]) -> Dict[int, Tuple[Any, List[Any]]]:
    """``items`` grouped by the optimizer beside each: ``{id(opt): (opt, [its items])}``."""
    out: Dict[int, Tuple[Any, List[Any]]] = {}
    for opt, item in zip(opts, items):
        out.setdefault(id(opt), (opt, []))[1].append(item)
    return out


@torch.no_grad()
def get_total_norm(tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: Optional[bool] = None) -> Tensor:
    original = _originals["get_total_norm"]
    if not _live:
        return original(tensors, norm_type, error_if_nonfinite, foreach)
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    views = [t for t in tensors if type(t) is ShardedGrad]
    if not views:
        return original(tensors, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    device = tensors[0].device
    groups = _by_optimizer([v.optimizer() for v in views], [v._index for v in views])
    parts = [opt._grads_view.total_norm(indices, norm_type) for opt, indices in groups.values()]
    plain = [t for t in tensors if type(t) is not ShardedGrad]
    if plain:
        parts.append(original(plain, norm_type, False, foreach))
    total = parts[0] if len(parts) == 1 else norms.combine(parts, norm_type, device)
    if error_if_nonfinite and not bool(torch.isfinite(total)):  # a host read, as in torch
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`")
    return total


@torch.no_grad()
def clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: Tensor,
                          foreach: Optional[bool] = None) -> None:
    original = _originals["clip_grads_with_norm_"]
    if not _live:
        return original(parameters, max_norm, total_norm, foreach)
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    opts = owners(params)
    plain = [p for p, opt in zip(params, opts) if opt is None]
    if len(plain) == len(params):
        return original(params, max_norm, total_norm, foreach)
    theirs = _by_optimizer([o for o in opts if o is not None], [p for p, o in zip(params, opts) if o is not None])
    groups = {key: (opt, opt._grads_view.indices(mine, "clip_grads_with_norm_")) for key, (opt, mine) in theirs.items()}
    for opt, indices in groups.values():  # every check first: nothing is clipped when one raises
        opt._grads_view.require(Action.CLIP, "clip_grads_with_norm_")
    for opt, indices in groups.values():
        opt._grads_view.clip(indices, max_norm, total_norm)
    if plain:
        original(plain, max_norm, total_norm, foreach)
    return None


@torch.no_grad()
def clip_grad_value_(parameters: Any, clip_value: float, foreach: Optional[bool] = None) -> None:
    original = _originals["clip_grad_value_"]
    if not _live:
        return original(parameters, clip_value, foreach)
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    managed = sum(owner(p) is not None for p in params)
    if managed:
        raise ValueError(
            f"clip_grad_value_: {managed} of the params are managed by a DistributedFusedAdam, whose grads are "
            "reduce-scattered shards resolved in its step: they cannot be clipped by value. Clip by norm "
            "(torch.nn.utils.clip_grad_norm_, opt.clip_grad_norm or max_grad_norm=).")
    return original(params, clip_value, foreach)


_WRAPPERS = {"get_total_norm": get_total_norm, "clip_grads_with_norm_": clip_grads_with_norm_,
             "clip_grad_value_": clip_grad_value_}


# ====================================================================== install / uninstall
def installed() -> bool:
    """torch's functions are wrapped now."""
    return bool(_replaced)


class GradClasses:
    """Switches one optimizer's params between their own class and the ``.grad``-reading subclass
    of it (see the module docstring): ``show(True)`` when the optimizer starts holding grads,
    ``show(False)`` when ``zero_grad`` drops them (its step cycle calls it). Only the params the
    optimizer still owns (param_tags.py: a newer optimizer built over a param takes it), and only
    until :func:`uninstall`."""

    def __init__(self, pairs: List[Tuple[Tensor, type, type]], owner: object) -> None:
        self._pairs = pairs  # (param, its own class, the subclass showing the optimizer's grads)
        self._owner = owner
        self._epoch = _epoch
        self._generation = -1
        self._owned: List[Tuple[Tensor, type, type]] = []

    def show(self, held: bool) -> None:
        if self._epoch != _epoch:
            return  # uninstalled: the params keep their own classes
        if self._generation != param_tags.generation():
            self._generation = param_tags.generation()
            self._owned = [t for t in self._pairs if param_tags.owner_token(t[0]) is self._owner]
        if held:
            for p, own, shown in self._owned:
                if type(p) is own:  # a class set since by someone else stays
                    p.__class__ = shown
        else:
            for p, own, shown in self._owned:
                if type(p) is shown:
                    p.__class__ = own


def install(opt: Any, params: Sequence[Tensor], owner: object) -> GradClasses:
    """At ``opt``'s construction: wrap torch's functions (once) and return the switch of its
    ``params``' classes (``owner``: its grad sync's owner token). The params keep their own
    classes until the optimizer holds grads (``config``'s ``switch_param_class`` off: they take
    the showing class now and keep it, and the switch moves nothing). Undone when the last
    DistributedFusedAdam is garbage-collected."""
    token = object()  # first: a collection of the last other optimizer meanwhile must not uninstall
    _live.add(token)
    weakref.finalize(opt, _released, token)
    _wrap_torch()
    switch = config.settings().switch_param_class
    refused = []
    pairs = []
    for i, p in enumerate(params):
        own = getattr(type(p), "_shardamp_grad_base", None) or type(p)
        shown = _compat.grad_property_class(own, _grad_of_managed, _set_grad_of_managed)
        # switched there (and back) now: a class Python refuses is named here, not at a backward
        if _compat.switch_class(p, shown) and (not switch or _compat.switch_class(p, own)):
            _switched[id(p)] = weakref.ref(p, functools.partial(_forget_switched, id(p)))
            pairs.append((p, own, shown))
        else:
            refused.append(f"{i} ({type(p).__qualname__})")
    if refused:
        warnings.warn(
            f"DistributedFusedAdam: the class of params {', '.join(refused[:5])} cannot take the .grad that shows "
            "the optimizer's grads (another memory layout): their p.grad stays None, so torch's tools reading it "
            "see nothing there. Use opt.clip_grad_norm / shardamp.optim.clip_grad_norm_, opt.grad_norm, "
            "opt.full_grad(p) for them.", UserWarning, stacklevel=3)
    return GradClasses(pairs if switch else [], owner)


def _forget_switched(key: int, ref: "weakref.ref[Tensor]") -> None:
    if _switched.get(key) is ref:  # a param switched since under the same id keeps its entry
        del _switched[key]


def _released(token: object) -> None:
    _live.discard(token)
    if not _live:
        uninstall()


def _wrap_torch() -> None:
    for name, places in _compat.torch_clip_functions().items():
        wrapper = _WRAPPERS[name]
        for module, attr in places:  # the first place is the one torch's clip_grad_norm_ calls
            current = getattr(module, attr)
            if current is wrapper:
                continue  # idempotent
            _replaced[(module, attr)] = current
            if name not in _originals:
                _originals[name] = current
                functools.update_wrapper(wrapper, current)  # torch's name and docstring
            setattr(module, attr, wrapper)


def uninstall() -> None:
    """Give torch its functions back (each only where it is still shardamp's wrapper) and the
    switched params their classes. Managed params then show ``param.grad`` None again (an
    optimizer built later installs again)."""
    global _epoch
    _epoch += 1  # the live optimizers' GradClasses switch nothing from here on
    for name, places in _compat.torch_clip_functions().items():
        for module, attr in places:
            if getattr(module, attr) is _WRAPPERS[name] and (module, attr) in _replaced:
                setattr(module, attr, _replaced[(module, attr)])
    _replaced.clear()
    for ref in list(_switched.values()):
        p = ref()
        base = getattr(type(p), "_shardamp_grad_base", None) if p is not None else None
        if base is not None:
            _compat.switch_class(p, base)
    _switched.clear()


__all__ = ["ShardedGrad", "GradClasses", "install", "uninstall", "installed", "get_total_norm", "clip_grads_with_norm_",
           "clip_grad_value_"]
