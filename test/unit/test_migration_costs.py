"""The migration controllers' hardware numbers are flags that reach both controllers and
change their decisions (issue 30, item 4): the CPU defaults, measured here, are not wired in."""

from __future__ import annotations

import pytest
from test_role_migration import CORES, HOME, P1, run

from banaserve.config.cli import ClusterOptions, build_parser
from banaserve.config.migration_costs import MigrationCosts
from banaserve.migration.role_controller import RoleController
from banaserve.router.base import Role

FLAGS = ["--model-path", "m", "--num-prefill", "2", "--num-decode", "1"]


def costs_of(*extra: str) -> MigrationCosts:
    options = ClusterOptions.from_args(build_parser().parse_args([*FLAGS, *extra]))
    assert options is not None
    return options.migration_costs


def test_the_flags_reach_both_controllers() -> None:
    costs = costs_of("--migration-decode-batch", "32", "--migration-prefill-batch", "2",
                     "--migration-split-cost", "1.3", "--migration-copy-gbps", "10")  # fmt: skip
    role = costs.role_config()
    assert (role.decode_full_reqs, role.prefill_full_reqs) == (32, 2)
    layer = costs.layer_config(predictive=True)
    assert (layer.decode_full_reqs, layer.prefill_full_reqs) == (32, 2)
    assert (layer.split_cost, layer.copy_bytes_per_s, layer.predictive) == (1.3, 10e9, True)
    # The defaults are the controllers' own, each defined once.
    default = costs_of()
    assert default.layer_config() == type(layer)()
    assert default.role_config() == type(role)()


def test_a_device_that_batches_decodes_moves_nothing_for_six_of_them() -> None:
    """Six decodes fill three CPU cores' worth of decode (each core serves one at full
    speed), so a prefill instance moves to decode; on a device that batches 32 at full speed
    they are a fifth of one, and nothing moves."""
    cpu, gpu = costs_of(), costs_of("--migration-decode-batch", "32")
    for costs, expected in ((cpu, [P1]), (gpu, [])):
        roles = dict(HOME)
        ctl = RoleController(costs.role_config(), cores=CORES, home=HOME)
        moves = run(ctl, roles, {"http://d0": 6}, 0.0, 5)
        assert [m.url for m in moves] == expected
        assert all(m.to_role == Role.DECODE for m in moves)


@pytest.mark.parametrize("flag, value", [("--migration-decode-batch", "0"),
                                         ("--migration-split-cost", "0.5"),
                                         ("--migration-copy-gbps", "-1")])  # fmt: skip
def test_bad_costs_are_refused(flag: str, value: str) -> None:
    with pytest.raises(ValueError, match=flag):
        costs_of(flag, value)
