"""The coefficients of the float32 erf in mojo/pha_decode_step.mojo (``_erf``) and its error.

erf(x) = x P(x^2) / Q(x^2) for |x| < CLAMP, P of degree 6 and Q of degree 5 with Q(0) = 1,
and the value at +-CLAMP beyond it (erf(3.9) rounds to 1 in float32). One branch and no exp,
where the standard library's erf computes two (a polynomial; an exp of a polynomial) and
selects: the GELU layers' epilogue pays it on every output (docs/pha_engine.md).

The fit: least squares of the linearized error x (P - f Q) over dense points of [0, CLAMP]
(f = erf(x) / x), each point weighted by 1 / Q of the previous fit (so the error fitted is
erf's), then Lawson's reweighting towards the smallest largest error. It prints the
coefficients as the Mojo code has them (float32) and the largest error of erf in float32
arithmetic with fused multiply-adds, as the op evaluates it, against math.erf:

    python scripts/fit_erf.py
"""

from __future__ import annotations

import math

import numpy as np

CLAMP = 3.9
P_DEGREE, Q_DEGREE = 6, 5


def fit(clamp: float = CLAMP, p_degree: int = P_DEGREE, q_degree: int = Q_DEGREE,
        rounds: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """(P's coefficients, Q's) from the constant term up, Q's first 1."""
    x = np.unique(np.concatenate([clamp / 2 * (1 + np.cos(np.linspace(0, np.pi, 4000))),
                                  np.linspace(0, clamp, 4000)]))
    f = np.array([math.erf(v) / v if v > 0 else 2 / math.sqrt(math.pi) for v in x])
    t = x * x
    weights, q_prev = np.ones_like(t), np.ones_like(t)
    for _ in range(rounds):
        powers = t[:, None] ** np.arange(max(p_degree, q_degree) + 1)
        a = np.concatenate([powers[:, : p_degree + 1], -f[:, None] * powers[:, 1 : q_degree + 1]], axis=1)
        row_weight = weights * x / np.abs(q_prev) + 1e-12  # x = 0 kept, barely
        sol, *_ = np.linalg.lstsq(a * row_weight[:, None], f * row_weight, rcond=None)
        p, q = sol[: p_degree + 1], np.concatenate([[1.0], sol[p_degree + 1 :]])
        q_prev = np.polyval(q[::-1], t)
        error = np.abs(x * (np.polyval(p[::-1], t) / q_prev - f))
        weights = weights * (np.sqrt(error / error.max()) + 1e-3)
        weights /= weights.max()
    return p.astype(np.float32), q.astype(np.float32)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a b + c rounded once to float32 (float64 holds a float32 product exactly)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def erf_float32(x: np.ndarray, p: np.ndarray, q: np.ndarray, clamp: float = CLAMP) -> np.ndarray:
    """erf as the op computes it: float32, Horner's rule by fused multiply-adds."""
    x = np.clip(np.asarray(x, np.float32), -np.float32(clamp), np.float32(clamp))
    t = x * x
    num, den = np.full_like(t, p[-1]), np.full_like(t, q[-1])
    for c in p[-2::-1]:
        num = _fma(num, t, np.full_like(t, c))
    for c in q[-2::-1]:
        den = _fma(den, t, np.full_like(t, c))
    return (x * num) / den


def main() -> None:
    p, q = fit()
    x = np.linspace(-8, 8, 400_001, dtype=np.float32)
    error = np.abs(erf_float32(x, p, q).astype(np.float64) - np.array([math.erf(float(v)) for v in x]))
    print("P:", ", ".join(repr(float(c)) for c in p))
    print("Q:", ", ".join(repr(float(c)) for c in q))
    print(f"largest error of erf in float32 on [-8, 8]: {error.max():.3g} at {x[error.argmax()]:.4f}; "
          f"erf(+-{CLAMP}) = {erf_float32(np.array([CLAMP, -CLAMP]), p, q)}")


if __name__ == "__main__":
    main()
