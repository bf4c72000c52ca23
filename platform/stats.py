"""Small, pure statistics for comparing runs across seeds: Student-t intervals and differences.

No SciPy: the Student-t quantile comes from its CDF (the regularized incomplete beta function,
evaluated by Lentz's continued fraction as in Numerical Recipes §6.4) inverted by bisection, which
is exact to ~1e-12 and fast enough for tables. Every function takes plain floats.

Conventions: a confidence interval is ``estimate ± half_width`` with
``half_width = t_{1-(1-level)/2, df} · standard error``; with fewer than two values there is no
spread estimate and ``half_width`` is NaN (reported as "n/a", never as 0).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Interval:
    estimate: float  # the mean (or the mean difference)
    half_width: float  # t quantile x standard error; NaN when it cannot be estimated
    n: int  # values (or pairs) behind the estimate
    df: float  # degrees of freedom of the t quantile
    level: float = 0.95
    method: str = "t"  # "t" (one sample), "paired", "Welch"

    @property
    def low(self) -> float:
        return self.estimate - self.half_width

    @property
    def high(self) -> float:
        return self.estimate + self.half_width

    def excludes_zero(self) -> bool:
        return math.isfinite(self.half_width) and (self.low > 0 or self.high < 0)


# --- the Student-t distribution -------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc: x={x} must be in [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the continued fraction converges fast here; else use symmetry
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom (``math.inf``: the normal)."""
    if df <= 0:
        raise ValueError(f"t_cdf: df={df} must be > 0")
    if math.isinf(df):
        return statistics.NormalDist().cdf(t)
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom, e.g. t_quantile(0.975, 2) = 4.3027."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p={p} must be in (0, 1)")
    if df <= 0:
        raise ValueError(f"t_quantile: df={df} must be > 0")
    if math.isinf(df):
        return statistics.NormalDist().inv_cdf(p)
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:  # bracket, then bisect: the CDF is monotone
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# --- intervals ----------------------------------------------------------------------------------------
def _quantile_for(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level={level} must be in (0, 1)")
    return 1.0 - (1.0 - level) / 2.0


def mean_ci(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean and its Student-t interval: mean ± t_{q, n-1} · s / √n (s: the sample standard deviation)."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return Interval(math.nan, math.nan, 0, 0.0, level)
    m = statistics.fmean(xs)
    if n < 2:
        return Interval(m, math.nan, n, 0.0, level)
    se = statistics.stdev(xs) / math.sqrt(n)
    return Interval(m, t_quantile(_quantile_for(level), n - 1) * se, n, float(n - 1), level)


def welch_ci(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """mean(a) - mean(b) with Welch's interval (unequal variances, Welch–Satterthwaite df)."""
    xa, xb = [float(v) for v in a], [float(v) for v in b]
    na, nb = len(xa), len(xb)
    if na == 0 or nb == 0:
        return Interval(math.nan, math.nan, min(na, nb), 0.0, level, "Welch")
    diff = statistics.fmean(xa) - statistics.fmean(xb)
    if na < 2 or nb < 2:
        return Interval(diff, math.nan, min(na, nb), 0.0, level, "Welch")
    va, vb = statistics.variance(xa) / na, statistics.variance(xb) / nb
    se2 = va + vb
    if se2 == 0.0:
        return Interval(diff, 0.0, min(na, nb), float(na + nb - 2), level, "Welch")
    df = se2 * se2 / (va * va / (na - 1) + vb * vb / (nb - 1))
    return Interval(diff, t_quantile(_quantile_for(level), df) * math.sqrt(se2), min(na, nb), df, level, "Welch")


def paired_ci(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """mean(a_i - b_i) over aligned pairs (same seed), with the one-sample t interval of the differences."""
    if len(a) != len(b):
        raise ValueError(f"paired_ci: {len(a)} vs {len(b)} values; pairs must align")
    iv = mean_ci([float(x) - float(y) for x, y in zip(a, b)], level)
    return Interval(iv.estimate, iv.half_width, iv.n, iv.df, level, "paired")


def difference_ci(a: Mapping[int, float], b: Mapping[int, float], level: float = 0.95) -> Interval:
    """Variant minus baseline, both keyed by seed: paired by seed when both have the same seeds (and at
    least two), which removes the seed-to-seed variation they share; otherwise Welch."""
    if set(a) == set(b) and len(a) >= 2:
        seeds = sorted(a)
        return paired_ci([a[s] for s in seeds], [b[s] for s in seeds], level)
    return welch_ci(list(a.values()), list(b.values()), level)


def seeds_to_resolve(iv: Interval, limit: int = 1000) -> int | None:
    """For an unresolved *paired* difference: the fewest pairs n with t_{q, n-1} · s / √n < |estimate|,
    s the standard deviation of the differences behind ``iv`` (recovered from its half width). A
    planning estimate for the next study (if the difference is real and this large, at this seed-to-seed
    spread, about n seeds resolve it), not a power calculation. None when it does not apply (not paired,
    fewer than two pairs, already resolved, a zero estimate); ``limit + 1`` when more than ``limit``."""
    if iv.method != "paired" or iv.n < 2 or not math.isfinite(iv.half_width) or iv.excludes_zero():
        return None
    if iv.estimate == 0.0 or iv.half_width == 0.0:
        return None
    q = _quantile_for(iv.level)
    s = iv.half_width * math.sqrt(iv.n) / t_quantile(q, iv.n - 1)
    for n in range(2, limit + 1):
        if t_quantile(q, n - 1) * s / math.sqrt(n) < abs(iv.estimate):
            return n
    return limit + 1


def median(values: Sequence[float]) -> float:
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return statistics.median(xs) if xs else math.nan


# --- report helpers -----------------------------------------------------------------------------------
def fmt(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def fmt_interval(iv: Interval, digits: int = 4, signed: bool = False) -> str:
    """``2.0000 ± 2.4841`` (or ``+0.0123 ± 0.0040`` when ``signed``); ``n/a`` parts where undefined."""
    if not math.isfinite(iv.estimate):
        return "n/a"
    est = f"{iv.estimate:+.{digits}f}" if signed else f"{iv.estimate:.{digits}f}"
    return f"{est} ± {fmt(iv.half_width, digits)}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one letter per column: l(eft) or r(ight)."""
    align = align or "l" * len(headers)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
