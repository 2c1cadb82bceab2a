"""Layer moves: where the boundary ``k`` of each split instance should be, from load records.

A split instance runs as two pipeline stages: layers [0, k) on its own cores, [k, L) on cores
it borrows from another instance (``--migration layer``: a decode instance borrows a prefill
instance's core). Its work divides between the two in proportion to the layers each runs, and
a split costs extra (``split_cost``: each step crosses the pipeline, SGLang runs PP without
its overlap scheduler and splits the batch into micro-batches; on this machine's CPU so much
that no split pays, see :class:`LayerControllerConfig`). Every other instance's work stays on
its own cores. The controller picks, per split instance, the
``k`` in [``min_boundary``, L] that minimises the peak utilisation over the cores, where a core's
utilisation is the cores' worth of work on it (:func:`banaserve.migration.work.cores_busy`: a
core holding two requests is twice busy).

Only decodes divide: a split instance's prefill steps (prompts that spilled to it whole) count
on its home cores, because one prompt is one micro-batch and its stages run in turn, so a split
does not make it faster. And no layer is lent to a core that prefills (more than
``max_lent_prefill`` prefill steps' worth, smoothed): the borrowed layers would time-share the
core with the prompts there, and TTFT pays; a split whose lent cores hold more than
``release_prefill`` goes back to ``k = L`` without dwelling (the gap between the two is the
hysteresis that keeps a prompt now and then from flapping the split). Counting spilled
prompts as decodes splits instances in prefill-heavy phases, which TTFT pays (RESULTS.md).

A move copies bytes: moving ``k`` down sends layers [k', k)'s weights and their KV for every
live token to the borrowed cores; moving it up sends the KV back (stage 0 keeps every layer's
weights). A move is made only when the time that copy takes (at ``copy_bytes_per_s``) is at
most ``max_copy_share`` of the core-seconds it saves over ``payback_s``, and it cuts the peak by
at least ``min_gain``. Against flapping: demand is smoothed, a move must be warranted for
``sustain_s`` in a row before it is made, and a split instance that moved stays for
``dwell_s``. When its split no longer pays (the lent cores got busy, or the load is gone) the
instance goes back to ``k = L``, which frees the borrowed cores; that move needs no gain.

In the predictive mode, the demand each instance holds is scaled by where the arrival rate of
its kind of work is heading (:class:`banaserve.migration.arrival_trend.Forecast`), so a split
starts while a decode-heavy phase builds up rather than once it is there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from banaserve.migration.arrival_trend import Forecast
from banaserve.migration.work import (
    DECODE_FULL_REQS,
    PREFILL_FULL_REQS,
    cores_busy,
    work_of,
)
from banaserve.router.base import Role
from banaserve.router.load import InstanceLoad


@dataclass(frozen=True)
class SplitInstance:
    """An instance whose later layers may run on borrowed cores.

    ``min_boundary`` is the smallest ``k`` the borrowing stage has buffers for (it holds
    layers [min_boundary, L) at most). ``layer_weight_bytes`` and ``kv_bytes_per_token_layer``
    size a move's copy.
    """

    url: str
    num_layers: int
    home_cores: tuple[int, ...]
    lent_cores: tuple[int, ...]
    min_boundary: int = 1
    layer_weight_bytes: int = 0
    kv_bytes_per_token_layer: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_boundary <= self.num_layers:
            raise ValueError(
                f"min_boundary must be in [1, {self.num_layers}], got {self.min_boundary}"
            )
        if not self.home_cores or not self.lent_cores:
            raise ValueError(f"{self.url}: a split instance needs home and lent cores")
        if min(self.layer_weight_bytes, self.kv_bytes_per_token_layer) < 0:
            raise ValueError("byte sizes must not be negative")

    def move_bytes(self, k: int, k_new: int, live_tokens: int) -> int:
        """Bytes a move from ``k`` to ``k_new`` copies with ``live_tokens`` in the KV pool."""
        layers = abs(k - k_new)
        kv = layers * self.kv_bytes_per_token_layer * live_tokens
        return kv + (layers * self.layer_weight_bytes if k_new < k else 0)


@dataclass(frozen=True)
class LayerControllerConfig:
    """The controller's knobs; every default is here."""

    #: A split instance's work, while split, over its work whole, in core-seconds: measured on
    #: this machine's CPU by ``benchmark/pp_cost_bench.py`` (RESULTS.md). At 2 or more a split
    #: never lowers the peak, so on a CPU the controller lends nothing; re-measure where PP pays.
    split_cost: float = 2.46
    #: At or below this peak utilisation no split starts, and a split whose instance would be
    #: at most this busy whole ends. One request's worth: a pipeline keeps both cores busy
    #: only with two micro-batches in flight, and one lone request runs its stages in turn.
    min_peak: float = 1.0
    #: A move must cut the peak utilisation by at least this fraction.
    min_gain: float = 0.2
    #: Seconds a move must be warranted in a row before it is made. With ``smoothing`` 0.5 a
    #: 2 s spike of 6 decodes stays above ``min_peak`` for 4 s; a decode phase lasts tens.
    sustain_s: float = 5.0
    #: Seconds a split instance stays after a move before it may move again.
    dwell_s: float = 20.0
    #: Weight of the newest sample in the smoothed demand (1: no smoothing).
    smoothing: float = 0.5
    #: Copy bandwidth a move gets, bytes per second: gloo send/recv between two processes on
    #: one host, 64 MiB, measured at 2.4 GB/s on this project's CPU machine (FACTS.md).
    copy_bytes_per_s: float = 2.4e9
    #: Seconds a move's gain is expected to last (about a phase of the load).
    payback_s: float = 20.0
    #: A move's copy may take at most this share of the core-seconds it saves.
    max_copy_share: float = 0.25
    #: Prefill steps (smoothed) on a lent core above which no layer is lent there. Half a
    #: step: one 1024-token prompt seen in two polls in a row.
    max_lent_prefill: float = 0.5
    #: Prefill steps (smoothed) on a lent core above which a split lending there goes back:
    #: more than one prompt, so prompts queue there.
    release_prefill: float = 1.0
    #: Scale demand by the arrival trend (:meth:`LayerController.step`'s ``forecast``).
    predictive: bool = False
    #: Decoding requests and prefill steps one core serves at full speed
    #: (:mod:`banaserve.migration.work`).
    decode_full_reqs: float = DECODE_FULL_REQS
    prefill_full_reqs: float = PREFILL_FULL_REQS

    def __post_init__(self) -> None:
        if self.split_cost < 1 or not 0 <= self.min_gain < 1 or not 0 < self.smoothing <= 1:
            raise ValueError("split_cost must be at least 1, min_gain in [0, 1), smoothing in "
                             "(0, 1]")  # fmt: skip
        if min(self.min_peak, self.sustain_s, self.dwell_s, self.payback_s,
               self.max_lent_prefill) < 0:  # fmt: skip
            raise ValueError("min_peak, sustain_s, dwell_s, payback_s and max_lent_prefill must "
                             "not be negative")  # fmt: skip
        if self.release_prefill < self.max_lent_prefill:
            raise ValueError("release_prefill must be at least max_lent_prefill")
        if min(self.copy_bytes_per_s, self.max_copy_share, self.decode_full_reqs,
               self.prefill_full_reqs) <= 0:  # fmt: skip
            raise ValueError("copy_bytes_per_s, max_copy_share, decode_full_reqs and "
                             "prefill_full_reqs must be positive")  # fmt: skip


