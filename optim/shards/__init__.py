"""The flat tensors of each bucket and the model params as views into them (``buffers.py``),
and the narrow view state-dict and checkpoint code read the optimizer through (``view.py``)."""
