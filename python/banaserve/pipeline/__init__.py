"""Layer-wise three-stage pipeline (DESIGN.md mechanism 3): fetch layer i+1, compute layer i and
store layer i-1 at the same time, with the copies in C++ (banaserve._C, csrc/transfer/)."""

from banaserve.pipeline.layer_pipeline import LayerPipeline, live_threads

__all__ = ["LayerPipeline", "live_threads"]
