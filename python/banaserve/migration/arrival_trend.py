"""Where the load is heading: the arrival trend of prompt and output tokens, for the layer
controller's predictive mode (the paper's stated future work).

The gateway records each admitted request's prompt tokens and the output tokens it asks for.
Over a sliding window the trend compares the arrival rate of each in the window's newer half
with the older half, extrapolates that slope ``lead_s`` ahead, and reports the forecast as a
factor on today's rate. By Little's law, at an unchanged service time the work an instance
holds grows with its arrival rate, so the controller scales the demand it measured by these
factors: prompt tokens for prefill work, output tokens for decode work.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: Seconds of arrivals the trend looks at.
WINDOW_S = 20.0
#: Seconds ahead the forecast looks (about what a layer move takes to pay back).
LEAD_S = 10.0
#: Forecast factors are clamped to [1 / MAX_FACTOR, MAX_FACTOR]: a burst's first seconds
#: extrapolate to absurd rates.
MAX_FACTOR = 4.0


@dataclass(frozen=True)
class Forecast:
    """Forecast arrival rate over the current one, per kind of work (1.0: no change)."""

    prefill_factor: float = 1.0
    decode_factor: float = 1.0


@dataclass(frozen=True)
class _Arrival:
    at: float
    prompt_tokens: int
    output_tokens: int


class ArrivalTrend:
    """Recent arrivals and their trend.

    Contract: a function of what :meth:`record` was given and the ``now`` passed in (no clock
    of its own), so a simulator replays it. Not locked: one caller (the gateway's event loop).
    Memory is bounded by the window: older arrivals are dropped as newer ones come.
    """

    def __init__(
        self, window_s: float = WINDOW_S, lead_s: float = LEAD_S, max_factor: float = MAX_FACTOR
    ) -> None:
        if window_s <= 0 or lead_s < 0 or max_factor < 1:
            raise ValueError(
                f"window_s must be positive, lead_s not negative and max_factor at least 1, got "
                f"{window_s}, {lead_s} and {max_factor}"
            )
        self.window_s = window_s
        self.lead_s = lead_s
        self.max_factor = max_factor
        self._arrivals: deque[_Arrival] = deque()

    def record(self, now: float, prompt_tokens: int, output_tokens: int) -> None:
        """A request arrived at ``now`` (times must not go backwards)."""
        if prompt_tokens < 0 or output_tokens < 0:
            raise ValueError(f"token counts must not be negative: {prompt_tokens}, {output_tokens}")
        self._arrivals.append(_Arrival(now, prompt_tokens, output_tokens))
        self._drop_before(now - self.window_s)

    def forecast(self, now: float) -> Forecast:
        """The factors by which each kind of work's arrival rate is expected to change over
        the next ``lead_s``, from the slope between the window's two halves."""
        self._drop_before(now - self.window_s)
        half = self.window_s / 2
        older = [a for a in self._arrivals if a.at < now - half]
        newer = [a for a in self._arrivals if a.at >= now - half]
        return Forecast(
            prefill_factor=self._factor(sum(a.prompt_tokens for a in older),
                                        sum(a.prompt_tokens for a in newer)),
            decode_factor=self._factor(sum(a.output_tokens for a in older),
                                       sum(a.output_tokens for a in newer)),
        )  # fmt: skip

    def clear(self) -> None:
        self._arrivals.clear()

    def _factor(self, older_tokens: int, newer_tokens: int) -> float:
        half = self.window_s / 2
        old_rate, new_rate = older_tokens / half, newer_tokens / half
        if new_rate == 0:
            # Nothing arrives now: falling to nothing if it used to, else nothing to say.
            return 1 / self.max_factor if old_rate > 0 else 1.0
        slope = (new_rate - old_rate) / half
        predicted = max(0.0, new_rate + slope * self.lead_s)
        return min(self.max_factor, max(1 / self.max_factor, predicted / new_rate))

    def _drop_before(self, cutoff: float) -> None:
        while self._arrivals and self._arrivals[0].at < cutoff:
            self._arrivals.popleft()
