#!/bin/bash
# ftlaunch under SLURM: one ftlaunch per node, a checkpoint at one agreed step when the job is about
# to be stopped, and the job requeued to resume from that step: no step is lost.
#
#   sbatch --nodes=4 --time=24:00:00 scripts/ftlaunch_sbatch.sh --nproc 8 train.py --epochs 90
#
# Every argument goes to ftlaunch. It needs no --nnodes, --node-rank or --rdzv-endpoint: under srun
# it reads them from SLURM (node 0 is the first host of the allocation), and the run is named after
# the job id, which a requeued job keeps, so the requeued job resumes the same run.
#
# What happens before the time limit (or `scancel --signal=USR1 --batch JOBID`):
#   1. SLURM sends SIGUSR1 to this script (the B: in --signal) 120 s ahead.
#   2. The script passes it to srun, which passes it to ftlaunch on every node.
#   3. Each ftlaunch takes it as a preemption: every rank stops at one step that all agreed on,
#      saves it (ft.should_stop(step) in the training script) and leaves; ftlaunch exits 143.
#   4. After exit 143, and only then, the script requeues the job; the requeued job resumes from
#      that step. A failure (budget spent: exit 1) or a usage error (exit 2) is never requeued.
# Without the notice, SLURM's SIGTERM at the time limit reaches every process at once, the workers
# included: they stop where they are, and the requeued job resumes from the last periodic save.
# The grace period (--grace-period, 5 s by default) must fit in the notice's lead (120 s here) and
# in the cluster's KillWait (30 s by default) after a SIGTERM.
#
# Settings (environment variables; sbatch passes the caller's environment to the job):
#   FTLAUNCH_RUN_DIR  where runs live, on storage every node sees (NFS, Lustre, gs://...)
#                     [default: $HOME/ftlaunch_runs]
#   FTLAUNCH_BIN      the ftlaunch command [default: ftlaunch]
#   FTLAUNCH_REQUEUE  0: never requeue, just exit 143 [default: 1]
#   FTLAUNCH_*        any other ftlaunch option, e.g. FTLAUNCH_MAX_FAILURES=5
#
#SBATCH --job-name=ftlaunch
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
#SBATCH --output=ftlaunch-%j.out

set -u

export FTLAUNCH_RUN_DIR="${FTLAUNCH_RUN_DIR:-$HOME/ftlaunch_runs}"
FTLAUNCH_BIN="${FTLAUNCH_BIN:-ftlaunch}"
FTLAUNCH_REQUEUE="${FTLAUNCH_REQUEUE:-1}"

echo "ftlaunch_sbatch: job ${SLURM_JOB_ID} on ${SLURM_JOB_NODELIST}," \
    "restart ${SLURM_RESTART_COUNT:-0}, runs in ${FTLAUNCH_RUN_DIR}"

# srun in the background: bash runs a trap only between commands or during `wait`, never while a
# foreground command runs, so a notice would wait for srun to end.
srun --ntasks-per-node=1 --kill-on-bad-exit=0 "$FTLAUNCH_BIN" "$@" &
step_pid=$!

forwarded=0
forward() {
    forwarded=1
    echo "ftlaunch_sbatch: SIG$1 received; passing it on to every node"
    kill -s "$1" "$step_pid" 2>/dev/null
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

# `wait` returns early (128 + the signal) whenever a trap ran; wait again until srun itself ended.
while :; do
    forwarded=0
    wait "$step_pid"
    code=$?
    [ "$forwarded" = 0 ] && break
done

if [ "$code" = 143 ] && [ "$FTLAUNCH_REQUEUE" = 1 ]; then
    echo "ftlaunch_sbatch: ftlaunch stopped after saving (exit 143): requeueing job ${SLURM_JOB_ID}"
    scontrol requeue "$SLURM_JOB_ID"
fi
echo "ftlaunch_sbatch: exit ${code}"
exit "$code"
