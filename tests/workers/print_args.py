"""For the launcher's flag tests: writes what this rank got, as JSON, to
<argv[-1]>/<RANK>.json: its arguments, LOCAL_RANK, OMP_NUM_THREADS and the
cores it may run on. Declares --local_rank as DeepSpeed scripts do."""

import argparse
import json
import os
import sys
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=None)
parser.add_argument("out")
args = parser.parse_args()
record = {
    "argv": sys.argv[1:],
    "local_rank_arg": args.local_rank,
    "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    "cores": sorted(os.sched_getaffinity(0)),
}
Path(args.out, f"{os.environ['RANK']}.json").write_text(json.dumps(record))
