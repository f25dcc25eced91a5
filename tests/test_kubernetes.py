"""Two "pods" on loopback, each an ftlaunch with exactly the environment Kubeflow's Trainer gives a
TrainJob's nodes and the command a TrainJob would run (`ftlaunch ... train.py`, no many-node flag).

Trainer's variables, from its own source (kubeflow/trainer, pkg/runtime/framework/plugins/torch/
torch.go, ``EnforceMLPolicy``, and pkg/constants/constants.go):
    PET_NNODES           the TrainJob's numNodes
    PET_NPROC_PER_NODE   numProcPerNode (a number, or auto, cpu, gpu)
    PET_NODE_RANK        from metadata.annotations['batch.kubernetes.io/job-completion-index']
    PET_MASTER_ADDR      "<trainjob>-node-0-0.<trainjob>" (node 0's pod, through the headless service)
    PET_MASTER_PORT      "29400" (constants.ContainerTrainerPort)
Two changes for one machine: the master address is 127.0.0.1 (the pod's DNS name resolves to its
IP), and the port a free one (29400 may be in use beside this test). GLOO_SOCKET_IFNAME=lo keeps
gloo on loopback, as the other many-node tests do.
"""

import socket
from pathlib import Path

import pytest
from helpers import SCRIPTS, run_state

from launcher.core.events import NodesMet, Transition
from launcher.observe.plot import draw_run, node_events
from launcher.runs.directory import RunDir

TRAIN = str(SCRIPTS / "ckpt_train.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _trainer_env(node_rank: int, port: int) -> dict:
    return {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
    }


@pytest.mark.timeout(300)
def test_two_pods_with_kubeflow_trainers_environment_run_as_two_nodes_and_survive_a_crash(launcher, tmp_path):
    port, out = _free_port(), tmp_path / "out.pt"
    command = [TRAIN, "--out", str(out), "--steps", "12", "--crash", "7:0", "--crash-rank", "1"]
    # The default log folder: <run>/logs/node<R> on the shared run dir, as a shared volume holds it.
    pods = [launcher.start(*command, env=_trainer_env(rank, port), log_dir=False) for rank in (0, 1)]
    codes = [pod.wait(240) for pod in pods]
    assert codes == [0, 0], (pods[0].stderr, pods[1].stderr)
    run = pods[0].run_url()
    state = run_state(run)
    assert [a.outcome for a in state.attempts] == ["FAILED", "SUCCEEDED"]
    assert state.attempts[0].failures[0].node == 1  # rank 1 lives on node 1: one rank per node
    assert [a.world_size for a in state.attempts] == [2, 2]
    assert [[n["node"] for n in a.nodes] for a in state.attempts] == [[0, 1], [0, 1]]
    for rank, pod in enumerate(pods):
        said = (
            f"from torchrun's PET_* environment: --nproc 1, --nnodes 2, --node-rank {rank}, --rdzv-endpoint "
        )
        assert said + f"127.0.0.1:{port}" in pod.stderr
        assert "has WORLD_SIZE 2" in pod.stdout
        pod.log_dir = Path(run) / "logs" / f"node{rank}"
        assert [e.nnodes for e in pod.events(NodesMet)] == [2, 2]
        ends = [
            (e.attempt, e.new.value) for e in pod.events(Transition) if e.new.value in ("FAILED", "SUCCEEDED")
        ]
        assert ends == [(0, "FAILED"), (1, "SUCCEEDED")]
    # The picture puts both nodes on one time axis: node 1's log sits beside node 0's.
    nodes = node_events(RunDir(run).read_events(), state.config["log_dir"])
    assert [n.node for n in nodes] == [0, 1]
    drawn = {line.get_gid() for line in draw_run("k8s", nodes).axes[0].get_lines()}
    assert {"steps/node0/attempt1", "steps/node1/attempt1"} <= drawn
