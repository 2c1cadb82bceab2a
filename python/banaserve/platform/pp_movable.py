"""A two-stage SGLang pipeline whose layer boundary ``k`` moves at run time.

With ``--pp-size 2 --pp-layer-boundary K --pp-min-boundary KMIN`` the launcher exports
:data:`~banaserve.env.MOVABLE_ENV` (KMIN) and the instance's split
folder; then, in each stage process:

- **Layers.** ``get_pp_indices`` gives stage 0 every layer, [0, L), and stage 1 the layers
  it may come to run, [KMIN, L): each builds those layers and allocates their KV. Stage 0
  keeps every layer's weights. Stage 1 keeps the weights of the layers it runs, [k, L), and
  frees the others once loaded (``k = L``: it holds none).
- **The boundary travels with each micro-batch.** Before each forward stage 0 reads the
  boundary asked for (:class:`~banaserve.migration.boundary_control.BoundaryControl`), runs
  layers [0, k) and adds ``k`` to the tensors it hands to stage 1, which runs [k, L) of that
  micro-batch. Every micro-batch runs each layer exactly once, on one stage, with the same
  weights, so the output does not depend on where the boundary was.
- **The move is real.** When ``k`` moves down, the first micro-batch at the new boundary
  also carries the weights of layers [k', k) from stage 0's copy (over the pipeline's own
  channel: gloo on the CPU), which stage 1 installs before it runs them: those are the bytes
  a move costs. Moving up frees stage 1's copies.
- **The KV does not move: both stages map it.** The KV of layers [KMIN, L) lives in files in
  the split folder (``/dev/shm``), mapped by both stage processes into their own pools, so a
  token's KV written by the stage that ran its layer is where the other stage reads it after
  a move. Both pools allocate slots alike (each stage's scheduler makes the same decisions,
  which is how SGLang's PP works), which needs equal pools: ``--max-total-tokens``. A move
  down is always safe (stage 1 runs a micro-batch only after stage 0 ran all earlier ones);
  a move up waits while a chunked prefill is in flight, since its next chunk could reach
  stage 0 before stage 1 wrote the previous one's KV. Any other request stage 0 runs has its
  last step's output back, so stage 1 finished writing it.

Applied by the import hook after the named SGLang modules execute; nothing changes in a
process without :data:`~banaserve.env.MOVABLE_ENV`.
"""

from __future__ import annotations

import functools
import logging
import os
import types
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from banaserve.env import MOVABLE_ENV, SPLIT_DIR_ENV
from banaserve.migration.boundary_control import BoundaryControl

logger = logging.getLogger("banaserve.platform")

BOUNDARY_KEY = "banaserve.boundary"
WEIGHT_PREFIX = "banaserve.weight."


def min_boundary() -> int | None:
    value = os.environ.get(MOVABLE_ENV)
    return int(value) if value else None


def split_dir() -> Path:
    value = os.environ.get(SPLIT_DIR_ENV)
    if not value:
        raise RuntimeError(f"{MOVABLE_ENV} is set without {SPLIT_DIR_ENV}")
    return Path(value)


# -- layers --------------------------------------------------------------------------------


def widened(original: Callable[..., tuple[int, int]]) -> Callable[..., tuple[int, int]]:
    """``get_pp_indices`` giving each of two stages every layer it may come to run."""

    @functools.wraps(original)
    def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
        lowest = min_boundary()
        if lowest is None or pp_size != 2:
            return original(num_hidden_layers, pp_rank, pp_size)
        return (0, num_hidden_layers) if pp_rank == 0 else (lowest, num_hidden_layers)

    get_pp_indices.__banaserve_patched__ = True  # type: ignore[attr-defined]
    return get_pp_indices


def patch_distributed_utils(module: types.ModuleType) -> None:
    if not getattr(module.get_pp_indices, "__banaserve_patched__", False):
        module.get_pp_indices = widened(module.get_pp_indices)


# -- the KV both stages map ------------------------------------------------------------------


def mapped(path: Path, like: Any) -> Any:
    """A tensor shaped like ``like`` backed by the file at ``path``, shared with every process
    that maps it (created, zero-filled, by whichever maps it first)."""
    import torch

    size = like.numel() * like.element_size()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        current = os.fstat(fd).st_size
        if current == 0:
            try:
                # Reserved now: a sparse file on a full tmpfs kills the stage with SIGBUS at
                # its first write instead (Docker gives /dev/shm 64 MB by default).
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise RuntimeError(
                    f"no room in {path.parent} for the KV the two stages share ({size} bytes "
                    f"for one layer: {exc.strerror}): give it more (docker run --shm-size) or "
                    "the instance a smaller --max-total-tokens"
                ) from exc
        elif current != size:
            raise RuntimeError(
                f"{path} holds {current} bytes, this stage's KV layer needs {size}: the two "
                "stages' KV pools differ (give the instance --max-total-tokens)"
            )
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=like.numel(), dtype=like.dtype).view(
        like.shape
    )


