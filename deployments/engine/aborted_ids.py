"""Request ids a caller has asked to abort, remembered for a while.

An abort by id is lost when it reaches the engine before the request does (vLLM's abort of an
unknown id does nothing). That happens with a rank actor of an expert-parallel group: the
caller's cancel and its abort can overtake the request still being added to the engine. The
server remembers the id, so a request that starts, or yields, after its abort is ended then.
Engine request ids are unique per request (the ingress adds a random suffix), so a remembered id
never ends somebody else's request.
"""

from __future__ import annotations

from collections import OrderedDict

# Long enough for the slowest add_request (tokenizing a long prompt on a loaded CPU), short
# enough that the set stays small; the cap bounds it whatever the abort rate.
REMEMBER_S = 300.0
MAX_REMEMBERED = 10_000


class AbortedIds:
    def __init__(self, remember_s: float = REMEMBER_S, max_remembered: int = MAX_REMEMBERED):
        self._remember_s = remember_s
        self._max = max_remembered
        self._until: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str, now: float) -> None:
        self._forget_expired(now)
        self._until.pop(request_id, None)
        self._until[request_id] = now + self._remember_s
        while len(self._until) > self._max:
            self._until.popitem(last=False)

    def contains(self, request_id: str, now: float) -> bool:
        until = self._until.get(request_id)
        return until is not None and until > now

    def __len__(self) -> int:
        return len(self._until)

    def _forget_expired(self, now: float) -> None:
        while self._until:
            request_id, until = next(iter(self._until.items()))
            if until > now:
                return
            del self._until[request_id]
