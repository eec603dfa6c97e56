"""Which DistributedFusedAdam manages a param: the last one built over it, its grad sync and that
grad sync's owner token (the grad hooks of an older optimizer over the param stand aside).

Kept in a table beside the params, keyed by ``id(param)`` and dropped when the param is
collected, not in the params' ``__dict__``: a managed param has its own class while its optimizer
holds no grads (torch_tools.py), and whatever its ``__dict__`` holds is what pickle,
``torch.save(model)`` and ``copy`` see, as for any param. A copy of a param is not managed
(another id), as a param torch's optimizers never saw is not.

``generation()`` changes whenever a param changes hands (a newer optimizer built over it): what
caches the params an optimizer still owns refreshes then.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional

from torch import Tensor


class Tag:
    """What is known of one managed param: ``optimizer`` and ``grad_sync`` (weak references,
    called for the object or None) and ``owner`` (the grad sync's token)."""

    __slots__ = ("optimizer", "grad_sync", "owner")

    def __init__(self) -> None:
        self.optimizer: Callable[[], Optional[Any]] = _none
        self.grad_sync: Callable[[], Optional[Any]] = _none
        self.owner: Optional[object] = None


def _none() -> None:
    return None


_TAGS: Dict[int, Tag] = {}
_generation = 0

# the tag of the param of this id, or None: one C call, for readers that run per param
by_id: Callable[[int], Optional[Tag]] = _TAGS.get


def get(p: Tensor) -> Optional[Tag]:
    """``p``'s tag, or None (no DistributedFusedAdam was built over it)."""
    return _TAGS.get(id(p))


def owner_token(p: Tensor) -> Optional[object]:
    """The owner token of the grad sync that manages ``p`` now, or None."""
    tag = _TAGS.get(id(p))
    return tag.owner if tag is not None else None


def _tag(p: Tensor) -> Tag:
    tag = _TAGS.get(id(p))
    if tag is None:
        tag = _TAGS[id(p)] = Tag()
        weakref.finalize(p, _TAGS.pop, id(p), None)  # before the id can be reused
    return tag


def manage(p: Tensor, optimizer: Any) -> None:
    """``optimizer`` is the last DistributedFusedAdam built over ``p`` (held weakly)."""
    _tag(p).optimizer = weakref.ref(optimizer)


def own(p: Tensor, grad_sync: Any, token: object) -> Optional[Any]:
    """``grad_sync`` (held weakly; ``token``: its owner token) takes ``p``'s grads over. Returns
    the grad sync that owned them before, if it is alive, for it to stand aside."""
    global _generation
    tag = _tag(p)
    older, changed = tag.grad_sync(), tag.owner is not None and tag.owner is not token
    tag.grad_sync, tag.owner = weakref.ref(grad_sync), token
    if changed:  # after the owner is written: a cache refreshed at this generation sees it
        _generation += 1
    return older


def generation() -> int:
    """Changes whenever a managed param changes hands."""
    return _generation


__all__ = ["Tag", "by_id", "get", "owner_token", "manage", "own", "generation"]
