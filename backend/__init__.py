"""The engine (``backend.engine``) over its kernels (``backend.kernels``) and the Triton glue (``backend.triton``: the
stub's side and the launcher); below them all, the contract every layer shares (``backend.contract``). The benchmarks
(``bench/``) and the tools (``tools/``) sit above, beside the frontend and the load tests. Importing it sets nothing:
the OpenMP wait policy is set by the processes that build an engine (``backend.engine.openmp``)."""