@dataclass(frozen=True)
class LayerMove:
    """A split instance's boundary moving from ``from_boundary`` to ``to_boundary`` at ``at``
    (the controller's clock)."""

    url: str
    from_boundary: int
    to_boundary: int
    at: float
    #: Peak core utilisation before and (as predicted) after the move.
    peak_before: float
    peak_after: float
    bytes_moved: int
    reason: str = "controller"

    def to_json(self) -> dict[str, object]:
        return {
            "url": self.url, "from": self.from_boundary, "to": self.to_boundary,
            "at": round(self.at, 3), "peak_before": round(self.peak_before, 3),
            "peak_after": round(self.peak_after, 3), "bytes_moved": self.bytes_moved,
            "reason": self.reason,
        }  # fmt: skip


@dataclass
class LayerController:
    """Decides boundary moves from load records.

    Contract: :meth:`step` is a function of the records, ``now``, the optional forecast and
    the controller's own state (smoothed demand and its prefill share, boundaries, since
    when a move has been warranted, when each instance last moved): no I/O and no clock but
    ``now``, so the gateway, tests and a simulator run the same decisions. The caller applies
    the moves it returns (the controller already counts them as made) and reports a boundary
    the instance took by itself (a stage that died: :meth:`set_boundary`). Not locked: one
    caller at a time. ``cores`` maps every other instance's url to its cores (one missing
    counts as a core of its own).
    """

    splits: Sequence[SplitInstance]
    cores: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    config: LayerControllerConfig = field(default_factory=LayerControllerConfig)
    boundary: dict[str, int] = field(default_factory=dict)
    demand: dict[str, float] = field(default_factory=dict)
    #: The part of ``demand`` that is prefill steps (smoothed alike).
    prefill: dict[str, float] = field(default_factory=dict)
    warranted_since: dict[str, float] = field(default_factory=dict)
    moved_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._splits = {s.url: s for s in self.splits}
        for split in self.splits:
            self.boundary.setdefault(split.url, split.num_layers)

    def step(
        self, loads: Sequence[InstanceLoad], now: float, forecast: Forecast | None = None
    ) -> list[LayerMove]:
        """The moves to make now (at most one), given every instance's record."""
        healthy = {load.url: load for load in loads if load.healthy}
        self._smooth(healthy.values(), forecast)
        for url in list(self.demand):
            if url not in healthy:  # gone from routing: its work is not on any core now
                del self.demand[url]
                self.prefill.pop(url, None)
        peak = self.peak(self.boundary)
        best: tuple[tuple[float, int, str], LayerMove] | None = None
        for split in self.splits:
            proposal = self._proposal(split, healthy.get(split.url), peak, now)
            if proposal is None:
                self.warranted_since.pop(split.url, None)
                continue
            since = self.warranted_since.setdefault(split.url, now)
            if now - since < self.config.sustain_s:
                continue
            rank = (proposal.peak_after, proposal.bytes_moved, split.url)
            if best is None or rank < best[0]:
                best = (rank, proposal)
        if best is None:
            return []
        move = best[1]
        self.set_boundary(move.url, move.to_boundary)
        self.moved_at[move.url] = now
        return [move]

    def peak(self, boundary: Mapping[str, int]) -> float:
        """The peak core utilisation over the smoothed demand with ``boundary`` (url -> k)."""
        return max(self.utilisation(boundary).values(), default=0.0)

    def utilisation(self, boundary: Mapping[str, int]) -> dict[object, float]:
        """Each core's utilisation with the smoothed demand and ``boundary`` (url -> k)."""
        on_core: dict[object, float] = {}
        for url, work in self.demand.items():
            split = self._splits.get(url)
            k = boundary.get(url, split.num_layers) if split else 0
            if split is None or k == split.num_layers:
                _spread(on_core, self._home_of(url), work)
                continue
            layers = split.num_layers
            prefill = min(work, self.prefill.get(url, 0.0))
            decode = (work - prefill) * self.config.split_cost
            _spread(on_core, split.home_cores,
                    prefill * self.config.split_cost + decode * k / layers)  # fmt: skip
            _spread(on_core, split.lent_cores, decode * (layers - k) / layers)
        return on_core

    def lent_prefill(self, split: SplitInstance) -> float:
        """The smoothed prefill steps of the other instances on ``split``'s lent cores (the
        busiest lent core's share)."""
        on_core: dict[object, float] = {}
        for url, prefill in self.prefill.items():
            if url != split.url:
                _spread(on_core, self._home_of(url), prefill)
        return max((on_core.get(core, 0.0) for core in split.lent_cores), default=0.0)

    def split_of(self, url: str) -> SplitInstance | None:
        """``url``'s split, None for an instance that is not (or no longer) split."""
        return self._splits.get(url)

    def _home_of(self, url: str) -> Sequence[object]:
        """The cores ``url``'s own work runs on (a split instance's home cores; a core of its
        own for an instance of unknown cores)."""
        split = self._splits.get(url)
        return split.home_cores if split else self.cores.get(url) or (url,)

    def set_boundary(self, url: str, k: int) -> None:
        """``url``'s boundary is ``k`` now (a move applied, by hand or after a stage died)."""
        split = self._splits[url]
        if not split.min_boundary <= k <= split.num_layers:
            raise ValueError(f"boundary {k} outside [{split.min_boundary}, {split.num_layers}]")
        self.boundary[url] = k
        self.warranted_since.pop(url, None)

    def retire(self, url: str) -> None:
        """``url`` runs whole on its own cores from now on (a stage died and it restarted as
        one): no longer split, its work counted on its home cores."""
        split = self._splits.pop(url)
        self.splits = [s for s in self.splits if s.url != url]
        self.boundary.pop(url, None)
        self.warranted_since.pop(url, None)
        self.cores = {**self.cores, url: split.home_cores}

    def forget(self) -> None:
        """Start afresh (caches cleared between benchmark runs): no demand, no dwelling, no
        pending move; boundaries stay where the instances have them."""
        self.demand.clear()
        self.prefill.clear()
        self.warranted_since.clear()
        self.moved_at.clear()

    def _smooth(self, loads: Sequence[InstanceLoad], forecast: Forecast | None) -> None:
        alpha = self.config.smoothing
        for load in loads:
            factor = self._factor(load, forecast)
            config = self.config
            busy = cores_busy(load, config.decode_full_reqs, config.prefill_full_reqs) * factor
            prefill = work_of(load)[Role.PREFILL] / config.prefill_full_reqs * factor
            self.demand[load.url] = alpha * busy + (1 - alpha) * self.demand.get(load.url, busy)
            self.prefill[load.url] = alpha * prefill + (1 - alpha) * self.prefill.get(
                load.url, prefill
            )

    def _factor(self, load: InstanceLoad, forecast: Forecast | None) -> float:
        if forecast is None or not self.config.predictive:
            return 1.0
        if load.role == Role.PREFILL:
            return forecast.prefill_factor
        if load.role == Role.DECODE:
            return forecast.decode_factor
        return (forecast.prefill_factor + forecast.decode_factor) / 2

    def _proposal(
        self, split: SplitInstance, load: InstanceLoad | None, peak: float, now: float
    ) -> LayerMove | None:
        """The move of ``split`` warranted now, if any (dwell, gain and byte bounds met)."""
        if load is None:
            return None
        k, layers = self.boundary[split.url], split.num_layers

        def peak_at(k_new: int) -> float:
            return self.peak({**self.boundary, split.url: k_new})

        whole = peak_at(layers)
        lent_prefill = self.lent_prefill(split)
        if k < layers and lent_prefill > self.config.release_prefill:
            # No dwelling: the prompts there wait meanwhile.
            return self._move(split, load, k, layers, peak, whole, now, "lent cores prefill")
        if now - self.moved_at.get(split.url, -math.inf) < self.config.dwell_s:
            return None
        if k < layers and (whole <= self.config.min_peak or whole <= peak):
            # The split no longer pays (or the load would not start one): the borrowed cores
            # go back. Judged at k = L, not at today's peak, which the split itself lowered.
            return self._move(split, load, k, layers, peak, whole, now, "release")
        if peak <= self.config.min_peak or lent_prefill > self.config.max_lent_prefill:
            return None
        # Fewest bytes among equal peaks, then the larger k (fewer borrowed layers).
        peaks = {c: peak_at(c) for c in range(split.min_boundary, layers + 1)}
        k_new = min(peaks, key=lambda c: (round(peaks[c], 9), abs(c - k), -c))
        after = peaks[k_new]
        if k_new == k or after > peak * (1 - self.config.min_gain):
            return None
        move = self._move(split, load, k, k_new, peak, after, now, "controller")
        copy_s = move.bytes_moved / self.config.copy_bytes_per_s
        saved_core_s = (peak - after) * self.config.payback_s
        return move if copy_s <= self.config.max_copy_share * saved_core_s else None

    @staticmethod
    def _move(split: SplitInstance, load: InstanceLoad, k: int, k_new: int, peak: float,
              after: float, now: float, reason: str) -> LayerMove:  # fmt: skip
        moved = split.move_bytes(k, k_new, load.kv_used_tokens)
        return LayerMove(split.url, k, k_new, now, peak, after, moved, reason)


def _spread(on_core: dict[object, float], cores: Sequence[object], work: float) -> None:
    """Add ``work`` to ``on_core``, in equal shares over ``cores``."""
    for core in cores:
        on_core[core] = on_core.get(core, 0.0) + work / len(cores)
