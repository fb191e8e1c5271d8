mkdir -p out/logs && { nohup bash out/jobs/smelt-1p6b-s97-b5-73918824.sh > out/logs/smelt-1p6b-s97-b5-73918824.log 2>&1 & echo $! > out/logs/smelt-1p6b-s97-b5-73918824.pid; }
