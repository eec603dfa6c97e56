"""The documentation is checked like code:

* every public class, function and method of shardamp's public modules has a docstring of its
  own (not one inherited from torch), and ``DistributedFusedAdam`` documents every constructor
  argument in its ``Args:`` section;
* the site builds with ``mkdocs build --strict`` (broken links and anchors fail it);
* every ```python block of README.md and docs/*.md runs (tests/doc_snippets.py says how each
  kind of block runs and how a block is marked).
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest
import torch

import doc_snippets

ROOT = Path(__file__).resolve().parents[1]

# The modules users import; their __all__ (or, without one, the public names defined in them)
# is the public API. The integrations are checked where their framework is installed.
PUBLIC_MODULES = (
    "shardamp.optim",
    "shardamp.optim.config",
    "shardamp.optim.checkpoint",
    "shardamp.scaler",
    "shardamp.integrations",
    "shardamp.integrations.lightning",
    "shardamp.integrations.accelerate",
    "shardamp.integrations.transformers",
)
FRAMEWORK_OF = {
    "shardamp.integrations.lightning": "lightning",
    "shardamp.integrations.accelerate": "accelerate",
    "shardamp.integrations.transformers": "transformers",
}


# ====================================================================== (a) docstrings
def _public_objects(module_name: str) -> Iterator[Tuple[str, object]]:
    framework = FRAMEWORK_OF.get(module_name)
    if framework is not None:
        pytest.importorskip(framework, reason=f"{framework} is not installed (pip install -e '.[integrations]')")
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, obj in vars(module).items()
                 if not n.startswith("_") and getattr(obj, "__module__", None) == module_name]
    for name in names:
        obj = getattr(module, name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__.startswith("shardamp."):
            yield f"{module_name}.{name}", obj


def _own_members(cls: type) -> Iterator[Tuple[str, object]]:
    """Methods and properties a shardamp class defines itself or inherits from a shardamp base
    (e.g. DistributedFusedAdam's reading half, optim/reads.py), not those of torch's bases."""
    seen = set()
    for klass in cls.__mro__:
        if klass is not cls and not klass.__module__.startswith("shardamp"):
            continue
        for name, value in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            yield from _member(name, value)


def _member(name: str, value: object) -> Iterator[Tuple[str, object]]:
    if name.startswith("_"):
        return
    if isinstance(value, property):
        yield name, value  # its doc: the getter's, or the one given to property()
    elif isinstance(value, (staticmethod, classmethod)):
        yield name, value.__func__
    elif inspect.isfunction(value):
        yield name, value


def _undocumented(module_name: str) -> List[str]:
    missing = []
    for qualname, obj in _public_objects(module_name):
        if inspect.isclass(obj):
            if not (vars(obj).get("__doc__") or "").strip():  # its own, not a base class's
                missing.append(f"{qualname} (class docstring)")
            for name, member in _own_members(obj):
                if not (getattr(member, "__doc__", None) or "").strip():
                    missing.append(f"{qualname}.{name}")
        elif not (obj.__doc__ or "").strip():
            missing.append(qualname)
    return missing


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_api_has_docstrings(module_name: str) -> None:
    missing = _undocumented(module_name)
    assert not missing, f"public names without a docstring of their own in {module_name}: {missing}"


def test_the_docstring_check_can_fail() -> None:
    class Undocumented(torch.optim.Optimizer):
        def state_dict(self):
            return super().state_dict()

    assert not vars(Undocumented).get("__doc__")  # torch's Optimizer docstring does not count
    assert [n for n, m in _own_members(Undocumented) if not m.__doc__] == ["state_dict"]


def _args_section(doc: str) -> List[str]:
    """Argument names listed in a Google-style ``Args:`` section."""
    match = re.search(r"^Args:\n(.*?)(?=^\S|\Z)", doc, re.M | re.S)
    assert match, "no Args: section"
    return re.findall(r"^    (\*{0,2}\w+)(?: \([^)]*\))?:", match.group(1), re.M)


def test_sharded_grad_scaler_has_its_own_docstring() -> None:
    from shardamp.scaler import ShardedGradScaler

    own = vars(ShardedGradScaler).get("__doc__") or ""
    assert own.strip() and own != torch.amp.GradScaler.__doc__
    doc = inspect.cleandoc(own)
    params = [p for p in inspect.signature(ShardedGradScaler.__init__).parameters if p != "self"]
    assert _args_section(doc) == params
    assert "Raises:" in doc


def test_distributed_fused_adam_documents_every_argument() -> None:
    from shardamp.optim import DistributedFusedAdam

    doc = inspect.cleandoc(vars(DistributedFusedAdam)["__doc__"])
    params = [p for p in inspect.signature(DistributedFusedAdam.__init__).parameters if p != "self"]
    assert _args_section(doc) == params, "Args: must list every constructor argument, in order"
    assert "Raises:" in doc
    for method in ("add_param_group", "state_dict", "load_state_dict"):
        # shardamp's own, not torch.optim.Optimizer's
        assert getattr(DistributedFusedAdam, method).__module__.startswith("shardamp."), method
        text = getattr(DistributedFusedAdam, method).__doc__ or ""  # defined here or in optim/reads.py
        assert "Raises:" in text, f"DistributedFusedAdam.{method} must say what it raises"
    for method in ("state_dict", "load_state_dict"):
        assert "collective" in getattr(DistributedFusedAdam, method).__doc__


# ====================================================================== (b) the site builds
def test_site_builds_strict(tmp_path: Path) -> None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs toolchain is not installed: "
                            "pip install mkdocs mkdocs-material 'mkdocstrings[python]' (tests/run_tests.sh does)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert (tmp_path / "site" / "api" / "optim" / "index.html").exists()


def test_strict_build_rejects_a_broken_link(tmp_path: Path) -> None:
    """The validation settings make a link to a missing page fail the build."""
    pytest.importorskip("mkdocs", reason="the docs toolchain is not installed")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[gone](nowhere.md) and [anchor](#no-such-heading)\n")
    config = (ROOT / "mkdocs.yml").read_text()
    config = re.sub(r"(?ms)^plugins:.*?(?=^\S)", "plugins:\n  - search\n\n", config)
    config = re.sub(r"(?ms)^hooks:.*?(?=^\S)", "", config)
    config = re.sub(r"(?ms)^nav:.*", "", config)
    (tmp_path / "mkdocs.yml").write_text(config)
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert run.returncode != 0
    assert "nowhere.md" in run.stderr + run.stdout


# ====================================================================== (c) every snippet runs
SNIPPETS = doc_snippets.all_snippets()


def test_snippets_are_found_and_fragments_are_rare() -> None:
    modes = [s.mode for s in SNIPPETS]
    assert modes.count("script") + modes.count("2 ranks") >= 20, "the docs should show runnable code"
    assert modes.count("fragment") <= max(3, len(SNIPPETS) // 10), \
        [s.name for s in SNIPPETS if s.mode == "fragment"]


def _clean_env() -> dict:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a block runs as its own job, even when pytest itself runs under torchrun
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


_TWO_RANKS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from dist_helper import run_distributed
    from doc_snippets import run_on_rank

    if __name__ == "__main__":  # the ranks are spawned: they import this file again
        run_distributed(run_on_rank, 2, open({code!r}).read(), {workdir!r}, timeout=540.0, pg_timeout=300.0)
""")


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.name for s in SNIPPETS])
def test_snippet_runs(snippet: doc_snippets.Snippet, tmp_path: Path) -> None:
    if snippet.mode == "fragment":
        pytest.skip("a fragment (marked <!-- snippet: fragment -->)")
    if snippet.mode == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (marked <!-- snippet: gpu -->)")
    code = tmp_path / "snippet.py"
    code.write_text(snippet.code)
    workdir = tmp_path / "work"
    workdir.mkdir()
    if snippet.mode == "2 ranks":
        driver = tmp_path / "driver.py"
        driver.write_text(_TWO_RANKS.format(tests=str(Path(__file__).parent), code=str(code), workdir=str(workdir)))
        args = [sys.executable, str(driver)]
    else:
        args = [sys.executable, str(code)]
    run = subprocess.run(args, cwd=workdir, capture_output=True, text=True, timeout=600, env=_clean_env())
    assert run.returncode == 0, f"{snippet.name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
