mkdir -p out/logs && nohup bash out/jobs/smelt-1p6b-s97-b5-e84ba499.sh > out/logs/smelt-1p6b-s97-b5-e84ba499.log 2>&1 & echo $! > out/logs/smelt-1p6b-s97-b5-e84ba499.pid
