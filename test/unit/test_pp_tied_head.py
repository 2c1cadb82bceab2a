"""The platform's ``pp_tied_head``, on fakes of SGLang's ``LlamaForCausalLM``: a tied model
gets an ``lm_head`` of its own on its last pipeline stage, loaded from the embedding. Served
end to end: ``e2e/test_pp_tied.py``."""

from __future__ import annotations

import types

from banaserve.platform import pp_tied_head


def test_a_tied_model_gets_a_head_on_its_last_stage_only() -> None:
    class Group:
        def __init__(self, rank: int, size: int) -> None:
            self.world_size, self.is_first_rank = size, rank == 0
            self.is_last_rank = rank == size - 1

    class Param:
        def __init__(self) -> None:
            self.loaded: list[str] = []

        def weight_loader(self, param: Param, tensor: str) -> None:
            param.loaded.append(tensor)

    class Head:
        def __init__(self, vocab: int, hidden: int, **kwargs: object) -> None:
            self.shape, self.kwargs, self.weight = (vocab, hidden), kwargs, Param()

    class LlamaForCausalLM:
        def __init__(self, config: object, quant_config: object = None, prefix: str = "") -> None:
            self.config, self.pp_group = config, GROUP
            self.lm_head = "embed_tokens"  # what SGLang does for a tied model

        def load_weights(self, weights: list[tuple[str, str]]) -> set[str]:
            self.got = list(weights)
            return {name for name, _ in self.got}

    module = types.SimpleNamespace(
        LlamaForCausalLM=LlamaForCausalLM, ParallelLMHead=Head,
        add_prefix=lambda name, prefix: f"{prefix}.{name}" if prefix else name,
        get_parallel=lambda: types.SimpleNamespace(enable_dp_lm_head=False),
    )  # fmt: skip
    pp_tied_head.patch_llama(module)  # type: ignore[arg-type]
    pp_tied_head.patch_llama(module)  # type: ignore[arg-type]  # idempotent
    tied = types.SimpleNamespace(tie_word_embeddings=True, vocab_size=16, hidden_size=4)
    weights = [("model.embed_tokens.weight", "E"), ("model.layers.5.mlp.weight", "W")]
    for rank, size, config, own_head in [
        (1, 2, tied, True),
        (0, 2, tied, False),  # the first stage has the embedding
        (0, 1, tied, False),  # no pipeline
        (1, 2, types.SimpleNamespace(tie_word_embeddings=False), False),
    ]:
        GROUP = Group(rank, size)  # read by the fake's __init__
        model = module.LlamaForCausalLM(config, prefix="")
        loaded = model.load_weights(iter(weights))
        if own_head:
            assert isinstance(model.lm_head, Head) and model.lm_head.shape == (16, 4)
            assert model.lm_head.kwargs["prefix"] == "lm_head"
            assert model.lm_head.weight.loaded == ["E"]
            assert model.got == weights[1:] and "lm_head.weight" in loaded
        else:
            assert model.lm_head == "embed_tokens" and model.got == weights
