// Registers the partial-attention functions on banaserve._C; called from csrc/bindings.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace banaserve::attention {

void register_attention(pybind11::module_& m);

}  // namespace banaserve::attention
