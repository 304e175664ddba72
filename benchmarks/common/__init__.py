"""What the benchmark scripts share: the models, parameters and machine description of the
baselines (baselines.py), the parent's supervision of its child processes, with the one
retry loop (supervise.py), and the fault runs' inference worker loop (fault_watch.py:
gpu_faults.py, store_faults.py). Imported as `common` with benchmarks/ on sys.path (as it is for
`python benchmarks/<script>.py`)."""
