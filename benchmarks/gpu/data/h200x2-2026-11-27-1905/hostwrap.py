"""pipeflow.train with every span's host times recorded too (perf_counter at enter and exit), dumped per rank
to $HOSTTRACE.rankN.json: what the host spends issuing each action, beside the device's events."""
import atexit, json, os, sys, time
import pipeflow.spans as sp

REC = []
_enter, _exit = sp._Recording.__enter__, sp._Recording.__exit__


def enter(self):
    self.h0 = time.perf_counter()
    return _enter(self)


def exit_(self, *exc):
    r = _exit(self, *exc)
    REC.append((self.kind, self.mb, self.timer.step, self.h0, time.perf_counter()))
    return r


sp._Recording.__slots__  # noqa
sp._Recording = type("_Recording", (), {"__init__": sp._Recording.__init__, "__enter__": enter, "__exit__": exit_})


def dump():
    rank = os.environ.get("PMI_RANK", "0")
    with open(f"{os.environ['HOSTTRACE']}.rank{rank}.json", "w") as f:
        json.dump(REC, f)


atexit.register(dump)
from pipeflow.train import main  # noqa: E402
sys.exit(main(sys.argv[1:]))
