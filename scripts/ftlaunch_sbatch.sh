#!/bin/bash
# ftlaunch under SLURM: one ftlaunch per node, a checkpoint at one agreed step when the job is about
# to be stopped, and the job requeued to resume from that step: no step is lost.
#
#   sbatch --nodes=4 --time=24:00:00 scripts/ftlaunch_sbatch.sh --nproc 8 train.py --epochs 90
#   # 4 nodes train and 1 stands by, ready to take a lost or unhealthy node's place:
#   FTLAUNCH_STANDBY_NODES=1 sbatch --nodes=5 scripts/ftlaunch_sbatch.sh --nproc 8 train.py
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
# The job's exit code is node 0's (it holds the run), not srun's (the highest of all nodes'): a node
# that exits 8 (unhealthy, or excluded) while the others go on is named with the scontrol line that
# would drain it (printed, never run), and neither fails a job that finished nor keeps a preempted
# one from being requeued. srun runs with --kill-on-bad-exit=0 --wait=0, whatever the cluster's
# KillOnBadExit and WaitTime say, so that such a node's exit leaves the others training.
#
# Settings (environment variables; sbatch passes the caller's environment to the job):
#   FTLAUNCH_RUN_DIR  where runs live, on storage every node sees (NFS, Lustre, gs://...)
#                     [default: $HOME/ftlaunch_runs]
#   FTLAUNCH_BIN      the ftlaunch command [default: ftlaunch]
#   FTLAUNCH_REQUEUE  0: never requeue, just exit 143 [default: 1]
#   FTLAUNCH_STANDBY_NODES  K: K of the job's nodes stand by (ftlaunch --standby-nodes K) and
#                     --nnodes is the rest; allocate the nodes that train plus K [default: 0]
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

standby=""
if [ "${FTLAUNCH_STANDBY_NODES:-0}" != 0 ]; then
    standby=", ${FTLAUNCH_STANDBY_NODES} of its nodes standing by"
fi
echo "ftlaunch_sbatch: job ${SLURM_JOB_ID} on ${SLURM_JOB_NODELIST}${standby}," \
    "restart ${SLURM_RESTART_COUNT:-0}, runs in ${FTLAUNCH_RUN_DIR}"

# What each node's task runs: ftlaunch, then one line with its exit code and SLURM's name for the
# node. The trap keeps this shell alive through the signals SLURM sends to every process of the step
# (ftlaunch gets them too: a trapped signal is back to its default in what the shell starts).
task='trap : INT TERM USR1 USR2
"$@"
code=$?
echo "ftlaunch_sbatch: node ${SLURM_PROCID} (${SLURMD_NODENAME:-$(hostname -s)}) exited ${code}" >&2
exit "$code"'

# srun's stderr (its own lines, every node's ftlaunch's and workers') goes on to the job's output;
# the lines read at the end (how each node ended, why one is unhealthy) are also kept aside, and
# only they: a day of a chatty job's output would fill the batch node's /tmp. A carriage return
# ends a line there (a progress bar's output has no other). The copy ignores the signals meant for
# ftlaunch: killed, it would take srun with it (SIGPIPE).
work=$(mktemp -d "${TMPDIR:-/tmp}/ftlaunch_sbatch.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
mkfifo "$work/all" || exit 1
copy="$work/kept"
keep='ftlaunch_sbatch: node |node [0-9]+ is (unhealthy|excluded)'
exec 3> >(
    trap '' INT TERM USR1 USR2
    tr '\r' '\n' <"$work/all" | grep -E "$keep" >"$copy" &
    tee -p "$work/all" >&2
    wait # for the copy's last lines
)
copy_pid=$!

# srun in the background: bash runs a trap only between commands or during `wait`, never while a
# foreground command runs, so a notice would wait for srun to end.
srun --ntasks-per-node=1 --kill-on-bad-exit=0 --wait=0 \
    bash -c "$task" ftlaunch_task "$FTLAUNCH_BIN" "$@" 2>&3 &
step_pid=$!
exec 3>&-

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
for _ in $(seq 100); do # the copy ends at srun's end; up to 10 s for its last lines on a loaded node
    kill -0 "$copy_pid" 2>/dev/null || break
    sleep 0.1
done

# "NODE HOST CODE" for each node whose task said how its ftlaunch ended.
ended() {
    sed -n 's/.*ftlaunch_sbatch: node \([0-9]*\) (\([^)]*\)) exited \([0-9]*\).*/\1 \2 \3/p' "$copy"
}

# Node NODE's own line from ftlaunch (why it is unhealthy or excluded), or a pointer to its lines.
why() {
    local line
    line=$(grep -o "node $1 is \(unhealthy\|excluded\).*" "$copy" | tail -n 1)
    echo "${line:-node $1 exited 8 (unhealthy or excluded): its own lines above say why}"
}

while read -r node host node_code; do
    [ "$node_code" = 8 ] || continue
    reason=$(why "$node" | sed 's/[\\"$`]/\\&/g') # to sit between double quotes
    echo "ftlaunch_sbatch: node ${node} (${host}) is unhealthy or excluded (exit 8): drain it or" \
        "replace it; an administrator would run:"
    echo "ftlaunch_sbatch:   scontrol update nodename=${host} state=drain reason=\"ftlaunch: ${reason}\""
done < <(ended)

# The job's code is node 0's; srun's (the highest) only where node 0 said nothing (killed).
node0=$(ended | awk '$1 == 0 { code = $3 } END { print code }')
if [ -n "$node0" ] && [ "$node0" != "$code" ]; then
    echo "ftlaunch_sbatch: srun exited ${code} (the highest of the nodes' codes); the job's is node 0's: ${node0}"
    code=$node0
fi

if [ "$code" = 143 ] && [ "$FTLAUNCH_REQUEUE" = 1 ]; then
    echo "ftlaunch_sbatch: ftlaunch stopped after saving (exit 143): requeueing job ${SLURM_JOB_ID}"
    scontrol requeue "$SLURM_JOB_ID"
fi
echo "ftlaunch_sbatch: exit ${code}"
exit "$code"
