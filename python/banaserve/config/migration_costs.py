"""What the hardware costs, as the migration controllers count it: the numbers in their
decisions that stand for measurements (issue 30, item 4). Each is a flag, its default
measured on this project's CPU machine and its source stated, so the same controllers decide
right on another machine (a GPU) once these are measured there.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from banaserve.migration.layer_controller import LayerControllerConfig
from banaserve.migration.role_controller import RoleControllerConfig
from banaserve.migration.work import DECODE_FULL_REQS, PREFILL_FULL_REQS

_LAYER = LayerControllerConfig()


@dataclass(frozen=True)
class MigrationCosts:
    """``--migration-decode-batch``, ``--migration-prefill-batch``, ``--migration-split-cost``
    and ``--migration-copy-gbps``; the defaults are the controllers' own."""

    #: Decoding requests one core (one device) serves at full speed.
    decode_batch: float = DECODE_FULL_REQS
    #: Prefill steps one core (one device) computes at once.
    prefill_batch: float = PREFILL_FULL_REQS
    #: A split instance's work over its work whole (pipeline parallelism's cost).
    split_cost: float = _LAYER.split_cost
    #: What a layer move's copy gets, in GB/s.
    copy_gbps: float = _LAYER.copy_bytes_per_s / 1e9

    def __post_init__(self) -> None:
        if min(self.decode_batch, self.prefill_batch, self.copy_gbps) <= 0:
            raise ValueError("--migration-decode-batch, --migration-prefill-batch and "
                             "--migration-copy-gbps must be positive")  # fmt: skip
        if self.split_cost < 1:
            raise ValueError("--migration-split-cost must be at least 1")

    def role_config(self) -> RoleControllerConfig:
        return RoleControllerConfig(decode_full_reqs=self.decode_batch,
                                    prefill_full_reqs=self.prefill_batch)  # fmt: skip

    def layer_config(self, predictive: bool = False) -> LayerControllerConfig:
        return dataclasses.replace(
            _LAYER, decode_full_reqs=self.decode_batch, prefill_full_reqs=self.prefill_batch,
            split_cost=self.split_cost, copy_bytes_per_s=self.copy_gbps * 1e9,
            predictive=predictive,
        )  # fmt: skip

    @staticmethod
    def add_args(group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--migration-decode-batch",
            type=float,
            default=DECODE_FULL_REQS,
            help="Decoding requests one core (or device) serves at full speed: the unit in "
            "which the migration controllers count an instance's load (default: "
            f"{DECODE_FULL_REQS:g}, measured on a CPU core, where a decode step's time grows "
            "with its batch; on a GPU, the batch at which a step stops taking about the same "
            "time, often 32 or more).",
        )
        group.add_argument(
            "--migration-prefill-batch",
            type=float,
            default=PREFILL_FULL_REQS,
            help="Prefill steps one core (or device) computes at once at full speed (default: "
            f"{PREFILL_FULL_REQS:g}).",
        )
        group.add_argument(
            "--migration-split-cost",
            type=float,
            default=_LAYER.split_cost,
            help="With --migration layer: an instance's work run as two pipeline stages over "
            f"its work whole (default: {_LAYER.split_cost:g}, measured on this project's CPU "
            "by benchmark/pp_cost_bench.py; at 2 or more no split lowers the peak, so nothing "
            "is lent; measure it where pipeline parallelism pays).",
        )
        group.add_argument(
            "--migration-copy-gbps",
            type=float,
            default=_LAYER.copy_bytes_per_s / 1e9,
            help="With --migration layer: GB/s a layer move's copy gets, which bounds the "
            f"moves worth making (default: {_LAYER.copy_bytes_per_s / 1e9:g}, gloo send/recv "
            "between two processes on one host, measured on this project's CPU machine).",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MigrationCosts:
        return cls(args.migration_decode_batch, args.migration_prefill_batch,
                   args.migration_split_cost, args.migration_copy_gbps)  # fmt: skip
