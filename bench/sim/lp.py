"""A small dense linear program solver with a certified upper bound (no scipy).

    maximize c.x  subject to  A x <= b,  0 <= x <= u   (u finite)

`solve` runs a primal-dual interior-point method (Mehrotra predictor-corrector) on the equality
form with a slack per row, every variable boxed. Its answer is not trusted as is: the value
returned is the weak-duality bound of the multipliers it found, repaired to be dual feasible:

    for any y >= 0:  c.x <= y.b + sum_k u_k * max(0, c_k - (A^T y)_k)   for every feasible x

(c.x <= c.x + y.(b - A x) = y.b + (c - A^T y).x, and x_k <= u_k). So the figure is an upper
bound on the optimum whatever the solver's accuracy; a converged solver makes it the optimum
(the primal value it reached is returned beside it, and the gap between them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LPResult:
    bound: float
    """Certified: at least the optimum (weak duality on the repaired multipliers)."""
    primal: float
    """c.x of the solver's last point, clipped into the box (feasible to `infeasibility`)."""
    x: np.ndarray
    y: np.ndarray
    """Row multipliers (>= 0) that certify `bound`."""
    infeasibility: float
    """Largest row violation max(A x - b) of `x`, relative to max(1, |b|)."""
    iterations: int


def certify(c: np.ndarray, A: np.ndarray, b: np.ndarray, u: np.ndarray, y: np.ndarray) -> float:
    """The weak-duality bound of multipliers `y` (negatives clipped to 0)."""
    y = np.maximum(y, 0.0)
    return float(y @ b + u @ np.maximum(0.0, c - A.T @ y))


def _pairs(A: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, ...]:
    """Columns with at most two nonzeros as (column, row 1, value 1, row 2, value 2); a
    one-entry column has row 2 = row 1 and value 2 = 0."""
    nz = A[:, cols] != 0
    r1 = nz.argmax(axis=0)
    nz[r1, np.arange(cols.size)] = False
    has2 = nz.any(axis=0)
    r2 = np.where(has2, nz.argmax(axis=0), r1)
    v1 = A[r1, cols]
    v2 = np.where(has2, A[r2, cols], 0.0)
    return cols, r1, v1, r2, v2


def _normal(A: np.ndarray, theta: np.ndarray, dense: np.ndarray, sparse: tuple[np.ndarray, ...]) -> np.ndarray:
    """A diag(theta) A^T: a matrix product over the dense columns, outer products of the rest."""
    Ad = A[:, dense]
    M = (Ad * theta[dense]) @ Ad.T
    cols, r1, v1, r2, v2 = sparse
    t = theta[cols]
    np.add.at(M, (r1, r1), t * v1 * v1)
    np.add.at(M, (r2, r2), t * v2 * v2)
    np.add.at(M, (r1, r2), t * v1 * v2)
    np.add.at(M, (r2, r1), t * v1 * v2)
    return M


def _step_len(v: np.ndarray, dv: np.ndarray) -> float:
    neg = dv < 0
    return float(min(1.0, (-v[neg] / dv[neg]).min())) if neg.any() else 1.0


