#!/usr/bin/env bash
# Multi-node GPU run without a scheduler (torchrun style): start this on every node.
#
#   # on node 0 (the coordinator) ... and on node i, with NODE_RANK=i:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/gpu_multinode.sh \
#     --config=configs/quickstart.py --config.workdir=/shared/runs/rl --config.checkpoint_every=20
#
# One process per node drives all of that node's GPUs (CUDA_VISIBLE_DEVICES to restrict them).
# The script maps the torchrun-style variables onto JAX's JAX_COORDINATOR_ADDRESS,
# JAX_NUM_PROCESSES and JAX_PROCESS_ID. The workdir must be on storage all nodes see.
# Environment: NNODES, NODE_RANK, MASTER_ADDR (required); MASTER_PORT (default 12345);
# JAXAGENT_PYTHON (default: python).
set -euo pipefail

: "${NNODES:?set NNODES to the number of nodes}"
# (No apostrophes in these messages: bash reads one inside "${VAR:?...}" as an opening quote.)
: "${NODE_RANK:?set NODE_RANK to the index of this node, 0 .. NNODES-1}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ && "$NNODES" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]]; then
  echo "NODE_RANK=$NODE_RANK must be an integer in [0, NNODES=$NNODES)" >&2
  exit 2
fi
export JAX_COORDINATOR_ADDRESS="$MASTER_ADDR:${MASTER_PORT:-12345}"
export JAX_NUM_PROCESSES="$NNODES"
export JAX_PROCESS_ID="$NODE_RANK"
exec "${JAXAGENT_PYTHON:-python}" -m jaxagent.launch "$@"
