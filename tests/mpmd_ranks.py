"""pipeflow-train whose ranks were started with different flags, as mpirun's MPMD form starts them
(`mpirun -np 1 pipeflow-train A : -np 1 pipeflow-train B`), in a batch: argv[0] is a JSON list of each rank's own
flags, the rest the flags they share. Run as `Case(2, [json.dumps([[...], [...]]), *args],
main="tests.mpmd_ranks:main")` (tests/test_bad_input_train.py)."""
from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from pipeflow.control import Control
    from pipeflow.train import main as train

    own = json.loads(argv[0])
    return train([*argv[1:], *own[Control.world().rank]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
