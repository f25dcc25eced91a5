"""The only node: it holds the run and has no one to tell."""

from typing import List, Optional

from launcher.core.beats import ProgressRow
from launcher.core.layout import Layout
from launcher.core.results import AttemptResult
from launcher.core.stopping import StopReading, local_stop_step
from launcher.roles.base import AttemptPlan, Conclusion
from launcher.roles.holder import RunHolder

__all__ = ["SingleNode"]


class SingleNode(RunHolder):
    def meet(self) -> AttemptPlan:
        number = self._open_attempt(members=None, world_size=self.config.world_size)
        layout = Layout.every_node(self.config)
        return AttemptPlan(number, self.config.group.master_addr, self.store.port, layout)

    def conclude(self, local: AttemptResult) -> Conclusion:
        self._close_store()
        self._record_end(local)
        return Conclusion(local)

    def agree_stop_step(self, reading: Optional[StopReading]) -> int:
        return local_stop_step(reading) if reading is not None else 0

    def publish_progress(self, attempt: int, rows: List[ProgressRow]) -> None:
        self.run.publish_progress(attempt, rows)
