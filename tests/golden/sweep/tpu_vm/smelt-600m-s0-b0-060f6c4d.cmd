mkdir -p out/logs && nohup bash out/jobs/smelt-600m-s0-b0-060f6c4d.sh > out/logs/smelt-600m-s0-b0-060f6c4d.log 2>&1 & echo $! > out/logs/smelt-600m-s0-b0-060f6c4d.pid
