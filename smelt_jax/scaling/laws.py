"""Parametric loss laws: SMELT's L(F,S,D), Chinchilla's L(N,D) and the looped law of Schwethelm et al.

Each law is a small frozen dataclass holding its parameters under their published names, with
`predict`, and where a closed form exists the compute-optimal allocation, the frontier loss L*(C) and its
inverse. Each also knows its log-sum-exp ("raw") parametrisation, which is what the fitter optimises:
log L = logsumexp(log_terms(raw, features)). All functions here are plain numpy; `log_terms` is written
with an array namespace argument so the fitter can trace it with jax.numpy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from smelt_jax.platform.errors import UsageError


def _positive(name: str, value: float) -> None:
    if not (np.isfinite(value) and value > 0):
        raise UsageError(f"{name} must be finite and > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not (np.isfinite(value) and value >= 0):
        raise UsageError(f"{name} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True)
class SmeltLaw:
    """L(F, S, D) = E + A (1-S)^b / F^a + K / D^c  (paper §7).

    F: training FLOPs per token, S: compute-equivalent sparsity in [0, 1), D: training tokens.
    Compute C = F * D.
    """

    E: float
    A: float
    K: float
    a: float
    b: float
    c: float

    name: ClassVar[str] = "smelt"
    param_names: ClassVar[tuple[str, ...]] = ("E", "A", "K", "a", "b", "c")
    # raw = (log E, log A, log K, log a, b, log c); features = (log F, log(1-S), log D). The capacity
    # and data exponents are fitted in log space so every fit lies in the law's domain (a, c > 0:
    # more compute or data never raises the loss), as the paper's bounded L-BFGS-B does; on data
    # that cannot identify them they go to ~0 instead of turning negative.
    raw_names: ClassVar[tuple[str, ...]] = ("log_E", "log_A", "log_K", "log_a", "b", "log_c")
    columns: ClassVar[tuple[str, ...]] = ("F", "S", "D")

    def __post_init__(self):
        # E, A, K, a, c >= 0: a fit whose log-parameter runs off to -inf (data that cannot identify
        # that term) is written at the bound 0 (scaling/written.py); scaling/health.py reports it.
        for name in ("E", "A", "K", "a", "c"):
            _non_negative(name, getattr(self, name))
        if not np.isfinite(self.b):
            raise UsageError(f"b must be finite, got {self.b!r}")

    # --- prediction -------------------------------------------------------------------------------
    def predict(self, F, S, D):
        """Loss at per-token FLOPs F, sparsity S, tokens D (broadcasting arrays)."""
        F, S, D = np.asarray(F, float), np.asarray(S, float), np.asarray(D, float)
        return self.E + self.A * (1.0 - S) ** self.b / F ** self.a + self.K / D ** self.c

    @staticmethod
    def features(table) -> np.ndarray:
        """[n, 3] features (log F, log(1-S), log D) from a table with columns F, S, D."""
        return np.stack([np.log(table["F"]), np.log1p(-np.asarray(table["S"], float)),
                         np.log(table["D"])], axis=1)

    @staticmethod
    def log_terms(raw, features, xp=np):
        """[n, 3] log of the three additive terms; raw [6], features [n, 3]."""
        log_e, log_a, log_k, log_exp_a, b, log_exp_c = (raw[i] for i in range(6))
        a, c = xp.exp(log_exp_a), xp.exp(log_exp_c)
        n = features.shape[0]
        return xp.stack([xp.full((n,), 1.0) * log_e,
                         log_a + b * features[:, 1] - a * features[:, 0],
                         log_k - c * features[:, 2]], axis=1)

    def to_raw(self) -> np.ndarray:
        return np.array([np.log(self.E), np.log(self.A), np.log(self.K), np.log(self.a), self.b,
                         np.log(self.c)])

    @classmethod
    def from_raw(cls, raw) -> SmeltLaw:
        raw = [float(v) for v in raw]
        return cls(E=np.exp(raw[0]), A=np.exp(raw[1]), K=np.exp(raw[2]), a=np.exp(raw[3]), b=raw[4],
                   c=np.exp(raw[5]))

    @staticmethod
    def start_grid() -> np.ndarray:
        """[starts, 6] raw initial points (1,296): a coarse Chinchilla-style grid."""
        exponents = np.log([0.2, 0.5, 1.0])
        axes = [np.array([0.0, 0.5]), np.arange(0.0, 20.1, 5.0), np.arange(0.0, 20.1, 5.0),
                exponents, np.array([0.0, 0.3, 0.6]), exponents]
        # 2*5*5*3*3*3 = 1350
        return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 6)

    # --- compute-optimal allocation under C = F * D --------------------------------------------------
    def _capacity(self, S):
        return self.A * (1.0 - np.asarray(S, float)) ** self.b

    def gamma(self) -> float:
        """Frontier exponent a c / (a + c) (a NumPy float: 0 or NaN, not an error, at a bound)."""
        with np.errstate(invalid="ignore"):
            return np.float64(self.a) * self.c / (np.float64(self.a) + self.c)

    def optimal_flops_per_token(self, C, S):
        """F*(C, S) = (a A (1-S)^b C^c / (c K))^(1/(a+c))."""
        C = np.asarray(C, float)
        return (self.a * self._capacity(S) * C ** self.c / (self.c * self.K)) ** (1.0 / (self.a + self.c))

    def optimal_tokens(self, C, S):
        """D*(C, S) = C / F*."""
        return np.asarray(C, float) / self.optimal_flops_per_token(C, S)

    def tokens_per_parameter(self, C, S):
        """TPP = D* / (F*/6) at the optimum."""
        return 6.0 * self.optimal_tokens(C, S) / self.optimal_flops_per_token(C, S)

    def frontier_coefficient(self, S):
        """f in L*(C) = E + f C^(-gamma)."""
        g = (self.a * self._capacity(S) / (self.c * self.K)) ** (1.0 / (self.a + self.c))
        return self._capacity(S) * g ** (-self.a) + self.K * g ** self.c

    def frontier_loss(self, C, S):
        """L*(C, S) = E + f(S) C^(-gamma): the loss at the compute-optimal allocation."""
        return self.E + self.frontier_coefficient(S) * np.asarray(C, float) ** (-self.gamma())

    def compute_for_loss(self, loss, S):
        """Inverse frontier: the compute C with L*(C, S) = loss; inf where loss <= E."""
        loss = np.asarray(loss, float)
        excess = loss - self.E
        with np.errstate(divide="ignore", invalid="ignore"):
            out = (excess / self.frontier_coefficient(S)) ** (-1.0 / self.gamma())
        return np.where(excess > 0, out, np.inf)

    def to_dict(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in self.param_names}


@dataclass(frozen=True)
class ChinchillaLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta  (Hoffmann et al. 2022), compute C = 6 N D."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    name: ClassVar[str] = "chinchilla"
    param_names: ClassVar[tuple[str, ...]] = ("E", "A", "B", "alpha", "beta")
    # raw = (log E, log A, log B, alpha, beta); features = (log N, log D)
    raw_names: ClassVar[tuple[str, ...]] = ("log_E", "log_A", "log_B", "alpha", "beta")
    columns: ClassVar[tuple[str, ...]] = ("N", "D")

    def __post_init__(self):
        for name in self.param_names:
            _positive(name, getattr(self, name))

    def predict(self, N, D):
        N, D = np.asarray(N, float), np.asarray(D, float)
        return self.E + self.A / N ** self.alpha + self.B / D ** self.beta

    @staticmethod
    def features(table) -> np.ndarray:
        return np.stack([np.log(table["N"]), np.log(table["D"])], axis=1)

    @staticmethod
    def log_terms(raw, features, xp=np):
        """[n, 3] log terms; raw [5], features [n, 2]."""
        log_e, log_a, log_b, alpha, beta = (raw[i] for i in range(5))
        n = features.shape[0]
        return xp.stack([xp.full((n,), 1.0) * log_e, log_a - alpha * features[:, 0],
                         log_b - beta * features[:, 1]], axis=1)

    def to_raw(self) -> np.ndarray:
        return np.array([np.log(self.E), np.log(self.A), np.log(self.B), self.alpha, self.beta])

    @classmethod
    def from_raw(cls, raw) -> ChinchillaLaw:
        raw = [float(v) for v in raw]
        return cls(E=np.exp(raw[0]), A=np.exp(raw[1]), B=np.exp(raw[2]), alpha=raw[3], beta=raw[4])

    @staticmethod
    def start_grid() -> np.ndarray:
        """[4500, 5] Hoffmann et al.'s grid: e in -1..1 step .5, a, b in 0..25 step 5, alpha, beta in 0..2 step .5."""
        axes = [np.arange(-1.0, 1.01, 0.5), np.arange(0.0, 25.1, 5.0), np.arange(0.0, 25.1, 5.0),
                np.arange(0.0, 2.01, 0.5), np.arange(0.0, 2.01, 0.5)]
        return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 5)

    def gamma(self) -> float:
        return self.alpha * self.beta / (self.alpha + self.beta)

    def optimal_params(self, C):
        """N*(C) = G (C/6)^(beta/(alpha+beta)), G = (alpha A / (beta B))^(1/(alpha+beta))."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        return g * (np.asarray(C, float) / 6.0) ** (self.beta / (self.alpha + self.beta))

    def optimal_tokens(self, C):
        return np.asarray(C, float) / (6.0 * self.optimal_params(C))

    def tokens_per_parameter(self, C):
        return self.optimal_tokens(C) / self.optimal_params(C)

    def frontier_loss(self, C):
        return self.predict(self.optimal_params(C), self.optimal_tokens(C))

    def frontier_coefficient(self) -> float:
        """f in L*(C) = E + f C^(-gamma)."""
        return float(self.frontier_loss(1.0) - self.E)

    def compute_for_loss(self, loss):
        excess = np.asarray(loss, float) - self.E
        with np.errstate(divide="ignore", invalid="ignore"):
            out = (excess / self.frontier_coefficient()) ** (-1.0 / self.gamma())
        return np.where(excess > 0, out, np.inf)

    def to_dict(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in self.param_names}


@dataclass(frozen=True)
class LoopedLaw:
    """L = E + A (N_once + r^phi N_rec)^(-alpha) + B D^(-beta)  (Schwethelm et al. 2604.21106).

    N_once: parameters executed once, N_rec: parameters of the repeated block, r: repeats. One extra
    recurrence is worth r^phi unique copies of the block.
    """

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    phi: float

    name: ClassVar[str] = "looped"
    param_names: ClassVar[tuple[str, ...]] = ("E", "A", "B", "alpha", "beta", "phi")
    raw_names: ClassVar[tuple[str, ...]] = ("log_E", "log_A", "log_B", "alpha", "beta", "phi")
    columns: ClassVar[tuple[str, ...]] = ("N_once", "N_rec", "r", "D")

    def __post_init__(self):
        for name in ("E", "A", "B", "alpha", "beta"):
            _positive(name, getattr(self, name))
        if not np.isfinite(self.phi):
            raise UsageError(f"phi must be finite, got {self.phi!r}")

    def effective_params(self, N_once, N_rec, r):
        return np.asarray(N_once, float) + np.asarray(r, float) ** self.phi * np.asarray(N_rec, float)

    def predict(self, N_once, N_rec, r, D):
        n_eff = self.effective_params(N_once, N_rec, r)
        return self.E + self.A * n_eff ** (-self.alpha) + self.B * np.asarray(D, float) ** (-self.beta)

    @staticmethod
    def features(table) -> np.ndarray:
        """[n, 4] (N_once, N_rec, log r, log D); parameter counts stay linear (they are summed)."""
        return np.stack([np.asarray(table["N_once"], float), np.asarray(table["N_rec"], float),
                         np.log(table["r"]), np.log(table["D"])], axis=1)

    @staticmethod
    def log_terms(raw, features, xp=np):
        log_e, log_a, log_b, alpha, beta, phi = (raw[i] for i in range(6))
        n = features.shape[0]
        n_eff = features[:, 0] + xp.exp(phi * features[:, 2]) * features[:, 1]
        return xp.stack([xp.full((n,), 1.0) * log_e, log_a - alpha * xp.log(n_eff),
                         log_b - beta * features[:, 3]], axis=1)

    def to_raw(self) -> np.ndarray:
        return np.array([np.log(self.E), np.log(self.A), np.log(self.B), self.alpha, self.beta, self.phi])

    @classmethod
    def from_raw(cls, raw) -> LoopedLaw:
        raw = [float(v) for v in raw]
        return cls(E=np.exp(raw[0]), A=np.exp(raw[1]), B=np.exp(raw[2]), alpha=raw[3], beta=raw[4],
                   phi=raw[5])

    @staticmethod
    def start_grid() -> np.ndarray:
        """[starts, 6]: Hoffmann's grid (coarser) times phi in {0.25, 0.5, 1}."""
        axes = [np.arange(-1.0, 1.01, 1.0), np.arange(0.0, 25.1, 5.0), np.arange(0.0, 25.1, 5.0),
                np.array([0.25, 0.5, 1.0]), np.array([0.25, 0.5, 1.0]), np.array([0.25, 0.5, 1.0])]
        return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 6)

    def at_fixed_shape(self, recurrent_fraction: float, r: float) -> tuple[ChinchillaLaw, float]:
        """Reduce to a Chinchilla law in the total unique parameter count N for a fixed architecture shape.

        With N_rec = rho N and N_once = (1-rho) N: N_eff = k_eff N, k_eff = 1-rho + r^phi rho; compute per
        token 6 N_exec = 6 N k_exec, k_exec = 1-rho + r rho. Returns (law in N_exec, k_eff/k_exec) — the
        law in executed parameters has A' = A (k_exec/k_eff)^alpha, so its Chinchilla allocation holds
        with C = 6 N_exec D.
        """
        rho = float(recurrent_fraction)
        if not 0.0 <= rho <= 1.0 or r < 1:
            raise UsageError("recurrent_fraction must be in [0, 1] and r >= 1")
        k_eff = 1.0 - rho + r ** self.phi * rho
        k_exec = 1.0 - rho + r * rho
        scaled_a = self.A * (k_exec / k_eff) ** self.alpha
        return ChinchillaLaw(E=self.E, A=scaled_a, B=self.B, alpha=self.alpha, beta=self.beta), k_eff / k_exec

    def to_dict(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in self.param_names}


