"""The study file (`study.yaml`): what a pre-registered analysis compares, read and checked before any run is.

Every key is required, and a key the schema does not know is refused with its name, so a typo cannot
drop an endpoint or a comparison unseen. Seeds are a list of integers or a range `"first-last"`
(inclusive). An endpoint reads one accuracy of the test evaluation during PPO (`metric`: `greedy`,
`sampled` or `pass@K`) either at one iteration (`iteration: 25`) or as the area under its curve over
the listed iterations (`area: [0, 25, 50, 75, 100]`, `stats.curve_area`). See
`experiments/prm_vs_orm_flaw/study.yaml` for a whole file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from prmppo.report.runs import ReportError

_PASS_AT = re.compile(r"pass@([1-9][0-9]*)$")
_RANGE = re.compile(r"([0-9]+)-([0-9]+)$")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*$")
LAST = "last"  # a compute-matched arm's iteration: its last evaluation


class SpecError(ReportError):
    """A study file that cannot be used; the message names the file, the key and what would be valid."""


@dataclass(frozen=True)
class Endpoint:
    id: str
    label: str
    metric: str  # greedy | sampled | pass@K
    iteration: int | None  # one evaluation, or None for an area
    area: tuple[int, ...] | None  # iterations of the trapezoid, or None

    @property
    def outcome(self) -> str:
        """What `stats.outcome_grid` reads from a per-problem row for this metric."""
        return "pass" if self.metric.startswith("pass@") else self.metric

    @property
    def k(self) -> int | None:
        """K of a pass@K metric (the samples per problem the evaluation must have drawn), else None."""
        match = _PASS_AT.match(self.metric)
        return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Comparison:
    arm: str
    against: str
    seeds: tuple[int, ...]
    label: str
    description: str


@dataclass(frozen=True)
class Matched:
    """`arm` at `iteration` against `against` at its last evaluation (more iterations for the same compute)."""
    arm: str
    iteration: int
    against: str
    metrics: tuple[str, ...]
    seeds: tuple[int, ...]
    label: str
    description: str


@dataclass(frozen=True)
class PrmQuality:
    id: str
    label: str
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class Spec:
    title: str
    root: str  # the archive's top directory: <root>/ppo/<arm>/s<seed>, <root>/prm/<id>/s<seed>
    baseline: str
    primary: str
    seeds: tuple[int, ...]
    endpoints: tuple[Endpoint, ...]
    margin: float
    alpha: float
    bootstrap_resamples: int
    bootstrap_seed: int
    secondary: tuple[Comparison, ...]
    compute_matched: Matched | None
    prm_quality: tuple[PrmQuality, ...]

    def arms(self) -> list[str]:
        """Every PPO arm the study names, in the order it first names them."""
        named = [self.baseline, self.primary]
        for c in self.secondary:
            named += [c.arm, c.against]
        if self.compute_matched:
            named += [self.compute_matched.arm, self.compute_matched.against]
        return list(dict.fromkeys(named))

    def seeds_of(self, arm: str) -> tuple[int, ...]:
        """The seeds the study runs `arm` on: the union over every comparison that names it."""
        seeds = set(self.seeds) if arm in (self.baseline, self.primary) else set()
        for c in (*self.secondary, *([self.compute_matched] if self.compute_matched else [])):
            if arm in (c.arm, c.against):
                seeds |= set(c.seeds)
        return tuple(sorted(seeds))


class _Reader:
    """Typed reads of one mapping of the study file, each error naming the file and the key's path."""

    def __init__(self, file: str, where: str, node: object, keys: tuple[str, ...]):
        self.file, self.where = file, where
        if not isinstance(node, dict):
            self.fail("", f"must be a mapping with the keys {', '.join(keys)}, got {type(node).__name__}")
        unknown = sorted(set(map(str, node)) - set(keys))
        if unknown:
            self.fail(unknown[0], f"is not a key of the study file here (valid: {', '.join(keys)})")
        missing = [key for key in keys if key not in node]
        if missing:
            self.fail(missing[0], "is required")
        self.node = node

    def fail(self, key: str, why: str):
        path = ".".join(part for part in (self.where, key) if part)
        raise SpecError(f"{self.file}: {path or 'the file'} {why}")

    def get(self, key: str, kind: type | tuple[type, ...]):
        value = self.node[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            self.fail(key, f"must be a {names}, got {value!r}")
        return value

    def text(self, key: str) -> str:
        return self.get(key, str)

    def ident(self, key: str) -> str:
        value = self.text(key)
        if not _ID.match(value):
            self.fail(key, f"must be a directory name (letters, digits, _ . -), got {value!r}")
        return value

    def number(self, key: str, low: float, high: float) -> float:
        value = float(self.get(key, (int, float)))
        if not low < value < high:
            self.fail(key, f"must lie in ({low:g}, {high:g}), got {value:g}")
        return value

    def seeds(self, key: str) -> tuple[int, ...]:
        value = self.node[key]
        if isinstance(value, str) and (match := _RANGE.match(value.strip())):
            first, last = int(match.group(1)), int(match.group(2))
            if first <= last:
                return tuple(range(first, last + 1))
        if isinstance(value, list) and value and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                     for s in value) and len(set(value)) == len(value):
            return tuple(sorted(value))
        self.fail(key, f"must be a list of distinct seeds >= 0 or a range 'first-last', got {value!r}")

    def items(self, key: str) -> list:
        value = self.node[key]
        if not isinstance(value, list):
            self.fail(key, f"must be a list, got {value!r}")
        return value


