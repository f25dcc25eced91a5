#!/usr/bin/env bash
# Start one ftlaunch per host over ssh, the same command on every host: node ranks follow the
# order of the host file, and the first host is node 0 (it hosts the rendezvous and holds the run).
#
#   scripts/ftlaunch_hosts.sh hosts.txt --nproc 8 --run-dir /shared/runs train.py --epochs 10
#
# hosts.txt: one host per line (blank lines and # comments are skipped). Each host needs ssh
# without a password, the same checkout and virtual environment at the same path, and the run
# dir on storage every host sees (NFS, gs://...). FTLAUNCH_PORT picks the rendezvous port (29400).
# Ctrl+C here is sent to every host's ftlaunch (ssh -tt), which stops its workers; relaunching the
# same command resumes the run. The exit status is node 0's.
set -uo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 HOSTFILE FTLAUNCH_ARGS... SCRIPT [SCRIPT_ARGS...]" >&2
  exit 2
fi
hostfile=$1
shift
mapfile -t hosts < <(grep -vE '^[[:space:]]*(#|$)' "$hostfile" | awk '{print $1}')
if [ ${#hosts[@]} -eq 0 ]; then
  echo "$0: no hosts in $hostfile" >&2
  exit 2
fi
endpoint="${hosts[0]}:${FTLAUNCH_PORT:-29400}"
workdir=$(pwd)
ftlaunch=${FTLAUNCH_BIN:-$(command -v ftlaunch || echo ftlaunch)}

pids=()
for rank in "${!hosts[@]}"; do
  command=$(printf '%q ' "$ftlaunch" --nnodes "${#hosts[@]}" --node-rank "$rank" --rdzv-endpoint "$endpoint" "$@")
  remote="cd $(printf '%q' "$workdir") && $command"
  ssh -tt -o BatchMode=yes "${hosts[$rank]}" "$remote" \
    > >(sed -u "s/^/[node$rank ${hosts[$rank]}] /") 2>&1 &
  pids+=($!)
done

stop_all() {
  for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null; done
}
trap stop_all INT TERM

status=0
for i in "${!pids[@]}"; do
  while kill -0 "${pids[$i]}" 2>/dev/null; do wait "${pids[$i]}"; done
  wait "${pids[$i]}"
  code=$?
  [ "$i" -eq 0 ] && status=$code
done
exit $status
