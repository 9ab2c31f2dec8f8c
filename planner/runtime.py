"""Idealized runtime, energy and cost of a query: runtime(p, o) = α(p) + β · (o − 1).

α is the prefill of the p-token prompt (it yields the first output token), β one decode step, as in Narayanan et
al.'s "idealized runtime" of a query on dedicated hardware. Energy counts the rated power of the devices the plan
keeps busy (every GPU used plus the CPU) for the whole run: an upper bound, since devices rarely sit at their rated
power. A batch of B sequences runs together, so one query's share is 1/B of the run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import InputError


@dataclass(frozen=True)
class RuntimeEstimate:
    prompt_len: int
    output_len: int
    batch_size: int
    alpha_s: float  # prefill, first token included
    beta_s: float  # each further output token
    runtime_s: float  # α + β (o − 1): the whole batch's run, and each query's latency
    power_watts: float
    energy_j: float  # per query
    energy_j_per_1k_tokens: float  # per 1000 generated tokens
    price_per_hour: float | None
    cost_usd: float | None  # per query
    cost_usd_per_1k_tokens: float | None  # per 1000 generated tokens

    def as_dict(self) -> dict:
        return asdict(self)


def idealized_runtime(alpha_s: float, beta_s: float, prompt_len: int, output_len: int, batch_size: int = 1,
                      power_watts: float = 0.0, price_per_hour: float | None = None) -> RuntimeEstimate:
    """runtime(p, o) = α + β (o − 1) of a batch, with energy and cost per query and per 1000 generated tokens."""
    if alpha_s < 0 or beta_s < 0 or power_watts < 0:
        raise InputError("alpha, beta and power must be >= 0")
    if output_len < 1 or prompt_len < 1 or batch_size < 1:
        raise InputError("prompt length, output length and batch size must be >= 1")
    if price_per_hour is not None and not 0 <= price_per_hour <= 10_000:
        raise InputError(f"price per hour must be in 0..10000 USD, got {price_per_hour}")
    runtime = alpha_s + beta_s * (output_len - 1)
    energy_run = power_watts * runtime
    generated = batch_size * output_len
    cost_run = None if price_per_hour is None else price_per_hour * runtime / 3600.0
    return RuntimeEstimate(
        prompt_len=prompt_len, output_len=output_len, batch_size=batch_size,
        alpha_s=alpha_s, beta_s=beta_s, runtime_s=runtime, power_watts=power_watts,
        energy_j=energy_run / batch_size, energy_j_per_1k_tokens=1000.0 * energy_run / generated,
        price_per_hour=price_per_hour,
        cost_usd=None if cost_run is None else cost_run / batch_size,
        cost_usd_per_1k_tokens=None if cost_run is None else 1000.0 * cost_run / generated,
    )
