#!/usr/bin/env bash
# On the H200: the disk's write speed (what bounds background checkpoints), then the Megatron-Core peer at the
# 1.8B shape and the 172b-tp4-stage shape against te.TransformerLayer, each bench call under the time left.
#   source .whl/env.sh && bash benchmarks/device/h200_peers.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  echo "=== the disk under /tmp: $(df -h --output=source,fstype,size,avail /tmp | tail -1)"
  dd if=/dev/zero of=/tmp/dd1 bs=64M count=64 oflag=direct 2>&1 | tail -1 | sed 's/^/one stream, O_DIRECT, 4 GiB: /'
  rm -f /tmp/dd1
  for i in 1 2 3 4; do dd if=/dev/zero of=/tmp/dd$i bs=64M count=32 oflag=direct 2>&1 | tail -1 > /tmp/dd$i.log & done
  wait; for i in 1 2 3 4; do sed "s/^/stream $i of 4, O_DIRECT, 2 GiB: /" /tmp/dd$i.log; done; rm -f /tmp/dd[1-4]*
  free -g | head -2
} 2>&1 | tee "$OUT/disk.txt"
BUDGET_S=${BUDGET_S:-330} bash benchmarks/device/perf.sh mcore-1.8b
BUDGET_S=200 bash benchmarks/device/perf.sh stage
