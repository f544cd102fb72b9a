#!/bin/bash
# Compare two snapshots with: diff -r OLD NEW (the predictions must not change in a refactor).
# The planner's --json for the refactor's three acceptance configurations (+ one more), to diff against.
out=${1:?usage: .ci/plan_snapshot.sh OUTDIR}; mkdir -p $out
shardwise plan --model llama-2-7b --devices 8 --device_memory 80GiB --json true > $out/llama7b.json 2>$out/llama7b.err
shardwise plan --model transformer-1b --devices 2 --device_memory 40GB --precision 32-true --json true > $out/t1b.json 2>$out/t1b.err
shardwise plan --model mingpt-1.7b --devices 4 --device_memory 24GiB --precision 16-mixed --json true > $out/mingpt.json 2>$out/mingpt.err
shardwise plan --model llama-2-70b --devices 8 --num_nodes 2 --device_memory 80GiB --all true --json true > $out/l70b.json 2>$out/l70b.err
# elapsed_s is the planner's own wall time: drop it so two snapshots of the same code are equal.
sed -i '/"elapsed_s"/d' $out/*.json
echo done
