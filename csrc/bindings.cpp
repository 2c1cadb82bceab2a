// The banaserve._C module. Nothing here touches CUDA at import time: the module must load on
// machines without an NVIDIA driver even when the CUDA kernels are compiled in.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "attention/bindings_attention.h"
#include "attention/merge_attn_states.h"
#include "common/cuda_info.h"
#include "transfer/bindings_transfer.h"

namespace py = pybind11;
using banaserve::Half;
using banaserve::attention::CudaMergeArgs;
using banaserve::attention::MergeShape;
using banaserve::attention::ScalarType;

namespace {

enum class HostType { kFloat16, kFloat32, kFloat64 };

HostType host_type(const py::array& a, const char* name, bool allow_half) {
  const py::dtype dt = a.dtype();
  const bool native = dt.byteorder() == '=' || dt.byteorder() == '|';
  if (dt.kind() == 'f' && native) {
    if (dt.itemsize() == 4) return HostType::kFloat32;
    if (dt.itemsize() == 8) return HostType::kFloat64;
    if (dt.itemsize() == 2 && allow_half) return HostType::kFloat16;
  }
  throw py::type_error(std::string(name) + ": unsupported dtype " +
                       py::str(dt).cast<std::string>() +
                       (allow_half ? " (need float16, float32 or float64 in native byte order)"
                                   : " (need float32 or float64 in native byte order)"));
}

void require_c_contiguous(const py::array& a, const char* name) {
  const bool aligned = reinterpret_cast<std::uintptr_t>(a.data()) % a.itemsize() == 0;
  if (!(a.flags() & py::array::c_style) || !aligned) {
    throw py::value_error(std::string(name) + " must be an aligned C-contiguous array");
  }
}

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

MergeShape check_shapes(const py::array& out_a, const py::array& lse_a, const py::array& out_b,
                        const py::array& lse_b) {
  if (out_a.ndim() != 3) {
    throw py::value_error("out_a must have shape [tokens, heads, head_dim], got " +
                          shape_str(out_a));
  }
  const MergeShape s{out_a.shape(0), out_a.shape(1), out_a.shape(2)};
  const bool out_b_ok = out_b.ndim() == 3 && out_b.shape(0) == s.tokens &&
                        out_b.shape(1) == s.heads && out_b.shape(2) == s.head_dim;
  if (!out_b_ok) {
    throw py::value_error("out_b shape " + shape_str(out_b) + " != out_a shape " +
                          shape_str(out_a));
  }
  for (const auto& [lse, name] : {std::pair{&lse_a, "lse_a"}, std::pair{&lse_b, "lse_b"}}) {
    if (lse->ndim() != 2 || lse->shape(0) != s.tokens || lse->shape(1) != s.heads) {
      throw py::value_error(std::string(name) + " must have shape [tokens, heads] = (" +
                            std::to_string(s.tokens) + ", " + std::to_string(s.heads) +
                            "), got " + shape_str(*lse));
    }
  }
  return s;
}

template <typename T, typename L>
void run_cpu(const py::array& out_a, const py::array& lse_a, const py::array& out_b,
             const py::array& lse_b, py::array& out, py::array& lse, MergeShape shape) {
  const auto* oa = static_cast<const T*>(out_a.data());
  const auto* la = static_cast<const L*>(lse_a.data());
  const auto* ob = static_cast<const T*>(out_b.data());
  const auto* lb = static_cast<const L*>(lse_b.data());
  auto* o = static_cast<T*>(out.mutable_data());
  auto* l = static_cast<L*>(lse.mutable_data());
  py::gil_scoped_release release;
  banaserve::attention::merge_attn_states_cpu<T, L>(oa, la, ob, lb, o, l, shape);
}

template <typename L>
void run_cpu_for_lse(HostType t, const py::array& out_a, const py::array& lse_a,
                     const py::array& out_b, const py::array& lse_b, py::array& out,
                     py::array& lse, MergeShape shape) {
  switch (t) {
    case HostType::kFloat16:
      return run_cpu<Half, L>(out_a, lse_a, out_b, lse_b, out, lse, shape);
    case HostType::kFloat32:
      return run_cpu<float, L>(out_a, lse_a, out_b, lse_b, out, lse, shape);
    case HostType::kFloat64:
      return run_cpu<double, L>(out_a, lse_a, out_b, lse_b, out, lse, shape);
  }
}

py::tuple merge_attn_states_cpu(const py::array& out_a, const py::array& lse_a,
                                const py::array& out_b, const py::array& lse_b) {
  const MergeShape shape = check_shapes(out_a, lse_a, out_b, lse_b);
  const HostType t = host_type(out_a, "out_a", true);
  if (host_type(out_b, "out_b", true) != t) throw py::type_error("out_a and out_b dtypes differ");
  const HostType lt = host_type(lse_a, "lse_a", false);
  if (host_type(lse_b, "lse_b", false) != lt) throw py::type_error("lse_a and lse_b dtypes differ");
  for (const auto& [a, name] : {std::pair{&out_a, "out_a"}, std::pair{&lse_a, "lse_a"},
                                std::pair{&out_b, "out_b"}, std::pair{&lse_b, "lse_b"}}) {
    require_c_contiguous(*a, name);
  }

  py::array out(out_a.dtype(), {shape.tokens, shape.heads, shape.head_dim});
  py::array lse(lse_a.dtype(), {shape.tokens, shape.heads});
  if (lt == HostType::kFloat32) {
    run_cpu_for_lse<float>(t, out_a, lse_a, out_b, lse_b, out, lse, shape);
  } else {
    run_cpu_for_lse<double>(t, out_a, lse_a, out_b, lse_b, out, lse, shape);
  }
  return py::make_tuple(out, lse);
}

void merge_attn_states_cuda(std::uintptr_t out, std::uintptr_t lse, std::uintptr_t out_a,
                            std::uintptr_t lse_a, std::uintptr_t out_b, std::uintptr_t lse_b,
                            std::int64_t tokens, std::int64_t heads, std::int64_t head_dim,
                            ScalarType dtype, int device, std::uintptr_t stream) {
  const CudaMergeArgs args{out,   lse,   out_a, lse_a, out_b, lse_b, {tokens, heads, head_dim},
                           dtype, device, stream};
#ifdef BANASERVE_WITH_CUDA
  py::gil_scoped_release release;
  banaserve::attention::merge_attn_states_cuda(args);
#else
  (void)args;
  throw std::runtime_error("banaserve._C was built without CUDA (BANASERVE_CUDA=OFF or no nvcc)");
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "BanaServe native kernels: CPU always, CUDA when compiled in (see cuda_compiled()).";

  m.def(
      "cuda_compiled",
      [] {
#ifdef BANASERVE_WITH_CUDA
        return true;
#else
        return false;
#endif
      },
      "True when the CUDA kernels were compiled into this module; says nothing about a device.");
  m.def(
      "cuda_device_count",
      [] {
#ifdef BANASERVE_WITH_CUDA
        return banaserve::cuda_device_count();
#else
        return 0;
#endif
      },
      "Usable CUDA devices; 0 without CUDA support, driver or device. Never raises.");

  py::enum_<ScalarType>(m, "ScalarType", "Element type of the out tensors of a CUDA call.")
      .value("float32", ScalarType::kFloat32)
      .value("float16", ScalarType::kFloat16)
      .value("bfloat16", ScalarType::kBFloat16);

  m.def("merge_attn_states_cpu", &merge_attn_states_cpu, py::arg("out_a"), py::arg("lse_a"),
        py::arg("out_b"), py::arg("lse_b"),
        "Merge two partial attention results (numpy arrays, C-contiguous). out_*: [tokens, "
        "heads, head_dim] float16/32/64, lse_*: [tokens, heads] float32/64. Returns new "
        "(out, lse) arrays of the input dtypes, owned by the caller.");
  m.def("merge_attn_states_cuda", &merge_attn_states_cuda, py::arg("out"), py::arg("lse"),
        py::arg("out_a"), py::arg("lse_a"), py::arg("out_b"), py::arg("lse_b"),
        py::arg("tokens"), py::arg("heads"), py::arg("head_dim"), py::arg("dtype"),
        py::arg("device"), py::arg("stream"),
        "Enqueue the merge on a CUDA stream. All pointers are device addresses (data_ptr()) of "
        "C-contiguous buffers on `device`; out/lse are caller-allocated outputs; lse buffers are "
        "float32. Returns without synchronizing. Raises RuntimeError without a usable device.");

  banaserve::attention::register_attention(m);  // partial attention
  banaserve::transfer::register_transfer(m);  // layer-wise transfer pipeline
}
