"""The only node: it holds the run and has no one to tell."""

from typing import Optional, Tuple

from launcher.core.layout import Layout
from launcher.core.policy import RestartPolicy
from launcher.core.results import AttemptResult
from launcher.process.attempt_store import StoreHost
from launcher.process.kit import NodeKit
from launcher.roles.holder import RunHolder
from launcher.roles.link import SingleLink
from launcher.roles.role import AttemptPlan, Conclusion, in_attempt
from launcher.runs.run import Run

__all__ = ["SingleNode"]


class SingleNode(RunHolder):
    def __init__(
        self,
        nproc: int,
        run: Run,
        kit: NodeKit,
        policy: RestartPolicy,
        store_at: Tuple[str, int],
        injectable: bool,
        store_host: StoreHost,
    ) -> None:
        super().__init__(run, kit, policy, store_at, injectable, store_host)
        self.nproc = nproc
        self._link: Optional[SingleLink] = None

    def meet(self) -> AttemptPlan:
        layout = Layout.every_node(1, 0, self.nproc)
        number = self._open_attempt(members=None, world_size=layout.world_size)
        self._link = SingleLink(self.run, self.may_restart)
        return AttemptPlan(number, self._store_at[0], self.store.port, layout)

    @property
    def link(self) -> SingleLink:
        return in_attempt(self._link, "link")

    def conclude(self, local: AttemptResult) -> Conclusion:
        self._close_store()
        local = self._with_culprit(local)
        self._record_end(local)
        self._link = None
        return Conclusion(local)
