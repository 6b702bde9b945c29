"""Training-loss curves read from ``pretrain_gpt.py --canzona-metrics-file`` JSON lines, and
drawn (``tools/plot_loss.py``, ``tools/compare_optimizers.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LossCurve:
    """One run's logged losses."""

    label: str
    """Legend text."""
    iterations: list[int]
    """Iteration of each logged point, increasing."""
    losses: list[float]
    """Mean ``lm loss`` of the log interval ending at that iteration."""


def read_curve(path: Path, label: str | None = None) -> LossCurve:
    """Read a metrics file; raise ``ValueError`` if it holds no loss at all."""
    points: dict[int, float] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not JSON ({error.msg}); pass files written by "
                             "pretrain_gpt.py --canzona-metrics-file") from error
        if record.get("lm_loss") is not None:
            # A restarted run appends again; its later lines win.
            points[int(record["iteration"])] = float(record["lm_loss"])
    if not points:
        raise ValueError(f"{path} has no lm_loss values; pass a file written by "
                         "pretrain_gpt.py --canzona-metrics-file")
    iterations = sorted(points)
    return LossCurve(label or path.stem, iterations, [points[i] for i in iterations])


def plot_curves(curves: list[LossCurve], output: Path, title: str | None = None) -> None:
    """Draw every curve (loss against iteration) into one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for curve in curves:
        axes.plot(curve.iterations, curve.losses, marker="o", markersize=2.5, linewidth=1.4,
                  label=curve.label)
    axes.set_xlabel("iteration")
    axes.set_ylabel("lm loss (mean over log interval)")
    axes.set_title(title or "training loss")
    axes.grid(True, alpha=0.3)
    axes.legend()
    save_figure(figure, output, dpi=120)


def save_figure(figure: Any, output: Path | str, *, dpi: int = 110, rect: tuple[float, ...] | None = None) -> None:
    """Lay out ``figure`` (inside ``rect``, figure fractions, if given), write it to ``output``
    (its folder made if missing) and free it."""
    import matplotlib.pyplot as plt

    figure.tight_layout(**({} if rect is None else {"rect": rect}))
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=dpi)
    plt.close(figure)
