// What the CUDA runtime sees. Defined only in CUDA builds (common/cuda_info.cu); safe to call
// with no NVIDIA driver installed.
#pragma once

namespace banaserve {

// Number of usable devices; 0 when there is no driver or no device, instead of throwing.
int cuda_device_count();

}  // namespace banaserve
