"""A training script for the launcher's fault tests: writes its pid to
<dir>/<RANK>.pid, then by argv[2]: ``sleep`` (until killed), ``exit:N``
(exits N), ``signal:N`` (kills itself with signal N)."""

import os
import sys
import time
from pathlib import Path

argv = [a for a in sys.argv if not a.startswith("--local_rank=")]  # the launcher passes it first
out, action = Path(argv[1]), argv[2]
rank = os.environ.get("RANK", "0")
tmp = out / f".{rank}.pid.tmp"
tmp.write_text(str(os.getpid()))
tmp.rename(out / f"{rank}.pid")  # whole, or not there at all
if action.startswith("exit:"):
    sys.exit(int(action.removeprefix("exit:")))
if action.startswith("signal:"):
    os.kill(os.getpid(), int(action.removeprefix("signal:")))
while True:
    time.sleep(3600)
