mkdir -p out/logs && { nohup bash out/jobs/baseline-100m-s0-stable-fd7fe19e.sh > out/logs/baseline-100m-s0-stable-fd7fe19e.log 2>&1 & echo $! > out/logs/baseline-100m-s0-stable-fd7fe19e.pid; }
