"""How long a step waits for its expert exchange: the exposed exchange of the roofline (docs/roofline.md).

    exposed_exchange_seconds(stats, work_bytes, tpu, pallas_fill) -> seconds

The exchange's collectives (`hlo_stats.HloStats.exchange_send_bytes_by_group`) take bytes sent / the
bandwidth of the torus axes their group spans. A synchronous one, or an async one with no compute in
its window, is exposed whole (`exchange_exposed_bytes`, its share of the exchange's time). An async one
with compute in its window (`exchange_windows`) is exposed for what its window's work does not cover:
max(0, its time - the window's work time), the work timed at its walked HBM bytes / HBM bandwidth (a
lower bound of each op's time, so an upper bound of the exposure; compute-bound ops run longer). Two
collectives whose windows share work each count it (the optimistic side of this estimate).
"""

from __future__ import annotations

from collections.abc import Mapping


def exposed_exchange_seconds(stats, work_bytes: Mapping[str, float], tpu, pallas_fill: float = 1.0) -> float:
    """Seconds of the expert exchange the step waits for. `stats`: `hlo_stats.HloStats`; `work_bytes`:
    walked HBM bytes per execution of each instruction by name (`hbm_traffic.walk`); `tpu`: the slice
    (`hardware.Slice`); `pallas_fill`: the filled share of a ragged all-to-all's buffer."""
    devices = tpu.chips

    def seconds(kind: str, group: int | None, sent: float) -> float:
        filled = pallas_fill if kind == "ragged-all-to-all" else 1.0
        return sent * filled / tpu.ici_bytes_per_second_for_group(group or devices)

    raw = sum(sent for _, _, sent in stats.exchange_send_bytes_by_group)
    total = sum(seconds(kind, group, sent) for kind, group, sent in stats.exchange_send_bytes_by_group)
    # the synchronous share, at the exchange's mean seconds per byte (as before async windows were read)
    synchronous = total * stats.exchange_exposed_bytes / raw if raw else 0.0
    uncovered = 0.0
    for kind, group, sent, times, window in stats.exchange_windows:
        work = times * sum(work_bytes.get(name, 0.0) for name in window) / tpu.hbm_bytes_per_second
        uncovered += max(0.0, seconds(kind, group, sent) - work)
    return synchronous + uncovered
