"""asynchdf5 benchmarks: throughput against the raw-read limit and the loaders people use instead.

Run ``python -m benchmarks --help``. Data sets are generated on the fly into ``--data-dir`` (default
``/tmp/asynchdf5-bench``) and reused while their parameters stay the same; every loader is measured
in its own subprocess so that peak memory is per loader. Out of core (data several times the
memory a reader may use, each reader in a memory cgroup, from a cold page cache):
``python -m benchmarks.out_of_core --help``.
"""
