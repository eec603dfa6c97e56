"""Backward and after the step: where grads wait and land (``grad_stager.py``), bucket readiness
and the reduce-scatters in fixed order (``grad_sync.py``, its state in ``grad_state.py``), one
order of reductions for several optimizers over a group (``backward_order.py``), the param
all-gather (``param_sync.py``) and the guard against reading params still in flight
(``stale_read_guard.py``)."""