def share_layers(pool: Any, first: int, folder: Path) -> list[str]:
    """Back ``pool``'s K and V buffers of layers ``first`` and up with files in ``folder``
    (the views keep their shapes and strides; a fused K/V allocation stays fused); the
    names of those files."""
    names = []
    for local in range(max(0, first - pool.start_layer), pool.layer_num):
        layer = pool.start_layer + local
        k, v = pool.k_buffer[local], pool.v_buffer[local]
        k_base = k if k._base is None else k._base
        v_base = v if v._base is None else v._base
        if k_base is v_base:
            names.append(f"kv{layer}")
            shared = mapped(folder / names[-1], k_base)
            pool.k_buffer[local] = shared.as_strided(k.shape, k.stride(), k.storage_offset())
            pool.v_buffer[local] = shared.as_strided(v.shape, v.stride(), v.storage_offset())
        else:
            names += [f"k{layer}", f"v{layer}"]
            pool.k_buffer[local] = mapped(folder / names[-2], k)
            pool.v_buffer[local] = mapped(folder / names[-1], v)
    return names


def unlink_once_both_mapped(folder: Path, rank: int, names: Iterable[str]) -> None:
    """Mark this stage's mapping done; the stage that finds the other's mark too unlinks the
    KV files, so that their memory goes back once both stages exit, however they exit (a
    mapping outlives its file's name)."""
    (folder / f"mapped{rank}").touch()
    if not (folder / f"mapped{1 - rank}").exists():
        return
    for name in names:
        (folder / name).unlink(missing_ok=True)


