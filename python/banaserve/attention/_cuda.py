"""What the CUDA paths of the attention wrappers share: the build check, dtype codes, and the
device and stream a kernel is enqueued on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from banaserve import _C

if TYPE_CHECKING:
    import torch


def require_cuda_build(op: str) -> None:
    """RuntimeError naming ``op`` when this build of banaserve._C has no CUDA kernels."""
    if not _C.cuda_compiled():
        raise RuntimeError(
            f"{op} got CUDA tensors but banaserve._C was built without CUDA; "
            "rebuild with nvcc on PATH (BANASERVE_CUDA=AUTO or ON)"
        )


def scalar_type(dtype: torch.dtype) -> Any | None:
    """The kernel's code for a float32/float16/bfloat16 dtype; None for any other dtype."""
    import torch

    codes = {
        torch.float32: _C.ScalarType.float32,
        torch.float16: _C.ScalarType.float16,
        torch.bfloat16: _C.ScalarType.bfloat16,
    }
    return codes.get(dtype)


def launch_target(tensor: torch.Tensor) -> tuple[int, int]:
    """(device index, current stream handle) of ``tensor``'s device: where kernels enqueue."""
    import torch

    device = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return device, torch.cuda.current_stream(device).cuda_stream
