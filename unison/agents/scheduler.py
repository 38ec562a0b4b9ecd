"""Many multi-round flows on one engine: `run_flows` runs functions that call `run_episodes` (a teacher method on one
question each) concurrently, so no question waits for another's round to end.

Each flow runs in a thread of its own, but only one runs at a time: a flow runs until it waits for episodes or
returns, then the driver runs the next ready flow, and steps the engine once all are waiting.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from tqdm import tqdm

from .runtime import EngineLoop, Episode, EpisodeSettings, flow_thread
from .toolbox import Toolbox

T = TypeVar("T")


def run_flows(flows: list[Callable[[], T]], backend, max_episodes: int, desc: str = "flows",
              unit: str = "flow") -> list[T]:
    """Run the flows (functions that call `run_episodes`, maybe several times, e.g. a method on one question)
    concurrently on one engine; their results in order.

    A flow's episodes join the engine as soon as it asks, so one question's next round starts when its own agents
    finish, not when every question's have; the next flow starts whenever fewer than `max_episodes` episodes are live,
    so the engine's batch stays full. Flows run one at a time between engine steps, in a fixed order, so the batches
    and the outputs are the same on every run."""
    if max_episodes < 1:
        raise ValueError(f"run_flows: max_episodes must be >= 1, got {max_episodes}")
    bar = tqdm(total=len(flows), desc=desc, unit=unit, mininterval=5)
    driver = _FlowDriver(flows, EngineLoop(backend, desc, progress=False), max_episodes, bar)
    try:
        return driver.run()
    finally:
        driver.loop.close()
        driver.bar.close()


class _Aborted(Exception):
    """Raised in a waiting flow when another flow failed."""


class _FlowDriver:
    """Hands control to one flow thread at a time: a flow runs until it waits for episodes or returns."""

    def __init__(self, flows: list[Callable], loop: EngineLoop, max_episodes: int, bar):
        self.flows, self.loop, self.max_episodes, self.bar = flows, loop, max_episodes, bar
        self.results: list = [None] * len(flows)
        self.error: BaseException | None = None
        self.resume = [threading.Event() for _ in flows]
        self.paused = threading.Event()
        self.started = [False] * len(flows)
        self.ended = [False] * len(flows)
        self.aborted = False

    def run(self) -> list:
        ready: list[int] = []  # flows whose episodes are done, to resume
        unstarted = 0
        try:
            while True:
                while self.error is None:  # resume the ready flows, then start new ones while the engine has room
                    if ready:
                        k = ready.pop(0)
                    elif unstarted < len(self.flows) and self.loop.live < self.max_episodes:
                        k, unstarted = unstarted, unstarted + 1
                    else:
                        break
                    self._switch_to(k)
                    if self.ended[k]:
                        self.bar.update(1)
                if self.error is not None:
                    raise self.error
                if not self.loop.busy:  # nothing live and nothing left to start
                    break
                ready = sorted(b.flow for b in self.loop.step())
        finally:
            self.aborted = True
            for k in range(len(self.flows)):
                if self.started[k] and not self.ended[k]:
                    self._switch_to(k)  # its wait raises _Aborted and the flow ends
        return self.results

    def wait_for(self, episodes: list[Episode], toolbox: Toolbox, cfg: EpisodeSettings) -> list[Episode]:
        """In a flow thread: queue the episodes, give control back, and continue once they are all done."""
        k = flow_thread.flow
        batch = self.loop.add(episodes, toolbox, cfg)
        batch.flow = k
        if batch.left:
            self.paused.set()
            self.resume[k].wait()
            self.resume[k].clear()
        if self.aborted:
            raise _Aborted
        return episodes

    def _switch_to(self, k: int) -> None:
        self.paused.clear()
        if not self.started[k]:
            self.started[k] = True
            threading.Thread(target=self._body, args=(k,), daemon=True, name=f"flow-{k}").start()
        else:
            self.resume[k].set()
        self.paused.wait()

    def _body(self, k: int) -> None:
        flow_thread.driver, flow_thread.flow = self, k
        try:
            self.results[k] = self.flows[k]()
        except _Aborted:
            pass
        except BaseException as ex:  # re-raised by the driver
            self.error = self.error or ex
        finally:
            self.ended[k] = True
            self.paused.set()
