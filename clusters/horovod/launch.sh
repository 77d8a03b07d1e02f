#!/bin/bash
# horovodrun across 4 g5.12xlarge nodes: 16 processes, 4 per host (one per GPU).
#
#   bash clusters/horovod/launch.sh train_hvd.py [ARGS...]
#   HOSTS=host1:4,host2:4 bash clusters/horovod/launch.sh train_hvd.py       # 2 nodes, 8 processes
#
# The script calls hvd.init() and wraps its optimizer in hvd.DistributedOptimizer (notebook 05).
# Run it on one of the hosts; every host needs the same Python environment, the script at the same
# path and passwordless ssh from here. On Databricks use horovod.spark / HorovodRunner instead.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 TRAIN_SCRIPT [ARGS...]" >&2
  exit 2
fi

# "host:slots" for each node; slots = GPUs = processes on that host.
hosts="${HOSTS:-host1:4,host2:4,host3:4,host4:4}"
# -np must equal the sum of the slots: add them up instead of typing 16 by hand.
np=0
IFS=',' read -r -a entries <<< "$hosts"
for entry in "${entries[@]}"; do
  np=$((np + ${entry##*:}))
done

# NCCL (Horovod's GPU all-reduce): warnings only; INFO shows interface and transport when it hangs.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# The interface the hosts reach each other on, for NCCL's sockets ...
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-eth0}"
# ... and for gloo, which runs Horovod's controller (rendezvous, coordination) over TCP.
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}"
# No InfiniBand on g5 (Ethernet): skip the IB probe. Set 0 on an IB/EFA cluster.
export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

# With --gloo horovodrun copies this shell's environment (the exports above) to every process;
# --network-interface tells its own controller which NIC to use.
horovodrun --gloo -np "$np" -H "$hosts" --network-interface "$NCCL_SOCKET_IFNAME" python "$@"
