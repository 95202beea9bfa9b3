#!/usr/bin/env bash
# Several JAX processes on one machine, as a multi-host run would be: each process is a "host" with
# 4 simulated CPU devices, the processes find each other through jax.distributed (process 0 is the
# coordinator) and run their collectives over gloo. Cluster.detect() makes one node per process, so
# 2 processes are a 2 nodes x 4 cluster, the same shape `make demo` simulates in one process.
#
#   examples/multiprocess_cpu.sh [PROCESSES] [extra `amsp-jax train` flags]
#   examples/multiprocess_cpu.sh 2 --steps 50 --strategy zero3
#
# Every process writes the same run directory (checkpoints are written by all of them together);
# only process 0 prints the plan and the progress bar, the others log to runs/multiprocess-*/process-N.log.
set -euo pipefail

processes="${1:-2}"
shift || true
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')"
run_dir="runs/multiprocess-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$run_dir"

pids=()
for ((i = 0; i < processes; i++)); do
  log=/dev/stdout
  [[ $i -gt 0 ]] && log="$run_dir/process-$i.log"
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=4" JAX_PLATFORMS=cpu \
    "$python" -m amsp_jax.cli train --config configs/train/demo.yaml --run-dir "$run_dir" \
    --coordinator "localhost:$port" --num-processes "$processes" --process-id "$i" "$@" >"$log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
exit "$status"
