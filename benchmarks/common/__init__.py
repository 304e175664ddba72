"""What the benchmark scripts share: the models, parameters and machine description of the
baselines (baselines.py) and the parent's supervision of its child processes, with the one
retry loop (supervise.py). Imported as `common` with benchmarks/ on sys.path (as it is for
`python benchmarks/<script>.py`)."""
