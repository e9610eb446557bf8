#!/usr/bin/env bash
# On a GPU machine: the CLI checks of --gpu-memory-limit (refused before upload / fits, one GPU and TP 2 on one
# GPU), the load progress bar, the KV cap in serve, and bench -m DIR --tp R. Binaries in build-tp-gpu/ (kdtree + lib/),
# logs under $OUT. Run from the repository root: OUT=dir bash scripts/gpu-tp-limits.sh
set -u
B=$PWD/build-tp-gpu
export LD_LIBRARY_PATH=$B/lib NCCL_NVLS_ENABLE=0
K=$B/kdtree
M=assets/pair/target
o=$OUT
P="--prompt-ids 1,2,3,4,5 -n 16"
t() { local name=$1; shift; local t0=$SECONDS; "$@" > $o/$name.out 2> $o/$name.err; echo "rc=$? s=$((SECONDS-t0))" > $o/$name.rc; echo "$name $(cat $o/$name.rc)"; }
nvidia-smi --query-gpu=name,memory.total,memory.used,memory.free --format=csv > $o/smi.txt 2>&1
t ref       $K run --device cuda -m $M $P --json
t lim1      $K run --device cuda -m $M $P --gpu-memory-limit 1
t lim4      env KDTREE_PROGRESS_MIN_S=0 $K run --device cuda -m $M $P --gpu-memory-limit 4 --json
t tp2lim4   $K run --device cuda -m $M $P --tp 2 --devices 0,0 --gpu-memory-limit 4
t tp2lim8   env KDTREE_PROGRESS_MIN_S=0 $K run --device cuda -m $M $P --tp 2 --devices 0,0 --gpu-memory-limit 8 --json
t kvbig     $K run --device cuda -m $M $P --gpu-memory-limit 3 --ctx-size 0 -n 2000000
t srvlim1   timeout 60 $K serve --device cuda -m $M --gpu-memory-limit 1 --port 0
for lim in 3 none; do
  extra=""; [ "$lim" != none ] && extra="--gpu-memory-limit $lim"
  $K serve --device cuda -m $M $extra --parallel 64 --ctx-size 131072 --port 0 > $o/srv_$lim.out 2> $o/srv_$lim.err &
  pid=$!
  for i in $(seq 1 120); do grep -q "ready on" $o/srv_$lim.err && break; kill -0 $pid 2>/dev/null || break; sleep 0.25; done
  kill -INT $pid; wait $pid; echo "srv_$lim rc=$?" >> $o/srv_$lim.err
  grep "ready on" $o/srv_$lim.err
done
t bench1    $K bench --device cuda -m $M -p 64 -n 32 -r 3 --json
t bench2    $K bench --device cuda -m $M --tp 2 --devices 0,0 -p 64 -n 32 -r 3 --json
t bench4    $K bench --device cuda -m $M --tp 4 --devices 0,0,0,0 -p 64 -n 32 -r 3 --json
t bench2txt env KDTREE_PROGRESS_MIN_S=0 $K bench --device cuda -m $M --tp 2 --devices 0,0 -p 64 -n 16 -r 1 --verify-sizes 1,8,32
t benchsrv  $K bench --device cuda -m $M --tp 2 --devices 0,0 --serve 1
tail -n 3 $o/*.err > $o/summary.txt
