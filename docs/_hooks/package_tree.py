"""mkdocs hook: lay out the ``shardamp`` package for mkdocstrings' static analysis.

The repository keeps the package's parts at its top level (``optim/`` is installed as
``shardamp.optim``, ``scaler/`` as ``shardamp.scaler`` ...: see setup.py's ``package_dir``), so no
directory is named ``shardamp``. mkdocstrings (griffe) reads the sources without importing them
when it finds the package on its search path, so this hook builds ``build/docs-src/shardamp/``
out of symlinks to those directories, and mkdocs.yml points the handler's ``paths`` there. Nothing
is imported: the build needs neither the kernels nor the frameworks, and it never reads an
installed copy that may be older than the checkout.
"""
from __future__ import annotations

import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TREE = os.path.join(ROOT, "build", "docs-src")
PARTS = ("optim", "scaler", "integrations", "csrc")  # shardamp.<part> <- <root>/<part>


def build_tree() -> str:
    package = os.path.join(TREE, "shardamp")
    shutil.rmtree(TREE, ignore_errors=True)
    os.makedirs(package)
    own = os.path.join(ROOT, "shardamp")  # a top-level package of its own, where there is one
    if os.path.isdir(own):
        for entry in os.listdir(own):
            if entry != "__pycache__":
                os.symlink(os.path.join(own, entry), os.path.join(package, entry))
    for part in PARTS:
        source, link = os.path.join(ROOT, part), os.path.join(package, part)
        if os.path.isdir(source) and not os.path.lexists(link):
            os.symlink(source, link)
    init = os.path.join(package, "__init__.py")
    if not os.path.lexists(init):
        # a regular package, not a namespace one: griffe prefers any regular ``shardamp`` found on
        # sys.path (an installed or editable copy, maybe of other sources) over a namespace package
        open(init, "w").close()
    return TREE


build_tree()
