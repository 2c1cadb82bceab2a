"""The layer controller's decisions over synthetic load records on an injected clock: moves on a
sustained imbalance, none on a brief spike, back again when the load turns, no flapping on
noise, bytes bounded; the predictive mode moves earlier on a rising trend."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from banaserve.migration.arrival_trend import ArrivalTrend, Forecast
from banaserve.migration.layer_controller import (
    LayerController,
    LayerControllerConfig,
    LayerMove,
    SplitInstance,
)
from banaserve.migration.work import cores_busy, work_of
from banaserve.router.base import Role
from banaserve.router.load import InstanceLoad

P, D = "http://prefill-0", "http://decode-0"
LAYERS = 30  # SmolLM2-135M
#: SmolLM2-135M fp32: 14.2 MB of weights per layer, 3 KV heads of 64 floats each for K and V.
WEIGHT_BYTES, KV_BYTES = 14_155_776, 1536
#: 1 prefill + 1 decode instance, one core each; decode-0 may borrow prefill-0's core.
SPLIT = SplitInstance(D, LAYERS, home_cores=(0,), lent_cores=(1,), min_boundary=1,
                      layer_weight_bytes=WEIGHT_BYTES,
                      kv_bytes_per_token_layer=KV_BYTES)  # fmt: skip


#: A split that pays (the default is this machine's CPU, where none does).
PAYS = 1.35


def controller(**config: object) -> LayerController:
    config = {"split_cost": PAYS, **config}
    return LayerController([SPLIT], cores={P: (1,)}, config=LayerControllerConfig(**config))


def records(prefill: int, decode: int, kv_tokens: int = 1000) -> list[InstanceLoad]:
    return [InstanceLoad(P, "prefill", running_reqs=prefill),
            InstanceLoad(D, "decode", running_reqs=decode, kv_used_tokens=kv_tokens)]  # fmt: skip


Load = Callable[[float], tuple[int, int]]


def run(ctl: LayerController, load: Load, start: float, seconds: int,
        forecast: Callable[[float], Forecast] | None = None) -> list[LayerMove]:  # fmt: skip
    """One step a second; ``load(t)`` gives (prefill, decode) requests."""
    moves = []
    for t in range(start, start + seconds):
        prefill, decode = load(t)
        moves += ctl.step(records(prefill, decode), float(t), forecast(t) if forecast else None)
    return moves


def test_a_sustained_decode_load_lends_half_the_layers_to_the_idle_prefill_core() -> None:
    ctl = controller()
    moves = run(ctl, lambda t: (0, 4), 0, 10)
    assert [(m.url, m.from_boundary, m.to_boundary) for m in moves] == [(D, LAYERS, 15)]
    move = moves[0]
    # 4 decodes on one core: 4.0; split in two halves at 1.35x: 2.7 on each core.
    assert move.peak_before == pytest.approx(4.0) and move.peak_after == pytest.approx(2.7)
    assert move.bytes_moved == 15 * (WEIGHT_BYTES + KV_BYTES * 1000)
    assert move.at >= LayerControllerConfig().sustain_s  # warranted for sustain_s first
    assert ctl.boundary[D] == 15


def test_with_the_measured_cpu_cost_no_split_ever_pays() -> None:
    ctl = LayerController([SPLIT], cores={P: (1,)})
    assert ctl.config.split_cost >= 2
    assert run(ctl, lambda t: (0, 8), 0, 60) == []
    assert ctl.peak({D: LAYERS // 2}) > ctl.peak({D: LAYERS})


def test_a_brief_spike_moves_nothing() -> None:
    ctl = controller()
    assert run(ctl, lambda t: (0, 6) if 5 <= t < 7 else (0, 0), 0, 30) == []
    assert ctl.boundary[D] == LAYERS


def test_one_lone_request_or_a_busy_prefill_core_splits_nothing() -> None:
    # One request: below min_peak. Two decodes against two prefills: a split at 1.35x cuts
    # the peak less than min_gain.
    assert run(controller(), lambda t: (0, 1), 0, 30) == []
    assert run(controller(), lambda t: (2, 4), 0, 30) == []


def test_the_borrowed_core_goes_back_when_the_load_turns() -> None:
    ctl = controller()
    decode_phase = run(ctl, lambda t: (0, 4), 0, 10)
    assert [m.to_boundary for m in decode_phase] == [15]
    # The decodes end: the split dwells, then goes back.
    idle = run(ctl, lambda t: (0, 0), 10, 40)
    assert [(m.from_boundary, m.to_boundary, m.reason) for m in idle] == [(15, LAYERS, "release")]
    release = idle[0]
    assert release.bytes_moved == 15 * KV_BYTES * 1000  # KV only: stage 0 kept the weights
    assert release.at - decode_phase[0].at >= LayerControllerConfig().dwell_s


def test_prompts_on_the_lent_core_take_it_back_without_dwelling() -> None:
    config = LayerControllerConfig()
    ctl = controller()
    decode_phase = run(ctl, lambda t: (0, 4), 0, 10)
    assert [m.to_boundary for m in decode_phase] == [15]
    # A prefill-heavy phase: prompts pile up on the lent core while decodes still run.
    prefill_phase = run(ctl, lambda t: (3, 4), 10, 40)
    assert [(m.from_boundary, m.to_boundary, m.reason) for m in prefill_phase] == [
        (15, LAYERS, "lent cores prefill")
    ]
    assert prefill_phase[0].at <= 10 + config.sustain_s + 1  # warranted for sustain_s only
    assert prefill_phase[0].at - decode_phase[0].at < config.dwell_s


def test_a_prefilling_core_is_not_lent() -> None:
    # Six decodes against one prompt on prefill-0's core: a split at 1.35x would cut the peak
    # from 6 to 4.55, but the prompt there would share its core with the borrowed layers.
    assert run(controller(), lambda t: (1, 6), 0, 60) == []


def test_prompts_that_spilled_to_the_decode_instance_are_not_split() -> None:
    # Six 1024-token prompts run whole on decode-0 (spilled: prefill-0 was backed up) while
    # prefill-0's core idles: one prompt is one micro-batch, so a split would not speed them.
    spilled = [InstanceLoad(P, "prefill"),
               InstanceLoad(D, "decode", running_reqs=1, queued_reqs=5,
                            queued_prefill_tokens=6 * 1024)]  # fmt: skip
    ctl = controller()
    assert [move for t in range(60) for move in ctl.step(spilled, float(t))] == []
    assert ctl.peak({D: 15}) > ctl.peak({D: LAYERS}) == pytest.approx(6.0)


def test_noise_around_a_balanced_load_does_not_flap() -> None:
    rng = random.Random(5)
    ctl = controller()
    moves = run(ctl, lambda t: (rng.randint(1, 3), rng.randint(1, 3)), 0, 300)
    assert moves == []
    # An imbalance with noise on top: one split, and it stays.
    moves = run(ctl, lambda t: (rng.randint(0, 1), rng.randint(5, 7)), 300, 300)
    assert len(moves) == 1 and moves[0].to_boundary < LAYERS


def test_a_move_whose_copy_outweighs_its_gain_is_not_made() -> None:
    slow = controller(copy_bytes_per_s=1e6)  # 1 MB/s: 212 MB of weights take minutes
    assert run(slow, lambda t: (0, 4), 0, 30) == []


def test_the_predictive_mode_splits_while_the_decode_phase_builds_up() -> None:
    def ramp(t: float) -> tuple[int, int]:
        return (0, min(4, int(t) // 4))  # decodes pile up: 0, 0, 0, 0, 1, ... 4 from t=16

    def first_split(predictive: bool) -> float:
        ctl = controller(predictive=predictive)
        trend = ArrivalTrend(window_s=8.0, lead_s=8.0)
        for t in range(0, 16, 4):  # one 128-token request every 4 s from t=0
            trend.record(float(t), prompt_tokens=32, output_tokens=128 * (1 + t // 4))
        moves = run(ctl, ramp, 0, 40, forecast=trend.forecast)
        return moves[0].at

    assert first_split(predictive=True) < first_split(predictive=False)


def test_arrival_trend_factors() -> None:
    trend = ArrivalTrend(window_s=10.0, lead_s=5.0, max_factor=4.0)
    assert trend.forecast(0.0) == Forecast(1.0, 1.0)
    for t in range(10):  # steady prompts; output tokens double in the newer half
        trend.record(float(t), prompt_tokens=100, output_tokens=100 if t < 5 else 200)
    forecast = trend.forecast(9.99)
    assert forecast.prefill_factor == pytest.approx(1.0)
    # Rate 20/s -> 40/s over 5 s; 5 s ahead: 60/s, 1.5x today's.
    assert forecast.decode_factor == pytest.approx(1.5)
    # Nothing arrived in the newer half: falling to nothing, clamped at 1/max_factor.
    assert trend.forecast(15.0).decode_factor == pytest.approx(0.25)
    assert trend.forecast(30.0) == Forecast(1.0, 1.0)  # nothing in the window


def test_a_stage_that_died_sets_the_boundary_back_and_bad_boundaries_are_refused() -> None:
    ctl = controller()
    run(ctl, lambda t: (0, 4), 0, 10)
    ctl.set_boundary(D, LAYERS)
    assert ctl.boundary[D] == LAYERS
    with pytest.raises(ValueError, match="outside"):
        ctl.set_boundary(D, 0)


@pytest.mark.parametrize(
    "bad",
    [{"split_cost": 0.9}, {"min_gain": 1.0}, {"smoothing": 0.0}, {"sustain_s": -1.0},
     {"copy_bytes_per_s": 0.0}, {"max_copy_share": 0.0}],
)  # fmt: skip
def test_bad_config_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        LayerControllerConfig(**bad)
    with pytest.raises(ValueError, match="release_prefill"):
        LayerControllerConfig(max_lent_prefill=2.0, release_prefill=1.0)


def test_bad_split_instances_are_refused() -> None:
    with pytest.raises(ValueError, match="min_boundary"):
        SplitInstance(D, LAYERS, (0,), (1,), min_boundary=LAYERS + 1)
    with pytest.raises(ValueError, match="lent cores"):
        SplitInstance(D, LAYERS, (0,), ())


def test_work_units_of_each_role() -> None:
    mixed = InstanceLoad("http://m", "mixed", running_reqs=3, queued_prefill_tokens=2048)
    assert work_of(mixed) == {Role.PREFILL: 2.0, Role.DECODE: 1.0}
    # A decode instance's prompts (spilled there whole) are prefill work too.
    spilled = InstanceLoad("http://d", "decode", running_reqs=4, queued_prefill_tokens=1024)
    assert work_of(spilled) == {Role.PREFILL: 1.0, Role.DECODE: 3.0}
    assert cores_busy(InstanceLoad("http://d", "decode", running_reqs=2)) == 2.0
    assert cores_busy(mixed, decode_full_reqs=2.0) == pytest.approx(2.5)
