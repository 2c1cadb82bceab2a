// pybind11 surface of the layer pipeline. Every blocking call releases the GIL: the worker
// threads never take it, and the caller's compute (Python) must be able to run meanwhile.
#include "transfer/bindings_transfer.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "transfer/cpu_copier.h"
#include "transfer/cuda_copier.h"
#include "transfer/layer_pipeline.h"

namespace py = pybind11;

namespace banaserve::transfer {
namespace {

using CopyTuple = std::tuple<std::uintptr_t, std::uintptr_t, std::size_t>;

std::vector<LayerCopy> to_copies(const std::vector<CopyTuple>& in) {
  std::vector<LayerCopy> out;
  out.reserve(in.size());
  for (const auto& [src, dst, bytes] : in) out.push_back(LayerCopy{src, dst, bytes});
  return out;
}

std::unique_ptr<LayerPipeline> make_pipeline(int num_layers, const std::vector<CopyTuple>& fetch,
                                             const std::vector<CopyTuple>& store, int depth,
                                             int device, std::uintptr_t stream,
                                             double bytes_per_second, int fault_stage,
                                             int fault_layer) {
  PipelineSpec spec;
  spec.num_layers = num_layers;
  spec.fetch = to_copies(fetch);
  spec.store = to_copies(store);
  spec.depth = depth;
  spec.fault_stage = fault_stage;
  spec.fault_layer = fault_layer;
  std::unique_ptr<StageCopier> copier;
  if (device < 0) {
    copier = std::make_unique<CpuCopier>(bytes_per_second);
  } else {
#ifdef BANASERVE_WITH_CUDA
    if (depth < 1) throw std::invalid_argument("depth must be >= 1");
    py::gil_scoped_release release;
    copier = make_cuda_copier(spec, device, stream);
#else
    (void)stream;
    throw std::runtime_error("banaserve._C was built without CUDA (BANASERVE_CUDA=OFF or no nvcc)");
#endif
  }
  return std::make_unique<LayerPipeline>(std::move(spec), std::move(copier));
}

}  // namespace

void register_transfer(py::module_& m) {
  py::class_<LayerPipeline>(m, "LayerPipeline",
                            "Layer-wise fetch/compute/store pipeline (see banaserve.pipeline).")
      .def(py::init(&make_pipeline), py::arg("num_layers"), py::arg("fetch"), py::arg("store"),
           py::arg("depth") = 3, py::arg("device") = -1, py::arg("stream") = 0,
           py::arg("bytes_per_second") = 0.0, py::arg("fault_stage") = -1,
           py::arg("fault_layer") = -1,
           "fetch/store: per-layer (src, dst, bytes) raw addresses, or empty. device -1: CPU "
           "threads; >= 0: CUDA device, stream = the compute cudaStream_t. Starts the threads.")
      .def("wait_fetched", &LayerPipeline::wait_fetched, py::arg("layer"),
           py::call_guard<py::gil_scoped_release>())
      .def("computed", &LayerPipeline::computed, py::arg("layer"),
           py::call_guard<py::gil_scoped_release>())
      .def("close", &LayerPipeline::close, py::call_guard<py::gil_scoped_release>())
      .def("abort", &LayerPipeline::abort, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &LayerPipeline::num_layers)
      .def_property_readonly("depth", &LayerPipeline::depth)
      .def_property_readonly("max_in_flight", &LayerPipeline::max_in_flight)
      .def(
          "timestamps",
          [](const LayerPipeline& p) {
            std::vector<std::int64_t> ts = p.timestamps();
            py::array_t<std::int64_t> out({static_cast<py::ssize_t>(p.num_layers()),
                                           py::ssize_t{3}, py::ssize_t{2}});
            std::copy(ts.begin(), ts.end(), out.mutable_data());
            return out;
          },
          "int64 [layer, stage (fetch, compute, store), (start, end)] steady_clock ns; -1 = "
          "not reached.")
      .def_static("live_threads", &LayerPipeline::live_threads,
                  "Pipeline worker threads alive in this process (all pipelines).");
  m.def("steady_clock_ns", [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }, "The clock of LayerPipeline.timestamps(), in ns.");
}

}  // namespace banaserve::transfer
