// pybind11 bindings of partial attention (the merge is bound in csrc/bindings.cpp). Like the rest
// of banaserve._C nothing here touches CUDA at import time.
#include "attention/bindings_attention.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention/partial_attention.h"

namespace py = pybind11;

namespace banaserve::attention {
namespace {

enum class HostElem { kFloat16, kBFloat16, kFloat32, kFloat64 };

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

HostElem host_elem(const py::array& a, const char* name) {
  const py::dtype dt = a.dtype();
  const bool native = dt.byteorder() == '=' || dt.byteorder() == '|';
  if (native && dt.kind() == 'f') {
    if (dt.itemsize() == 2) return HostElem::kFloat16;
    if (dt.itemsize() == 4) return HostElem::kFloat32;
    if (dt.itemsize() == 8) return HostElem::kFloat64;
  }
  // numpy has no bfloat16: its bit pattern arrives as uint16 (torch: t.view(torch.int16)).
  if (native && dt.kind() == 'u' && dt.itemsize() == 2) return HostElem::kBFloat16;
  throw py::type_error(std::string(name) + ": unsupported dtype " +
                       py::str(dt).cast<std::string>() +
                       " (need float16, float32, float64, or uint16 holding bfloat16 bits)");
}

void require_c_contiguous(const py::array& a, const char* name) {
  const bool aligned = reinterpret_cast<std::uintptr_t>(a.data()) % a.itemsize() == 0;
  if (!(a.flags() & py::array::c_style) || !aligned) {
    throw py::value_error(std::string(name) + " must be an aligned C-contiguous array");
  }
}

template <typename T, typename L>
py::tuple run_cpu(const py::array& q, const py::array& k, const py::array& v,
                  const std::int64_t* positions, const PartialAttentionParams& p) {
  py::array out(q.dtype(), {p.tokens, p.out_heads(), p.head_dim});
  py::array lse(py::dtype::of<L>(), {p.tokens, p.out_heads()});
  const auto* qd = static_cast<const T*>(q.data());
  const auto* kd = static_cast<const T*>(k.data());
  const auto* vd = static_cast<const T*>(v.data());
  auto* od = static_cast<T*>(out.mutable_data());
  auto* ld = static_cast<L*>(lse.mutable_data());
  {
    py::gil_scoped_release release;
    partial_attention_cpu<T, L>(qd, kd, vd, positions, od, ld, p);
  }
  return py::make_tuple(out, lse);
}

py::tuple partial_attention_cpu_py(const py::array& q, const py::array& k, const py::array& v,
                                   const std::optional<py::array>& q_positions,
                                   std::int64_t start, std::int64_t stop,
                                   const std::vector<std::int64_t>& kv_head_groups, bool causal,
                                   std::int64_t kv_offset, double scale) {
  if (q.ndim() != 3) {
    throw py::value_error("q must have shape [tokens, q_heads, head_dim], got " + shape_str(q));
  }
  if (k.ndim() != 3) {
    throw py::value_error("k must have shape [kv_len, kv_heads, head_dim], got " + shape_str(k));
  }
  if (v.ndim() != 3 || v.shape(0) != k.shape(0) || v.shape(1) != k.shape(1) ||
      v.shape(2) != k.shape(2)) {
    throw py::value_error("v shape " + shape_str(v) + " != k shape " + shape_str(k));
  }
  if (k.shape(2) != q.shape(2)) {
    throw py::value_error("head_dim of k " + shape_str(k) + " != head_dim of q " + shape_str(q));
  }
  const HostElem t = host_elem(q, "q");
  if (host_elem(k, "k") != t || host_elem(v, "v") != t) {
    throw py::type_error("q, k and v dtypes differ");
  }
  for (const auto& [a, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    require_c_contiguous(*a, name);
  }

  PartialAttentionParams p;
  p.tokens = q.shape(0);
  p.q_heads = q.shape(1);
  p.head_dim = q.shape(2);
  p.kv_len = k.shape(0);
  p.kv_heads = k.shape(1);
  p.start = start;
  p.stop = stop;
  p.kv_head_groups = kv_head_groups;
  p.causal = causal;
  p.kv_offset = kv_offset;
  p.scale = scale;
  validate_partial_attention(p);  // before allocating the outputs, whose shape depends on it

  const std::int64_t* positions = nullptr;
  if (causal) {
    if (!q_positions) throw py::value_error("causal attention needs q_positions");
    const py::array& pos = *q_positions;
    const py::dtype dt = pos.dtype();
    if (dt.kind() != 'i' || dt.itemsize() != 8 || pos.ndim() != 1 || pos.shape(0) != p.tokens) {
      throw py::value_error("q_positions must be int64 of shape (" + std::to_string(p.tokens) +
                            ",), got " + py::str(dt).cast<std::string>() + " " +
                            shape_str(pos));
    }
    require_c_contiguous(pos, "q_positions");
    positions = static_cast<const std::int64_t*>(pos.data());
  }

  switch (t) {
    case HostElem::kFloat16:
      return run_cpu<Half, float>(q, k, v, positions, p);
    case HostElem::kBFloat16:
      return run_cpu<BFloat16, float>(q, k, v, positions, p);
    case HostElem::kFloat32:
      return run_cpu<float, float>(q, k, v, positions, p);
    case HostElem::kFloat64:
      return run_cpu<double, double>(q, k, v, positions, p);
  }
  throw std::logic_error("unreachable");
}

void partial_attention_cuda_py(std::uintptr_t out, std::uintptr_t lse, std::uintptr_t q,
                               std::uintptr_t k, std::uintptr_t v, std::uintptr_t q_positions,
                               std::int64_t tokens, std::int64_t q_heads, std::int64_t kv_heads,
                               std::int64_t kv_len, std::int64_t head_dim, std::int64_t start,
                               std::int64_t stop, const std::vector<std::int64_t>& kv_head_groups,
                               bool causal, std::int64_t kv_offset, double scale,
                               ScalarType dtype, int device, std::uintptr_t stream) {
  CudaPartialAttentionArgs args{out, lse, q, k, v, q_positions, {}, dtype, device, stream};
  PartialAttentionParams& p = args.params;
  p.tokens = tokens;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.kv_len = kv_len;
  p.head_dim = head_dim;
  p.start = start;
  p.stop = stop;
  p.kv_head_groups = kv_head_groups;
  p.causal = causal;
  p.kv_offset = kv_offset;
  p.scale = scale;
#ifdef BANASERVE_WITH_CUDA
  py::gil_scoped_release release;
  partial_attention_cuda(args);
#else
  (void)args;
  throw std::runtime_error("banaserve._C was built without CUDA (BANASERVE_CUDA=OFF or no nvcc)");
#endif
}

}  // namespace

void register_attention(py::module_& m) {
  m.def("partial_attention_cpu", &partial_attention_cpu_py, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("q_positions"), py::arg("start"), py::arg("stop"),
        py::arg("kv_head_groups"), py::arg("causal"), py::arg("kv_offset"), py::arg("scale"),
        "Partial attention on the CPU (numpy arrays, C-contiguous). q: [tokens, q_heads, "
        "head_dim], k/v: [kv_len, kv_heads, head_dim], all float16/float32/float64 or uint16 "
        "holding bfloat16 bits; q_positions: int64 [tokens] (read only when causal). Keys "
        "[start, stop) of the KV-head groups kv_head_groups ([] = all). Returns new (out, lse) "
        "arrays owned by the caller: out [tokens, out_heads, head_dim] of q's dtype, lse "
        "[tokens, out_heads] float32 (float64 for float64 inputs), -inf where no key is visible.");
  m.def("partial_attention_cuda", &partial_attention_cuda_py, py::arg("out"), py::arg("lse"),
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_positions"), py::arg("tokens"),
        py::arg("q_heads"), py::arg("kv_heads"), py::arg("kv_len"), py::arg("head_dim"),
        py::arg("start"), py::arg("stop"), py::arg("kv_head_groups"), py::arg("causal"),
        py::arg("kv_offset"), py::arg("scale"), py::arg("dtype"), py::arg("device"),
        py::arg("stream"),
        "Enqueue partial attention on a CUDA stream. Pointers are device addresses "
        "(data_ptr()) of C-contiguous buffers on `device`; out [tokens, out_heads, head_dim] "
        "and lse (float32) [tokens, out_heads] are caller-allocated; q_positions int64 or 0. "
        "Returns without synchronizing. Raises ValueError for bad parameters, RuntimeError "
        "without a usable device.");
}

}  // namespace banaserve::attention
