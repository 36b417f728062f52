#!/bin/sh
# The tour's long GPU job: "speaks" a text file line by line (no model, no sound).
#
#     gpulock run --timeout 10m --name tts -- examples/speak.sh examples/data/speech/lines.txt
#
# Under `gpulock run --lease 30m` it renews the lease after every line with
# `gpulock heartbeat` (which finds its ticket in $GPULOCK_TICKET), as a long job should.
set -eu
file=${1:?usage: speak.sh FILE}
n=0
while IFS= read -r line || [ -n "$line" ]; do
    [ -n "$line" ] || continue
    n=$((n + 1))
    echo "speak.sh: gpu ${CUDA_VISIBLE_DEVICES:-none}: line $n: $line"
    if [ -n "${GPULOCK_TICKET:-}" ]; then
        gpulock heartbeat
    fi
done < "$file"
echo "speak.sh: $n lines spoken"
