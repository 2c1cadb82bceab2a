"""The one facade the gateway calls for every routing decision: :class:`Router`.

A request's walk: :meth:`Router.plan` (handoff or direct, from the placer), then per step
:meth:`Router.pick` (an instance of the step's role, booked on the board) and
:meth:`Router.done` (unbooked, the policy told). The gateway keeps what is not a decision:
parsing, relaying, racing an instance's death, and retries, which call ``pick`` again with the
instances already tried.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass

from banaserve.router.base import NoHealthyInstance, Policy, Role
from banaserve.router.board import Board
from banaserve.router.load import InstanceLoad
from banaserve.router.placement import Placement, Placer
from banaserve.router.request_shape import RequestShape
from banaserve.router.spare_prefill import (
    SERVE_ON_SPARE_PREFILL,
    spare_prefill_or,
    spare_prefill_serves,
)
from banaserve.router.spill import SPILL_PREFILL, prefill_backlogged, serving_idle


@dataclass(frozen=True)
class Pick:
    """One step of a request placed on one instance; hand it back to :meth:`Router.done`."""

    url: str
    #: The step: ``Role.PREFILL`` (a handoff's prefill) or ``Role.DECODE`` (serving).
    step: Role
    #: The chosen instance's role (a serve step may land on a prefill instance).
    role: Role
    #: Prompt tokens booked as the instance's queued prefill work until ``done``.
    prefill_tokens: int
    #: A serve step on a prefill instance because no decode instance is healthy.
    fallback: bool = False
    #: Output tokens booked as owed there until ``done`` (a serve step's ``max_new_tokens``).
    decode_tokens: int = 0
    #: Its prompt is computed for other requests too (a handoff's prefill step, or a leading
    #: request): booked as queued handoff work, which closes a prefill instance to long requests.
    for_others: bool = False


class Router:
    """Places requests on the board's instances with one policy per step.

    Contract: confined to one thread (the gateway's event loop), as the board and the placer
    are; the policies lock their own state. Nothing here blocks or does I/O. Every
    :meth:`pick` books the request on the board and must be matched by one :meth:`done`.
    """

    def __init__(
        self,
        board: Board,
        prefill_policy: Policy,
        decode_policy: Policy,
        placer: Placer,
        spill_prefill: bool = SPILL_PREFILL,
        serve_on_spare_prefill: bool = SERVE_ON_SPARE_PREFILL,
    ) -> None:
        self.board = board
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.placer = placer
        self.spill_prefill = spill_prefill
        self.serve_on_spare_prefill = serve_on_spare_prefill

    def plan(self, shape: RequestShape) -> Placement:
        """Handoff or direct, and the prompt recorded as computed (see :class:`Placer`: a
        short request is never handed off). A long request whose prompt needs a handoff runs
        whole instead (a spill) with ``spill_prefill`` while the prefill instances are backed
        up or a serving instance is idle (:mod:`banaserve.router.spill`), and with
        ``serve_on_spare_prefill`` when its serve step would take a spare prefill instance
        (:func:`~banaserve.router.spare_prefill.spare_prefill_serves`)."""
        if not self.placer.hands_off or self.placer.runs_anywhere(shape):
            return self.placer.place(shape)
        mixed = self.board.healthy(Role.MIXED)
        prefill = self.board.healthy(Role.PREFILL)
        serving = self.board.healthy(Role.DECODE) + mixed
        whole = self.spill_prefill and (
            serving_idle(serving)
            or prefill_backlogged(prefill + mixed, serving, self.placer.handoff_min_tokens)
        )
        if not whole and self._serves_on_spare_prefill():
            whole = spare_prefill_serves(serving, prefill)
        return self.placer.place(shape, whole)

    def _serves_on_spare_prefill(self) -> bool:
        return self.serve_on_spare_prefill and self.decode_policy.name == "load_aware"

    def prefilled(self, shape: RequestShape) -> None:
        """The prefill step of a handoff planned for ``shape`` has ended (well or not)."""
        self.placer.prefilled(shape.prompt)

    def reset(self) -> int:
        """Forget every computed prompt (the caches were cleared); index characters dropped."""
        return self.placer.reset()

    def can_prefill(self) -> bool:
        """Whether any instance that takes prefill steps is in routing (else a handoff
        computes on decode)."""
        return bool(self.board.healthy(Role.PREFILL) or self.board.healthy(Role.MIXED))

    def pick(
        self,
        role: Role,
        shape: RequestShape,
        tried: Collection[str] = (),
        *,
        only: str | None = None,
        any_role: bool = False,
        prefill_tokens: int | None = None,
        prefilled_on: str | None = None,
        leads: bool = False,
    ) -> Pick:
        """The instance for ``shape``'s next ``role`` step, booked on the board.

        ``Role.PREFILL``: the handoff's prefill step, among the prefill instances.
        ``Role.DECODE``: the serve step, among the decode instances, and the prefill ones too
        with ``any_role`` (a short direct request) or ``only``; among the prefill ones when no
        decode instance is healthy, so the cluster keeps serving. ``Role.MIXED`` instances
        (moved there by the migration controller) take both steps. With
        ``serve_on_spare_prefill`` and the ``load_aware`` decode policy, the serve step of a
        long request may go to a prefill instance whose cores are spare
        (:mod:`banaserve.router.spare_prefill`), other than the one ``prefilled_on`` (a handoff
        exists to move the decode off the instance that computed the prompt). Instances in
        ``tried`` are skipped; ``only`` allows that one instance alone (a suspect request goes
        back to the instance that restarted). ``prefill_tokens`` (default: the whole prompt)
        count as the instance's queued prefill work until :meth:`done`; with ``leads`` (a
        leading request: other requests wait for its prompt) as a handoff's prompt too.

        Raises :class:`NoHealthyInstance` when no healthy candidate is left.
        """
        role, fallback = Role(role), False
        mixed = self.board.healthy(Role.MIXED)
        spare: list[InstanceLoad] = []
        if role == Role.PREFILL:
            pool, policy = self.board.healthy(Role.PREFILL) + mixed, self.prefill_policy
        else:
            pool, policy = self.board.healthy(Role.DECODE) + mixed, self.decode_policy
            if any_role or only is not None:
                pool += self.board.healthy(Role.PREFILL)
            elif not pool:
                pool, fallback = self.board.healthy(Role.PREFILL), True
            elif self._serves_on_spare_prefill():
                spare = [c for c in self.board.healthy(Role.PREFILL)
                         if allowed(c, tried, None) and c.url != prefilled_on]  # fmt: skip
        candidates = [c for c in pool if allowed(c, tried, only)]
        if not candidates:
            raise NoHealthyInstance(str(role), len(pool))
        chosen = policy.choose(candidates, shape.prompt)
        if spare:
            chosen = spare_prefill_or(chosen, spare)
        tokens = shape.prompt_tokens if prefill_tokens is None else prefill_tokens
        owed = shape.decode_tokens if role == Role.DECODE else 0
        for_others = role == Role.PREFILL or leads
        self.board.begin(chosen.url, tokens, handoff=for_others, decode_tokens=owed)
        return Pick(chosen.url, role, Role(chosen.role), tokens, fallback, owed, for_others)

    def first_token(self, pick: Pick) -> Pick:
        """``pick``'s instance answered its first token, so its prompt is computed: the pick
        with no prefill tokens booked any more (hand that one to :meth:`done`). Without it a
        long request's prompt would count as queued prefill work until its last token."""
        self.board.prefilled(pick.url, pick.prefill_tokens, handoff=pick.for_others)
        return dataclasses.replace(pick, prefill_tokens=0)

    def done(self, pick: Pick, shape: RequestShape) -> None:
        """The step :meth:`pick` placed has ended (answered, failed or abandoned)."""
        self.board.end(pick.url, pick.prefill_tokens, handoff=pick.for_others,
                       decode_tokens=pick.decode_tokens)  # fmt: skip
        policy = self.prefill_policy if pick.step == Role.PREFILL else self.decode_policy
        policy.on_done(pick.url, shape.prompt)


def allowed(candidate: InstanceLoad, tried: Collection[str], only: str | None) -> bool:
    """Whether a retry may go to ``candidate``: ``only`` it, or any instance not yet tried."""
    return candidate.url == only if only is not None else candidate.url not in tried