@dataclass(frozen=True)
class SmeltLawFixedExponents:
    """The smelt law with its exponents a, b, c held fixed: only E, A, K are fitted (the paper's per-domain
    refit, §8: "per-domain refit of E, A, K with the aggregate exponents"). raw = (log E, log A, log K);
    `from_raw` gives a full `SmeltLaw`. Hashable, so the vectorised fitter can take it as a static argument."""

    a: float
    b: float
    c: float

    name: ClassVar[str] = "smelt-fixed-exponents"
    raw_names: ClassVar[tuple[str, ...]] = ("log_E", "log_A", "log_K")
    columns: ClassVar[tuple[str, ...]] = ("F", "S", "D")
    features = staticmethod(SmeltLaw.features)

    @classmethod
    def of(cls, law: SmeltLaw) -> SmeltLawFixedExponents:
        return cls(a=float(law.a), b=float(law.b), c=float(law.c))

    def log_terms(self, raw, features, xp=np):
        full = (raw[0], raw[1], raw[2], np.log(self.a), self.b, np.log(self.c))
        return SmeltLaw.log_terms(full, features, xp=xp)

    def from_raw(self, raw) -> SmeltLaw:
        raw = [float(v) for v in raw]
        return SmeltLaw(E=np.exp(raw[0]), A=np.exp(raw[1]), K=np.exp(raw[2]), a=self.a, b=self.b, c=self.c)

    @staticmethod
    def start_grid() -> np.ndarray:
        """[50, 3] raw initial points: SmeltLaw's grid over (log E, log A, log K)."""
        axes = [np.array([0.0, 0.5]), np.arange(0.0, 20.1, 5.0), np.arange(0.0, 20.1, 5.0)]
        return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3)


LAWS = {law.name: law for law in (SmeltLaw, ChinchillaLaw, LoopedLaw)}


def law_from_dict(name: str, params: dict) -> SmeltLaw | ChinchillaLaw | LoopedLaw:
    """Build a law by name from a mapping holding (at least) its parameters."""
    if name not in LAWS:
        raise UsageError(f"unknown law {name!r}; choose one of {sorted(LAWS)}")
    cls = LAWS[name]
    missing = [k for k in cls.param_names if k not in params]
    if missing:
        raise UsageError(f"{name} law needs parameters {list(cls.param_names)}; missing {missing}")
    return cls(**{k: float(params[k]) for k in cls.param_names})


def replace(law, **changes):
    """A copy of `law` with some parameters changed."""
    return dataclasses.replace(law, **changes)
