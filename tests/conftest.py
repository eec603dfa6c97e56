import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# A private kernel-build directory (spawned ranks inherit it): never a cache shared with other
# checkouts, whose stale locks or other kernel sources could stall or confuse this run.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "torch_extensions")
)


# Modules whose single tests run for minutes (a wheel build, the docs site and its snippets): run
# first, so the other worker takes the many short tests meanwhile and both end together.
SLOW_FIRST = ("test_wheel", "test_docs")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests that share one spawned process group (same module, same world size) must run on
    the same xdist worker, or each worker would spawn the group again; the slowest modules are
    scheduled first. First among the plugins' hooks: pytest-xdist's own turns the group marks into
    the node ids ``--dist loadgroup`` schedules by, so a mark added after it is ignored."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "world" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}-w{callspec.params['world']}"))
    items.sort(key=lambda item: 0 if item.module.__name__ in SLOW_FIRST else 1)  # stable: order kept otherwise


def set_env(monkeypatch, name: str, value: str):
    """Set a ``SHARDAMP_*`` variable for this test and re-read the settings (they are read once
    per process: shardamp.optim.config). A malformed value raises here, naming the variable."""
    from shardamp.optim import config

    monkeypatch.setenv(name, value)
    return config.reload()


@pytest.fixture(autouse=True)
def _settings_follow_the_environment():
    """Each test starts and ends with the settings read from the environment it sees (autouse:
    set up before, so torn down after, a test's monkeypatch restores the environment)."""
    from shardamp.optim import config

    config.reload()
    yield
    config.reload()
