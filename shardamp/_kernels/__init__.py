"""Kernels prebuilt into the package (``SHARDAMP_BUILD_KERNELS=1 pip install
--no-build-isolation .``): the extension modules and ``build_info.json`` land here. Empty in a
plain install, where the kernels are built just in time (:mod:`shardamp.optim.kernels`)."""
