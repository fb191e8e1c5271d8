mkdir -p out/logs && { nohup bash out/jobs/smelt-600m-s0-b0-4ec0c954.sh > out/logs/smelt-600m-s0-b0-4ec0c954.log 2>&1 & echo $! > out/logs/smelt-600m-s0-b0-4ec0c954.pid; }
