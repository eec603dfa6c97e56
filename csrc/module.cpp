// The extension module's entry point, compiled for each module (TORCH_EXTENSION_NAME names it).
// Everything it holds is registered by binding.cpp, binding_blockwise.cpp and grad_parts.cpp, whose objects (with
// grad_stager.cpp's and land_grads.cpp's, none of them vectorized by hand) the CPU modules of an
// ahead-of-time build share: setup.py compiles them once, not once per vector ISA.
#include <pybind11/pybind11.h>

namespace shardamp {
void register_bindings(pybind11::module_& m);  // binding.cpp
void register_blockwise(pybind11::module_& m);  // binding_blockwise.cpp
void register_grad_parts(pybind11::module_& m);  // grad_parts.cpp
}  // namespace shardamp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  shardamp::register_bindings(m);
  shardamp::register_blockwise(m);
  shardamp::register_grad_parts(m);
}
