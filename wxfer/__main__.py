"""python -m wxfer {selftest,plan,demo,calibrate,backends,doctor} ..."""

from __future__ import annotations

import sys

USAGE = """usage: python -m wxfer COMMAND [options]

commands:
  selftest   two local processes, one-sided writes, bytes checked, GB/s printed
  plan       build and simulate a transfer plan for a preset model and cluster
  demo       trainers (FSDP2) -> inference workers: train, push, verify bit for bit and logits, GB/s
  backends   which transports are usable here, and why not
  doctor     check this machine: libraries, RDMA ports, GPU registration, limits, topology, store
  calibrate  measure the simulator's figures here (quantizer, all-gather, writes, host cost per task)
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "selftest":
        from .tools.selftest import main as run
    elif cmd == "plan":
        from .plan.cli import main as run
    elif cmd == "demo":
        from .tools.demo import main as run
    elif cmd == "calibrate":
        from .tools.calibrate import main as run
    elif cmd == "doctor":
        from .tools.doctor import main as run
    elif cmd == "backends":
        from .tools.selftest import backends_main as run
    else:
        print("unknown command %r\n\n%s" % (cmd, USAGE), file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
