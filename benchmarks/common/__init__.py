"""What the benchmark scripts share: the models, parameters and machine description of the
baselines (baselines.py), the parent's supervision of its child processes, with the one
retry loop (supervise.py), and the fault runs' inference worker loop (fault_watch.py:
gpu_faults.py, store_faults.py), and the table of bench_baselines' push phases over an A/B's
runs (phase_table.py: gpu_perf.sh, gpu_submit.sh). Imported as `common` with benchmarks/ on
sys.path (as it is for `python benchmarks/<script>.py`)."""