def _metric(r: _Reader, key: str, value: object = None) -> str:
    value = r.text(key) if value is None else value
    if not isinstance(value, str) or (value not in ("greedy", "sampled") and not _PASS_AT.match(value)):
        r.fail(key, f"must be greedy, sampled or pass@K, got {value!r}")
    return value


def _endpoint(file: str, where: str, node) -> Endpoint:
    keys = ("id", "label", "metric", "iteration") if isinstance(node, dict) and "iteration" in node \
        else ("id", "label", "metric", "area")
    r = _Reader(file, where, node, keys)
    if "iteration" in keys:
        iteration = r.get("iteration", int)
        if iteration < 0:
            r.fail("iteration", f"must be >= 0, got {iteration}")
        return Endpoint(r.ident("id"), r.text("label"), _metric(r, "metric"), iteration, None)
    area = r.items("area")
    integers = all(isinstance(x, int) and not isinstance(x, bool) for x in area)
    if len(area) < 2 or not integers or area != sorted(set(area)):
        r.fail("area", f"must list 2 or more increasing iterations, got {area!r}")
    return Endpoint(r.ident("id"), r.text("label"), _metric(r, "metric"), None, tuple(area))


def _comparison(file: str, where: str, node) -> Comparison:
    r = _Reader(file, where, node, ("arm", "against", "seeds", "label", "description"))
    return Comparison(r.ident("arm"), r.ident("against"), r.seeds("seeds"), r.text("label"), r.text("description"))


def _matched(file: str, node) -> Matched:
    r = _Reader(file, "compute_matched", node,
                ("arm", "iteration", "against", "metrics", "seeds", "label", "description"))
    metrics = tuple(_metric(r, f"metrics[{i}]", m) for i, m in enumerate(r.items("metrics")))
    if not metrics:
        r.fail("metrics", "must list at least one metric")
    return Matched(r.ident("arm"), r.get("iteration", int), r.ident("against"), metrics, r.seeds("seeds"),
                   r.text("label"), r.text("description"))


KEYS = ("title", "root", "baseline", "primary", "seeds", "endpoints", "margin", "alpha", "bootstrap", "secondary",
        "compute_matched", "prm_quality")


def load_spec(path: str | Path) -> Spec:
    """The study file at `path`, checked whole (see the module docstring)."""
    path = Path(path)
    file = path.name
    try:
        node = yaml.safe_load(path.read_text())
    except OSError as err:
        raise SpecError(f"{file}: the study file cannot be read ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{file}: not valid YAML ({err})") from None
    r = _Reader(file, "", node, KEYS)
    boot = _Reader(file, "bootstrap", node["bootstrap"], ("resamples", "seed"))
    resamples, boot_seed = boot.get("resamples", int), boot.get("seed", int)
    if resamples < 100:
        boot.fail("resamples", f"must be >= 100, got {resamples}")
    endpoints = tuple(_endpoint(file, f"endpoints[{i}]", e) for i, e in enumerate(r.items("endpoints")))
    if not endpoints or len({e.id for e in endpoints}) != len(endpoints):
        r.fail("endpoints", "must list at least one endpoint, each with its own id")
    quality = []
    for i, item in enumerate(r.items("prm_quality")):
        q = _Reader(file, f"prm_quality[{i}]", item, ("id", "label", "seeds"))
        quality.append(PrmQuality(q.ident("id"), q.text("label"), q.seeds("seeds")))
    matched = None if node["compute_matched"] is None else _matched(file, node["compute_matched"])
    spec = Spec(r.text("title"), r.ident("root"), r.ident("baseline"), r.ident("primary"), r.seeds("seeds"),
                endpoints, r.number("margin", 0, 1), r.number("alpha", 0, 1), resamples, boot_seed,
                tuple(_comparison(file, f"secondary[{i}]", c) for i, c in enumerate(r.items("secondary"))),
                matched, tuple(quality))
    if spec.baseline == spec.primary:
        r.fail("primary", f"must differ from the baseline, both are {spec.primary!r}")
    return spec
