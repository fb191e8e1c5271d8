mkdir -p out/logs && nohup bash out/jobs/baseline-100m-s0-stable-9a7f9b78.sh > out/logs/baseline-100m-s0-stable-9a7f9b78.log 2>&1 & echo $! > out/logs/baseline-100m-s0-stable-9a7f9b78.pid
