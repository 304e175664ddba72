"""Helper process for tests/test_signals.py (not a test module).

python tests/signal_worker.py STORE
    installs its own SIGTERM handler, opens a fabric transport (a Receiver in a thread
    and a Sender, world 1, TINY model), pushes until interrupted; prints what it sees:
    "ready" once the first push returned, "term handler" when its SIGTERM handler ran,
    "KeyboardInterrupt" and "finally" when SIGINT arrives.
"""

import os
import signal
import sys
import threading
import time


def main(store):
    terms = []
    signal.signal(signal.SIGTERM, lambda s, f: terms.append(s))
    from wxfer.models import TINY, inference_params, preset_for, train_model
    from wxfer.runtime.receiver import Receiver
    from wxfer.runtime.sender import Sender

    params = inference_params(TINY, 1, 0)
    keep = []  # the receiver must outlive its thread
    th = threading.Thread(
        target=lambda: keep.append(
            Receiver(params, mapping=preset_for(TINY).name, store=store, name="sig", timeout=30)
        ),
        daemon=True,
    )
    th.start()
    m = train_model(TINY)
    s = Sender(m, mapping=preset_for(TINY), store=store, name="sig", timeout=30, write_timeout=10)
    s.push()
    print("ready", flush=True)
    seen = 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            s.push()
            if len(terms) > seen:
                seen = len(terms)
                print("term handler", flush=True)
        print("no interrupt within 60 s", flush=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
    finally:
        print("finally", flush=True)
        sys.stdout.flush()
        os._exit(0)  # the receiver thread is a daemon blocked in nothing we need


if __name__ == "__main__":
    main(sys.argv[1])
