mkdir -p out/logs && nohup bash out/jobs/smelt-600m-s0-b0-30314c3e.sh > out/logs/smelt-600m-s0-b0-30314c3e.log 2>&1 & echo $! > out/logs/smelt-600m-s0-b0-30314c3e.pid
