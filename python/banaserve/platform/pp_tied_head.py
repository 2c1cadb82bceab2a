"""A Llama with tied word embeddings (SmolLM2) under SGLang's pipeline parallelism: the
last stage gets an ``lm_head`` of its own.

``models/llama.py`` ``LlamaForCausalLM.__init__`` makes ``lm_head`` *be* ``embed_tokens``
when the config ties them, but only the first pipeline stage builds ``embed_tokens``; on the
last stage it is a ``PPMissingLayer``, and the first logits fail with "'PPMissingLayer' object
has no attribute 'quant_method'". ``models/qwen2.py`` shows SGLang's own answer, done here the
same way for Llama: a last stage that is not also the first builds a ``ParallelLMHead`` and
loads the checkpoint's ``model.embed_tokens.weight`` into it (the checkpoint has no
``lm_head.weight``). The head holds the same values as the embedding of a one-stage model, so
logits are bit for bit the same. Nothing changes with one stage, or for an untied model.

Applied by the import hook right after ``sglang.srt.models.llama`` executes, on the CPU
platform; the subclasses of ``LlamaForCausalLM`` that call its ``__init__`` and
``load_weights`` get it too.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

EMBED_WEIGHT = "model.embed_tokens.weight"
HEAD_WEIGHT = "lm_head.weight"


def needs_own_head(model: Any) -> bool:
    """True for a tied model on a last pipeline stage that does not build the embedding."""
    pp_group = getattr(model, "pp_group", None)
    return (
        bool(getattr(model.config, "tie_word_embeddings", False))
        and pp_group is not None
        and pp_group.world_size > 1
        and pp_group.is_last_rank
        and not pp_group.is_first_rank
    )


def patch_llama(module: types.ModuleType) -> None:
    """Give ``LlamaForCausalLM`` a last-stage head when its embeddings are tied."""
    cls = module.LlamaForCausalLM
    if getattr(cls.__init__, "__banaserve_patched__", False):
        return
    cls.__init__ = _with_own_head(cls.__init__, module)
    cls.load_weights = _loading_embed_into_head(cls.load_weights)


def _with_own_head(original: Callable[..., None], module: types.ModuleType) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, config: Any, quant_config: Any = None, prefix: str = "") -> None:
        original(self, config, quant_config, prefix)
        if needs_own_head(self):
            self.lm_head = module.ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=quant_config,
                prefix=module.add_prefix("lm_head", prefix),
                use_attn_tp_group=module.get_parallel().enable_dp_lm_head,
            )

    __init__.__banaserve_patched__ = True  # type: ignore[attr-defined]
    return __init__


def _loading_embed_into_head(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_weights(self: Any, weights: Iterable[tuple[str, Any]]) -> Any:
        if not needs_own_head(self):
            return original(self, weights)
        loaded = original(self, _embed_into_head(self, weights))
        if isinstance(loaded, set):
            loaded.add(HEAD_WEIGHT)
        return loaded

    return load_weights


def _embed_into_head(model: Any, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``weights`` without the embedding, which goes into ``model.lm_head`` instead (this
    stage has no embedding to load it into)."""
    for name, tensor in weights:
        if name != EMBED_WEIGHT:
            yield name, tensor
            continue
        param = model.lm_head.weight
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            from sglang.srt.model_loader.weight_utils import default_weight_loader as loader
        loader(param, tensor)


POST_IMPORT_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.models.llama": patch_llama,
}
