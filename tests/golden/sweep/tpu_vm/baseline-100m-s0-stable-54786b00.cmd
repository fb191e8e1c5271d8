mkdir -p out/logs && nohup bash out/jobs/baseline-100m-s0-stable-54786b00.sh > out/logs/baseline-100m-s0-stable-54786b00.log 2>&1 & echo $! > out/logs/baseline-100m-s0-stable-54786b00.pid
