"""The engine (``backend.engine``) over its kernels (``backend.kernels``), the Triton glue (``backend.triton``: the
stub's side and the launcher) and the tools (``backend.tools``); below them all, the contract every layer shares
(``backend.contract``). Importing it sets nothing: the OpenMP wait policy is set by the processes that build an engine
(``backend.engine.openmp``)."""
