import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# A private kernel-build directory (spawned ranks inherit it): never a cache shared with other
# checkouts, whose stale locks or other kernel sources could stall or confuse this run.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "torch_extensions")
)


def pytest_collection_modifyitems(config, items):
    """Tests that share one spawned process group (same module, same world size) must run on
    the same xdist worker, or each worker would spawn the group again."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "world" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}-w{callspec.params['world']}"))
