#!/usr/bin/env bash
# One prepared run on a lent GPU machine (issues 33 and 34): the CUDA tests, then the GPU
# benchmark at two sizes. Each part has its own time limit and log, so a part that fails
# leaves the others' results. Results land in $OUT (default ./gpu_out).
#
#   bash bench/gpu_session.sh            # all parts
#   PARTS="tests 940m-state profile" bash bench/gpu_session.sh
#   PARTS="probe stall" bash bench/gpu_session.sh   # the open stall of issue 34
#
# Order and time: the default parts take at most 90 + 230 + 170 + 200 s; a session with
# 15 minutes of device time runs PARTS="tests 940m 940m-streamed" in one call (under the
# 600 s a call may run; the issue-49 and issue-50 rows first), then "370m" if time is left.
#
# Needs torch with CUDA and the package's dependencies; wheels in .whl/ are installed to
# /tmp/site first when present (a machine with no package index).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PARTS=${PARTS:-"tests 940m 940m-streamed 370m"}
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the benchmarks' files go to the disk the checkout is on (not a RAM /tmp)
export BENCH_DIR=${BENCH_DIR:-$PWD/.bench_tmp}
mkdir -p "$BENCH_DIR"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nproc; free -g | head -2; df -h "$BENCH_DIR" /tmp | cat
  # the disk's bound: 4 GiB written and fsynced
  $PY - <<'PY'
import os, time
p = os.path.join(os.environ["BENCH_DIR"], "raw.bin"); buf = bytes(64 << 20)
t = time.perf_counter(); fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
for _ in range(64): os.write(fd, buf)
os.fsync(fd); os.close(fd); dt = time.perf_counter() - t; os.unlink(p)
print(f"disk write+fsync {4 / dt:.2f} GiB/s")
PY
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for part in $PARTS; do
  echo "=== $part $(date -u +%T)"
  case $part in
    tests)
      timeout 90 $PY -m pytest -q -p no:cacheprovider -p no:benchmark -n 7 tests/torch/test_cuda_capture.py \
        > "$OUT/cuda_tests.txt" 2>&1
      echo "rc $?"; tail -25 "$OUT/cuda_tests.txt" ;;
    370m)
      timeout 200 $PY bench/bench_gpu.py --size 370m --rounds 2 --steps 10 --warmup 2 \
        --configs bare,dense+log,topk,topk+log,dcp.async/10,torch.save/10 \
        --every 6 --base-steps 14 --json "$OUT/gpu_370m.json" > "$OUT/gpu_370m.txt" 2>&1
      echo "rc $?"; grep -v Warning "$OUT/gpu_370m.txt" | tail -30 ;;
    940m)
      timeout 230 $PY bench/bench_gpu.py --size 940m --rounds 3 --steps 4 --warmup 2 \
        --configs bare,topk,topk+log,topk+log-thread --every 6 --base-steps 14 \
        --json "$OUT/gpu_940m.json" > "$OUT/gpu_940m.txt" 2>&1
      echo "rc $?"; grep -v Warning "$OUT/gpu_940m.txt" | tail -30 ;;
    profile)  # where the log's per-step cost goes (bench/profile_gpu.py)
      timeout 150 $PY bench/profile_gpu.py --size 940m --steps 3 --rounds 2 --prof-steps 2 \
        --out "$OUT" > "$OUT/profile_gpu.log" 2>&1
      echo "rc $?"; grep -v Warning "$OUT/profile_gpu.log" | head -8 ;;
    probe)  # device-to-host copy speed into pinned / registered / pageable host memory
      timeout 90 $PY bench/probe_pinned.py --gib 4 > "$OUT/probe_pinned.json" 2>&1
      echo "rc $?"; cat "$OUT/probe_pinned.json"
      # letting go of a registered buffer: unregistered back to back vs paced, pages given back
      timeout 120 $PY bench/probe_free.py --cuda --gib 4 --rounds 2 > "$OUT/probe_free.json" 2>&1
      echo "rc $?"; cat "$OUT/probe_free.json" ;;
    stall)  # the 940m base run with torch.profiler over the steps around the first staged base
      timeout 170 $PY bench/bench_gpu.py --size 940m --rounds 1 --steps 1 --warmup 1 \
        --configs bare --every 6 --base-steps 14 --pre-steps 2 --profile-steps 9:12 \
        --profile-out "$OUT/stall_profile.txt" --json "$OUT/gpu_940m_stall.json" \
        > "$OUT/gpu_940m_stall.txt" 2>&1
      echo "rc $?"; grep -v Warning "$OUT/gpu_940m_stall.txt" | tail -20 ;;
    940m-streamed)  # issue 50: streamed bases (16 slices, a base every 16 steps) on a warm
      # model, against top-1% alone: pinned staging, slowest / median of the base run
      timeout 170 $PY bench/bench_gpu.py --size 940m --rounds 1 --steps 6 --warmup 1 \
        --configs topk --every 16 --slices 16 --base-steps 50 --pre-steps 2 \
        --json "$OUT/gpu_940m_streamed.json" > "$OUT/gpu_940m_streamed.txt" 2>&1
      echo "rc $?"; grep -v Warning "$OUT/gpu_940m_streamed.txt" | tail -30 ;;
    940m-state)  # the state-sized figures alone, on a warm model (--pre-steps)
      timeout 160 $PY bench/bench_gpu.py --size 940m --rounds 1 --steps 1 --warmup 1 \
        --configs bare --every 6 --base-steps 14 --pre-steps 2 \
        --json "$OUT/gpu_940m_state.json" > "$OUT/gpu_940m_state.txt" 2>&1
      echo "rc $?"; grep -v Warning "$OUT/gpu_940m_state.txt" | tail -30 ;;
  esac
done
rm -rf "$BENCH_DIR"
