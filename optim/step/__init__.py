"""One step's protocol: the one stats all-reduce and the scalars from it (``grad_stats.py``),
the step round (``step_round.py``: norms, unscale, clips, the grad coefficient) and
``torch.amp.GradScaler`` handing itself to ``step`` (``torch_scaler.py``)."""
