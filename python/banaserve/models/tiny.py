"""A tiny random-weight Llama with its own tokenizer, built offline for tests.

Contract: ``build_tiny_model(out, seed=s)`` writes a Hugging Face folder (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) that transformers and SGLang load as a
``LlamaForCausalLM``. For a given seed and the same library versions the bytes are
identical on every run: the tokenizer is trained on a generated corpus, and every weight
tensor comes from its own numpy PCG64 stream keyed by (seed, tensor name), so neither
dict order nor torch's RNG implementation enter. It builds in a few seconds on one core.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from banaserve.models.atomic import atomic_output_dir
from banaserve.models.corpus import generate_corpus

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Special tokens come first so their ids are fixed (0..3) whatever the corpus teaches.
BOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"  # ends an assistant turn, so chat generation stops on it
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, IM_START, EOS_TOKEN, PAD_TOKEN)

# ChatML, the format SmolLM2 uses too, so prompts look alike for both models.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model; the defaults are what tests compare outputs against."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    init_std: float = 0.02
    seed: int = 0
    #: Untied by default: with tied embeddings and small random layers, greedy decoding
    #: mostly repeats the last input token; a separate head gives varied outputs.
    tie_word_embeddings: bool = False


def build_tokenizer(spec: TinySpec = TinySpec()) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with exactly ``spec.vocab_size`` tokens on the generated corpus.

    Byte-level means every string encodes (no unknown token) and decodes back exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(spec.seed), trainer=trainer)
    if tok.get_vocab_size() != spec.vocab_size:
        # The corpus ran out of pairs to merge; fail loudly rather than silently build a
        # model whose vocabulary differs from what tests and docs assume.
        raise RuntimeError(
            f"tokenizer has {tok.get_vocab_size()} tokens, expected {spec.vocab_size}"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,  # keep decode(encode(x)) == x
    )


def _random_weights(shapes: dict[str, tuple[int, ...]], spec: TinySpec) -> dict:
    """Return float32 torch tensors: norms are ones, everything else N(0, init_std)."""
    import numpy as np
    import torch

    tensors = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            array = np.ones(shape, dtype=np.float32)
        else:
            # A stream per tensor, keyed by its name: adding or reordering tensors never
            # changes the values of the others.
            rng = np.random.Generator(np.random.PCG64([spec.seed, zlib.crc32(name.encode())]))
            array = rng.standard_normal(shape, dtype=np.float32) * np.float32(spec.init_std)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(array))
    return tensors


def build_tiny_model(
    out: Path, *, seed: int = 0, force: bool = False, spec: TinySpec | None = None
) -> Path:
    """Build the tiny model into ``out`` atomically and return ``out``.

    ``spec`` changes its shape (``seed`` is ignored then: the spec carries its own); a
    weight's values depend only on the seed and its name, so a variant with more layers
    shares the default model's first layers. Raises ``OutputExistsError`` if ``out`` is a
    non-empty directory and ``force`` is false.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    spec = TinySpec(seed=seed) if spec is None else spec
    out = Path(out)
    with atomic_output_dir(out, force=force) as tmp:
        tokenizer = build_tokenizer(spec)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            max_position_embeddings=spec.max_position_embeddings,
            initializer_range=spec.init_std,
            tie_word_embeddings=spec.tie_word_embeddings,
            bos_token_id=ids[BOS_TOKEN],
            eos_token_id=ids[EOS_TOKEN],
            pad_token_id=ids[PAD_TOKEN],
            dtype="float32",
            architectures=["LlamaForCausalLM"],
        )
        # The meta device gives names and shapes without allocating or initialising.
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
        if spec.tie_word_embeddings:
            shapes.pop("lm_head.weight", None)  # the embedding is the head: one tensor
        save_file(_random_weights(shapes, spec), tmp / "model.safetensors", {"format": "pt"})
        config.save_pretrained(tmp)
        GenerationConfig(
            bos_token_id=ids[BOS_TOKEN],
            eos_token_id=ids[EOS_TOKEN],
            pad_token_id=ids[PAD_TOKEN],
        ).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out
