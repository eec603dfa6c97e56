"""Just-in-time build of the csrc/ kernels (placeholder until the kernels land)."""


def load_extension(cuda: bool):
    raise RuntimeError("the native kernels are not part of this build yet")
