"""asynchdf5 benchmarks: throughput against the raw-read limit and the loaders people use instead.

``python -m benchmarks list`` names them; ``python -m benchmarks run NAME... [--quick]`` runs them,
each in a fresh interpreter, and writes one JSON file per benchmark (:mod:`benchmarks.report`);
``python -m benchmarks report DIR`` prints those as markdown. Data sets are generated on the fly
(:mod:`benchmarks.data`) into ``--data-dir`` (default ``/tmp/asynchdf5-bench``) and reused while
their parameters stay the same. The registry (:mod:`benchmarks.registry`) says where each lives.
"""
