"""Turns per-pool wishes into targets that fit together: prefill needs decode and vice versa,
and all pools share one budget of units.

Rule, in order:
1. wake together: a prefill or decode pool leaving zero wakes its partner if that is at zero
   (a prompt prefilled with nowhere to decode, or the reverse, is wasted);
2. decode does not shrink while prefill grows (scales out now, has replicas starting, or is
   over its thresholds): prefill's extra output lands on decode next;
3. ratio, by raising: if prefill:decode replicas leave ratio_bounds, raise the short side
   (within its allowed range);
4. budget: pools keep min(current, wish) (cut from the least pressed pool first if even that
   does not fit, never below min_replicas); the units left are handed out one replica at a
   time to the pool whose projected pressure (pressure * ready / replicas so far) is highest,
   i.e. the most violated SLO is served first and water-filled against the others. When no
   units are left for a pool over its SLO, pools under theirs give up replicas they do not
   need for their current load (within their allowed range, so cooldowns still hold);
5. ratio, by lowering: if the budget left the ratio out of bounds, lower the long side (within
   its allowed range; lowering never breaks the budget).
Ratio rules apply with exactly one prefill and one decode pool, both above zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autoscaler.pool_plan import PoolPlan

_EPS = 1e-9


@dataclass
class Coordinated:
    targets: dict[str, int]
    notes: dict[str, list[str]] = field(default_factory=dict)

    def note(self, pool: str, text: str) -> None:
        self.notes.setdefault(pool, []).append(text)


def coordinate(plans: list[PoolPlan], ratio_bounds: tuple[float, float] | None,
               budget_units: float) -> Coordinated:
    result = Coordinated({plan.pool: plan.want for plan in plans})
    by_role = _prefill_decode(plans)
    if by_role is not None:
        _wake_together(*by_role, result)
        _decode_follows_prefill(*by_role, result)
        if ratio_bounds is not None:
            _ratio_by_raising(*by_role, ratio_bounds, result)
    _fit_budget(plans, budget_units, result)
    if by_role is not None and ratio_bounds is not None:
        _ratio_by_lowering(*by_role, ratio_bounds, result)
    return result


def _prefill_decode(plans: list[PoolPlan]) -> tuple[PoolPlan, PoolPlan] | None:
    prefill = [plan for plan in plans if plan.role == "prefill"]
    decode = [plan for plan in plans if plan.role == "decode"]
    return (prefill[0], decode[0]) if len(prefill) == 1 and len(decode) == 1 else None


def _wake_together(prefill: PoolPlan, decode: PoolPlan, result: Coordinated) -> None:
    for waking, partner in ((prefill, decode), (decode, prefill)):
        if waking.waking and result.targets[partner.pool] == 0:
            result.targets[partner.pool] = max(1, partner.min_replicas)
            result.note(partner.pool, f"woken with {waking.pool}: its requests need this pool next")


def _decode_follows_prefill(prefill: PoolPlan, decode: PoolPlan, result: Coordinated) -> None:
    growing = (result.targets[prefill.pool] > prefill.current or prefill.ready < prefill.current
               or prefill.pressure > 1.0)
    if growing and result.targets[decode.pool] < decode.current:
        result.targets[decode.pool] = decode.current
        result.note(decode.pool, f"kept at {decode.current}: {prefill.pool} is growing or backlogged, "
                                 f"its output lands here next")


def _ratio_by_raising(prefill: PoolPlan, decode: PoolPlan, bounds: tuple[float, float],
                      result: Coordinated) -> None:
    low, high = bounds
    p, d = result.targets[prefill.pool], result.targets[decode.pool]
    if p == 0 or d == 0:
        return
    if p > high * d + _EPS:
        raised = min(max(d, math.ceil(p / high - _EPS)), max(d, decode.hi))
        if raised > d:
            result.targets[decode.pool] = raised
            result.note(decode.pool, f"raised to {raised} to keep prefill:decode <= {high:g}")
    elif p < low * d - _EPS:
        raised = min(max(p, math.ceil(low * d - _EPS)), max(p, prefill.hi))
        if raised > p:
            result.targets[prefill.pool] = raised
            result.note(prefill.pool, f"raised to {raised} to keep prefill:decode >= {low:g}")


def _ratio_by_lowering(prefill: PoolPlan, decode: PoolPlan, bounds: tuple[float, float],
                       result: Coordinated) -> None:
    low, high = bounds
    p, d = result.targets[prefill.pool], result.targets[decode.pool]
    if p == 0 or d == 0:
        return
    if p > high * d + _EPS:
        lowered = max(prefill.lo, 1, math.floor(high * d + _EPS))
        if lowered < p:
            result.targets[prefill.pool] = lowered
            result.note(prefill.pool, f"lowered to {lowered} to keep prefill:decode <= {high:g}")
    elif p < low * d - _EPS:
        lowered = max(decode.lo, 1, math.floor(p / low + _EPS))
        if lowered < d:
            result.targets[decode.pool] = lowered
            result.note(decode.pool, f"lowered to {lowered} to keep prefill:decode >= {low:g}")


def _fit_budget(plans: list[PoolPlan], budget_units: float, result: Coordinated) -> None:
    wanted = dict(result.targets)
    if sum(wanted[plan.pool] * plan.units_per_replica for plan in plans) <= budget_units + _EPS:
        return
    granted = {plan.pool: min(wanted[plan.pool], max(plan.current, plan.lo)) for plan in plans}
    used = sum(granted[plan.pool] * plan.units_per_replica for plan in plans)
    while used > budget_units + _EPS:  # even keeping what runs does not fit: shed the least pressed
        sheddable = [plan for plan in plans if granted[plan.pool] > plan.min_replicas]
        if not sheddable:
            break
        victim = min(sheddable, key=lambda plan: (plan.pressure, plan.pool))
        granted[victim.pool] -= 1
        used -= victim.units_per_replica
    left = budget_units - used
    passed_over: set[str] = set()
    lent: dict[tuple[str, str], int] = {}  # (donor, receiver) -> replicas
    while True:
        candidates = [plan for plan in plans if granted[plan.pool] < wanted[plan.pool] and plan.pool not in passed_over]
        if not candidates:
            break
        best = max(candidates, key=lambda plan: (_projected(plan, granted[plan.pool]), plan.pool))
        if best.units_per_replica > left + _EPS:
            left += _borrow(best, plans, granted, best.units_per_replica - left, lent)
        if best.units_per_replica > left + _EPS:
            passed_over.add(best.pool)  # smaller pools may still fit in what is left
            continue
        granted[best.pool] += 1
        left -= best.units_per_replica
    for (donor, receiver), count in lent.items():
        result.note(donor, f"gave {count} replica(s) of a shared budget to {receiver}, which is over its SLO")
    for plan in plans:
        got, want = granted[plan.pool], wanted[plan.pool]
        if got < want:
            result.note(plan.pool, f"budget {budget_units:g} units: got {got} of {want} "
                                   f"({plan.units_per_replica:g} units each)")
        result.targets[plan.pool] = got


def _borrow(receiver: PoolPlan, plans: list[PoolPlan], granted: dict[str, int], units: float,
            lent: dict[tuple[str, str], int]) -> float:
    """Units freed for a pool over its SLO by pools under theirs that hold more than they need
    (never below their allowed range): all of `units`, or nothing."""
    if receiver.pressure <= 1.0:
        return 0.0
    donors = sorted((plan for plan in plans if plan is not receiver and plan.pressure < 1.0),
                    key=lambda plan: (plan.pressure, plan.pool))
    spare = {plan.pool: granted[plan.pool] - max(plan.lo, plan.need, plan.min_replicas) for plan in donors}
    if sum(max(spare[plan.pool], 0) * plan.units_per_replica for plan in donors) < units - _EPS:
        return 0.0
    freed = 0.0
    for donor in donors:
        given = 0
        while freed < units - _EPS and given < spare[donor.pool]:
            given += 1
            freed += donor.units_per_replica
        if given:
            granted[donor.pool] -= given
            lent[(donor.pool, receiver.pool)] = lent.get((donor.pool, receiver.pool), 0) + given
    return freed


def _projected(plan: PoolPlan, replicas: int) -> float:
    """The pool's pressure if its load were spread over `replicas` (ready ones carry it now)."""
    if math.isinf(plan.pressure):
        return math.inf
    return plan.pressure * max(plan.ready, 1) / max(replicas, 1)
