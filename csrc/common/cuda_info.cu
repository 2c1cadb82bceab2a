#include "common/cuda_info.h"

#include <cuda_runtime.h>

namespace banaserve {

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // do not leave the failure behind for the next checked call
    return 0;
  }
  return count;
}

}  // namespace banaserve
