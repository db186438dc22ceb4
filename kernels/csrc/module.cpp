// The one CPU extension: every C++ kernel registers its functions here.
#include <torch/extension.h>

void register_attention(pybind11::module& m);
void register_quant(pybind11::module& m);
void register_ops(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_attention(m);
  register_quant(m);
  register_ops(m);
}
