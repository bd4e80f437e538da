"""Records of benchmark runs and the tables written from them.

``provenance`` (where a run ran: commit, date, CPU and its instruction sets, memory bandwidth, versions), ``record``
(a run's settings and its figures as tables, each figure beside its baseline) and ``tables`` (the README's and docs'
result tables, written from the records kept in ``records/runs/``). Standard library only, but for torch to measure the
memory bandwidth."""
