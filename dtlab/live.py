"""A live view of training: a progress bar and a loss curve that update as you train.

In Jupyter (with ipywidgets) you get a progress bar and a small loss plot redrawn every
``every`` steps. Headless — a script, a launcher's worker, or a notebook run by ``dtlab course
run`` / papermill (which set ``DTLAB_HEADLESS=1``) — the same calls print one plain line every
``every`` steps, so CI logs show progress too.

>>> view = LiveView(total=3, every=1, headless=True)
>>> for step in range(3):
...     view.update(loss=1.0 / (step + 1))       # doctest: +ELLIPSIS
step 1/3  loss 1.0000  ...
step 2/3  loss 0.5000  ...
step 3/3  loss 0.3333  ...
>>> view.history["loss"]
[1.0, 0.5, 0.3333333333333333]
"""

from __future__ import annotations

import os
import time


def is_headless() -> bool:
    """True unless we run inside an interactive Jupyter kernel with ipywidgets available."""
    if os.environ.get("DTLAB_HEADLESS", "") not in ("", "0"):
        return True
    try:
        from IPython import get_ipython

        shell = get_ipython()
        import ipywidgets  # noqa: F401
    except ImportError:
        return True
    return shell is None or "IPKernelApp" not in shell.config


class LiveView:
    """Progress plus metric curves for a loop of ``total`` steps.

    Args:
        total: number of steps expected (for the progress bar and the ``step i/total`` lines).
        every: redraw the plot / print a line every this many steps (and always at the last).
        title: shown above the plot.
        enabled: pass ``dtlab.distributed.is_main()`` so only rank 0 draws and prints.
        headless: force text (True) or widgets (False); None decides with ``is_headless()``.
    """

    def __init__(self, total: int, every: int = 10, title: str = "training", enabled: bool = True,
                 headless: bool | None = None):
        self.total, self.every, self.title, self.enabled = total, max(1, every), title, enabled
        self.headless = is_headless() if headless is None else headless
        self.step = 0
        self.history: dict[str, list[float]] = {}
        self.start = time.perf_counter()
        self._bar = self._out = None
        if enabled and not self.headless:
            import ipywidgets
            from IPython.display import display
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=title)
            self._out = ipywidgets.Output()
            display(self._out)

    def update(self, **metrics: float) -> None:
        """Record one step's metrics (e.g. ``loss=...``) and refresh the view if it is time."""
        self.step += 1
        for name, value in metrics.items():
            self.history.setdefault(name, []).append(float(value))
        if not self.enabled:
            return
        due = self.step % self.every == 0 or self.step == self.total
        if self._bar is not None:
            self._bar.update(1)
            if due:
                self._bar.set_postfix({k: f"{v:.4f}" for k, v in metrics.items()})
                self._draw()
        elif due:
            rate = self.step / max(time.perf_counter() - self.start, 1e-9)
            values = "  ".join(f"{k} {float(v):.4f}" for k, v in metrics.items())
            print(f"step {self.step}/{self.total}  {values}  ({rate:.1f} steps/s)", flush=True)

    def _draw(self) -> None:
        import matplotlib.pyplot as plt
        from IPython.display import display

        with self._out:
            self._out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(5, 2.6))
            for name, values in self.history.items():
                ax.plot(range(1, len(values) + 1), values, label=name)
            ax.set_xlabel("step")
            ax.set_title(self.title)
            ax.legend(loc="upper right")
            fig.tight_layout()
            display(fig)
            plt.close(fig)

    def close(self) -> None:
        """Finish the progress bar (text mode: nothing to do)."""
        if self._bar is not None:
            self._bar.close()
