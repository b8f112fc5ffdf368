#!/bin/bash
# On a lent GPU machine (the device tool, carry [".gpu"] built by scripts/device-bundle.sh):
# `trillium demo` with its 2 NN ranks on one GPU, then bench/nn_step.py on CUDA. Results in $OUT.
set -u
G=/tmp/g; mkdir -p $G; t0=$(date +%s)
el() { echo "$1 $(( $(date +%s)-t0 ))s"; }
xz -T0 -dc .gpu/bundle.tar.xz | tar x -C $G || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
cp $G/pb/* trillium/wire/pb/ && ln -sfn ../services trillium/services
mkdir -p $G/bin; printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/redis/lib exec %s/redis/redis-server "$@"\n' $G $G > $G/bin/redis-server; chmod +x $G/bin/redis-server
export PATH=$G/bin:$G/jre/bin:$PATH PYTHONPATH=/tmp/site:$G/native:$PWD TRILLIUM_KAFKA_LIBS=$G/kafka/libs PYTHONUNBUFFERED=1
I=$OUT/info.txt
{ nvidia-smi -L; nproc; python3 -c "import torch,grpc,google.protobuf as p,numpy,pyarrow,typer,fastapi,trillium_native; print(torch.__version__, torch.cuda.is_available(), grpc.__version__, p.__version__, numpy.__version__, pyarrow.__version__, typer.__version__)"; java -version; redis-server --version; } > $I 2>&1
el setup | tee -a $I
(while sleep 1; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; done > $OUT/smi.txt 2>&1) & SMI=$!
timeout ${DEMO_S:-200} python3 -m trillium.cli demo --run-dir /tmp/trl-demo --report /tmp/demo.json > $OUT/demo.log 2>&1; el "demo rc=$?" | tee -a $I
kill $SMI; cp /tmp/demo.json $OUT/ 2>/dev/null
grep -h "collective backend\|error\|Error" /tmp/trl-demo/logs/nn_worker-*.log | head -20 >> $I
tar czf $OUT/logs.tgz -C /tmp/trl-demo logs 2>/dev/null
for a in "8192 fp32" "8192 bf16" "512 fp32"; do set -- $a
  timeout 90 python3 bench/nn_step.py --json --device cuda --batch $1 --precision $2 >> $OUT/nn_step.jsonl 2>>$OUT/nn_step.err; el "nn_step $1 $2 rc=$?" | tee -a $I
done
cat $I; tail -15 $OUT/demo.log; cat $OUT/nn_step.jsonl
