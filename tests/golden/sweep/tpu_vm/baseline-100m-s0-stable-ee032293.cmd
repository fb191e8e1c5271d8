mkdir -p out/logs && nohup bash out/jobs/baseline-100m-s0-stable-ee032293.sh > out/logs/baseline-100m-s0-stable-ee032293.log 2>&1 & echo $! > out/logs/baseline-100m-s0-stable-ee032293.pid
