mkdir -p out/logs && nohup bash out/jobs/smelt-1p6b-s97-b5-8f9b9da4.sh > out/logs/smelt-1p6b-s97-b5-8f9b9da4.log 2>&1 & echo $! > out/logs/smelt-1p6b-s97-b5-8f9b9da4.pid
