"""The search space of a sweep file: suggest one trial's values, enumerate a grid, write overrides.

Parameters are floats (optionally log-uniform or stepped), ints and
categoricals, each named by the config key it sets. `above: OTHER` makes a
parameter exceed another one: OTHER is suggested first and this one is drawn
from `[max(low, OTHER + gap), high]` (just above OTHER when gap is 0), so
every sampled pair is feasible and no trial is spent on `lower >= upper`.
The bounds are checked once, up front: the highest OTHER must still leave
room below `high`.

Optuna accepts a float or int parameter whose range changes from trial to
trial (it checks only the kind and log scale), and TPE models the values it
saw, so the moving lower bound costs the sampler nothing.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from dataclasses import dataclass
from typing import Any, Mapping

GRID_LIMIT = 100_000  # combinations; a grid this large is a mistake, not a sweep


class SearchSpaceError(ValueError):
    pass


@dataclass
class Param:
    name: str
    type: str
    low: float | None
    high: float | None
    log: bool
    step: float | None
    choices: list[Any] | None
    above: str | None
    gap: float
    grid: list[Any] | None

    def lowest(self, other: float) -> float:
        """The smallest value allowed when the parameter this one must exceed took `other`."""
        assert self.low is not None
        if self.type == "int":
            return max(self.low, other + max(1, math.ceil(self.gap)))
        if self.step:  # the first point of the grid low, low + step, ... that is allowed (1e-9: float noise)
            if self.gap > 0:
                k = math.ceil((other + self.gap - self.low) / self.step - 1e-9)
            else:
                k = math.floor((other - self.low) / self.step + 1e-9) + 1
            return round(self.low + max(k, 0) * self.step, 12)
        return max(self.low, other + self.gap if self.gap > 0 else math.nextafter(other, math.inf))

    def allows(self, value: Any, other: Any) -> bool:
        return value > other and value >= other + self.gap

    def values(self) -> list[Any]:
        """Every value the grid sampler tries."""
        if self.grid is not None:
            return list(self.grid)
        if self.type == "categorical":
            return list(self.choices or [])
        if self.type == "int":
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        if self.step:
            n = int(round((self.high - self.low) / self.step))
            return [round(self.low + i * self.step, 12) for i in range(n + 1)]
        raise SearchSpaceError(
            f"params.{self.name}: a continuous float needs `grid: [...]` (or a step) for sampler=grid"
        )


class SearchSpace:
    def __init__(self, params: Mapping[str, Mapping[str, Any]]):
        self.params = {name: _param(name, spec) for name, spec in params.items()}
        if not self.params:
            raise SearchSpaceError("hydra.sweeper.params is empty: a sweep file must name at least one parameter")
        self.order = _dependency_order(self.params)
        for p in self.params.values():
            _check_bounds(p, self.params)

    def suggest(self, trial: Any) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name in self.order:
            p = self.params[name]
            low = p.lowest(values[p.above]) if p.above else p.low
            if p.type == "float":
                values[name] = trial.suggest_float(name, low, p.high, log=p.log, step=p.step)
            elif p.type == "int":
                values[name] = trial.suggest_int(name, int(low), int(p.high), log=p.log, step=int(p.step or 1))
            else:
                values[name] = trial.suggest_categorical(name, p.choices)
        return values

    def grid(self, seed: int) -> list[dict[str, Any]]:
        """Every feasible combination once, in an order shuffled by `seed` (a cut-short grid is still spread out)."""
        names = list(self.order)
        size = math.prod(len(self.params[n].values()) for n in names)
        if size > GRID_LIMIT:
            raise SearchSpaceError(f"the grid has {size} combinations (limit {GRID_LIMIT}); give coarser `grid:` lists")
        combos = []
        for values in itertools.product(*(self.params[n].values() for n in names)):
            combo = dict(zip(names, values))
            if all(p.allows(combo[n], combo[p.above]) for n, p in self.params.items() if p.above):
                combos.append(combo)
        random.Random(seed).shuffle(combos)
        return combos


def overrides(values: Mapping[str, Any]) -> list[str]:
    """`key=value` command-line overrides, quoted where Hydra's grammar needs it."""
    return [f"{name}={override_value(value)}" for name, value in values.items()]


def override_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    text = str(value)
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]*", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _param(name: str, spec: Mapping[str, Any]) -> Param:
    get = spec.get
    p = Param(
        name,
        get("type", "float"),
        get("low"),
        get("high"),
        bool(get("log", False)),
        get("step"),
        _plain(get("choices")),
        get("above"),
        float(get("gap", 0.0)),
        _plain(get("grid")),
    )
    where = f"params.{name}"
    if p.type not in ("float", "int", "categorical"):
        raise SearchSpaceError(f"{where}.type={p.type!r}: choose float, int or categorical")
    if p.type == "categorical":
        if not p.choices:
            raise SearchSpaceError(f"{where}: a categorical needs `choices: [...]`")
        if p.above:
            raise SearchSpaceError(f"{where}: `above` needs a float or int parameter")
        return p
    if p.low is None or p.high is None or not p.low < p.high:
        raise SearchSpaceError(f"{where}: needs low < high (got low={p.low}, high={p.high})")
    if p.log and p.low <= 0:
        raise SearchSpaceError(f"{where}: log scale needs low > 0 (got {p.low})")
    if p.log and p.step:
        raise SearchSpaceError(f"{where}: choose log or step, not both")
    if p.type == "int" and not all(float(v).is_integer() for v in (p.low, p.high, p.step or 1)):
        raise SearchSpaceError(f"{where}: an int parameter needs integer low, high and step")
    return p


def _plain(values: Any) -> list[Any] | None:
    if values is None:
        return None
    from omegaconf import OmegaConf

    return OmegaConf.to_container(values) if OmegaConf.is_config(values) else list(values)


def _dependency_order(params: dict[str, Param]) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in path:
            raise SearchSpaceError(f"params: `above` goes round in a circle: {' -> '.join(path + (name,))}")
        above = params[name].above
        if above:
            if above not in params:
                raise SearchSpaceError(f"params.{name}.above={above!r}: no such parameter; have {sorted(params)}")
            visit(above, path + (name,))
        order.append(name)

    for name in params:
        visit(name, ())
    return order


def _check_bounds(p: Param, params: dict[str, Param]) -> None:
    """Even the highest value of the parameter below must leave this one a value: never an infeasible pair."""
    if not p.above:
        return
    other = params[p.above]
    if other.type == "categorical":
        raise SearchSpaceError(f"params.{p.name}.above={p.above!r}: must be a float or int parameter")
    if p.lowest(other.high) > p.high:
        raise SearchSpaceError(
            f"params.{p.name}: high={p.high} leaves no value above {p.above}'s high={other.high} (gap {p.gap}); raise {p.name}.high or lower {p.above}.high"
        )
