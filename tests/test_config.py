"""shardamp.optim.config: every SHARDAMP_* variable parsed once into one frozen dataclass; an
explicit value beats the environment, which beats the default; malformed values name the variable."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import set_env

from shardamp.optim import config
from shardamp.optim.kernels import dispatch


def test_defaults_without_environment() -> None:
    s = config.from_environment({})
    assert s == config.Settings()
    assert (s.kernels, s.prebuilt, s.collective_timeout, s.collective_watchdog) == ("auto", True, None, "on")
    assert s.async_grad_release is True and s.python_grad_hooks is False and s.cuda_chunk == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.kernels = "native"  # type: ignore[misc]


@pytest.mark.parametrize("var, raw, field, value", [
    ("SHARDAMP_KERNELS", "Reference", "kernels", "reference"),
    ("SHARDAMP_PREBUILT", "0", "prebuilt", False),
    ("SHARDAMP_CUDA_ARCH", "8.0;9.0+PTX", "cuda_arch", "8.0;9.0+PTX"),
    ("SHARDAMP_CPU_CAPABILITY", "AVX2", "cpu_capability", "avx2"),
    ("SHARDAMP_BUILD_VERBOSE", "1", "build_verbose", True),
    ("SHARDAMP_CUDA_CHUNK", "8192", "cuda_chunk", 8192),
    ("SHARDAMP_CUDA_STEP", "1x4", "cuda_step", "1x4"),
    ("SHARDAMP_COLLECTIVE_TIMEOUT", "2.5", "collective_timeout", 2.5),
    ("SHARDAMP_COLLECTIVE_WATCHDOG", "force", "collective_watchdog", "force"),
    ("SHARDAMP_PYTHON_GRAD_HOOKS", "1", "python_grad_hooks", True),
    ("SHARDAMP_ASYNC_GRAD_RELEASE", "0", "async_grad_release", False),
    ("SHARDAMP_COPY_GRADS", "1", "copy_grads", True),
])
def test_each_variable_parses_into_its_field(var, raw, field, value) -> None:
    assert getattr(config.from_environment({var: raw}), field) == value
    assert config.VARIABLES[var][0] == field


@pytest.mark.parametrize("var, raw", [
    ("SHARDAMP_KERNELS", "fast"), ("SHARDAMP_PREBUILT", "maybe"), ("SHARDAMP_CUDA_CHUNK", "4k"),
    ("SHARDAMP_COLLECTIVE_TIMEOUT", "-1"), ("SHARDAMP_COLLECTIVE_TIMEOUT", "inf"),
    ("SHARDAMP_COLLECTIVE_WATCHDOG", "yes"), ("SHARDAMP_CPU_CAPABILITY", "sse9"), ("SHARDAMP_CUDA_STEP", "9x9"),
])
def test_malformed_values_name_the_variable(var, raw) -> None:
    with pytest.raises(ValueError, match=var):
        config.from_environment({var: raw})


def test_read_once_then_reload(monkeypatch) -> None:
    set_env(monkeypatch, "SHARDAMP_COLLECTIVE_TIMEOUT", "3")
    assert config.settings().collective_timeout == 3.0
    monkeypatch.setenv("SHARDAMP_COLLECTIVE_TIMEOUT", "7")
    assert config.settings().collective_timeout == 3.0  # not read again
    assert config.reload().collective_timeout == 7.0


def test_explicit_beats_environment_beats_default(monkeypatch) -> None:
    set_env(monkeypatch, "SHARDAMP_COLLECTIVE_TIMEOUT", "3")
    try:
        assert config.configure(collective_timeout=11.0).collective_timeout == 11.0
        assert config.reload().collective_timeout == 11.0  # an explicit value survives a reload
        assert config.explicit() == {"collective_timeout": 11.0}
        assert config.configure(collective_timeout=None).collective_timeout == 3.0  # back to the env
        monkeypatch.delenv("SHARDAMP_COLLECTIVE_TIMEOUT")
        assert config.reload().collective_timeout is None  # the default
    finally:
        config.configure(collective_timeout=None)


def test_configure_validates_and_rejects_unknown_names() -> None:
    with pytest.raises(TypeError, match="unknown setting 'timeout'"):
        config.configure(timeout=3)
    with pytest.raises(ValueError, match="collective_watchdog"):
        config.configure(collective_watchdog="sometimes")
    assert "collective_watchdog" not in config.explicit()


def test_async_release_reaches_loaded_extensions(monkeypatch) -> None:
    """configure(async_grad_release=...) is pushed into every loaded extension at once (what users
    called ``native_module(device).set_async_release`` for)."""
    calls = []

    class FakeExt:
        def set_async_release(self, on: bool) -> None:
            calls.append(on)

    monkeypatch.setattr(dispatch, "_native_cache", {"fake": FakeExt()})
    try:
        config.configure(async_grad_release=False)
        config.configure(async_grad_release=True)
    finally:
        config.configure(async_grad_release=None)
    assert calls[:2] == [False, True]


def test_settings_reach_their_users(monkeypatch) -> None:
    from shardamp.optim.comm import order, watchdog
    from shardamp.optim.sync import grad_stager

    set_env(monkeypatch, "SHARDAMP_COLLECTIVE_TIMEOUT", "4.5")
    set_env(monkeypatch, "SHARDAMP_COLLECTIVE_WATCHDOG", "0")
    set_env(monkeypatch, "SHARDAMP_PYTHON_GRAD_HOOKS", "1")
    set_env(monkeypatch, "SHARDAMP_KERNELS", "reference")
    assert order.collective_timeout() == 4.5 and watchdog.mode() == "off"
    assert grad_stager._python_hooks_forced() and dispatch.requested_backend() == "reference"
