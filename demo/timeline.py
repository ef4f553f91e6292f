"""The run as a picture: one row per worker reader, one bar per task coloured by wave,
and a line where each wave ended (the next one was sent then)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from demo import runs

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg

SIZE = (12.0, 5.0)  # inches
DPI = 120
BAR_HEIGHT = 0.62  # of a row
LABEL_PAD = 6  # pixels a name inside a bar keeps from its ends
SMALL = 7.5  # points: names squeezed into short bars, or written beside them
# Matplotlib's tab10, whose first colours read apart for most people (and in grey).
WAVE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


def draw(task_runs: Sequence[runs.TaskRun], path: Path, *, title: str) -> Path:
    """Draw the timeline of ``task_runs`` into the PNG ``path``.

    :param title: the first line of the title; the makespan is added to it
    :return: ``path``
    """
    # Imported here: matplotlib is the demo's extra, and slow to import.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ran = [r for r in task_runs if r.ran]
    if not ran:
        raise ValueError("no task ran: nothing to draw")
    origin = min(r.sent_at for r in task_runs)
    end = max(r.end_time or r.start_time for r in ran) - origin
    labels = runs.reader_labels(ran)
    rows = {reader: n for n, reader in enumerate(labels)}
    waves = sorted({r.wave for r in ran})

    figure = Figure(figsize=SIZE, dpi=DPI)
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for r in ran:
        assert r.reader is not None and r.end_time is not None
        failed = r.status != "SUCCEEDED"
        axes.barh(
            rows[r.reader],
            r.end_time - r.start_time,
            left=r.start_time - origin,
            height=BAR_HEIGHT,
            color=_colour(r.wave),
            edgecolor="black" if failed else "white",
            hatch="//" if failed else None,
            linewidth=1.0,
        )
    # Wave boundaries: when each wave's last task ended; the wave's number above its span.
    ends = {w: max(r.end_time or 0.0 for r in ran if r.wave == w) - origin for w in waves}
    begins = {w: min(r.sent_at for r in task_runs if r.wave == w) - origin for w in waves}
    for w in waves:
        axes.axvline(ends[w], color="0.35", linestyle="--", linewidth=0.9, zorder=0)
    axes.set_yticks(range(len(labels)), list(labels.values()))
    # Reader 1 on top; room above for the wave names, below for names beside the last row.
    axes.set_ylim(len(labels) - 0.3, -1.1)
    axes.set_xlim(0, end * 1.01)
    axes.set_xlabel("seconds since the first task was sent")
    axes.grid(axis="x", color="0.9", zorder=-1)
    axes.set_axisbelow(True)
    counts = [sum(1 for r in task_runs if r.wave == w) for w in waves]
    axes.set_title(
        f"{title}\n{len(task_runs)} tasks in waves of {', '.join(map(str, counts))}, run by "
        f"{len(labels)} reader threads — makespan {end:.1f} s",
        fontsize=11,
    )
    legend = [
        Patch(color=_colour(w), label=f"wave {w} ({n} task{'s' if n > 1 else ''})")
        for w, n in zip(waves, counts, strict=True)
    ]
    if any(r.status != "SUCCEEDED" for r in ran):
        legend.append(
            Patch(facecolor="white", edgecolor="black", hatch="//", label="failed / cancelled")
        )
    axes.legend(
        handles=legend,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=9,
        frameon=False,
        title="dashed: wave ended",
        title_fontsize=8,
    )
    figure.tight_layout()
    _name_waves(axes, canvas, begins, ends)
    _name_bars(axes, canvas, ran, rows, origin)
    canvas.print_png(str(path))
    return path


def _name_waves(
    axes: Axes, canvas: FigureCanvasAgg, begins: dict[int, float], ends: dict[int, float]
) -> None:
    """Each wave's name above its span; only its number where the span is too narrow."""
    renderer = canvas.get_renderer()
    for w in begins:
        text = axes.text(
            (begins[w] + ends[w]) / 2,
            -0.5 - BAR_HEIGHT / 2,
            f"wave {w}",
            ha="center",
            va="bottom",
            fontsize=9,
            color=_colour(w),
            fontweight="bold",
        )
        span = axes.transData.transform([(begins[w], 0), (ends[w], 0)])
        if text.get_window_extent(renderer).width + LABEL_PAD > span[1][0] - span[0][0]:
            text.set_text(str(w))


def _name_bars(
    axes: Axes,
    canvas: FigureCanvasAgg,
    ran: Sequence[runs.TaskRun],
    rows: dict[str, int],
    origin: float,
) -> None:
    """Each bar's task name: inside the bar when it fits (in smaller type if need be),
    else in small type above it — below it when that would overlap another name — from
    the bar's start, or up to its end near the right edge."""
    renderer = canvas.get_renderer()
    edge = axes.get_window_extent(renderer).x1
    taken: dict[tuple[int, bool], list[tuple[float, float]]] = {}  # (row, above) -> x spans
    for r in sorted(ran, key=lambda r: r.start_time):
        assert r.reader is not None and r.end_time is not None
        row = rows[r.reader]
        left, right = r.start_time - origin, r.end_time - origin
        name = r.task_name if r.status == "SUCCEEDED" else f"{r.task_name}: {r.status}"
        text = axes.text((left + right) / 2, row, name, ha="center", va="center", fontsize=9)
        text.set_color("white")
        bar = axes.transData.transform([(left, row), (right, row)])
        room = bar[1][0] - bar[0][0] - 2 * LABEL_PAD
        if text.get_window_extent(renderer).width <= room:
            continue
        text.set_fontsize(SMALL)
        if text.get_window_extent(renderer).width <= room:
            continue
        # In the wave's colour, so it reads as the name of its bar and not of a neighbour;
        # on white, so a wave line running through it does not cross out letters.
        text.set(x=left, ha="left", color=_colour(r.wave), fontweight="bold", zorder=3)
        text.set_bbox({"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.85})
        if text.get_window_extent(renderer).x1 > edge:  # near the end: end where the bar ends
            text.set(x=right, ha="right")
        for above in (True, False, True):
            text.set(
                y=row + (-1 if above else 1) * (BAR_HEIGHT / 2 + 0.03),
                va="bottom" if above else "top",
            )
            extent = text.get_window_extent(renderer)
            span = (extent.x0 - LABEL_PAD, extent.x1 + LABEL_PAD)
            spans = taken.setdefault((row, above), [])
            if not any(a < span[1] and span[0] < b for a, b in spans):
                break
        spans.append(span)


def _colour(wave: int) -> str:
    return WAVE_COLOURS[(wave - 1) % len(WAVE_COLOURS)]
