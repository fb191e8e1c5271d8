mkdir -p out/logs && nohup bash out/jobs/smelt-1p6b-s97-b5-5fb810cc.sh > out/logs/smelt-1p6b-s97-b5-5fb810cc.log 2>&1 & echo $! > out/logs/smelt-1p6b-s97-b5-5fb810cc.pid
