"""Where a request runs: through the prefill -> store -> decode handoff, or whole on one instance.

The handoff pays when a prompt has much left to compute: a prefill instance takes that heavy
step, so long prefills never stall the decode instances' batches. It costs a second request
and the last partial page computed twice (once on each side), which is nothing next to a long
prefill but doubles the work of a prompt whose prefix the cluster already holds, such as a
popular system prompt with a short question. The store makes a prefix computed anywhere
available everywhere, so what decides is the prompt's *uncached* part, not its length:

- a long request (more than ``in_place_max_new_tokens`` output tokens) whose uncached part is
  at least ``handoff_min_tokens``: handoff;
- but it *spills*, running whole as a direct request, when the prefill instances are backed
  up or a serving instance is idle (:mod:`.spill`: on a serving instance whose cores are
  freer), or when its decode would run on a spare prefill instance (:mod:`.spare_prefill`:
  there); requests sharing a spilled prompt wait for it (below), as for a handoff's;
- a long request whose prompt is mostly cached goes straight to a decode instance, which loads
  the cached prefix from the store;
- a *short* request (at most ``in_place_max_new_tokens`` output tokens) is never handed off:
  it runs whole on any instance, prefill ones included (a decode phase too short to disturb
  their prefills), and when its prompt is uncached it *leads* (below). Its decode is too short
  to need protecting, and a handoff would only add a second request, a store round trip of the
  prompt's KV and the last partial page computed twice (RESULTS.md, session 28).

The gateway cannot see the instances' caches, so it keeps its own approximate index of the
prompts the cluster has computed (text prefixes, as sglang-router's trees, least recently used
first out when full). A prompt enters the index when it is placed. A direct request whose
cached prefix comes from a handoff still in its prefill step, or from a leading or spilled
request that has not answered its first token yet, *follows* it: the gateway holds it until
then, so a burst on a new system prompt computes it once and every other request of the burst
loads it, instead of each instance computing it for the requests it admitted meanwhile (the
store's claims would make them wait too, but only once their own instance looks the pages
up). The index may be wrong (the store evicted a page, an instance failed): then the instance
computes more itself, slower but never wrong.

A cluster without a store (``--kv-store none``) cannot hand KV over at all:
:class:`NoStorePlacer` runs every request whole on one instance.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from banaserve.router.prefix_tree import ApproxRadixTree, common_prefix_len
from banaserve.router.request_shape import RequestShape

#: SGLang's HiCache neither looks up the store for fewer new tokens than this nor loads a
#: shorter store hit: the default of its ``prefetch_threshold``, which BanaServe leaves alone.
SGLANG_PREFETCH_THRESHOLD = 256
#: A handoff of fewer uncached tokens gains nothing: the decode side would not load them.
HANDOFF_MIN_TOKENS = SGLANG_PREFETCH_THRESHOLD
#: Requests generating at most this many tokens (and needing no handoff) may run whole on a
#: prefill instance.
IN_PLACE_MAX_NEW_TOKENS = 16
#: The index holds at most this many characters of prompt text (about 64 MiB).
INDEX_MAX_CHARS = 2**26


@dataclass(frozen=True)
class Placement:
    """The gateway's plan for one request."""

    handoff: bool  # a prefill instance computes the prompt first
    uncached_tokens: int  # estimated prompt tokens no cache in the cluster holds
    any_role: bool  # the (direct) request may run on a prefill instance as well as a decode
    follows: str | None = None  # a prompt still being computed (a handoff's, a leader's)
    spilled: bool = False  # direct although it needed a handoff (see Placer.place)
    prefilled_on: str | None = None  # a handoff's: the instance whose prefill step computed it
    leads: bool = False  # direct and short, its prompt uncached: others follow it (see Placer)

    @property
    def followed(self) -> bool:
        """Whether requests sharing its prompt wait for it (see :class:`Placer`): a handoff's
        until its prefill step ends, a leading or spilled request's until its first token."""
        return self.handoff or self.leads or self.spilled


