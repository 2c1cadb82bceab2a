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
#include <utility>
#include <variant>
#include <vector>

#include "transfer/cpu_copier.h"
#include "transfer/cuda_copier.h"
#include "transfer/layer_pipeline.h"

namespace py = pybind11;

namespace banaserve::transfer {
namespace {

using CopyTuple = std::tuple<std::uintptr_t, std::uintptr_t, std::size_t>;
// Per layer: one (src, dst, bytes) triple, as before segment lists existed, or a list of them.
using LayerEntry = std::variant<CopyTuple, std::vector<CopyTuple>>;

std::vector<LayerSegments> to_copies(const std::vector<LayerEntry>& in) {
  std::vector<LayerSegments> out;
  out.reserve(in.size());
  for (const LayerEntry& entry : in) {
    LayerSegments segments;
    if (const auto* one = std::get_if<CopyTuple>(&entry)) {
      const auto& [src, dst, bytes] = *one;
      segments.push_back(LayerCopy{src, dst, bytes});
    } else {
      const auto& many = std::get<std::vector<CopyTuple>>(entry);
      segments.reserve(many.size());
      for (const auto& [src, dst, bytes] : many) segments.push_back(LayerCopy{src, dst, bytes});
    }
    out.push_back(std::move(segments));
  }
  return out;
}

std::unique_ptr<LayerPipeline> make_pipeline(int num_layers, const std::vector<LayerEntry>& fetch,
                                             const std::vector<LayerEntry>& store, int depth,
                                             int device, std::uintptr_t stream,
                                             double bytes_per_second, int fault_stage,
                                             int fault_layer, bool gated) {
  PipelineSpec spec;
  spec.num_layers = num_layers;
  spec.fetch = to_copies(fetch);
  spec.store = to_copies(store);
  spec.depth = depth;
  spec.gated = gated;
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
           py::arg("fault_layer") = -1, py::arg("gated") = false,
           "fetch/store: per layer a (src, dst, bytes) raw-address triple or a list of them "
           "(segments), or empty. device -1: CPU threads; >= 0: CUDA device, stream = the "
           "compute cudaStream_t. gated: layer i's fetch also waits for source_ready(i). Starts "
           "the threads.")
      .def("wait_fetched", &LayerPipeline::wait_fetched, py::arg("layer"),
           py::call_guard<py::gil_scoped_release>())
      .def("computed", &LayerPipeline::computed, py::arg("layer"),
           py::call_guard<py::gil_scoped_release>())
      .def("close", &LayerPipeline::close, py::call_guard<py::gil_scoped_release>())
      .def("abort", &LayerPipeline::abort, py::call_guard<py::gil_scoped_release>())
      // Called from a reader thread while the main thread may sit in wait_fetched(): they only
      // take the pipeline mutex, but release the GIL anyway so no lock is ever held while waiting
      // for the other (the message is converted before the release).
      .def("source_ready", &LayerPipeline::source_ready, py::arg("layer"),
           py::call_guard<py::gil_scoped_release>(),
           "Gated only: layer's host bytes arrived (layers in order). False once closed/failed.")
      .def("source_failed", &LayerPipeline::source_failed, py::arg("layer"), py::arg("message"),
           py::call_guard<py::gil_scoped_release>(),
           "Gated only: fail the pipeline like a fetch error. False once closed/failed.")
      .def_property_readonly("gated", &LayerPipeline::gated)
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
