"""One step's cycle and protocol: its phase and counters (``cycle.py``), the one stats all-reduce
and the scalars from it (``grad_stats.py``), the step round's norms, unscale and clips
(``step_round.py``), the step's health (``health.py``) and ``torch.amp.GradScaler`` handing itself
to ``step`` (``torch_scaler.py``)."""
