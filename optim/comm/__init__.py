"""The collectives: the one place that talks to torch.distributed (``collectives.py``: ``Comm``),
ranks whose collectives do not line up (``order.py``: bounded waits, the error naming each
rank's position) and the watchdog where the host never waits (``watchdog.py``)."""
from .collectives import Comm, all_reduce_max, make_comm

__all__ = ["Comm", "make_comm", "all_reduce_max"]
