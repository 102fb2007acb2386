#!/usr/bin/env bash
# The standard measurement sequence on a lent GPU machine (no .git, no package registry), in one command:
#   bash tools/device_check.sh [tests] [bench] [trace] [gil] [talker] [fused] [prefill] [gemm] [parts] [overlap] [codec]
#   (default: tests bench)
# Run from the repository root with the wheels of ../shared/tools/device-wheels.sh carried in .whl/; results
# land in $OUT (the device tool's output folder; ./out here otherwise). Set OMNILOOP_COMMIT to the commit
# the tree is (the copy has no .git). Each part prints its own summary line(s). OMNILOOP_FUSED_QKV_ATTENTION=0
# or OMNILOOP_PACKED_PREFILL=0 in the environment run every part without those kernels / graphs
# (layers.FUSED_QKV_ATTENTION, prefill_graphs.PACKED). The serve tests need the openai client, which the device
# image lacks: they are left out.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 OMNILOOP_CACHE=${OMNILOOP_CACHE:-/tmp/olcache}
commit=${OMNILOOP_COMMIT:-unknown}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests bench)
for part in "${parts[@]}"; do
  case $part in
    tests)
      # every GPU-marked test but the serve ones
      python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore-glob='tests/test_serve_*' 2>&1 | tail -3 ;;
    bench)
      python3 -m omniloop bench qwen3_tts --model builtin:1.7b --concurrency 1,8,64 --max-frames 100 --repeat 3 \
        --out "$out/pipeline-$commit.json" 2>&1 | grep '^{"concurrency"'
      python3 -c 'import json, sys; [print(json.dumps(s)) for s in json.load(open(sys.argv[1])).get("summary", [])]' \
        "$out/pipeline-$commit.json" ;;
    trace)  # then the first burst's steps and first audios (tools/wave_timeline.py)
      python3 -m omniloop trace qwen3_tts --model builtin:1.7b --concurrency 64 --num-requests 128 --max-frames 100 \
        --text-words 40 --out "$out/trace-$commit.json" > "$out/trace-$commit.txt" 2>&1
      grep '^{"concurrency"' "$out/trace-$commit.txt"
      python3 tools/wave_timeline.py "$out/trace-$commit.json" --burst 0 | head -40
      gzip -f "$out/trace-$commit.json" ;;
    gil)  # who holds the GIL while serving 64 streams (py-spy from the carried wheels), per loop thread
      "$site/bin/py-spy" record --gil --threads --rate 1000 --nonblocking --format raw -o "$out/gil-$commit.raw" -- \
        python3 -m omniloop bench qwen3_tts --model builtin:1.7b --concurrency 64 --max-frames 100 --repeat 2 \
        --out "$out/gil-bench-$commit.json" 2>&1 | grep '^{"concurrency"' | cut -c1-200
      python3 tools/gil_profile.py "$out/gil-$commit.raw" --thread talker --thread codec --thread MainThread \
        --within _on_step_done _launch _on_inbox _drain --top 15 > "$out/gil-$commit.txt"
      head -60 "$out/gil-$commit.txt"; gzip -f "$out/gil-$commit.raw" ;;
    talker)
      python3 tools/bench_talker.py --batch 64 --iters 20 --runner-steps 10 --out "$out/talker-$commit.json" 2>&1 | tail -2 ;;
    fused)  # the frame at 64 rows, one process: decode attention with / without the q/k norm+rope and KV write,
      # a shallower key-loop pipeline, and the tree's default (with the partial sums); OMNILOOP_FUSED_VARIANTS
      # replaces the list
      log="$out/talker-fused-$commit.log"
      python3 tools/bench_talker.py --batch 64 --iters 20 --runner-steps 0 --kernels \
        --variants "${OMNILOOP_FUSED_VARIANTS:-off,attention,stages:2,attention+stages:2,attention+down:4+o:4}" \
        --out "$out/talker-fused-$commit.json" > "$log" 2>&1
      grep '"variant"' "$log" | grep -o '"frame_graph_ms": [0-9.]*, "frame_eager_ms": [0-9.]*, "talker_graph_ms": [0-9.]*, "cp_graph_ms": [0-9.]*\|"variant": "[^"]*"' \
        | paste -d' ' - - | grep . || tail -4 "$log" ;;
    prefill)  # admission plans through the packed prefill graphs vs the padded (rows x tokens) ones
      for flags in "" --padded-prefill; do
        echo "prefill ${flags:-packed}"
        log="$out/prefill${flags:+-padded}-$commit.log"
        python3 tools/bench_talker.py --prefill 1x120 4x218 18x218 $flags \
          --out "$out/prefill${flags:+-padded}-$commit.json" > "$log" 2>&1
        grep -o '"batch": [0-9]*, "tokens": [0-9]*, "plan_ms": [0-9.]*, "cuda_total_ms": [0-9.]*' "$log" || tail -4 "$log" 
      done ;;
    overlap)  # talker frames and codec steps alone and at once
      python3 tools/bench_overlap.py --frames 96 --out "$out/overlap-$commit.json" > "$out/overlap-$commit.log" 2>&1
      grep '^{"mode"' "$out/overlap-$commit.log" || tail -6 "$out/overlap-$commit.log" ;;
    codec)  # codec steps at 64 and 16 rows, chunks 1-8 frames: defaults, then without each of the session-8 changes
      for flags in "" --no-fused-transformer --no-fold-bias; do
        echo "codec ${flags:-defaults}"
        python3 tools/bench_codec.py --batches 64 16 --chunks 1 2 4 8 --steps 10 $flags 2>&1 | grep "ms/step"
      done
      python3 tools/bench_codec.py --batches 64 --chunks 8 --steps 10 --profile 64x8 > "$out/codec-profile-$commit.txt" 2>&1
      grep "GPU kernel" "$out/codec-profile-$commit.txt"
      # a 64 x 1 step: what the replay's fixed part (~1.8 ms by the fit in tools/sim_codec.py) is made of
      python3 tools/bench_codec.py --batches 64 --chunks 1 --steps 10 --profile 64x1 > "$out/codec-profile-64x1-$commit.txt" 2>&1
      grep "GPU kernel" "$out/codec-profile-64x1-$commit.txt" ;;
    parts)  # the prepared partial-sums projections (layers.DOWN_PARTS / O_PARTS): which matmuls are split-K, the
      # batched partial products against them, then the frame at 64 rows with each projection split
      python3 tools/bench_gemm.py --m 64 --kernels --parts 2 4 --out "$out/gemm-parts-$commit.json" 2>&1 \
        | grep -o '"name": "[^"]*"\|"us": [0-9.]*\|"parts[0-9]_us": [0-9.]*\|splitKreduce' | paste -sd' ' \
        | sed 's/"name"/\n&/g'
      echo
      OMNILOOP_FUSED_VARIANTS=${OMNILOOP_FUSED_VARIANTS:-attention,attention+down:2,attention+down:4,attention+o:2,attention+o:4,attention+down:4+o:4} \
        bash "$0" fused ;;
    gemm)
      python3 tools/bench_gemm.py --m 1 64 --kernels --parts 2 4 --out "$out/gemm-$commit.json" 2>&1 | grep -E 'per_frame|"m": 64' ;;
    *) echo "unknown part $part (tests, bench, trace, gil, talker, fused, prefill, gemm, parts, overlap, codec)"; exit 2 ;;
  esac
done