def solve(c: np.ndarray, A: np.ndarray, b: np.ndarray, u: np.ndarray, tol: float = 1e-9,
          max_iter: int = 80, gap: float = 3e-4) -> LPResult:
    """Maximize c.x over A x <= b, 0 <= x <= u (module docstring). Stops once the certified
    bound is within `gap` (relative) of a point feasible to 1e-6. Variables boxed at 0 are left out."""
    keep = u > 0
    live = (A[:, keep] > 0).any(axis=1)  # a row with no positive coefficient left holds at x >= 0
    if (b[~live] < 0).any():
        raise ValueError("infeasible: a row with no positive coefficient asks for a negative bound")
    if not keep.all() or not live.all():
        r = solve(c[keep], A[np.ix_(live, keep)], b[live], u[keep], tol, max_iter, gap)
        x, y = np.zeros(u.size), np.zeros(b.size)
        x[keep], y[live] = r.x, r.y
        return LPResult(bound=certify(c, A, b, u, y), primal=r.primal, x=x, y=y,
                        infeasibility=r.infeasibility, iterations=r.iterations)
    m, n = A.shape
    # equality form: [A I] (x, s) = b, 0 <= s <= us (the most any row can be slack)
    us = b + np.maximum(0.0, -A) @ u
    if (us < 0).any():
        raise ValueError("infeasible: some row cannot be met even at its most favourable x")
    us = np.maximum(us, 1e-3 * max(1.0, float(np.abs(b).max())))  # a box no slack reaches: changes nothing
    ip = _IPM(np.hstack([A, np.eye(m)]), b, np.concatenate([-c, np.zeros(m)]), np.concatenate([u, us]))
    bscale = max(1.0, float(np.abs(b).max()))
    it = 0
    for it in range(1, max_iter + 1):
        mu, infeas = ip.step()
        if mu < tol * ip.scale and infeas < 1e-9 * bscale:
            break
        if it > 5 and infeas < 1e-6 * bscale:
            lo, hi = float(c @ np.clip(ip.x[:n], 0.0, u)), certify(c, A, b, u, -ip.y)
            if hi - lo <= gap * abs(hi):
                break
    xs = np.clip(ip.x[:n], 0.0, u)
    yin = np.maximum(0.0, -ip.y)  # the inequality form's multipliers (>= 0)
    viol = float(np.max(A @ xs - b) / bscale) if m else 0.0
    return LPResult(bound=certify(c, A, b, u, yin), primal=float(c @ xs), x=xs, y=yin,
                    infeasibility=max(0.0, viol), iterations=it)


class _IPM:
    """Mehrotra predictor-corrector on: minimize c.x, A x = b, 0 <= x <= u (w = u - x)."""

    def __init__(self, A: np.ndarray, b: np.ndarray, c: np.ndarray, u: np.ndarray) -> None:
        self.A, self.b, self.c, self.u = A, b, c, u
        self.scale = max(1.0, float(np.abs(c).max()))
        nnz = (A != 0).sum(axis=0)
        self.dense = np.flatnonzero(nnz > 2)
        self.sparse = _pairs(A, np.flatnonzero(nnz <= 2))
        self.x, self.w = 0.5 * u, 0.5 * u
        self.y = np.zeros(A.shape[0])
        self.v = np.full(u.size, self.scale)
        self.z = np.maximum(np.full(u.size, self.scale), c + self.v)

    def _direction(self, rxz: np.ndarray, rwv: np.ndarray) -> tuple[np.ndarray, ...]:
        x, w, z, v = self.x, self.w, self.z, self.v
        r = self.rc - rxz / x + (rwv - v * self.ru) / w
        dy = np.linalg.solve(self.L.T, np.linalg.solve(self.L, self.rb + self.A @ (self.theta * r)))
        dx = self.theta * (self.A.T @ dy - r)
        dz = (rxz - z * dx) / x
        dw = self.ru - dx
        dv = (rwv - v * dw) / w
        return dx, dw, dy, dz, dv

    def step(self) -> tuple[float, float]:
        """One predictor-corrector iteration; returns (mu, primal infeasibility) before it."""
        A, x, w, z, v = self.A, self.x, self.w, self.z, self.v
        self.rb = self.b - A @ x
        self.ru = self.u - x - w
        self.rc = self.c - A.T @ self.y - z + v
        k = 2 * x.size
        mu = float((x @ z + w @ v) / k)
        self.theta = 1.0 / (z / x + v / w)
        M = _normal(A, self.theta, self.dense, self.sparse)
        M[np.diag_indices(M.shape[0])] += 1e-12 * max(1.0, float(np.trace(M)) / M.shape[0])
        self.L = np.linalg.cholesky(M)
        dx, dw, dy, dz, dv = self._direction(-x * z, -w * v)  # affine (predictor)
        ap = min(_step_len(x, dx), _step_len(w, dw))
        ad = min(_step_len(z, dz), _step_len(v, dv))
        mu_aff = float(((x + ap * dx) @ (z + ad * dz) + (w + ap * dw) @ (v + ad * dv)) / k)
        sm = (mu_aff / mu) ** 3 * mu
        dx, dw, dy, dz, dv = self._direction(sm - x * z - dx * dz, sm - w * v - dw * dv)
        ap = 0.995 * min(_step_len(x, dx), _step_len(w, dw))
        ad = 0.995 * min(_step_len(z, dz), _step_len(v, dv))
        self.x, self.w = x + ap * dx, w + ap * dw
        self.y, self.z, self.v = self.y + ad * dy, z + ad * dz, v + ad * dv
        return mu, float(np.abs(self.rb).max())