def sharing_shared_layers(original: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(original)
    def _create_buffers_normal(self: Any) -> None:
        original(self)
        lowest = min_boundary()
        if lowest is not None:
            folder = split_dir()
            names = share_layers(self, lowest, folder)
            unlink_once_both_mapped(folder, 0 if self.start_layer == 0 else 1, names)

    _create_buffers_normal.__banaserve_patched__ = True  # type: ignore[attr-defined]
    return _create_buffers_normal


def patch_memory_pool(module: types.ModuleType) -> None:
    cls = module.MHATokenToKVPool
    if not getattr(cls._create_buffers_normal, "__banaserve_patched__", False):
        cls._create_buffers_normal = sharing_shared_layers(cls._create_buffers_normal)


# -- the scheduler (whether a chunked prefill is in flight) ----------------------------------

_scheduler: Callable[[], Any] = lambda: None  # noqa: E731


def remembering_scheduler(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        global _scheduler
        _scheduler = weakref.ref(self)
        original(self, *args, **kwargs)

    __init__.__banaserve_patched__ = True  # type: ignore[attr-defined]
    return __init__


def patch_scheduler(module: types.ModuleType) -> None:
    if not getattr(module.Scheduler.__init__, "__banaserve_patched__", False):
        module.Scheduler.__init__ = remembering_scheduler(module.Scheduler.__init__)


def chunked_prefill_in_flight() -> bool:
    scheduler = _scheduler()
    return scheduler is not None and getattr(scheduler, "chunked_req", None) is not None


# -- the boundary per micro-batch ------------------------------------------------------------


def layer_weights(layer: Any) -> Iterable[tuple[str, Any]]:
    return layer.named_parameters()


class FirstStage:
    """Stage 0's side: reads the boundary asked for, decides the one this micro-batch runs
    at, and what weights go with it. Confined to the stage's scheduler thread."""

    def __init__(self, model: Any, lowest: int, control: BoundaryControl) -> None:
        self.model = model
        self.lowest = lowest
        self.layers = len(model.layers)
        self.control = control
        self.applied = control.read().applied  # stage 1 holds the weights of [applied, L)
        self.moves = 0
        self.bytes_moved = 0
        self.chunked_before = False

    def next_boundary(self) -> tuple[int, dict[str, Any]]:
        """The boundary of the micro-batch about to run and the tensors to add for stage 1."""
        chunked = chunked_prefill_in_flight()
        wanted = min(max(self.control.read().requested, self.lowest), self.layers)
        if wanted > self.applied and (chunked or self.chunked_before):
            wanted = self.applied  # up moves wait for chunked prefills (module docstring)
        self.chunked_before = chunked
        extra: dict[str, Any] = {}
        if wanted != self.applied:
            for layer in range(wanted, self.applied):  # none when moving up
                for name, param in layer_weights(self.model.layers[layer]):
                    extra[f"{WEIGHT_PREFIX}{layer}.{name}"] = param.data
                    self.bytes_moved += param.data.numel() * param.data.element_size()
            self.moves += 1
            logger.info("layer boundary %d -> %d", self.applied, wanted)
            self.applied = wanted
            self.control.record_applied(wanted, self.moves, self.bytes_moved)
        return wanted, extra


class LastStage:
    """Stage 1's side: holds the weights of layers [boundary, L), installs those that come
    with a micro-batch, frees those it no longer runs. Confined to the stage's scheduler
    thread."""

    def __init__(self, model: Any, boundary: int) -> None:
        self.model = model
        self.layers = len(model.layers)
        self.freed: set[int] = set()  # layers whose weights this stage does not hold
        self.boundary = boundary
        self.release_below(boundary)

    def release_below(self, boundary: int) -> None:
        """Free the weights of the layers below ``boundary`` (stage 0 keeps its copies)."""
        import torch

        for layer in range(self.model.start_layer, min(boundary, self.layers)):
            if layer in self.freed:
                continue
            self.freed.add(layer)
            for _, param in layer_weights(self.model.layers[layer]):
                param.data = torch.empty(0, dtype=param.data.dtype)

    def take(self, tensors: dict[str, Any]) -> int:
        """The boundary of the micro-batch in ``tensors`` (stage 1's current one when stage 0
        did not send it: a warm-up), after installing the weights that came with it."""
        boundary = tensors.pop(BOUNDARY_KEY, None)
        boundary = self.boundary if boundary is None else int(boundary.reshape(-1)[0])
        weights = [key for key in tensors if key.startswith(WEIGHT_PREFIX)]
        for key in weights:
            layer_name = key[len(WEIGHT_PREFIX) :]
            layer, name = layer_name.split(".", 1)
            params = dict(layer_weights(self.model.layers[int(layer)]))
            params[name].data = tensors.pop(key)
            self.freed.discard(int(layer))
        missing = [layer for layer in range(boundary, self.layers) if layer in self.freed]
        if missing:
            raise RuntimeError(f"layer boundary {boundary}: no weights for layers {missing}")
        if boundary > self.boundary:
            self.release_below(boundary)
        self.boundary = boundary
        return boundary


def moving_boundary(original: Callable[..., Any]) -> Callable[..., Any]:
    """``LlamaModel.forward`` running the layers of this micro-batch's boundary."""

    @functools.wraps(original)
    def forward(self: Any, input_ids: Any, positions: Any, forward_batch: Any,
                input_embeds: Any = None, pp_proxy_tensors: Any = None) -> Any:  # fmt: skip
        side = getattr(self, "_banaserve_stage", None)
        if side is None:
            return original(self, input_ids, positions, forward_batch, input_embeds,
                            pp_proxy_tensors)  # fmt: skip
        start, end = self.start_layer, self.end_layer
        try:
            if isinstance(side, FirstStage):
                import torch

                boundary, extra = side.next_boundary()
                self.end_layer = boundary
                out = original(self, input_ids, positions, forward_batch, input_embeds,
                               pp_proxy_tensors)  # fmt: skip
                out.tensors[BOUNDARY_KEY] = torch.tensor([boundary], dtype=torch.int64)
                out.tensors.update(extra)
                return out
            boundary = side.take(pp_proxy_tensors.tensors)
            if boundary < end:
                self.start_layer = boundary
            else:  # k = L: no layer here; layer L-1's entry restores the stream all the same
                self.start_layer = self.end_layer = end - 1
            return original(self, input_ids, positions, forward_batch, input_embeds,
                            pp_proxy_tensors)  # fmt: skip
        finally:
            self.start_layer, self.end_layer = start, end

    forward.__banaserve_patched__ = True  # type: ignore[attr-defined]
    return forward


def attaching_stage(original: Callable[..., Any]) -> Callable[..., Any]:
    """``LlamaForCausalLM.load_weights`` that, in a movable split, sets up the stage's side
    once the weights are in."""

    @functools.wraps(original)
    def load_weights(self: Any, weights: Iterable[tuple[str, Any]]) -> Any:
        loaded = original(self, weights)
        lowest = min_boundary()
        model = self.model
        if lowest is None or model.pp_group.world_size != 2:
            return loaded
        control = BoundaryControl(split_dir())
        if model.pp_group.is_first_rank:
            model._banaserve_stage = FirstStage(model, lowest, control)
        else:
            model._banaserve_stage = LastStage(model, control.read().applied)
        logger.info("movable layer boundary at %d (down to %d)", control.read().applied, lowest)
        return loaded

    load_weights.__banaserve_patched__ = True  # type: ignore[attr-defined]
    return load_weights


def patch_llama(module: types.ModuleType) -> None:
    model_cls, causal_cls = module.LlamaModel, module.LlamaForCausalLM
    if not getattr(model_cls.forward, "__banaserve_patched__", False):
        model_cls.forward = moving_boundary(model_cls.forward)
    if not getattr(causal_cls.load_weights, "__banaserve_patched__", False):
        causal_cls.load_weights = attaching_stage(causal_cls.load_weights)


POST_IMPORT_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.distributed.utils": patch_distributed_utils,
    "sglang.srt.mem_cache.memory_pool": patch_memory_pool,
    "sglang.srt.managers.scheduler": patch_scheduler,
    "sglang.srt.models.llama": patch_llama,
}
