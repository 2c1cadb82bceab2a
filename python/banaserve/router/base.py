"""The routing contract: roles, the :class:`Policy` protocol and the healthy-candidate helpers
every policy shares.

Nothing here (or anywhere in :mod:`banaserve.router`) does I/O, reads a clock it was not
given, or imports the cluster's HTTP code, so the gateway, the migration controller and the
simulator run the very same decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from banaserve.router.load import InstanceLoad


class Role(str, Enum):
    """What an instance serves. A ``str`` enum, so a role compares equal to its name (the
    form the command line, ``/cluster`` and the load records carry)."""

    PREFILL = "prefill"
    DECODE = "decode"
    #: Runs prefill and decode (a plain SGLang instance).
    MIXED = "mixed"

    def __str__(self) -> str:
        return self.value


#: Every role's name.
ROLES: tuple[str, ...] = tuple(role.value for role in Role)


class NoHealthyInstance(RuntimeError):
    """No candidate of ``role`` is healthy; the request cannot be routed now."""

    def __init__(self, role: str, num_candidates: int) -> None:
        super().__init__(
            f"no healthy {role} instance to route to ({num_candidates} candidate(s), none healthy)"
        )
        self.role = role
        self.num_candidates = num_candidates


@runtime_checkable
class Policy(Protocol):
    """Chooses one instance per request among the candidates of one role.

    Contract:
    - ``choose`` returns one of the *healthy* ``candidates`` (the same object) and raises
      :class:`NoHealthyInstance` when there is none. It does no I/O and does not block beyond
      the policy's own lock.
    - ``on_done(url, prompt)`` is called once per chosen request when it finishes (or fails),
      with the url it was sent to; policies without in-flight state ignore it.
    - Both are safe to call concurrently from threads.
    """

    name: str

    def choose(self, candidates: Sequence[InstanceLoad], prompt: str) -> InstanceLoad: ...

    def on_done(self, url: str, prompt: str) -> None: ...


def healthy_candidates(candidates: Sequence[InstanceLoad], role: str) -> list[InstanceLoad]:
    """The healthy candidates, in the given order; raises NoHealthyInstance if there are none."""
    healthy = [c for c in candidates if c.healthy]
    if not healthy:
        raise NoHealthyInstance(role, len(candidates))
    return healthy


def check_role(role: str) -> Role:
    """``role`` as a :class:`Role`; ValueError naming the valid roles if it is none."""
    try:
        return Role(role)
    except ValueError:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}") from None
