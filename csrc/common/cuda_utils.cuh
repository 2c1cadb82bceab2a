// Error checking and device selection for the CUDA sources (nvcc only).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace banaserve {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file,
                                          int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + expr +
                           " failed: " + cudaGetErrorString(err));
}

}  // namespace banaserve

#define BANASERVE_CUDA_CHECK(expr)                                                \
  do {                                                                            \
    const cudaError_t banaserve_err_ = (expr);                                    \
    if (banaserve_err_ != cudaSuccess) {                                          \
      ::banaserve::throw_cuda_error(banaserve_err_, #expr, __FILE__, __LINE__);   \
    }                                                                             \
  } while (0)

namespace banaserve {

// Makes `device` current for a scope and restores the caller's device afterwards, so that a
// call on cuda:1 does not leave the calling thread on cuda:1. Throws a readable error first
// when no device is usable (no driver is the usual cause on the development machines).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      const char* why = err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0";
      throw std::runtime_error(std::string("no usable CUDA device: ") + why);
    }
    if (device < 0 || device >= count) {
      throw std::runtime_error("CUDA device " + std::to_string(device) + " out of range (" +
                               std::to_string(count) + " devices)");
    }
    BANASERVE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) BANASERVE_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    // A destructor must not throw; a failure here would already have failed the call above.
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace banaserve
