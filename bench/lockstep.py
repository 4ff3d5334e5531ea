"""Lock-step between the two sides of a bench (``dpo_step_vs_trl.py``, ``hpa_step_packing.py``).

Each side runs in its own spawned process and does its work only in the turns the driver gives it, one
at a time, so background load on a shared machine hits both sides alike and they never compete for the
cores.
"""


class Turn:
    """A side's end of the lock-step: ``begin`` waits for the driver's go, ``end`` hands the turn back."""

    def __init__(self, go, done):
        self.go, self.done = go, done

    def begin(self) -> None:
        self.go.wait()
        self.go.clear()

    def end(self) -> None:
        self.done.set()
