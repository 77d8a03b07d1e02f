#!/bin/bash
# DeepSpeed's own launcher across the nodes of clusters/deepspeed/hostfile (4 x g5.12xlarge = 16 GPUs).
# Run it on the first host of the hostfile, from the folder that holds your script:
#
#   bash clusters/deepspeed/launch.sh train.py --deepspeed_config ds_config.json
#   HOSTFILE=my_hosts bash clusters/deepspeed/launch.sh train.py ...
#
# The script calls deepspeed.initialize(...) (notebook 06 shows one). Every node needs the same
# Python environment and the script at the same path, and passwordless ssh from this host.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 TRAIN_SCRIPT [ARGS...]" >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
hostfile="${HOSTFILE:-$here/hostfile}"

# NCCL: warnings only; INFO names the interface and transport it chose (read it when a job hangs).
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# The interface the nodes reach each other on: not docker0, not a second unreachable NIC.
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-eth0}"
# No InfiniBand on g5 (Ethernet): skip the IB probe, use sockets. Set 0 on an IB/EFA cluster.
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
# gloo's interface (torch CPU collectives; DeepSpeed on CPU uses gloo): the same one.
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

# What reaches the other nodes: the launcher forwards NCCL_* (and PYTHON*, MLFLOW*, UCX*) from this
# shell by itself. Anything else must be listed, KEY=VALUE one per line, in .deepspeed_env in the
# current folder or the home folder (no comments in that file). This overwrites ./.deepspeed_env.
printf '%s\n' "GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME" "OMP_NUM_THREADS=$OMP_NUM_THREADS" > .deepspeed_env

# The first host in the hostfile is the rendezvous point (MASTER_ADDR) for every process.
head_node="$(awk '!/^#/ && NF {print $1; exit}' "$hostfile")"
deepspeed --hostfile "$hostfile" --master_addr "$head_node" --master_port 29500 "$@"