class PromptIndex:
    """The prompts the cluster has computed, as text prefixes; bounded, least recently used
    out first. Not locked: the gateway uses it from its event loop only."""

    def __init__(self, max_chars: int = INDEX_MAX_CHARS) -> None:
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        self.max_chars = max_chars
        self._tree = ApproxRadixTree()
        self._clock = 0

    def cached_fraction(self, text: str) -> float:
        """The fraction of ``text``'s characters that is a prefix some indexed prompt shares."""
        if not text:
            return 0.0
        return self._tree.match_len(text) / len(text)

    def add(self, text: str) -> None:
        if not text:
            return
        self._clock += 1
        self._tree.insert(text, self._clock)
        if self._tree.size > self.max_chars:
            # Down to 7/8 so a full index does not walk the tree on every insert.
            self._tree.evict_to(self.max_chars - self.max_chars // 8)

    @property
    def size_chars(self) -> int:
        return self._tree.size

    def clear(self) -> int:
        """Forget every prompt (the cluster's caches were cleared); the characters dropped."""
        dropped = self._tree.size
        self._tree = ApproxRadixTree()
        return dropped


class Placer:
    """Decides :class:`Placement` per request and records the prompt as computed.

    A handoff is *pending* from :meth:`place` until the gateway calls :meth:`prefilled`
    with its prompt (whether the prefill step succeeded or not); so is a leading or spilled
    request, until its first token (or its end). Not locked: one event loop.
    """

    #: Whether this placer ever hands a request off (False: :class:`NoStorePlacer`).
    hands_off = True

    def __init__(
        self,
        handoff_min_tokens: int = HANDOFF_MIN_TOKENS,
        in_place_max_new_tokens: int = IN_PLACE_MAX_NEW_TOKENS,
        index: PromptIndex | None = None,
    ) -> None:
        if handoff_min_tokens < 0 or in_place_max_new_tokens < 0:
            raise ValueError(
                "handoff_min_tokens and in_place_max_new_tokens must not be negative, got "
                f"{handoff_min_tokens} and {in_place_max_new_tokens}"
            )
        self.handoff_min_tokens = handoff_min_tokens
        self.in_place_max_new_tokens = in_place_max_new_tokens
        self.index = index if index is not None else PromptIndex()
        self._pending: Counter[str] = Counter()

    def place(self, shape: RequestShape, spill: bool = False) -> Placement:
        """The plan for ``shape``; ``spill``: a long request whose prompt needs a handoff runs
        whole on one serving instance instead (the prefill instances are backed up,
        :mod:`.spill`, or a spare one takes it, :mod:`.spare_prefill`)."""
        cached = self.index.cached_fraction(shape.prompt)
        uncached = round(shape.prompt_tokens * (1.0 - cached))
        self.index.add(shape.prompt)
        # max_new_tokens 0 only fills a cache (SGLang's frontend does it): nothing to hand off.
        handoff = uncached >= self.handoff_min_tokens and shape.max_new_tokens != 0
        short = self.runs_anywhere(shape)
        if not handoff:
            return Placement(False, uncached, short, self._followed(shape))
        # Its prompt is computed for others too (Placement.followed): pending from here on.
        follows = self._followed(shape) if short or spill else None  # before it is pending
        self._pending[shape.prompt] += 1
        if short:
            return Placement(False, uncached, True, follows, leads=True)
        # From here a request that needs a handoff is long: it decodes on a serving instance.
        if spill:
            return Placement(False, uncached, False, follows, spilled=True)
        return Placement(handoff=True, uncached_tokens=uncached, any_role=False)

    def runs_anywhere(self, shape: RequestShape) -> bool:
        """Whether ``shape`` generates few enough tokens (``in_place_max_new_tokens``) to run
        whole on a prefill instance too."""
        limit = self.in_place_max_new_tokens
        return shape.max_new_tokens is not None and shape.max_new_tokens <= limit

    def reset(self) -> int:
        """Forget every prompt and pending handoff (the cluster's caches were cleared); the
        index characters dropped. A handoff still in its prefill step may end after this:
        :meth:`prefilled` then finds nothing to end, and requests no longer follow it."""
        self._pending.clear()
        return self.index.clear()

    def prefilled(self, prompt: str) -> None:
        """The prefill step of a handoff placed with ``prompt`` has ended, or a leading
        request's first token came (or it ended without one)."""
        if prompt in self._pending:  # not if a reset came in between
            self._pending[prompt] -= 1
            if self._pending[prompt] <= 0:
                del self._pending[prompt]

    def _followed(self, shape: RequestShape) -> str | None:
        """The pending handoff whose prompt shares the longest prefix with this one, if that
        prefix is long enough to be worth waiting for (``handoff_min_tokens``)."""
        if not self._pending or not shape.prompt:
            return None
        best, best_len = None, 0
        for prompt in self._pending:
            shared = common_prefix_len(prompt, shape.prompt)
            if shared > best_len:
                best, best_len = prompt, shared
        shared_tokens = shape.prompt_tokens * best_len / len(shape.prompt)
        return best if best_len and shared_tokens >= max(1, self.handoff_min_tokens) else None


class NoStorePlacer(Placer):
    """Placement for a cluster without a KV store (``--kv-store none``): no KV can move from
    one instance to another, so nothing is handed off and every request runs whole on the
    least loaded instance of either role. Its whole prompt counts as uncached: the gateway
    cannot tell which instance's own cache holds a prefix, and no other instance can load it.
    No index is kept and no request follows another."""

    hands_off = False

    def place(self, shape: RequestShape, spill: bool = False) -> Placement:
        return Placement(handoff=False, uncached_tokens=shape.prompt_tokens, any_role=True)
