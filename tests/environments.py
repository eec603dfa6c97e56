"""A fresh virtual environment that sees the packages of the interpreter running the tests.

A test that installs something (tests/test_wheel.py: the built wheel) needs an environment of its
own in which torch and the test dependencies still import, wherever the running interpreter got
them, and without downloading anything. ``python -m venv --system-site-packages`` does not give
that: a venv's "system" site-packages are always those of the BASE interpreter (a venv made from
a venv's python points at the installation that venv was made from, ``home`` in pyvenv.cfg), so
when the tests run in a venv, or a venv nested in one, the torch installed there is invisible.

Instead the new venv gets a ``.pth`` file naming the directories the running interpreter imports
installed packages from, read from a fresh process of it: its site-packages (a venv's and, with
``--system-site-packages``, its base's), the user site of ``pip install --user``, PYTHONPATH when
the caller's environment has it, directories other ``.pth`` files add (a ``pip install -e`` of
torch), a venv made inside the checkout. ``site`` appends a ``.pth`` file's directories after the
site-packages holding it, so whatever is installed into the new venv wins over the same package
outside. Only directories are carried: the outer ``.pth`` files are not run, so an outer editable
install of shardamp (an import hook) stays out, and no directory of the source tree is carried.
The venv is made without pip: its ``python -m pip`` is the outer pip, which installs into the venv
it runs in (and needs no ensurepip, which some distributions' pythons lack).

Conda (not tested here): a conda environment is a full installation (its ``sys.prefix`` is its
own base, so even ``--system-site-packages`` would have worked from it, though not from a venv
made from its python); the ``.pth`` names its ``lib/pythonX.Y/site-packages`` as for any system
interpreter, and ``conda develop`` paths (``conda.pth``) as directories. Conda's torch finds its
shared libraries (MKL, OpenMP, libstdc++) through RPATHs relative to its own files, not through
``sys.prefix``, so it loads from the new venv too; what ``conda activate`` scripts set (e.g.
``CUDA_HOME``) reaches the new venv's processes through the environment the tests pass on.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

_SYS_PATH = "import json, sys; print(json.dumps(sys.path))"


def _import_dirs(python: str, env: Dict[str, str], cwd: Path) -> List[str]:
    """The directories on a fresh ``python``'s sys.path, in order (``-c``'s cwd entry left out)."""
    run = subprocess.run([python, "-c", _SYS_PATH], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    assert run.returncode == 0, f"{python} -c 'print(sys.path)' failed:\n{run.stderr[-3000:]}"
    return [os.path.realpath(p) for p in json.loads(run.stdout)[1:] if p and os.path.isdir(p)]


def _in_tree(path: Path, tree: Path) -> bool:
    """Whether ``path`` is part of the source tree ``tree``: inside it and not inside a virtual
    environment made there (``python3 -m venv venv`` in a clone)."""
    tree = Path(os.path.realpath(tree))
    if path != tree and tree not in path.parents:
        return False
    return not any((folder / "pyvenv.cfg").is_file() for folder in [path, *path.parents] if tree in folder.parents)


def venv_seeing_this_environment(dest: Path, exclude: Path, env: Optional[Dict[str, str]] = None) -> Path:
    """Make a venv at ``dest`` that sees this interpreter's installed packages after its own.

    Args:
        dest: where the venv goes (must not exist).
        exclude: a source tree none of whose directories the venv may see (a venv inside it
            excepted: that is an environment, not source).
        env: the environment to read this interpreter's import directories under (PYTHONPATH
            counts); ``os.environ`` if None.

    Returns:
        The venv's python.
    """
    env = dict(os.environ if env is None else env)
    run = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, f"python -m venv {dest} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    python = dest / "bin" / "python"
    cwd = dest.parent  # no source tree on -c's path
    own = _import_dirs(str(python), env, cwd)
    outer = [p for p in _import_dirs(sys.executable, env, cwd) if p not in own and not _in_tree(Path(p), exclude)]
    site_packages = next(p for p in own if p.startswith(os.path.realpath(dest) + os.sep) and p.endswith("-packages"))
    Path(site_packages, "outer_environment.pth").write_text("".join(p + "\n" for p in outer))
    return python
