// Registers the transfer pipeline on banaserve._C (called from csrc/bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace banaserve::transfer {

void register_transfer(pybind11::module_& m);

}  // namespace banaserve::transfer
