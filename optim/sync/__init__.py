"""Backward and after the step: where grads wait and land (``grad_stager.py``), bucket readiness
and the reduce-scatters in fixed order (``grad_sync.py``), the param all-gather
(``param_sync.py``) and the guard against reading params still in flight
(``stale_read_guard.py``)."""
